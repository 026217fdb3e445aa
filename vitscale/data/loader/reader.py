"""Bytes of samples: ranged reads of sample records, their checksums, and label parsing.

A sample is read from its shard with one ranged read (``offset``/``size`` from ``_index.parquet``):
the bytes hold the tar headers and padded members ``{key}.jpg`` and ``{key}.cls`` / ``{key}.json``
(split by :mod:`vitscale.data.loader.tar`). Everything that can be wrong with such bytes (short
read, checksum mismatch, broken header, foreign member, missing or malformed label) raises
:class:`BadSample`, which the stream counts and skips.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

from vitscale.data.loader.labels import LabelError, parse_class_id, parse_json_label
from vitscale.data.loader.tar import BadSample, split_tar_record
from vitscale.data.storage import LocalStorage, Storage

__all__ = ["BadSample", "SampleReader", "check_crc", "check_labels", "parse_label", "split_tar_record"]


def check_crc(raw: bytes, expected: int) -> None:
    """Raise :class:`BadSample` unless ``zlib.crc32(raw) == expected`` (``expected < 0``: no checksum).

    The index's ``crc32`` column (see :mod:`vitscale.data.format`) covers the sample's whole byte
    range, so a flipped bit anywhere in it (headers, image, label) is caught before parsing.
    """
    if expected >= 0:
        got = zlib.crc32(raw)
        if got != expected:
            raise BadSample(f"checksum mismatch: crc32 {got:08x}, the index says {expected:08x}")


def no_label(extensions: Iterable[str]) -> str:
    """Why a sample with these members has no label, in the words every tool uses."""
    return f"no label member (.cls or .json) among {sorted(extensions)[:10]}"


def parse_label(members: dict[str, bytes], num_classes: int, multi_label: bool) -> list[int]:
    """Class ids of a sample from ``cls`` (ascii int) or ``json`` (``{"labels": [ints]}``).

    Single-label datasets need exactly one id; multi-label ones accept any number (JFT-style).
    Raises :class:`BadSample` when the label is missing, unparsable or out of ``[0, num_classes)``.
    """
    try:
        if "cls" in members:
            labels = [parse_class_id(members["cls"])]
        elif "json" in members:
            found = parse_json_label(members["json"], "labels")
            if not all(isinstance(v, int) for v in found):
                raise LabelError("malformed .json label: 'labels' must be a list of ints")
            labels = [int(v) for v in found]
        else:
            raise BadSample(no_label(members))
    except LabelError as exc:  # bounded size and depth: data/loader/labels.py
        raise BadSample(str(exc)) from None
    check_labels(labels, num_classes, multi_label)
    return labels


def check_labels(labels: list[int], num_classes: int, multi_label: bool) -> None:
    """Raise :class:`BadSample` unless ``labels`` are class ids in range (exactly one if single-label)."""
    if not multi_label and len(labels) != 1:
        raise BadSample(f"single-label dataset but the sample has {len(labels)} labels")
    for v in labels:
        if not 0 <= v < num_classes:
            raise BadSample(f"label {v} outside [0, {num_classes})")


class SampleReader:
    """Ranged reads of sample records: pread on cached file descriptors locally, concurrent
    coalesced GETs on object storage."""

    def __init__(self, storage: Storage, max_gap: int = 256 << 10, threads: int = 16) -> None:
        self.storage = storage
        self.local = isinstance(storage, LocalStorage)
        self.max_gap = max_gap
        self.threads = threads
        self._fds: dict[str, int] = {}
        self._pool: ThreadPoolExecutor | None = None

    def _fd(self, name: str) -> int:
        fd = self._fds.get(name)
        if fd is None:
            if len(self._fds) >= 64:  # bound open files: a window touches only a few shards
                os.close(self._fds.pop(next(iter(self._fds))))
            fd = os.open(self.storage.url_of(name), os.O_RDONLY)
            self._fds[name] = fd
        return fd

    def close(self) -> None:
        """Close cached file descriptors and the request thread pool."""
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None

    def read(self, requests: list[tuple[str, int, int]]) -> list[bytes]:
        """Bytes of each (shard name, offset, size); shorter than size where the shard ends early."""
        if self.local:
            return [os.pread(self._fd(n), size, off) for n, off, size in requests]
        # Coalesce requests into runs per shard whose gaps are small: one GET per run.
        order = sorted(range(len(requests)), key=lambda i: (requests[i][0], requests[i][1]))
        runs: list[tuple[str, int, int, list[int]]] = []
        for i in order:
            name, off, size = requests[i]
            if runs and runs[-1][0] == name and off - runs[-1][2] <= self.max_gap:
                r = runs[-1]
                runs[-1] = (name, r[1], max(r[2], off + size), r[3] + [i])
            else:
                runs.append((name, off, off + size, [i]))
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads)
        blobs = self._pool.map(lambda r: self.storage.read_range(r[0], r[1], r[2] - r[1]), runs)
        out: list[bytes] = [b""] * len(requests)
        for (_, start, _, members), blob in zip(runs, blobs):
            for i in members:
                off = requests[i][1] - start
                out[i] = blob[off : off + requests[i][2]]
        return out

