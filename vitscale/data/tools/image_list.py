"""``list:FILE``: an image list, a ``.parquet``, ``.csv`` or ``.tsv`` table with one row per image.

Image column (first present): ``path``, ``image``, ``image_path``, ``file``, ``filename``.
Label column (first present): ``labels``, ``label``, ``class``, ``class_id``, ``target``.
A label cell is an int, a class name, a list of either, or a string joining several with
``;`` (``"3;17"``); any row with other than one label makes the dataset multi-label. Labels
that are all integers are class indices (``classes`` names them, else ``"0".."K-1"``); names
are mapped to indices in sorted order. An optional ``key`` column gives sample keys.
Relative paths resolve against ``root`` (default: the image list's folder); ``s3://`` paths
are read through :mod:`vitscale.data.storage`. Options: ``root``, ``path_column``,
``label_column``, ``classes``, ``endpoint_url``.
"""

from __future__ import annotations

import csv
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from vitscale.config.errors import UserError
from vitscale.data.loader.labels import MAX_CLASSES
from vitscale.data.tools.keys import unique_keys
from vitscale.data.tools.source_base import Sample, Source, SourceKind

__all__ = ["LABEL_COLUMNS", "PATH_COLUMNS", "SOURCE", "ImageListSource", "parse_labels"]

PATH_COLUMNS = ("path", "image", "image_path", "file", "filename")
LABEL_COLUMNS = ("labels", "label", "class", "class_id", "target")


def parse_labels(cell: Any) -> list[str]:
    """Split one image-list label cell into label tokens: int, name, list, or ``"3;17"`` strings."""
    if cell is None or (isinstance(cell, float) and math.isnan(cell)):
        return []
    if isinstance(cell, (list, tuple, np.ndarray)):
        return [t for c in cell for t in parse_labels(c)]
    if isinstance(cell, (bool, np.bool_)):
        raise UserError(f"label {cell!r} is a boolean, expected a class index or name")
    if isinstance(cell, (int, np.integer)):
        return [str(int(cell))]
    if isinstance(cell, (float, np.floating)):
        if not float(cell).is_integer():
            raise UserError(f"label {cell!r} is not an integer class index")
        return [str(int(cell))]
    text = str(cell).strip()
    if text.startswith("[") and text.endswith("]"):  # a list written to CSV as "[3, 17]"
        text = text[1:-1].replace(",", ";")
    return [t.strip().strip("'\"") for t in text.split(";") if t.strip()]


def _read_table(path: Path) -> list[dict[str, Any]]:
    if path.suffix.lower() == ".parquet":
        import pyarrow as pa

        from vitscale.data.format.meta import read_parquet

        try:
            return read_parquet(path).to_pylist()
        except (pa.ArrowInvalid, OSError) as exc:  # not a parquet file, or a damaged one
            raise UserError(f"image list {path}: cannot read it as parquet: {exc}") from None
    if path.suffix.lower() in (".csv", ".tsv"):
        # utf-8-sig: spreadsheets (Excel's "CSV UTF-8") start the file with a byte-order mark, which read as
        # text glued itself to the first column's name ('\ufeffpath': "missing image path column").
        try:
            with open(path, newline="", encoding="utf-8-sig") as f:
                return list(csv.DictReader(f, delimiter="\t" if path.suffix.lower() == ".tsv" else ","))
        except (UnicodeDecodeError, csv.Error) as exc:  # another encoding, or a binary file named .csv
            raise UserError(f"image list {path}: cannot read it as UTF-8 {path.suffix[1:].upper()}: {exc}") from None
    raise UserError(f"image list {path} must be .parquet, .csv or .tsv")


def _pick_column(
    columns: Sequence[str], wanted: str | None, candidates: Sequence[str], what: str, path: Path
) -> str:
    if wanted is not None:
        if wanted not in columns:
            raise UserError(f"image list {path}: missing {what} column {wanted!r} (columns: {list(columns)})")
        return wanted
    for c in candidates:
        if c in columns:
            return c
    raise UserError(
       f"image list {path}: missing {what} column; name one of {list(candidates)} "
       f"(columns present: {list(columns)})"
   )


class ImageListSource(Source):
    """Rows of an image list (parquet/CSV/TSV): image path + label(s); see the module docstring."""

    def __init__(
        self,
        path: str | Path,
        *,
        root: str | Path | None = None,
        path_column: str | None = None,
        label_column: str | None = None,
        classes: Sequence[str] | None = None,
        endpoint_url: str | None = None,
    ) -> None:
        self.path = Path(path).expanduser()
        if not self.path.is_file():
            raise UserError(f"image list {self.path} does not exist")
        rows = _read_table(self.path)
        if not rows:
            raise UserError(f"image list {self.path} has no rows")
        cols = list(rows[0].keys())
        pcol = _pick_column(cols, path_column, PATH_COLUMNS, "image path", self.path)
        lcol = _pick_column(cols, label_column, LABEL_COLUMNS, "label", self.path)
        self.root = Path(root).expanduser() if root is not None else self.path.parent
        self.endpoint_url = endpoint_url
        self.name = self.path.stem
        tokens = [parse_labels(r[lcol]) for r in rows]
        for n, t in enumerate(tokens):
            if not t:
                raise UserError(f"image list {self.path}: row {n} ({rows[n][pcol]}) has no label")
        flat = {t for ts in tokens for t in ts}
        if all(re.fullmatch(r"-?\d+", t) for t in flat):
            ids = [[int(t) for t in ts] for ts in tokens]
            # Without classes= the count is the largest id + 1: bounded, since one mistyped id (a 20-digit
            # number) once built a name for every class below it until the machine ran out of memory.
            k = len(classes) if classes is not None else min(max(max(i) for i in ids) + 1, MAX_CLASSES)
            bad = [i for ts in ids for i in ts if not 0 <= i < k]
            if bad:
                raise UserError(
                   f"image list {self.path}: label {bad[0]} outside [0, {k}); "
                   + (f"more than {k} classes need classes= naming them" if classes is None and k == MAX_CLASSES
                      else f"pass classes= to name all {k}")
                )
            self.classes = tuple(classes) if classes is not None else tuple(str(i) for i in range(k))
        else:
            names = tuple(classes) if classes is not None else tuple(sorted(flat))
            lookup = {c: i for i, c in enumerate(names)}
            missing = sorted(flat - set(lookup))
            if missing:
                raise UserError(f"image list {self.path}: labels {missing[:5]} are not in classes")
            ids = [[lookup[t] for t in ts] for ts in tokens]
            self.classes = names
        self._labels = [tuple(sorted(set(i))) for i in ids]
        self.multi_label = any(len(ls) != 1 for ls in self._labels)
        self._paths = [str(r[pcol]) for r in rows]
        if "key" in cols:
            raw_keys = [str(r["key"]) for r in rows]
        else:  # the path without its extension (for s3:// the object name)
            raw_keys = [
                p.rsplit("/", 1)[-1].rsplit(".", 1)[0] if p.startswith("s3://") else Path(p).with_suffix("").as_posix()
                for p in self._paths
            ]
        self._keys = unique_keys(raw_keys)
        self._stores: dict[str, Any] = {}

    def __len__(self) -> int:
        return len(self._paths)

    def _read(self, p: str) -> bytes:
        if p.startswith("s3://"):
            from vitscale.data.storage import open_storage

            folder, _, name = p.rpartition("/")
            if folder not in self._stores:
                self._stores[folder] = open_storage(folder, endpoint_url=self.endpoint_url)
            return self._stores[folder].read_bytes(name)
        path = Path(p).expanduser()
        if not path.is_absolute():
            path = self.root / path
        if not path.is_file():
            raise UserError(f"image list {self.path}: image {path} does not exist")
        return path.read_bytes()

    def origin(self, i: int) -> str:
        p = self._paths[i]
        return p if p.startswith("s3://") or Path(p).is_absolute() else str(self.root / p)

    def __getitem__(self, i: int) -> Sample:  # type: ignore[override]
        i = self._check_index(i)
        return Sample(self._keys[i], self._read(self._paths[i]), self._labels[i])


SOURCE = SourceKind("list", ImageListSource, "an image list: .parquet/.csv/.tsv of path + label(s)", arg="FILE",
                    options=("root", "path_column", "label_column", "classes", "endpoint_url"))
