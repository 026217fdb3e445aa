"""Write one's own samples as a vitscale dataset: shards + ``_index.parquet`` + ``dataset.json``.

    from vitscale.data import DatasetWriter

    with DatasetWriter("data/mine", name="mine", classes=["cat", "dog"]) as w:
        for image, label in my_samples:          # encoded bytes, a PIL image or a uint8 array
            w.add(image, label)                  # split="train" unless told
        w.add(test_image, 1, split="test")

The same files ``vitscale shards write`` makes, through the same pieces
(:mod:`vitscale.data.tools.write`'s shard packer and JPEG encoder, :mod:`~vitscale.data.tools.publish`'s
claim-fill-publish): a write that fails or is interrupted leaves no dataset, and ``dataset.json``
appears only when the ``with`` block ends without an error. Samples are written in the order they
are added, each split's shards one after another; the training stream shuffles shards and samples
within a window (:mod:`vitscale.data.order`), so add class-sorted data shuffled.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from types import TracebackType
from typing import Any, Self

import numpy as np
from PIL import Image

from vitscale.config.checks import check, positive_int
from vitscale.data.format import FORMAT, DatasetMeta, SplitMeta, write_index_and_meta
from vitscale.data.storage import open_storage
from vitscale.data.tools import publish
from vitscale.data.tools.images import MAX_PIXELS, encode_image
from vitscale.data.tools.write import ShardWriter

__all__ = ["DatasetWriter"]

_KEY = re.compile(r"[A-Za-z0-9_-]+")


def _as_image(image: Image.Image | bytes | np.ndarray) -> Image.Image | bytes:
    """What the encoder takes: encoded bytes or a PIL image (a uint8 (H, W) or (H, W, 3|4) array becomes one)."""
    if isinstance(image, (bytes, bytearray, memoryview)):
        return bytes(image)
    if isinstance(image, Image.Image):
        return image
    if isinstance(image, np.ndarray):
        check(image.dtype == np.uint8 and (image.ndim == 2 or (image.ndim == 3 and image.shape[2] in (1, 3, 4))),
              "image", f"an array must be uint8 (H, W), (H, W, 1), (H, W, 3) or (H, W, 4); got {image.dtype} "
                       f"{image.shape}")
        return Image.fromarray(image[:, :, 0] if image.ndim == 3 and image.shape[2] == 1 else image)
    raise TypeError(f"image must be encoded bytes, a PIL image or a uint8 numpy array, got {type(image).__name__}")


class DatasetWriter:
    """Writes samples added one at a time as a vitscale dataset at ``out`` (a folder or ``s3://``).

    ``classes`` names the classes (label ``i`` is ``classes[i]``); ``multi_label=True`` takes a
    sequence of class indices per sample. Images are shrunk to fit ``max_side`` (never enlarged)
    and JPEG-encoded at ``quality`` with ``chroma`` subsampling, as ``vitscale shards write`` does.
    """

    def __init__(
        self,
        out: str,
        *,
        name: str,
        classes: Sequence[str],
        multi_label: bool = False,
        shard_size: int = 1000,
        max_side: int = 384,
        quality: int = 90,
        chroma: str = "4:2:0",
        endpoint_url: str | None = None,
    ) -> None:
        check(bool(name), "name", "must name the dataset")
        shown = classes if isinstance(classes, str) else list(classes)[:5]  # a string is no list of names
        check(not isinstance(classes, str) and len(classes) >= 1 and len(set(classes)) == len(classes), "classes",
              f"must be distinct class names, at least one; got {shown!r}")
        positive_int(shard_size, "shard_size")
        check(max_side >= 8, "max_side", f"must be >= 8 px, got {max_side}")
        check(1 <= quality <= 95, "quality", f"must be in [1, 95] (JPEG), got {quality}")
        check(chroma in ("4:2:0", "4:2:2", "4:4:4"), "chroma", f"must be 4:2:0, 4:2:2 or 4:4:4, got {chroma!r}")
        self.name, self.classes, self.multi_label = name, tuple(str(c) for c in classes), multi_label
        self.shard_size, self.max_side, self.quality, self.chroma = shard_size, max_side, quality, chroma
        self.storage = open_storage(out, endpoint_url=endpoint_url)
        publish.claim(self.storage)  # refuses a destination holding a dataset; clears a failed write's leftovers
        self._writers: dict[str, ShardWriter] = {}
        self._keys: set[str] = set()
        self._closed = False

    def add(self, image: Image.Image | bytes | np.ndarray, label: int | Sequence[int], *,
            split: str = "train", key: str | None = None) -> str:
        """Add one sample to ``split``; returns its key (``{split}-{n:08d}`` unless given one).

        ``image``: an image file's bytes (any format Pillow reads), a PIL image, or a uint8 array
        (H, W) / (H, W, 3) RGB / (H, W, 4). ``label``: a class index or a class name (a sequence of them
        when ``multi_label``).
        """
        check(not self._closed, "add", "the writer is closed")
        check(bool(split) and all(c.isalnum() or c == "_" for c in split), "split",
              f"must be letters, digits or '_' (it names shard files {{split}}-NNNNNN.tar), got {split!r}")
        given = list(label) if isinstance(label, (Sequence, np.ndarray)) and not isinstance(label, str) else [label]
        check(self.multi_label or len(given) == 1, "label",
              f"a single-label dataset takes one class index, got {given}")
        labels = [self._class_index(x) for x in given]
        writer = self._writers.get(split)
        if writer is None:
            writer = self._writers[split] = ShardWriter(self.storage, split, self.shard_size, self.multi_label)
        if key is None:
            key = f"{split}-{len(writer.rows):08d}"
        check(bool(_KEY.fullmatch(key)), "key", f"must be letters, digits, '_' or '-' (it names tar members), "
                                               f"got {key!r}")
        check(key not in self._keys, "key", f"{key!r} was added before; keys must be unique")
        jpeg, width, height = encode_image(_as_image(image), self.max_side, self.quality, MAX_PIXELS, self.chroma)
        writer.add(key, jpeg, sorted(set(labels)), width, height)
        self._keys.add(key)
        return key

    def _class_index(self, label: Any) -> int:
        """A class index in [0, classes), or the index of a class name; a float or a bool is refused, not
        rounded or read as 0/1: it is a label of some other kind passed by mistake."""
        if isinstance(label, str):
            check(label in self.classes, "label", f"{label!r} is not one of the classes {list(self.classes)[:5]}")
            return self.classes.index(label)
        check(isinstance(label, (int, np.integer)) and not isinstance(label, (bool, np.bool_)), "label",
              f"a class index (an int) or a class name, got {type(label).__name__} {label!r}")
        index = int(label)
        check(0 <= index < len(self.classes), "label", f"class index [{index}] outside [0, {len(self.classes)})")
        return index

    def close(self) -> dict[str, Any]:
        """Finish the shards and publish ``_index.parquet`` and ``dataset.json``; returns the latter."""
        check(not self._closed, "close", "the writer is closed")
        check(bool(self._writers), "add", "no samples were added")
        self._closed = True
        rows: list[dict[str, Any]] = []
        splits: dict[str, SplitMeta] = {}
        for split, writer in self._writers.items():
            writer.finish_shard()
            splits[split] = SplitMeta(len(writer.rows), tuple(writer.shards))
            rows.extend(writer.rows)
        meta = DatasetMeta(
            name=self.name, num_classes=len(self.classes), multi_label=self.multi_label, splits=splits,
            classes=self.classes, max_side=self.max_side, quality=self.quality,
            extra={"source": "vitscale.data.DatasetWriter", "format": FORMAT, "chroma": self.chroma},
        )
        write_index_and_meta(self.storage, rows, meta)
        publish.release(self.storage)
        return meta.to_json()

    def abort(self, error: BaseException) -> None:
        """Remove what this write put at ``out`` (no dataset is left); ``error`` is why."""
        self._closed = True
        for writer in self._writers.values():
            writer.abort(error)
        publish.abort(self.storage, error)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 tb: TracebackType | None) -> None:
        if error is not None:
            self.abort(error)
        elif not self._closed:
            try:
                self.close()
            except BaseException as exc:
                self.abort(exc)
                raise
