"""The CIFAR binary version, memory-mapped: the reader behind ``cifar10:DIR`` and ``cifar100:DIR``.

``cifar10:DIR``: ``DIR`` (or ``DIR/cifar-10-batches-bin``) holds ``data_batch_1.bin`` ..
``data_batch_5.bin`` (split ``train``), ``test_batch.bin`` (``test``) and ``batches.meta.txt`` (the
10 class names, one a line). A record is 1 label byte + 3072 pixel bytes (1024 R, 1024 G, 1024 B,
each 32x32 row-major). Keys are ``{file stem}_{record:05d}`` (``data_batch_1_00042``).

``cifar100:DIR``: ``DIR`` (or ``DIR/cifar-100-binary``) holds ``train.bin``, ``test.bin`` and
``fine_label_names.txt`` (100 names). A record is 1 coarse label byte + 1 fine label byte + 3072
pixel bytes; the fine label (100 classes) is used.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import numpy as np
from PIL import Image

from vitscale.config.errors import UserError
from vitscale.data.tools.downstream import (
    PredefinedSplitSource,
    need_dir,
    need_file,
    read_names,
    split_indices,
)
from vitscale.data.tools.source_base import Sample

__all__ = ["CIFAR_PIXELS", "CifarSource"]


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
            raise UserError(f"CifarSource: kind must be one of {sorted(_CIFAR)}, got {kind!r}")
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
                raise UserError(f"{kind}: {path} is {size} bytes, not a whole number of {record}-byte "
                                f"records (truncated, or not the binary version)")
            mm = np.memmap(path, dtype=np.uint8, mode="r", shape=(size // record, record))
            if layout.label_bytes == 2:  # CIFAR-100: the coarse label first, 20 superclasses
                coarse = np.asarray(mm[:, 0])
                if coarse.max() >= 20:
                    r = int(np.argmax(coarse >= 20))
                    raise UserError(f"{kind}: {path} record {r} has coarse label {coarse[r]}, outside [0, 20)")
            lab = np.asarray(mm[:, layout.label_at]).astype(np.int64)
            if lab.max() >= layout.num_classes:
                r = int(np.argmax(lab >= layout.num_classes))
                raise UserError(f"{kind}: {path} record {r} has label {lab[r]}, "
                                f"outside [0, {layout.num_classes})")
            self._maps.append(mm)
            self._stems.append(Path(fname).stem)
            labels.append(lab)
            sizes.append((split, len(lab)))
        self._labels = np.concatenate(labels)
        self._starts = np.cumsum([0] + [n for _, n in sizes])
        self._splits = split_indices(sizes)

    def __len__(self) -> int:
        return int(self._starts[-1])

    def __getitem__(self, i: int) -> Sample:  # type: ignore[override]
        i = self._check_index(i)
        f = int(np.searchsorted(self._starts, i, side="right")) - 1
        r = i - int(self._starts[f])
        planes = np.asarray(self._maps[f][r, self._pixels_at:]).reshape(3, 32, 32)
        image = Image.fromarray(np.ascontiguousarray(planes.transpose(1, 2, 0)))  # (32, 32, 3) uint8: RGB
        return Sample(f"{self._stems[f]}_{r:05d}", image, (int(self._labels[i]),))
