"""Read a whole shard front to back: its samples in tar order, members grouped by key.

For the offline tools that visit every sample (verify, dedup); the training loader instead reads
single samples by byte range (:mod:`vitscale.data.loader.reader`).
"""

from __future__ import annotations

import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import BinaryIO

from vitscale.data.loader.labels import LabelError, parse_class_id, parse_json_label

__all__ = ["ShardSample", "iter_shard", "labels_of", "member_key"]


@dataclass(frozen=True)
class ShardSample:
    """One sample read back from a shard: its members by extension and tar byte range."""

    key: str
    files: dict[str, bytes]
    offset: int
    size: int


def member_key(name: str) -> tuple[str, str]:
    """(key, extension) of a tar member by WebDataset's rule: the base name splits at its first dot. The
    extension is lower-cased, as the training loader reads it (`data/loader/tar.py`): ``x.JPEG`` and
    ``x.CLS`` are the image and the label of sample ``x``."""
    folder, _, base = name.rpartition("/")
    stem, _, ext = base.partition(".")
    return (f"{folder}/{stem}" if folder else stem), ext.lower()


def iter_shard(f: BinaryIO) -> Iterator[ShardSample]:
    """Samples of a shard stream in order, grouping members by key (:func:`member_key`)."""
    current: ShardSample | None = None
    with tarfile.open(fileobj=f, mode="r|") as tar:
        for info in tar:
            if not info.isfile():
                continue
            key, ext = member_key(info.name)
            data = tar.extractfile(info).read()  # type: ignore[union-attr]
            end = info.offset_data + ((info.size + 511) // 512) * 512
            if current is not None and current.key == key:
                current.files[ext] = data
                current = ShardSample(key, current.files, current.offset, end - current.offset)
            else:
                if current is not None:
                    yield current
                current = ShardSample(key, {ext: data}, info.offset, end - info.offset)
    if current is not None:
        yield current


def labels_of(s: ShardSample) -> list[int] | None:
    """Labels from a sample's ``.cls`` or ``.json`` member; None when it has neither.

    Parsed with the training loader's bounded parser (:mod:`vitscale.data.loader.labels`): a label
    that cannot be one raises ``LabelError`` (a ``ValueError``), never ``RecursionError`` or
    ``MemoryError``.
    """
    if "cls" in s.files:
        return [parse_class_id(s.files["cls"])]
    if "json" in s.files:
        found = parse_json_label(s.files["json"], "labels")
        if not all(isinstance(v, int) for v in found):
            raise LabelError("malformed .json label: 'labels' must be a list of ints")
        return [int(v) for v in found]
    return None
