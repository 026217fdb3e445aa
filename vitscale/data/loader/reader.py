"""Bytes of one sample -> its tar members and labels: ranged reads of sample records, tar-record
parsing and label parsing.

A sample is read from its shard with one ranged read (``offset``/``size`` from ``_index.parquet``):
the bytes hold the tar headers and padded members ``{key}.jpg`` and ``{key}.cls`` / ``{key}.json``.
Everything that can be wrong with such bytes (short read, broken header, foreign member, missing or
malformed label) raises :class:`BadSample`, which the stream counts and skips.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor

from vitscale.data.storage import LocalStorage, Storage

__all__ = ["BadSample", "SampleReader", "parse_label", "split_tar_record"]

_BLOCK = 512
_ZERO_BLOCK = bytes(_BLOCK)


class BadSample(ValueError):
    """One sample cannot be used (truncated, corrupt, unlabeled); the stream skips and counts it."""


def _octal(field: bytes) -> int:
    """A tar numeric field: NUL/space-terminated octal, or GNU base-256 when the top bit is set."""
    if field and field[0] & 0x80:
        return int.from_bytes(field[1:], "big")
    text = field.split(b"\0", 1)[0].strip()
    return int(text, 8) if text else 0


def _pax_path(data: bytes) -> str | None:
    """The ``path`` record of a PAX extended header, if any (``"<len> path=<value>\\n"``)."""
    pos = 0
    while pos < len(data):
        space = data.find(b" ", pos)
        if space < 0:
            break
        length = int(data[pos:space])
        record = data[space + 1 : pos + length - 1]  # without the trailing newline
        pos += length
        name, _, value = record.partition(b"=")
        if name == b"path":
            return value.decode("utf-8")
    return None


def split_tar_record(raw: bytes, key: str, expected_size: int | None = None) -> dict[str, bytes]:
    """The members of one sample's tar record, as ``{extension: bytes}`` (``"jpg"``, ``"cls"``).

    ``raw`` is the byte range of the sample in its shard; ``key`` the sample key from the index.
    Raises :class:`BadSample` on a short read, a header with a bad checksum, a member that runs past
    the end, or a member whose name does not start with ``key + "."`` (index and shard disagree).
    """
    if expected_size is not None and len(raw) != expected_size:
        raise BadSample(f"truncated read: got {len(raw)} of {expected_size} bytes")
    members: dict[str, bytes] = {}
    pos, n = 0, len(raw)
    long_name: str | None = None
    while pos + _BLOCK <= n:
        hdr = raw[pos : pos + _BLOCK]
        if hdr == _ZERO_BLOCK:
            break  # end-of-archive marker: nothing of this sample follows
        # Checksum: sum of all header bytes with the checksum field itself read as spaces.
        try:
            stored = _octal(hdr[148:156])
            size = _octal(hdr[124:136])
        except ValueError as exc:
            raise BadSample(f"malformed tar header at byte {pos}") from exc
        if stored != sum(hdr[:148]) + 8 * 32 + sum(hdr[156:]):
            raise BadSample(f"tar header checksum mismatch at byte {pos}")
        start = pos + _BLOCK
        end = start + size
        if end > n:
            raise BadSample(f"tar member runs past the end of the record ({end} > {n} bytes)")
        data = raw[start:end]
        pos = start + -(-size // _BLOCK) * _BLOCK
        kind = hdr[156:157]
        if kind in (b"x", b"g"):
            long_name = _pax_path(data) or long_name
            continue
        if kind == b"L":  # GNU long name for the next member
            long_name = data.rstrip(b"\0").decode("utf-8")
            continue
        if kind not in (b"0", b"\0", b"7"):
            long_name = None
            continue  # directories, links: not sample data
        if long_name is not None:
            name, long_name = long_name, None
        else:
            name = hdr[0:100].split(b"\0", 1)[0].decode("utf-8")
            if hdr[257:262] == b"ustar":
                prefix = hdr[345:500].split(b"\0", 1)[0].decode("utf-8")
                if prefix:
                    name = f"{prefix}/{name}"
        if not name.startswith(key + "."):
            raise BadSample(f"member {name!r} does not belong to sample {key!r}")
        members[name[len(key) + 1 :].lower()] = data
    if pos < n and raw[pos:].strip(b"\0"):
        raise BadSample(f"{n - pos} stray bytes after the last tar member")
    if not members:
        raise BadSample("no tar members in the sample's byte range")
    return members


def parse_label(members: dict[str, bytes], num_classes: int, multi_label: bool) -> list[int]:
    """Class ids of a sample from ``cls`` (ascii int) or ``json`` (``{"labels": [ints]}``).

    Single-label datasets need exactly one id; multi-label ones accept any number (JFT-style).
    Raises :class:`BadSample` when the label is missing, unparsable or out of ``[0, num_classes)``.
    """
    if "cls" in members:
        try:
            labels = [int(members["cls"].decode("ascii").strip())]
        except (UnicodeDecodeError, ValueError) as exc:
            raise BadSample(f"malformed .cls label {members['cls'][:32]!r}") from exc
    elif "json" in members:
        try:
            obj = json.loads(members["json"])
            raw = obj["labels"] if isinstance(obj, dict) else None
            if not isinstance(raw, list) or not all(
                isinstance(v, int) and not isinstance(v, bool) for v in raw
            ):
                raise ValueError("'labels' must be a list of ints")
            labels = list(raw)
        except (ValueError, KeyError, TypeError) as exc:
            raise BadSample(f"malformed .json label {members['json'][:64]!r}: {exc}") from exc
    else:
        raise BadSample(f"no label member (.cls or .json) among {sorted(members)}")
    if not multi_label and len(labels) != 1:
        raise BadSample(f"single-label dataset but the sample has {len(labels)} labels")
    for v in labels:
        if not 0 <= v < num_classes:
            raise BadSample(f"label {v} outside [0, {num_classes})")
    return labels


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

