"""``imagenet:DIR``: ILSVRC-2012 (ImageNet-1k) as distributed, splits ``train`` and ``val``.

Images, under ``DIR`` or, in the Kaggle layout, ``DIR/ILSVRC/Data/CLS-LOC``:

- ``train/<wnid>/*.JPEG``: one folder per class (any image extension, any case);
- ``val/``: the 50,000 validation images, labelled by the first of these found:

  1. ``val/<wnid>/*.JPEG`` sub-folders (val already sorted into class folders);
  2. ``LOC_val_solution.csv`` (Kaggle: ``ImageId,PredictionString``; the first token of
     ``PredictionString`` is the wnid; ``ImageId`` names ``val/<ImageId>.JPEG``);
  3. ``ILSVRC2012_validation_ground_truth.txt`` (the devkit's ``data/`` folder: one 1-based
     ILSVRC2012_ID a line, for the val images in sorted file-name order) **with** the devkit's
     ``meta.mat`` beside it, whose ``synsets`` map ILSVRC2012_ID to wnid. The devkit's ids are
     not in wnid order (id 1 is n02119789), so they are never read as positions in a synset list.

Label files are looked for in ``DIR``, the image root and ``DIR/ILSVRC2012_devkit_t12/data``.

Classes are wnids, ordered as in ``LOC_synset_mapping.txt`` (lines ``n01440764 tench, Tinca
tinca``) when present, else sorted; every ``train/`` folder must be one of them. Keys are the file
names without extension (``n01440764_10026``, ``ILSVRC2012_val_00000001``). Only file names are
held (a compact byte-string array); images are read one at a time when a sample is asked for.
"""

from __future__ import annotations

import csv
import os
from pathlib import Path

import numpy as np

from vitscale.config.errors import UserError
from vitscale.data.tools.downstream import (
    PredefinedSplitSource,
    load_mat,
    need_dir,
    need_file,
)
from vitscale.data.tools.keys import clean_key
from vitscale.data.tools.source_base import IMAGE_EXTENSIONS, Sample, SourceKind

__all__ = ["SOURCE", "ImageNetSource"]

KIND = "imagenet"
KAGGLE_ROOT = Path("ILSVRC", "Data", "CLS-LOC")
SYNSETS = "LOC_synset_mapping.txt"
KAGGLE_VAL = "LOC_val_solution.csv"
DEVKIT_VAL = "ILSVRC2012_validation_ground_truth.txt"


def _images_in(folder: Path) -> list[str]:
    """Image file names directly in ``folder``, sorted."""
    with os.scandir(folder) as it:
        return sorted(e.name for e in it if e.is_file() and os.path.splitext(e.name)[1].lower() in IMAGE_EXTENSIONS)


def _subdirs(folder: Path) -> list[str]:
    with os.scandir(folder) as it:
        return sorted(e.name for e in it if e.is_dir() and not e.name.startswith("."))


class ImageNetSource(PredefinedSplitSource):
    """ILSVRC-2012 from its train folders and validation images + labels (see the module docstring)."""

    def __init__(self, root: str | Path) -> None:
        root = need_dir(Path(root).expanduser(), KIND)
        base = root if (root / "train").is_dir() or not (root / KAGGLE_ROOT).is_dir() else root / KAGGLE_ROOT
        if not (base / "train").is_dir():
            raise UserError(f"{KIND}: no train/ folder in {root} (nor {KAGGLE_ROOT}/train, the Kaggle layout)")
        val = need_dir(base / "val", KIND)
        self.root, self.name, self.multi_label = root, "imagenet", False
        self._lookup = [root, base, root / "ILSVRC2012_devkit_t12" / "data"]
        train_wnids = _subdirs(base / "train")
        if not train_wnids:
            raise UserError(f"{KIND}: {base / 'train'} has no class folders (train/<wnid>/*.JPEG)")
        synsets = self._find(SYNSETS)
        if synsets is not None:
            self.classes = self._read_synsets(synsets)
            unknown = sorted(set(train_wnids) - set(self.classes))
            if unknown:
                raise UserError(f"{KIND}: {base / 'train' / unknown[0]} is not a class of {synsets}")
        else:
            self.classes = tuple(train_wnids)
        self._class_of = {w: i for i, w in enumerate(self.classes)}

        self._dirs: list[Path] = []
        dir_of: list[np.ndarray] = []
        names: list[str] = []
        labels: list[int] = []

        def add(folder: Path, files: list[str], file_labels: list[int]) -> None:
            self._dirs.append(folder)
            dir_of.append(np.full(len(files), len(self._dirs) - 1, dtype=np.int32))
            names.extend(files)
            labels.extend(file_labels)

        for wnid in train_wnids:
            files = _images_in(base / "train" / wnid)
            add(base / "train" / wnid, files, [self._class_of[wnid]] * len(files))
        n_train = len(names)
        if not n_train:
            raise UserError(f"{KIND}: no images under {base / 'train'}")
        for folder, files, file_labels in self._val(val):
            add(folder, files, file_labels)
        if len(names) == n_train:
            raise UserError(f"{KIND}: no validation images in {val}")
        # Compact: ~20 bytes a name rather than a Python str (and a Path) per image.
        self._names = np.array([os.fsencode(n) for n in names], dtype=np.bytes_)
        self._dir_of = np.concatenate(dir_of)
        self._labels = np.array(labels, dtype=np.int32)
        self._splits = {"train": np.arange(n_train, dtype=np.int64),
                        "val": np.arange(n_train, len(names), dtype=np.int64)}

    def _find(self, name: str) -> Path | None:
        for folder in self._lookup:
            if (folder / name).is_file():
                return folder / name
        return None

    @staticmethod
    def _read_synsets(path: Path) -> tuple[str, ...]:
        wnids = [line.split()[0] for line in path.read_text().splitlines() if line.strip()]
        if not wnids:
            raise UserError(f"{KIND}: {path} lists no synsets")
        if len(set(wnids)) != len(wnids):
            raise UserError(f"{KIND}: {path} lists a wnid twice")
        return tuple(wnids)

    def _label(self, wnid: str, where: str) -> int:
        if wnid not in self._class_of:
            raise UserError(f"{KIND}: {where}: {wnid!r} is not a class (no train/{wnid}/ folder or synset line)")
        return self._class_of[wnid]

    def _val(self, val: Path) -> list[tuple[Path, list[str], list[int]]]:
        """(folder, file names, labels) groups of the validation images."""
        sub = _subdirs(val)
        if sub and not _images_in(val):  # val/<wnid>/*.JPEG
            out = []
            for wnid in sub:
                files = _images_in(val / wnid)
                out.append((val / wnid, files, [self._label(wnid, str(val / wnid))] * len(files)))
            return out
        present = {os.path.splitext(n)[0]: n for n in _images_in(val)}
        kaggle = self._find(KAGGLE_VAL)
        if kaggle is not None:
            return [(val, *self._kaggle_labels(kaggle, val, present))]
        devkit = self._find(DEVKIT_VAL)
        if devkit is not None:
            return [(val, *self._devkit_labels(devkit, val, sorted(present.values())))]
        raise UserError(f"{KIND}: no labels for {val}: expected val/<wnid>/ folders, {KAGGLE_VAL} or "
                        f"{DEVKIT_VAL} with meta.mat in {', '.join(str(p) for p in dict.fromkeys(self._lookup))}")

    def _kaggle_labels(self, path: Path, val: Path, present: dict[str, str]) -> tuple[list[str], list[int]]:
        rows: list[tuple[str, int]] = []
        with open(path, newline="") as f:
            reader = csv.reader(f)
            header = next(reader, None)
            if header is None or header[:2] != ["ImageId", "PredictionString"]:
                raise UserError(f"{KIND}: {path} must start with the header 'ImageId,PredictionString'")
            for n, row in enumerate(reader, start=2):
                if not row:
                    continue
                tokens = row[1].split() if len(row) > 1 else []
                if not tokens:
                    raise UserError(f"{KIND}: {path}:{n}: no wnid in PredictionString")
                image_id = row[0].strip()
                if image_id not in present:
                    raise UserError(f"{KIND}: {path}:{n}: image {image_id} is not in {val}")
                rows.append((present[image_id], self._label(tokens[0], f"{path}:{n}")))
        if not rows:
            raise UserError(f"{KIND}: {path} lists no images")
        rows.sort()
        if len({r[0] for r in rows}) != len(rows):
            raise UserError(f"{KIND}: {path} lists an image twice")
        return [r[0] for r in rows], [r[1] for r in rows]

    def _devkit_labels(self, path: Path, val: Path, files: list[str]) -> tuple[list[str], list[int]]:
        meta = path.parent / "meta.mat"
        need_file(meta, KIND, f"the devkit's synsets, needed to read {path.name}")
        records = load_mat(meta, "synsets", KIND, squeeze_me=True).ravel()
        if not {"ILSVRC2012_ID", "WNID"} <= set(records.dtype.names or ()):
            raise UserError(f"{KIND}: {meta}: 'synsets' has no ILSVRC2012_ID and WNID fields")
        id_to_wnid = {int(i): str(w) for i, w in zip(records["ILSVRC2012_ID"], records["WNID"])}
        lines = [line.strip() for line in path.read_text().splitlines() if line.strip()]
        if len(lines) != len(files):
            raise UserError(f"{KIND}: {path} has {len(lines)} labels but {val} holds {len(files)} images")
        labels = []
        for n, text in enumerate(lines, start=1):
            if not text.isdigit() or int(text) not in id_to_wnid:
                raise UserError(f"{KIND}: {path}:{n}: {text!r} is not an ILSVRC2012_ID of {meta}")
            labels.append(self._label(id_to_wnid[int(text)], f"{path}:{n}"))
        return files, labels

    def __len__(self) -> int:
        return len(self._names)

    def __getitem__(self, i: int) -> Sample:  # type: ignore[override]
        i = self._check_index(i)
        name = os.fsdecode(self._names[i])
        data = (self._dirs[int(self._dir_of[i])] / name).read_bytes()
        key = clean_key(os.path.splitext(name)[0], i)  # ILSVRC2012 file names are unique already
        return Sample(key, data, (int(self._labels[i]),))


SOURCE = SourceKind("imagenet", ImageNetSource, "ILSVRC-2012 as distributed (its own train/val splits)", arg="DIR",
                    predefined_splits=True)
