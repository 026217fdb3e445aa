"""Every PIL mode becomes the right 8-bit RGB JPEG; unreadable files are UnreadableImage."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from vitscale.data.tools.images import BACKGROUND, UnreadableImage, encode_image
from vitscale.data.tools.keys import unique_keys


def _rgb(jpeg: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(jpeg)).convert("RGB"), dtype=np.int32)


def _mean(img: Image.Image | bytes) -> float:
    jpeg, _, _ = encode_image(img, 64, 95)
    return float(_rgb(jpeg).mean())


def _image(arr: np.ndarray, mode: str) -> Image.Image:
    img = Image.fromarray(arr)  # the array's dtype picks the mode
    assert img.mode == mode
    return img


def test_16_and_32_bit_greys_are_scaled_not_clipped():
    half16 = np.full((8, 8), 32768, np.uint16)
    assert abs(_mean(_image(half16, "I;16")) - 128) <= 3
    assert abs(_mean(_image(half16.astype(np.int32), "I")) - 128) <= 3  # how PIL reads 16-bit PNGs
    half31 = np.full((8, 8), 2**30, np.int32)  # values beyond 16 bits: scaled from the 31-bit range
    assert abs(_mean(_image(half31, "I")) - 128) <= 3
    # A 16-bit PNG round trip, as files come.
    buf = io.BytesIO()
    _image(np.tile(np.linspace(0, 65535, 16).astype(np.uint16), (8, 1)), "I;16").save(buf, "PNG")
    row = _rgb(encode_image(buf.getvalue(), 64, 95)[0])[4, :, 0]
    assert row[0] < 20 and row[-1] > 235 and 100 < row[8] < 160  # a ramp, not black-then-white


def test_float_images_are_intensities_in_0_1():
    assert abs(_mean(_image(np.full((8, 8), 0.5, np.float32), "F")) - 128) <= 3
    assert _mean(_image(np.full((8, 8), 7.0, np.float32), "F")) >= 250  # clipped at 1
    assert _mean(_image(np.full((8, 8), np.nan, np.float32), "F")) <= 3


@pytest.mark.parametrize("mode", ["RGBA", "LA", "PA", "P"])
def test_transparent_pixels_are_the_documented_background(mode):
    rgba = Image.new("RGBA", (16, 16), (10, 200, 30, 0))  # fully transparent green
    if mode == "P":
        img = Image.new("P", (16, 16), 0)
        img.putpalette([10, 200, 30] + [0] * 765)
        img.info["transparency"] = 0
    elif mode == "PA":
        img = rgba.convert("PA")
    else:
        img = rgba.convert(mode)
    pixels = _rgb(encode_image(img, 64, 95)[0])
    assert np.abs(pixels - np.array(BACKGROUND)).max() <= 3


def test_cmyk_and_palette_and_bilevel_convert():
    assert _mean(Image.new("CMYK", (8, 8), (0, 0, 0, 0))) >= 250  # no ink: white
    assert _mean(Image.new("CMYK", (8, 8), (0, 0, 0, 255))) <= 5  # full black ink
    assert _mean(Image.new("1", (8, 8), 1)) >= 250
    pal = Image.new("P", (8, 8), 1)
    pal.putpalette([0, 0, 0, 200, 200, 200] + [0] * 762)
    assert abs(_mean(pal) - 200) <= 3


def test_exif_orientation_is_applied():
    img = Image.new("RGB", (40, 20), (255, 0, 0))
    img.paste((0, 0, 255), (20, 0, 40, 20))  # right half blue
    exif = Image.Exif()
    exif[0x0112] = 6  # stored rotated: display turns it 90 degrees clockwise
    buf = io.BytesIO()
    img.save(buf, "JPEG", exif=exif.tobytes(), quality=95)
    jpeg, w, h = encode_image(buf.getvalue(), 64, 95)
    assert (w, h) == (20, 40)
    px = _rgb(jpeg)
    assert px[5, 10, 0] > 200 and px[35, 10, 2] > 200  # red on top, blue below after the turn


# An EXIF block whose one entry points past its end: PIL's reader warns "Corrupt EXIF data" (a phone's or an
# editor's damaged metadata is common in real photo folders).
_BAD_EXIF = b"Exif\x00\x00II*\x00\x08\x00\x00\x00\x01\x00\x12\x01\x03\x00\x01\x00\x00\x00\xff\xff\xff\xff"


@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
def test_damaged_exif_is_written_upright_without_pils_warning_on_the_terminal(fmt):
    import warnings

    buf = io.BytesIO()
    Image.new("RGB", (40, 20), (255, 0, 0)).save(buf, fmt, exif=_BAD_EXIF if fmt == "JPEG" else _BAD_EXIF[6:])
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        jpeg, w, h = encode_image(buf.getvalue(), 64, 95)
    assert [str(x.message) for x in seen] == [] and (w, h) == (40, 20)
    assert _rgb(jpeg)[10, 20, 0] > 200


def test_damaged_exif_from_many_threads_at_once_prints_nothing_and_leaves_the_filters_as_they_were():
    """The shard writer encodes on a thread pool: each thread's quiet must hold while another's ends, and the
    process's warning filters must be the same afterwards (`warnings.catch_warnings` per thread broke both)."""
    import sys
    import threading
    import warnings

    buf = io.BytesIO()
    Image.new("RGB", (40, 20), (255, 0, 0)).save(buf, "JPEG", exif=_BAD_EXIF)
    data, start = buf.getvalue(), threading.Barrier(8)

    def encode_many() -> None:
        start.wait()
        for _ in range(40):
            encode_image(data, 16, 90)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads take turns inside each other's quiet, as on a busy machine
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            before = list(warnings.filters)
            threads = [threading.Thread(target=encode_many) for _ in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            after = list(warnings.filters)
    finally:
        sys.setswitchinterval(interval)
    assert [str(x.message) for x in seen] == [] and after == before


def _png_claiming(width: int, height: int) -> bytes:
    buf = io.BytesIO()
    Image.new("L", (4, 4)).save(buf, "PNG")
    data = bytearray(buf.getvalue())
    ihdr = data.index(b"IHDR")
    data[ihdr + 4 : ihdr + 12] = struct.pack(">II", width, height)
    crc = zlib.crc32(bytes(data[ihdr : ihdr + 17]))
    data[ihdr + 17 : ihdr + 21] = struct.pack(">I", crc)
    return bytes(data)


def _truncated_jpeg() -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), np.uint8)).save(buf, "JPEG")
    return buf.getvalue()[: len(buf.getvalue()) // 2]


@pytest.mark.parametrize("data, why", [
    (b"", "empty"),
    (b"hello, I am a text file\n", "not an image"),
    (_truncated_jpeg(), "cannot decode"),
    (_png_claiming(30000, 30000), "decompression bomb"),
])  # fmt: skip
def test_unreadable_files_are_unreadable_image(data, why):
    with pytest.raises(UnreadableImage, match=why):
        encode_image(data, 64, 90)


def test_pixel_limit_is_configurable():
    with pytest.raises(UnreadableImage, match="decompression bomb: 40x40"):
        encode_image(Image.new("RGB", (40, 40)), 64, 90, max_pixels=1000)


def test_sample_keys_never_collide():
    raw = ["a", "a", "a_1", "a b", "a_b", "", "", "sample5"]
    keys = unique_keys(raw)
    assert len(set(keys)) == len(keys) == len(raw)
    assert keys[0] == "a" and keys[2] == "a_1"  # a name's own key wins over a suffix
