"""One sample's tar record -> its members: a tar parser that treats every byte as hostile.

A sample's byte range (``offset``/``size`` from ``_index.parquet``) holds tar headers and padded
members ``{key}.jpg``, ``{key}.cls`` / ``{key}.json``, possibly preceded by PAX extended headers
(``x``/``g``) or GNU long-name members (``L``). Any damage to those bytes (a flipped bit, a
truncation, inserted junk, a PAX record of length 0, a long name that is not UTF-8, a size that
points past the end) raises :class:`BadSample`, never another exception and never a loop that does
not advance:

- every header step advances by at least one 512-byte block, so a record of ``n`` bytes takes at
  most ``n / 512`` steps;
- every PAX record must advance by its own positive length and lie inside its header's data, so
  parsing one is bounded by the header's size;
- every number and name is parsed with its failure mapped to :class:`BadSample`.

Why hand-written and not :mod:`tarfile`: it parses the bytes already in memory without a file
object, in about a microsecond per sample, and accepts exactly what a sample record may hold.
"""

from __future__ import annotations

__all__ = ["BadSample", "split_tar_record"]

_BLOCK = 512
_ZERO_BLOCK = bytes(_BLOCK)
_MEMBER_TYPES = (b"0", b"\0", b"7")  # regular files (and contiguous files): sample data
_EXT_TYPES = (b"x", b"g")  # PAX extended headers: per-member and global


class BadSample(ValueError):
    """One sample cannot be used (truncated, corrupt, unlabeled); the stream skips and counts it."""


def _number(field: bytes, what: str, pos: int) -> int:
    """A tar numeric field: NUL/space-terminated octal, or GNU base-256 when the top bit is set."""
    if field and field[0] & 0x80:
        if field[0] & 0x40:  # base-256 negative numbers: never a valid size or checksum
            raise BadSample(f"negative {what} in the tar header at byte {pos}")
        return int.from_bytes(bytes([field[0] & 0x7F]) + field[1:], "big")
    text = field.split(b"\0", 1)[0].strip()
    if not text:
        return 0
    if text.strip(b"01234567"):  # int(..., 8) would also take '_', '+', '-' and other digits
        raise BadSample(f"malformed {what} {field!r} in the tar header at byte {pos}")
    return int(text, 8)


def _text(raw: bytes, what: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadSample(f"{what} is not UTF-8: {raw[:64]!r}") from exc


def _pax_records(data: bytes, pos: int) -> dict[bytes, bytes]:
    """The ``"<len> <key>=<value>\\n"`` records of a PAX header's data, strictly checked."""
    out: dict[bytes, bytes] = {}
    at, n = 0, len(data.rstrip(b"\0"))
    while at < n:
        space = data.find(b" ", at, min(n, at + 21))  # a length has at most 20 digits
        digits = data[at:space] if space > at else b""
        if not digits or not digits.isdigit():
            raise BadSample(f"malformed PAX record length {data[at:at + 24]!r} in the header at byte {pos}")
        length = int(digits)
        end = at + length
        # A record covers its own length field, the space, "k=v" and the newline: it always
        # advances, and it must end inside the data on a newline.
        if length < len(digits) + 4 or end > n or data[end - 1 : end] != b"\n":
            raise BadSample(f"PAX record of length {length} does not fit the header at byte {pos}")
        key, eq, value = data[space + 1 : end - 1].partition(b"=")
        if not eq or not key:
            raise BadSample(f"PAX record without key=value in the header at byte {pos}")
        out[key] = value
        at = end
    return out


def _checksum_ok(hdr: bytes, pos: int) -> bool:
    stored = _number(hdr[148:156], "checksum", pos)
    # The checksum is the sum of all header bytes with the checksum field itself read as spaces.
    return stored == sum(hdr[:148]) + 8 * 32 + sum(hdr[156:])


def split_tar_record(raw: bytes, key: str, expected_size: int | None = None) -> dict[str, bytes]:
    """The members of one sample's tar record, as ``{extension: bytes}`` (``"jpg"``, ``"cls"``).

    ``raw`` is the byte range of the sample in its shard; ``key`` the sample key from the index.
    Raises :class:`BadSample` on a short read, a malformed header or PAX record, a bad header
    checksum, a member that runs past the end, a name that is not UTF-8, or a member whose name
    does not start with ``key + "."`` (index and shard disagree); nothing else.
    """
    if expected_size is not None and len(raw) != expected_size:
        raise BadSample(f"truncated read: got {len(raw)} of {expected_size} bytes")
    members: dict[str, bytes] = {}
    pos, n = 0, len(raw)
    long_name: str | None = None
    pax_size: int | None = None
    while pos + _BLOCK <= n:
        hdr = raw[pos : pos + _BLOCK]
        if hdr == _ZERO_BLOCK:
            break  # end-of-archive marker: nothing of this sample follows
        if not _checksum_ok(hdr, pos):
            raise BadSample(f"tar header checksum mismatch at byte {pos}")
        size = _number(hdr[124:136], "size", pos) if pax_size is None else pax_size
        pax_size = None
        start = pos + _BLOCK
        end = start + size
        if end > n:
            raise BadSample(f"tar member runs past the end of the record ({end} > {n} bytes)")
        data = raw[start:end]
        pos = start + -(-size // _BLOCK) * _BLOCK  # >= one block further: the loop always advances
        kind = hdr[156:157]
        if kind in _EXT_TYPES:
            records = _pax_records(data, start - _BLOCK)
            if kind == b"x":  # a global header ("g") applies to no one member of a sample
                if b"path" in records:
                    long_name = _text(records[b"path"], "PAX path")
                if b"size" in records:
                    digits = records[b"size"]
                    if not digits.isdigit():
                        raise BadSample(f"malformed PAX size {digits[:24]!r} in the header at byte {start - _BLOCK}")
                    pax_size = int(digits)
            continue
        if kind == b"L":  # GNU long name for the next member
            long_name = _text(data.split(b"\0", 1)[0], "GNU long name")
            continue
        if kind not in _MEMBER_TYPES:
            long_name = None
            continue  # directories, links: not sample data
        if long_name is not None:
            name, long_name = long_name, None
        else:
            name = _text(hdr[0:100].split(b"\0", 1)[0], "tar member name")
            if hdr[257:262] == b"ustar":
                prefix = _text(hdr[345:500].split(b"\0", 1)[0], "ustar name prefix")
                if prefix:
                    name = f"{prefix}/{name}"
        if not name.startswith(key + "."):
            raise BadSample(f"member {name[:200]!r} does not belong to sample {key!r}")
        members[name[len(key) + 1 :].lower()] = data
    if pos < n and raw[pos:].strip(b"\0"):
        raise BadSample(f"{n - pos} stray bytes after the last tar member")
    if not members:
        raise BadSample("no tar members in the sample's byte range")
    return members
