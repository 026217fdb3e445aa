"""Damaged sample records end as a skipped sample (BadSample), in bounded time, never a crash or hang.

Real records (vitscale's shard writer, webdataset.TarWriter, GNU and PAX long names) go through
the loader's whole per-sample chain (`decode_sample`) after random byte flips, truncations,
insertions and header-field overwrites; targeted cases pin the damage that used to crash or hang.
"""

from __future__ import annotations

import contextlib
import io
import signal
import tarfile
import tempfile
import time
import zlib
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest
import webdataset as wds
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from helpers.datasets import tar_records
from vitscale.data.loader.sample import decode_sample
from vitscale.data.loader.tar import BadSample, split_tar_record
from vitscale.data.loader.transforms import TransformSpec, sample_rng
from vitscale.data.storage import LocalStorage
from vitscale.data.tools.write import ShardWriter

R = 16
SPEC = TransformSpec(resolution=R, train=True)
SECONDS_PER_RECORD = 2.0  # generous for a loaded 2-core machine: a sound record takes milliseconds


@contextlib.contextmanager
def within(seconds: float):
    """Fail (TimeoutError) instead of hanging when the body runs longer than ``seconds``."""

    def expire(signum, frame):
        raise TimeoutError(f"took longer than {seconds}s")

    old = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _jpeg(seed: int, size: tuple[int, int] = (40, 30)) -> bytes:
    arr = np.random.default_rng(seed).integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "JPEG", quality=80)
    return buf.getvalue()


def _tar(fmt: int, members: list[tuple[str, bytes]]) -> bytes:
    return tar_records(fmt, members)[:-1024]  # a sample's byte range holds no end-of-archive blocks


@lru_cache(maxsize=1)
def records() -> dict[str, tuple[str, bytes, bool]]:
    """name -> (key, record bytes, multi_label): the record kinds a shard can hold."""
    with tempfile.TemporaryDirectory() as tmp:
        writer = ShardWriter(LocalStorage(tmp), "train", shard_size=10, multi_label=False)
        writer.add("train-0001", _jpeg(1), [3], 40, 30)
        writer.finish_shard()
        row = writer.rows[0]
        with open(Path(tmp) / row["shard"], "rb") as f:
            f.seek(row["offset"])
            ours = f.read(row["size"])
    assert zlib.crc32(ours) == row["crc32"]
    buf = io.BytesIO()
    with wds.TarWriter(buf) as tw:
        tw.write({"__key__": "s7", "jpg": _jpeg(2), "json": b'{"labels": [1, 4]}'})
    long_key = "d" * 70 + "/" + "e" * 70 + "/naïve"
    return {
        "vitscale": ("train-0001", ours, False),
        "webdataset": ("s7", buf.getvalue()[:-1024], True),
        "gnu-long-name": (long_key, _tar(tarfile.GNU_FORMAT, [(f"{long_key}.jpg", _jpeg(3)), (f"{long_key}.cls", b"2")]), False),
        "pax-path": (long_key, _tar(tarfile.PAX_FORMAT, [(f"{long_key}.jpg", _jpeg(4)), (f"{long_key}.cls", b"5")]), False),
    }


def _decode(key: str, raw: bytes, multi: bool, crc: int = -1) -> list[int]:
    out = np.empty((3, R, R), np.uint8)
    return decode_sample(raw, key, size=len(raw), crc=crc, num_classes=10, multi_label=multi,
                         spec=SPEC, rng=sample_rng(0, 0, 0), out=out)


def _survives(key: str, raw: bytes, multi: bool, crc: int = -1) -> str:
    """'ok' or 'skipped': anything else (another exception, a hang) fails the test."""
    t0 = time.perf_counter()
    with within(4 * SECONDS_PER_RECORD):
        try:
            _decode(key, raw, multi, crc)
            outcome = "ok"
        except BadSample:
            outcome = "skipped"
    assert time.perf_counter() - t0 < SECONDS_PER_RECORD
    return outcome


@pytest.mark.parametrize("name", ["vitscale", "webdataset", "gnu-long-name", "pax-path"])
def test_sound_records_decode(name):
    key, raw, multi = records()[name]
    assert _decode(key, raw, multi) in ([3], [1, 4], [2], [5])


# One mutation: (kind, position as a fraction of the record, a byte or bytes).
_mutation = st.one_of(
    st.tuples(st.just("flip"), st.floats(0, 1, exclude_max=True), st.integers(1, 255)),
    st.tuples(st.just("truncate"), st.floats(0, 1, exclude_max=True), st.just(b"")),
    st.tuples(st.just("insert"), st.floats(0, 1), st.binary(min_size=1, max_size=600)),
    # Header fields (name, size, checksum, type flag, ustar magic) of the first three headers.
    st.tuples(st.just("field"), st.sampled_from([0, 99, 124, 130, 135, 148, 155, 156, 257, 345]),
              st.binary(min_size=1, max_size=12)),
)


def _mutate(raw: bytes, mutations: list[tuple]) -> bytes:
    b = bytearray(raw)
    for kind, where, what in mutations:
        if not b:
            break
        at = int(where * len(b)) if isinstance(where, float) else where
        if kind == "flip":
            b[at] ^= what
        elif kind == "truncate":
            del b[at:]
        elif kind == "insert":
            b[at:at] = what
        else:  # overwrite a field of one of the first headers (512-byte blocks)
            base = 512 * (len(mutations) % 3)
            if base + at < len(b):
                b[base + at : base + at + len(what)] = what
    return bytes(b)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(["vitscale", "webdataset", "gnu-long-name", "pax-path"]),
       mutations=st.lists(_mutation, min_size=1, max_size=4))
def test_any_mutation_is_a_skipped_sample_in_bounded_time(name, mutations):
    key, raw, multi = records()[name]
    damaged = _mutate(raw, mutations)
    _survives(key, damaged, multi)  # the parser alone (datasets without checksums)
    if damaged != raw:  # with the index's checksum, every change is caught before parsing
        assert _survives(key, damaged, multi, zlib.crc32(raw)) == "skipped"


def _header(name: bytes, size: int, kind: bytes) -> bytes:
    """A ustar header with a correct checksum."""
    h = bytearray(512)
    h[0 : len(name)] = name
    h[100:108] = b"0000444\0"
    h[124:136] = f"{size:011o}\0".encode()
    h[136:148] = b"00000000000\0"
    h[156:157] = kind
    h[257:263] = b"ustar\0"
    h[263:265] = b"00"
    h[148:156] = b" " * 8
    h[148:156] = f"{sum(h):06o}\0 ".encode()
    return bytes(h)


def _member(name: bytes, data: bytes, kind: bytes = b"0") -> bytes:
    return _header(name, len(data), kind) + data + bytes(-len(data) % 512)


def _pax(records: bytes) -> bytes:
    return _member(b"././@PaxHeader", records, b"x")


JPG = _jpeg(9)


@pytest.mark.parametrize("raw, why", [
    (_pax(b"0 mtime=1\n14 path=k.jpg\n") + _member(b"k.jpg", JPG), "PAX record of length 0"),  # used to loop forever
    (_pax(b"3 path=k.jpg\n") + _member(b"k.jpg", JPG), "PAX record of length 3"),
    (_pax(b"x9 path=k.jpg\n") + _member(b"k.jpg", JPG), "malformed PAX record length"),
    (_pax(b"99999 path=k.jpg\n") + _member(b"k.jpg", JPG), "does not fit"),
    (_pax(b"13 path=k.jpg") + _member(b"k.jpg", JPG), "does not fit"),  # no newline
    (_pax(b"15 path=\xff\xfe.jpg\n") + _member(b"k.jpg", JPG), "PAX path is not UTF-8"),
    (_pax(b"11 size=x1\n") + _member(b"k.jpg", JPG), "malformed PAX size"),
    (_member(b"././@LongLink", b"k\xff\xfe.jpg\0", b"L") + _member(b"k.jpg", JPG), "GNU long name is not UTF-8"),
    (_member(b"k\xff.jpg", JPG), "tar member name is not UTF-8"),
    (_member(b"k.jpg", JPG)[:124] + b"\xff" * 12 + _member(b"k.jpg", JPG)[136:], "checksum"),
])  # fmt: skip
def test_damage_that_used_to_crash_or_hang(raw, why):
    with within(4 * SECONDS_PER_RECORD), pytest.raises(BadSample, match=why):
        split_tar_record(raw, "k")


def test_negative_base256_size_is_refused():
    h = bytearray(_header(b"k.jpg", 0, b"0"))
    h[124:136] = b"\xff" * 12  # GNU base-256 -1
    h[148:156] = b" " * 8
    h[148:156] = f"{sum(h):06o}\0 ".encode()
    with pytest.raises(BadSample, match="negative size"):
        split_tar_record(bytes(h) + bytes(512), "k")


def test_deeply_nested_json_label_is_a_bad_sample():
    raw = _member(b"k.jpg", JPG) + _member(b"k.json", b"[" * 100_000)
    with pytest.raises(BadSample, match="malformed .json"):
        _decode("k", raw, True)


def test_image_header_claiming_huge_size_is_refused_fast():
    jpg = bytearray(JPG)
    sof = jpg.index(b"\xff\xc0")  # baseline SOF0: length(2) precision(1) height(2) width(2)
    jpg[sof + 5 : sof + 9] = (60000).to_bytes(2, "big") + (60000).to_bytes(2, "big")
    raw = _member(b"k.jpg", bytes(jpg)) + _member(b"k.cls", b"1")
    t0 = time.perf_counter()
    with pytest.raises(BadSample, match="60000x60000"):
        _decode("k", raw, False)
    assert time.perf_counter() - t0 < SECONDS_PER_RECORD


def test_any_decoder_exception_is_a_bad_sample():
    # A PNG whose IHDR chunk is cut: PIL raises SyntaxError/struct errors, not OSError.
    buf = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buf, "PNG")
    png = buf.getvalue()[:30]
    raw = _member(b"k.jpg", png) + _member(b"k.cls", b"1")
    with pytest.raises(BadSample, match="corrupt image"):
        _decode("k", raw, False)
