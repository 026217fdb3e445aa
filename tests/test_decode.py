"""Tar-record parsing, labels, JPEG decode + crop, augmentation geometry and normalisation."""

from __future__ import annotations

import io
import json
import math
import random
import tarfile

import numpy as np
import pytest
import torch
import webdataset as wds
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from helpers.datasets import tar_records
from vitscale.data.loader.decode import decode_image_into
from vitscale.data.loader.reader import BadSample, parse_label, split_tar_record
from vitscale.data.loader.transforms import (
    TransformSpec,
    crop_box,
    normalize_on_device,
    sample_rng,
)


def _jpeg(arr: np.ndarray, quality: int = 95, mode: str | None = None) -> bytes:
    img = Image.fromarray(arr)
    if mode:
        img = img.convert(mode)
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=quality)
    return buf.getvalue()


def _halves(width: int = 200, height: int = 120) -> np.ndarray:
    """Left half red, right half blue."""
    arr = np.zeros((height, width, 3), np.uint8)
    arr[:, : width // 2, 0] = 255
    arr[:, width // 2 :, 2] = 255
    return arr


def _photo(width: int, height: int, seed: int = 0, wavelength: float = 1.0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32) / wavelength
    img = np.stack([127 + 100 * np.sin(xx / (17 + 9 * c) + yy / (23 + 5 * c) + c) for c in range(3)], -1)
    return np.clip(img + rng.normal(0, 4, img.shape), 0, 255).astype(np.uint8)


# ---------------------------------------------------------------- tar records


@pytest.mark.parametrize(
    "fmt, key",
    [(f, k) for f in (tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT)
     for k in ("a1", "d" * 60 + "/" + "e" * 60 + "/x", "naïve_ключ")
     if f != tarfile.USTAR_FORMAT or k.isascii()],  # ustar cannot store non-ASCII names
)  # fmt: skip
def test_tar_record_roundtrip_across_formats(fmt, key):
    # Long names take the ustar prefix field, a GNU long-name member or a PAX path record.
    raw = tar_records(fmt, [(f"{key}.jpg", b"J" * 700), (f"{key}.cls", b"3")])
    raw = raw[: len(raw) - 1024]  # a sample's byte range has no end-of-archive blocks
    assert split_tar_record(raw, key, len(raw)) == {"jpg": b"J" * 700, "cls": b"3"}


def test_tar_record_from_webdataset_writer():
    buf = io.BytesIO()
    with wds.TarWriter(buf) as tw:
        tw.write({"__key__": "s7", "jpg": b"\xff\xd8xyz", "cls": b"5"})
    raw = buf.getvalue()
    assert split_tar_record(raw, "s7") == {"jpg": b"\xff\xd8xyz", "cls": b"5"}


def test_tar_record_errors():
    raw = tar_records(tarfile.USTAR_FORMAT, [("k.jpg", b"x" * 1000), ("k.cls", b"1")])[:-1024]
    with pytest.raises(BadSample, match="truncated"):
        split_tar_record(raw[:900], "k", len(raw))
    with pytest.raises(BadSample, match="past the end"):
        split_tar_record(raw[:900], "k")
    broken = bytearray(raw)
    broken[10] ^= 0xFF  # a byte of the first member's name: checksum no longer matches
    with pytest.raises(BadSample, match="checksum"):
        split_tar_record(bytes(broken), "k")
    with pytest.raises(BadSample, match="does not belong"):
        split_tar_record(raw, "other")
    with pytest.raises(BadSample, match="no tar members"):
        split_tar_record(b"\0" * 1024, "k")
    with pytest.raises(BadSample, match="stray"):
        split_tar_record(raw + b"garbage", "k")


# ---------------------------------------------------------------- labels


def test_parse_label():
    assert parse_label({"cls": b" 7\n"}, 10, False) == [7]
    assert parse_label({"json": json.dumps({"labels": [1, 4]}).encode()}, 10, True) == [1, 4]
    assert parse_label({"json": b'{"labels": []}'}, 10, True) == []
    assert parse_label({"cls": b"2"}, 10, True) == [2]
    bad = [
        ({}, False, "no label"),
        ({"cls": b"seven"}, False, "malformed"),
        ({"cls": b"12"}, False, "outside"),
        ({"json": b"{oops"}, True, "malformed"),
        ({"json": b'{"labels": [1, "2"]}'}, True, "malformed"),
        ({"json": b'{"labels": [true]}'}, True, "malformed"),
        ({"json": b"[1, 2]"}, True, "malformed"),
        ({"json": b'{"labels": [1, 2]}'}, False, "single-label"),
        ({"json": b'{"labels": [-1]}'}, True, "outside"),
    ]
    for members, multi, match in bad:
        with pytest.raises(BadSample, match=match):
            parse_label(members, 10, multi)


# ---------------------------------------------------------------- images


def _decode(data: bytes, spec: TransformSpec, rng=None) -> np.ndarray:
    out = np.empty((3, spec.resolution, spec.resolution), np.uint8)
    decode_image_into(data, out, spec, rng)
    return out


def test_eval_centre_crop_and_train_flip_geometry():
    data = _jpeg(_halves())
    out = _decode(data, TransformSpec(resolution=32, train=False, eval_crop=1.0))
    assert out.shape == (3, 32, 32)
    assert out[0, :, :12].mean() > 200 and out[2, :, :12].mean() < 40  # left stays red
    assert out[2, :, -12:].mean() > 200  # right stays blue
    # A full-image "crop" (scale and ratio pinned) with flip: whichever way the coin falls,
    # red and blue sides must match it.
    spec = TransformSpec(resolution=32, scale=(1.0, 1.0), ratio=(200 / 120, 200 / 120))
    for i in range(8):
        rng = sample_rng(1, 0, i)
        flip = crop_box(200, 120, spec, sample_rng(1, 0, i)).flip
        o = _decode(data, spec, rng)
        left_red = o[0, :, :12].mean() > 200
        assert left_red != flip


def test_train_decode_is_deterministic_per_sample_rng():
    data = _jpeg(_photo(500, 375))
    spec = TransformSpec(resolution=64)
    a = _decode(data, spec, sample_rng(5, 2, 1234))
    b = _decode(data, spec, sample_rng(5, 2, 1234))
    c = _decode(data, spec, sample_rng(5, 3, 1234))
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


def test_reduced_scale_decode_matches_full_decode():
    # 2000x1500 to 64 px: the crop is far larger than the output, so decoding runs at 1/8 scale.
    arr = _photo(2000, 1500, wavelength=8.0)  # detail the 64 px output can represent
    data = _jpeg(arr)
    spec = TransformSpec(resolution=64, train=False, eval_crop=1.0)
    fast = _decode(data, spec).transpose(1, 2, 0).astype(np.float32)
    full = Image.open(io.BytesIO(data)).convert("RGB")
    ref = np.asarray(full.resize((64, 64), Image.Resampling.BILINEAR, box=(250, 0, 1750, 1500)))
    assert np.abs(fast - ref.astype(np.float32)).mean() < 2.0


@pytest.mark.parametrize("mode", ["L", "CMYK"])
def test_grayscale_and_cmyk_jpegs_decode_to_rgb(mode):
    data = _jpeg(_photo(120, 90), mode=mode)
    out = _decode(data, TransformSpec(resolution=48, train=False))
    assert out.shape == (3, 48, 48) and out.std() > 5


def test_png_named_jpg_still_decodes():
    buf = io.BytesIO()
    Image.fromarray(_halves(64, 64)).save(buf, "PNG")
    out = _decode(buf.getvalue(), TransformSpec(resolution=16, train=False, eval_crop=1.0))
    assert out[0, :, :4].mean() > 200


def _png(array: np.ndarray, mode: str | None = None) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array, mode).save(buf, "PNG")
    return buf.getvalue()


@pytest.mark.parametrize(("data", "mean"), [
    # A 16-bit grey ramp over [0, 65535]: scaled to 8 bits (about 127 on average), as the writer does;
    # PIL's convert("RGB") clipped it at 255, an image 99% white.
    (_png(np.linspace(0, 65535, 64 * 64).reshape(64, 64).astype(np.uint16)), 127.5),
    # Fully transparent: white, as the writer composites it; dropping alpha gave black.
    (_png(np.zeros((64, 64, 4), np.uint8), "RGBA"), 255.0),
])
def test_a_png_in_an_adopted_tar_reads_as_the_writer_would_write_it(data, mean):
    out = _decode(data, TransformSpec(resolution=32, train=False, eval_crop=1.0))
    assert abs(out.mean() - mean) < 3, out.mean()


def test_corrupt_and_truncated_images_are_bad_samples():
    data = _jpeg(_photo(300, 200))
    for bad in [b"not an image", data[: len(data) // 2], data[:200] + b"\0" * 4000]:
        with pytest.raises(BadSample):
            _decode(bad, TransformSpec(resolution=32, train=False))


def test_a_png_header_past_pils_bomb_limit_is_a_bad_sample_without_pils_warning():
    """100M pixels: over PIL's warning threshold (89,478,485), under the loader's MAX_PIXELS (2^27), and only
    a header: a bad sample, and PIL's DecompressionBombWarning not printed among fewshot's or inspect's lines."""
    import struct
    import warnings
    import zlib

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 10000, 10000, 8, 2, 0, 0, 0))
           + chunk(b"IDAT", zlib.compress(b"\0" * 100)) + chunk(b"IEND", b""))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with pytest.raises(BadSample):
            _decode(png, TransformSpec(resolution=32, train=False))
    assert [str(w.message) for w in seen] == []


def test_output_buffer_is_checked():
    with pytest.raises(ValueError, match="shape"):
        decode_image_into(_jpeg(_halves()), np.empty((3, 8, 8), np.uint8), TransformSpec(resolution=16), None)


# ---------------------------------------------------------------- geometry


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 3000), st.integers(1, 3000), st.integers(0, 10**6), st.booleans())
def test_crop_box_stays_inside_the_image(width, height, index, train):
    spec = TransformSpec(train=train)
    box = crop_box(width, height, spec, sample_rng(0, 0, index))
    assert box.left >= 0 and box.top >= 0 and box.width > 0 and box.height > 0
    assert box.left + box.width <= width + 1e-9 and box.top + box.height <= height + 1e-9
    if not train:
        assert math.isclose(box.width, box.height) and not box.flip


def test_random_resized_crop_statistics():
    spec = TransformSpec()
    boxes = [crop_box(500, 375, spec, sample_rng(0, 0, i)) for i in range(2000)]
    areas = np.array([b.width * b.height / (500 * 375) for b in boxes])
    ratios = np.array([b.width / b.height for b in boxes])
    assert areas.min() >= 0.07 and areas.max() <= 1.0 and 0.3 < areas.mean() < 0.7
    assert ratios.min() >= 0.74 and ratios.max() <= 1.34
    assert 0.45 < np.mean([b.flip for b in boxes]) < 0.55
    assert len({(b.left, b.top, b.width) for b in boxes}) > 1900


def test_sample_rng_is_pure_and_separates_inputs():
    draws = {(s, e, i): sample_rng(s, e, i).random() for s in range(3) for e in range(3) for i in range(50)}
    assert len(set(draws.values())) == len(draws)
    assert sample_rng(2, 1, 7).random() == draws[(2, 1, 7)]
    assert isinstance(sample_rng(0, 0, 0), random.Random)
    with pytest.raises(ValueError):
        sample_rng(-1, 0, 0)


def test_transform_spec_validation():
    for bad in [dict(resolution=0), dict(scale=(0.5, 0.2)), dict(ratio=(0, 1)), dict(eval_crop=1.5)]:
        with pytest.raises(ValueError):
            TransformSpec(**bad)


def test_normalize_on_device():
    x = torch.tensor([0, 255, 51], dtype=torch.uint8).view(1, 3, 1, 1)
    y = normalize_on_device(x)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y.flatten(), (x.flatten().float() / 255 - 0.5) / 0.5)
    assert normalize_on_device(x, torch.bfloat16).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="uint8"):
        normalize_on_device(x.float())
