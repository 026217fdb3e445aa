"""The ViT paper's transfer datasets, read from the files they are distributed in.

Each source here has **predefined splits** (:meth:`Source.predefined_splits`): the dataset's own
train/test lists, written as they are (``--split`` fractions are refused). Nothing is downloaded
and nothing is unpickled; every check runs when the source is opened, before a shard is written,
and a bad file is a one-line ``ValueError`` naming it.

``cifar10:DIR``
    The CIFAR-10 *binary version*: ``DIR`` (or ``DIR/cifar-10-batches-bin``) holds
    ``data_batch_1.bin`` .. ``data_batch_5.bin`` (split ``train``), ``test_batch.bin`` (``test``)
    and ``batches.meta.txt`` (the 10 class names, one a line). A record is 1 label byte + 3072
    pixel bytes (1024 R, 1024 G, 1024 B, each 32x32 row-major). Files are memory-mapped; keys are
    ``{file stem}_{record:05d}`` (``data_batch_1_00042``).
``cifar100:DIR``
    The CIFAR-100 binary version: ``DIR`` (or ``DIR/cifar-100-binary``) holds ``train.bin``,
    ``test.bin`` and ``fine_label_names.txt`` (100 names). A record is 1 coarse label byte + 1 fine
    label byte + 3072 pixel bytes; the fine label (100 classes) is used.
``pets:DIR``
    Oxford-IIIT Pets: ``DIR/images/{name}.jpg``, ``DIR/annotations/trainval.txt`` (split
    ``train``) and ``annotations/test.txt`` (``test``), lines ``Abyssinian_100 1 1 1`` (image
    name, class id 1..37, species, breed id; ``#`` starts a comment). Class index = class id - 1;
    a class's name is its images' name prefix (all before the last ``_``: ``Abyssinian``).
``flowers102:DIR``
    Oxford Flowers-102: ``DIR/jpg/image_00001.jpg`` .., ``imagelabels.mat`` (``labels``: 1..102,
    one per image) and ``setid.mat`` (``trnid``, ``valid``, ``tstid``: 1-based image ids) give
    splits ``train``, ``val`` and ``test``. The paper's Flowers "train" is ``train`` + ``val``.
    The distribution names no classes: class index ``i`` is label ``i + 1`` and is named
    ``"i + 1"`` (``"1"`` .. ``"102"``).
``imagenet:DIR``
    ILSVRC-2012, see :mod:`vitscale.data.tools.imagenet`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from PIL import Image

from vitscale.data.tools.sources import DOWNSTREAM_KINDS, Sample, Source, _unique_keys

__all__ = ["DOWNSTREAM_KINDS", "CifarSource", "FlowersSource", "PetsSource", "PredefinedSplitSource",
           "load_mat", "open_downstream", "read_mat_ints"]


class PredefinedSplitSource(Source):
    """A source whose samples belong to the dataset's own splits (``self._splits``: name -> indices)."""

    _splits: dict[str, np.ndarray]

    def predefined_splits(self) -> dict[str, np.ndarray]:
        return {name: idx.copy() for name, idx in self._splits.items()}


def need_dir(path: Path, kind: str) -> Path:
    if not path.is_dir():
        raise ValueError(f"{kind}: {path} is not a directory")
    return path


def need_file(path: Path, kind: str, what: str = "") -> Path:
    if not path.is_file():
        raise ValueError(f"{kind}: {path} does not exist" + (f" ({what})" if what else ""))
    return path


def read_names(path: Path, kind: str, count: int) -> tuple[str, ...]:
    """Class names, one a line (blank lines dropped); exactly ``count`` of them."""
    need_file(path, kind, "class names, one a line")
    names = tuple(line.strip() for line in path.read_text().splitlines() if line.strip())
    if len(names) != count:
        raise ValueError(f"{kind}: {path} names {len(names)} classes, expected {count}")
    return names


def load_mat(path: Path, variable: str, kind: str, **kwargs: Any) -> np.ndarray:
    """One variable of a MATLAB ``.mat`` file (``scipy.io.loadmat``: v4 to v7.2 files)."""
    from scipy.io import loadmat

    need_file(path, kind)
    try:
        mat = loadmat(path, variable_names=[variable], **kwargs)
    except Exception as exc:  # noqa: BLE001 - scipy raises MatReadError, ValueError, IndexError, ...
        raise ValueError(f"{kind}: cannot read {path} as a .mat file ({type(exc).__name__}: {exc})") from None
    if variable not in mat:
        raise ValueError(f"{kind}: {path} has no variable {variable!r}")
    return np.asarray(mat[variable])


def read_mat_ints(path: Path, variable: str, kind: str) -> np.ndarray:
    """A ``.mat`` variable of integers as a flat int64 array."""
    values = load_mat(path, variable, kind).ravel()
    if values.size == 0 or not np.issubdtype(values.dtype, np.number) or np.any(values != np.round(values)):
        raise ValueError(f"{kind}: {path} variable {variable!r} must hold integers")
    return values.astype(np.int64)


def _split_indices(sizes: Sequence[tuple[str, int]]) -> dict[str, np.ndarray]:
    """Consecutive index ranges, one per (split, count), in order; a split may span several files."""
    out: dict[str, list[np.ndarray]] = {}
    start = 0
    for split, n in sizes:
        out.setdefault(split, []).append(np.arange(start, start + n, dtype=np.int64))
        start += n
    return {s: np.concatenate(parts) for s, parts in out.items()}


# ------------------------------------------------------------------------------------------ CIFAR


class _CifarLayout(NamedTuple):
    folder: str                          # the folder the archive unpacks to
    files: tuple[tuple[str, str], ...]   # (split, file name), in order
    names: str                           # class-name file
    label_bytes: int                     # bytes before the pixels
    label_at: int                        # which of them is the label
    num_classes: int


_CIFAR = {
    "cifar10": _CifarLayout(
        "cifar-10-batches-bin",
        (*(("train", f"data_batch_{i}.bin") for i in range(1, 6)), ("test", "test_batch.bin")),
        "batches.meta.txt", 1, 0, 10),
    "cifar100": _CifarLayout(
        "cifar-100-binary", (("train", "train.bin"), ("test", "test.bin")),
        "fine_label_names.txt", 2, 1, 100),
}
CIFAR_PIXELS = 3 * 32 * 32


class CifarSource(PredefinedSplitSource):
    """CIFAR-10 / CIFAR-100, binary version, memory-mapped (see the module docstring)."""

    def __init__(self, root: str | Path, kind: str = "cifar10") -> None:
        if kind not in _CIFAR:
            raise ValueError(f"CifarSource: kind must be one of {sorted(_CIFAR)}, got {kind!r}")
        layout = _CIFAR[kind]
        root = need_dir(Path(root).expanduser(), kind)
        if not (root / layout.names).is_file() and (root / layout.folder).is_dir():
            root = root / layout.folder
        self.root, self.name, self.multi_label = root, kind, False
        self.classes = read_names(root / layout.names, kind, layout.num_classes)
        record = layout.label_bytes + CIFAR_PIXELS
        self._pixels_at = layout.label_bytes
        self._maps: list[np.memmap] = []
        self._stems: list[str] = []
        labels: list[np.ndarray] = []
        sizes: list[tuple[str, int]] = []
        for split, fname in layout.files:
            path = need_file(root / fname, kind, "the binary version: cifar-*-binary.tar.gz")
            size = path.stat().st_size
            if size == 0 or size % record:
                raise ValueError(f"{kind}: {path} is {size} bytes, not a whole number of {record}-byte "
                                 f"records (truncated, or not the binary version)")
            mm = np.memmap(path, dtype=np.uint8, mode="r", shape=(size // record, record))
            if layout.label_bytes == 2:  # CIFAR-100: the coarse label first, 20 superclasses
                coarse = np.asarray(mm[:, 0])
                if coarse.max() >= 20:
                    r = int(np.argmax(coarse >= 20))
                    raise ValueError(f"{kind}: {path} record {r} has coarse label {coarse[r]}, outside [0, 20)")
            lab = np.asarray(mm[:, layout.label_at]).astype(np.int64)
            if lab.max() >= layout.num_classes:
                r = int(np.argmax(lab >= layout.num_classes))
                raise ValueError(f"{kind}: {path} record {r} has label {lab[r]}, "
                                 f"outside [0, {layout.num_classes})")
            self._maps.append(mm)
            self._stems.append(Path(fname).stem)
            labels.append(lab)
            sizes.append((split, len(lab)))
        self._labels = np.concatenate(labels)
        self._starts = np.cumsum([0] + [n for _, n in sizes])
        self._splits = _split_indices(sizes)

    def __len__(self) -> int:
        return int(self._starts[-1])

    def __getitem__(self, i: int) -> Sample:  # type: ignore[override]
        i = self._check_index(i)
        f = int(np.searchsorted(self._starts, i, side="right")) - 1
        r = i - int(self._starts[f])
        planes = np.asarray(self._maps[f][r, self._pixels_at:]).reshape(3, 32, 32)
        image = Image.fromarray(np.ascontiguousarray(planes.transpose(1, 2, 0)))  # (32, 32, 3) uint8: RGB
        return Sample(f"{self._stems[f]}_{r:05d}", image, (int(self._labels[i]),))


# ------------------------------------------------------------------------------------------- Pets


PETS_FILES = (("train", "trainval.txt"), ("test", "test.txt"))
PETS_CLASSES = 37


class PetsSource(PredefinedSplitSource):
    """Oxford-IIIT Pets: ``images/*.jpg`` + ``annotations/{trainval,test}.txt``."""

    def __init__(self, root: str | Path) -> None:
        kind = "pets"
        root = need_dir(Path(root).expanduser(), kind)
        images = need_dir(root / "images", kind)
        self.root, self.name, self.multi_label = root, "pets", False
        names: dict[int, str] = {}
        rows: list[tuple[str, int]] = []
        sizes: list[tuple[str, int]] = []
        seen: dict[str, str] = {}
        for split, fname in PETS_FILES:
            path = need_file(root / "annotations" / fname, kind, "the annotations archive")
            count = 0
            for n, line in enumerate(path.read_text().splitlines(), start=1):
                fields = line.split()
                if not fields or fields[0].startswith("#"):
                    continue
                where = f"{path}:{n}"
                try:
                    image, class_id = fields[0], int(fields[1])
                except (IndexError, ValueError):
                    raise ValueError(f"{kind}: {where}: expected 'IMAGE CLASS_ID SPECIES BREED_ID', "
                                     f"got {line.strip()!r}") from None
                if not 1 <= class_id <= PETS_CLASSES:
                    raise ValueError(f"{kind}: {where}: class id {class_id} outside 1..{PETS_CLASSES}")
                prefix, sep, _ = image.rpartition("_")
                if not sep or not prefix:
                    raise ValueError(f"{kind}: {where}: image name {image!r} has no '<breed>_<n>' form")
                if names.setdefault(class_id, prefix) != prefix:
                    raise ValueError(f"{kind}: {where}: class id {class_id} is {names[class_id]!r} "
                                     f"elsewhere, {prefix!r} here")
                if image in seen:
                    raise ValueError(f"{kind}: {where}: image {image!r} is listed twice (also in {seen[image]})")
                seen[image] = where
                need_file(images / f"{image}.jpg", kind, f"listed in {where}")
                rows.append((image, class_id - 1))
                count += 1
            if not count:
                raise ValueError(f"{kind}: {path} lists no images")
            sizes.append((split, count))
        k = max(names)
        missing = [c for c in range(1, k + 1) if c not in names]
        if missing:
            raise ValueError(f"{kind}: class id {missing[0]} appears in no annotation file, so it has no name")
        self.classes = tuple(names[c] for c in range(1, k + 1))
        self._images = images
        self._names = [r[0] for r in rows]
        self._labels = np.array([r[1] for r in rows], dtype=np.int64)
        self._keys = _unique_keys(self._names)
        self._splits = _split_indices(sizes)

    def __len__(self) -> int:
        return len(self._names)

    def __getitem__(self, i: int) -> Sample:  # type: ignore[override]
        i = self._check_index(i)
        data = (self._images / f"{self._names[i]}.jpg").read_bytes()
        return Sample(self._keys[i], data, (int(self._labels[i]),))


# ---------------------------------------------------------------------------------------- Flowers


FLOWERS_SPLITS = (("train", "trnid"), ("val", "valid"), ("test", "tstid"))
FLOWERS_CLASSES = 102


class FlowersSource(PredefinedSplitSource):
    """Oxford Flowers-102: ``jpg/image_NNNNN.jpg`` + ``imagelabels.mat`` + ``setid.mat``."""

    def __init__(self, root: str | Path) -> None:
        kind = "flowers102"
        root = need_dir(Path(root).expanduser(), kind)
        jpg = need_dir(root / "jpg", kind)
        self.root, self.name, self.multi_label = root, "flowers102", False
        self.classes = tuple(str(c) for c in range(1, FLOWERS_CLASSES + 1))
        labels_path = root / "imagelabels.mat"
        labels = read_mat_ints(labels_path, "labels", kind)
        bad = np.flatnonzero((labels < 1) | (labels > FLOWERS_CLASSES))
        if bad.size:
            raise ValueError(f"{kind}: {labels_path} gives image {bad[0] + 1} label {labels[bad[0]]}, "
                             f"outside 1..{FLOWERS_CLASSES}")
        setid = root / "setid.mat"
        ids: list[np.ndarray] = []
        sizes: list[tuple[str, int]] = []
        owner: dict[int, str] = {}
        for split, var in FLOWERS_SPLITS:
            split_ids = read_mat_ints(setid, var, kind)
            for image_id in split_ids.tolist():
                if not 1 <= image_id <= len(labels):
                    raise ValueError(f"{kind}: {setid} {var} lists image {image_id}, but {labels_path} "
                                     f"labels images 1..{len(labels)}")
                if image_id in owner:
                    raise ValueError(f"{kind}: {setid} lists image {image_id} twice ({owner[image_id]}, {var})")
                owner[image_id] = var
                need_file(jpg / f"image_{image_id:05d}.jpg", kind, f"listed in {setid} {var}")
            ids.append(split_ids)
            sizes.append((split, len(split_ids)))
        self._jpg = jpg
        self._ids = np.concatenate(ids)
        self._labels = labels[self._ids - 1] - 1
        self._splits = _split_indices(sizes)

    def __len__(self) -> int:
        return len(self._ids)

    def __getitem__(self, i: int) -> Sample:  # type: ignore[override]
        i = self._check_index(i)
        name = f"image_{int(self._ids[i]):05d}"
        return Sample(name, (self._jpg / f"{name}.jpg").read_bytes(), (int(self._labels[i]),))


def open_downstream(kind: str, path: str, **options: Any) -> Source:
    """The source of ``kind`` (one of :data:`DOWNSTREAM_KINDS`) reading the files under ``path``."""
    if kind in _CIFAR:
        return CifarSource(path, kind, **options)
    if kind == "pets":
        return PetsSource(path, **options)
    if kind == "flowers102":
        return FlowersSource(path, **options)
    if kind == "imagenet":
        from vitscale.data.tools.imagenet import ImageNetSource

        return ImageNetSource(path, **options)
    raise ValueError(f"unknown downstream source {kind!r}: use one of {', '.join(DOWNSTREAM_KINDS)}")
