"""Image sources the shard writer reads: ``folder:PATH``, ``list:FILE``, ``digits``, ``synthetic``, ``fractal``.

Every source is a random-access sequence of :class:`Sample` ``(key, image, labels)`` where
``image`` is a PIL image or the encoded bytes of an image file, and ``labels`` a tuple of class
indices (one for single-label data). Random access lets the writer visit samples in a seeded
shuffled order, so shards mix classes and splits are carved reproducibly.

Sources, with the options :func:`open_source` accepts:

``folder:PATH``
    ImageNet layout: one sub-folder per class (class names = sub-folder names, sorted), image files
    anywhere below each (``.jpg .jpeg .png .bmp .gif .webp .tif .tiff .ppm``, any case).
``list:FILE``
    An image list: a ``.parquet``, ``.csv`` or ``.tsv`` table with one row per image.
    Image column (first present): ``path``, ``image``, ``image_path``, ``file``, ``filename``.
    Label column (first present): ``labels``, ``label``, ``class``, ``class_id``, ``target``.
    A label cell is an int, a class name, a list of either, or a string joining several with
    ``;`` (``"3;17"``); any row with other than one label makes the dataset multi-label. Labels
    that are all integers are class indices (``classes`` names them, else ``"0".."K-1"``); names
    are mapped to indices in sorted order. An optional ``key`` column gives sample keys.
    Relative paths resolve against ``root`` (default: the image list's folder); ``s3://`` paths
    are read through :mod:`vitscale.data.storage`. Options: ``root``, ``path_column``,
    ``label_column``, ``classes``, ``endpoint_url``.
``digits``
    scikit-learn's bundled handwritten digits (1,797 8x8 grey images, 10 classes), upscaled to
    ``image_size`` (default 64) px with ``resample`` (``"bicubic"`` or ``"nearest"``), grey to RGB.
``synthetic``
    Procedural, learnable images (:mod:`vitscale.data.tools.synthetic`): each class is a fixed
    pattern (hue, grating orientation and frequency, shape) placed at random position and scale
    over a noisy random background. Options: ``count`` (1000), ``classes`` (10), ``image_size``
    (None: photo-like random sizes from 256 to 512 px a side; an int: square images),
    ``multi_label`` (False: one object; True: 1-3 objects of distinct classes), ``seed`` (0).
``fractal``
    Formula-driven images in the manner of FractalDB (:mod:`vitscale.data.tools.fractal`): each
    class is a random iterated function system kept only if its attractor's filling rate is in
    bounds, each image its chaos-game rendering with FractalDB's per-image variation (one map
    parameter perturbed, flips, small rotation, scale, offset), grey strokes. Options: ``count``
    (1000), ``classes`` (10), ``image_size`` (64), ``points`` (chaos-game points per image, default
    one per pixel), ``ink`` (``"dark"`` on light, ``"light"`` on black or ``"random"``; default
    dark), ``blur`` (Gaussian radius of the strokes in px; default ``image_size / 32``, 0 for
    FractalDB's hard edges), ``seed`` (0).
``cifar10:DIR``, ``cifar100:DIR``, ``pets:DIR``, ``flowers102:DIR``, ``imagenet:DIR``
    The paper's transfer datasets read from the files they are distributed in, with their own
    predefined splits (:meth:`Source.predefined_splits`): :mod:`vitscale.data.tools.downstream`.
"""

from __future__ import annotations

import csv
import io
import math
import re
from collections.abc import Iterator, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from PIL import Image

from vitscale.config.checks import check, one_of
from vitscale.data.tools.keys import unique_keys

__all__ = [
    "Sample",
    "Source",
    "FolderSource",
    "ImageListSource",
    "DigitsSource",
    "DOWNSTREAM_KINDS",
    "open_source",
    "parse_labels",
    "IMAGE_EXTENSIONS",
    "PATH_COLUMNS",
    "LABEL_COLUMNS",
]

IMAGE_EXTENSIONS = frozenset({".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm"})
PATH_COLUMNS = ("path", "image", "image_path", "file", "filename")
LABEL_COLUMNS = ("labels", "label", "class", "class_id", "target")


class Sample(NamedTuple):
    """One image: a dataset-unique ``key``, a PIL image or encoded bytes, class indices."""

    key: str
    image: Image.Image | bytes
    labels: tuple[int, ...]


class Source(Sequence[Sample]):
    """A random-access image source with class names and a multi-label flag."""

    name: str
    classes: tuple[str, ...]
    multi_label: bool

    def __len__(self) -> int:
        raise NotImplementedError

    def __getitem__(self, i: int) -> Sample:  # type: ignore[override]
        raise NotImplementedError

    def __iter__(self) -> Iterator[Sample]:
        for i in range(len(self)):
            yield self[i]

    def predefined_splits(self) -> dict[str, np.ndarray] | None:
        """The dataset's own splits (name -> source indices, disjoint), or None: carve by fractions.

        A source that returns splits is written as they are (``write_dataset`` refuses ``--split``
        fractions for it); see :mod:`vitscale.data.tools.downstream`.
        """
        return None

    def origin(self, i: int) -> str:
        """Where sample ``i`` comes from, for messages: its file, or the source and index."""
        return f"{self.name}[{i}]"

    def _check_index(self, i: int) -> int:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"{self.name}: index {i} out of range for {n} samples")
        return i % n


_unique_keys = unique_keys  # the name downstream sources and tests import


class FolderSource(Source):
    """ImageNet layout: ``root/<class name>/**/<image>``; classes sorted by name."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).expanduser()
        if not self.root.is_dir():
            raise ValueError(f"folder source: {self.root} is not a directory")
        class_dirs = sorted(p for p in self.root.iterdir() if p.is_dir() and not p.name.startswith("."))
        if not class_dirs:
            raise ValueError(f"folder source: {self.root} has no class sub-folders (ImageNet layout)")
        self.name = self.root.name
        self.classes = tuple(p.name for p in class_dirs)
        self.multi_label = False
        files: list[tuple[Path, int]] = []
        for ci, d in enumerate(class_dirs):
            for p in sorted(d.rglob("*")):
                if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS:
                    files.append((p, ci))
        if not files:
            raise ValueError(f"folder source: no images ({sorted(IMAGE_EXTENSIONS)}) under {self.root}")
        self._files = files
        self._keys = _unique_keys([p.relative_to(self.root).with_suffix("").as_posix() for p, _ in files])

    def __len__(self) -> int:
        return len(self._files)

    def origin(self, i: int) -> str:
        return str(self._files[i][0])

    def __getitem__(self, i: int) -> Sample:  # type: ignore[override]
        i = self._check_index(i)
        path, ci = self._files[i]
        return Sample(self._keys[i], path.read_bytes(), (ci,))


def parse_labels(cell: Any) -> list[str]:
    """Split one image-list label cell into label tokens: int, name, list, or ``"3;17"`` strings."""
    if cell is None or (isinstance(cell, float) and math.isnan(cell)):
        return []
    if isinstance(cell, (list, tuple, np.ndarray)):
        return [t for c in cell for t in parse_labels(c)]
    if isinstance(cell, (bool, np.bool_)):
        raise ValueError(f"label {cell!r} is a boolean, expected a class index or name")
    if isinstance(cell, (int, np.integer)):
        return [str(int(cell))]
    if isinstance(cell, (float, np.floating)):
        if not float(cell).is_integer():
            raise ValueError(f"label {cell!r} is not an integer class index")
        return [str(int(cell))]
    text = str(cell).strip()
    if text.startswith("[") and text.endswith("]"):  # a list written to CSV as "[3, 17]"
        text = text[1:-1].replace(",", ";")
    return [t.strip().strip("'\"") for t in text.split(";") if t.strip()]


def _read_table(path: Path) -> list[dict[str, Any]]:
    if path.suffix.lower() == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    if path.suffix.lower() in (".csv", ".tsv"):
        with open(path, newline="") as f:
            return list(csv.DictReader(f, delimiter="\t" if path.suffix.lower() == ".tsv" else ","))
    raise ValueError(f"image list {path} must be .parquet, .csv or .tsv")


def _pick_column(
    columns: Sequence[str], wanted: str | None, candidates: Sequence[str], what: str, path: Path
) -> str:
    if wanted is not None:
        if wanted not in columns:
            raise ValueError(f"image list {path}: missing {what} column {wanted!r} (columns: {list(columns)})")
        return wanted
    for c in candidates:
        if c in columns:
            return c
    raise ValueError(
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
            raise ValueError(f"image list {self.path} does not exist")
        rows = _read_table(self.path)
        if not rows:
            raise ValueError(f"image list {self.path} has no rows")
        cols = list(rows[0].keys())
        pcol = _pick_column(cols, path_column, PATH_COLUMNS, "image path", self.path)
        lcol = _pick_column(cols, label_column, LABEL_COLUMNS, "label", self.path)
        self.root = Path(root).expanduser() if root is not None else self.path.parent
        self.endpoint_url = endpoint_url
        self.name = self.path.stem
        tokens = [parse_labels(r[lcol]) for r in rows]
        for n, t in enumerate(tokens):
            if not t:
                raise ValueError(f"image list {self.path}: row {n} ({rows[n][pcol]}) has no label")
        flat = {t for ts in tokens for t in ts}
        if all(re.fullmatch(r"-?\d+", t) for t in flat):
            ids = [[int(t) for t in ts] for ts in tokens]
            k = len(classes) if classes is not None else max(max(i) for i in ids) + 1
            bad = [i for ts in ids for i in ts if not 0 <= i < k]
            if bad:
                raise ValueError(
                    f"image list {self.path}: label {bad[0]} outside [0, {k}); pass classes= to name all {k}"
                )
            self.classes = tuple(classes) if classes is not None else tuple(str(i) for i in range(k))
        else:
            names = tuple(classes) if classes is not None else tuple(sorted(flat))
            lookup = {c: i for i, c in enumerate(names)}
            missing = sorted(flat - set(lookup))
            if missing:
                raise ValueError(f"image list {self.path}: labels {missing[:5]} are not in classes")
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
        self._keys = _unique_keys(raw_keys)
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
            raise ValueError(f"image list {self.path}: image {path} does not exist")
        return path.read_bytes()

    def origin(self, i: int) -> str:
        p = self._paths[i]
        return p if p.startswith("s3://") or Path(p).is_absolute() else str(self.root / p)

    def __getitem__(self, i: int) -> Sample:  # type: ignore[override]
        i = self._check_index(i)
        return Sample(self._keys[i], self._read(self._paths[i]), self._labels[i])


@lru_cache(maxsize=1)
def _digits() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    d = load_digits()
    # images: (1797, 8, 8) float in [0, 16]; target: (1797,) int
    return d.images.astype(np.float32), d.target.astype(np.int64)


class DigitsSource(Source):
    """scikit-learn's bundled 8x8 handwritten digits, upscaled and turned RGB (no download)."""

    def __init__(self, *, image_size: int = 64, resample: str = "bicubic") -> None:
        check(image_size >= 8, "digits.image_size", f"must be >= 8, got {image_size}")
        modes = {"bicubic": Image.Resampling.BICUBIC, "nearest": Image.Resampling.NEAREST}
        one_of(resample, sorted(modes), "digits.resample")
        self.image_size = image_size
        self._resample = modes[resample]
        self._images, self._targets = _digits()
        self.name = "digits"
        self.classes = tuple(str(i) for i in range(10))
        self.multi_label = False

    def __len__(self) -> int:
        return len(self._targets)

    def __getitem__(self, i: int) -> Sample:  # type: ignore[override]
        i = self._check_index(i)
        # (8, 8) in [0, 16], ink high -> dark ink on white paper like a scan.
        grey = (255.0 - self._images[i] * (255.0 / 16.0)).round().astype(np.uint8)
        img = Image.fromarray(grey, mode="L").resize((self.image_size,) * 2, self._resample)
        return Sample(f"digits-{i:04d}", img.convert("RGB"), (int(self._targets[i]),))


DOWNSTREAM_KINDS = ("cifar10", "cifar100", "pets", "flowers102", "imagenet")
"""The paper's transfer datasets, read in their distributed formats (data/tools/downstream.py)."""

_OPTIONS = {
    "folder": set(),
    "list": {"root", "path_column", "label_column", "classes", "endpoint_url"},
    "digits": {"image_size", "resample"},
    "synthetic": {"count", "classes", "image_size", "multi_label", "seed"},
    "fractal": {"count", "classes", "image_size", "points", "ink", "blur", "seed"},
    **{kind: set() for kind in DOWNSTREAM_KINDS},
}


def open_source(spec: str, **options: Any) -> Source:
    """Open a source from ``folder:PATH``, ``list:FILE``, ``digits``, ``synthetic``, ``fractal`` or a transfer
    dataset's files (``cifar10:DIR``, ``cifar100:DIR``, ``pets:DIR``, ``flowers102:DIR``,
    ``imagenet:DIR``: :mod:`vitscale.data.tools.downstream`).

    ``options`` are the keyword options listed in the module docstring; an option a source does
    not take is an error (options whose value is ``None`` are ignored).
    """
    kind, _, arg = spec.partition(":")
    if kind not in _OPTIONS:
        raise ValueError(f"unknown source {spec!r}: use folder:PATH, list:FILE, digits, synthetic, fractal or "
                         f"{', '.join(k + ':DIR' for k in DOWNSTREAM_KINDS)}")
    opts = {k: v for k, v in options.items() if v is not None}
    unknown = sorted(set(opts) - _OPTIONS[kind])
    if unknown:
        raise ValueError(
            f"source {kind!r} does not take option(s) {unknown}; it takes {sorted(_OPTIONS[kind])}"
        )
    downstream = kind in DOWNSTREAM_KINDS
    if (kind in ("folder", "list") or downstream) and not arg:
        raise ValueError(f"source {kind!r} needs a path: {kind}:PATH")
    if downstream:  # imported here: these sources subclass Source from this module
        from vitscale.data.tools.downstream import open_downstream

        return open_downstream(kind, arg, **opts)
    if kind in ("digits", "synthetic", "fractal") and arg:
        raise ValueError(f"source {kind!r} takes no path (got {spec!r})")
    if kind == "folder":
        return FolderSource(arg)
    if kind == "list":
        return ImageListSource(arg, **opts)
    if kind == "digits":
        return DigitsSource(**opts)
    if kind == "fractal":  # imported here: it subclasses Source from this module
        from vitscale.data.tools.fractal import FractalSource

        return FractalSource(**opts)
    # Imported here: the synthetic source subclasses Source from this module.
    from vitscale.data.tools.synthetic import SyntheticSource

    return SyntheticSource(**opts)


def image_of(sample_image: Image.Image | bytes) -> Image.Image:
    """A PIL image from either form a source yields (bytes are opened lazily, not yet decoded)."""
    if isinstance(sample_image, Image.Image):
        return sample_image
    return Image.open(io.BytesIO(sample_image))
