"""Source image -> the JPEG a shard stores: every PIL mode turned into 8-bit RGB the same way.

What each mode becomes (``to_rgb``):

- ``RGB``, ``L``, ``1``, ``YCbCr``, ``LAB``, ``HSV``: PIL's own conversion to RGB.
- ``CMYK``: PIL's conversion (``R = 255 - C - K`` per channel); Adobe's inverted CMYK JPEGs are
  read by PIL with the inversion already undone.
- ``I;16``, ``I;16L``, ``I;16B``, ``I;16N`` (16-bit integer grey): scaled to 8 bits,
  ``v * 255 / 65535``, not clipped at 255 (PIL's own conversion would make them nearly all white).
- ``I`` (32-bit integer grey): scaled from ``[0, 65535]`` when every value fits 16 bits (PIL
  decodes 16-bit PNGs and TIFFs to ``I``), otherwise from ``[0, 2**31 - 1]``; negatives become 0.
- ``F`` (32-bit float grey): taken as intensities in ``[0, 1]``, clipped, times 255; NaN becomes 0.
- ``P`` (palette), ``PA``, ``LA``, ``La``, ``RGBA``, ``RGBa`` and a palette or grey image with a
  transparent colour: composited on :data:`BACKGROUND` (white), so transparent pixels are white,
  as a browser or a slide shows them, not the black that dropping alpha would give.

EXIF orientation is applied (a phone photo stored sideways is written upright). Images larger
than :data:`MAX_PIXELS` (width x height) are refused before they are decoded, as decompression
bombs; anything PIL cannot open or decode (not an image, empty, truncated) raises
:class:`UnreadableImage`. The shard writer skips and counts such files (``--max-bad``).
"""

from __future__ import annotations

import contextlib
import io
import threading
import warnings
from collections.abc import Iterator
from typing import Any, cast

import numpy as np
from PIL import Image, ImageOps

__all__ = ["BACKGROUND", "MAX_PIXELS", "UnreadableImage", "encode_image", "open_image", "pil_quiet", "to_rgb"]

BACKGROUND = (255, 255, 255)
"""What transparent pixels are composited on: white."""

MAX_PIXELS = 89_478_485
"""Largest source image, in pixels (width x height), that is decoded: PIL's own decompression-bomb
threshold (``Image.MAX_IMAGE_PIXELS``, about 9459 x 9459). Larger files are skipped as bad."""

_ALPHA_MODES = ("RGBA", "RGBa", "LA", "La", "PA")
_INT16_MODES = ("I;16", "I;16L", "I;16B", "I;16N")


class UnreadableImage(ValueError):
    """A source file that is no image PIL can decode (or a decompression bomb); skipped and counted."""


_QUIET_LOCK = threading.Lock()
_quiet_within = 0
"""Threads inside `pil_quiet` now; the filters are in place while it is above 0."""
_quiet_added: list[Any] = []
"""The filter entries the first of them put in `warnings.filters`, which the last one takes out."""


@contextlib.contextmanager
def pil_quiet() -> Iterator[None]:
    """Within: PIL's warnings about what vitscale's own pixel limits decide (big images; here and in the
    loader, `data/loader/decode.py`) and about damaged EXIF metadata (``Corrupt EXIF data``, from its TIFF
    reader, when a JPEG is opened or its EXIF read: the image decodes, only its orientation is taken from
    EXIF, upright when unreadable) are not printed among the verb's lines.

    Thread-safe, unlike `warnings.catch_warnings` (the shard writer and the hashes call this from a thread
    pool: a thread leaving a `catch_warnings` put back the filters as they were when it entered, taking
    another thread's out from under it or leaving them in place for good). The first thread in adds the
    two filters, the last one out removes exactly those entries; filters set meanwhile by anyone else stay.
    """
    global _quiet_within
    with _QUIET_LOCK:
        if _quiet_within == 0:
            before = list(warnings.filters)
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            warnings.filterwarnings("ignore", category=UserWarning, module=r"PIL\.TiffImagePlugin")
            _quiet_added[:] = [f for f in warnings.filters if f not in before]
        _quiet_within += 1
    try:
        yield
    finally:
        with _QUIET_LOCK:
            _quiet_within -= 1
            if _quiet_within == 0:
                filters = cast(list[Any], warnings.filters)  # a list (typeshed says Sequence)
                for entry in _quiet_added:
                    with contextlib.suppress(ValueError):  # someone reset the filters meanwhile
                        filters.remove(entry)
                # What warnings' own functions call after a change (its "once" caches); private, so not assumed.
                getattr(warnings, "_filters_mutated", lambda: None)()
                _quiet_added.clear()


def open_image(image: Image.Image | bytes, max_pixels: int = MAX_PIXELS) -> Image.Image:
    """A PIL image from a source's bytes (header read, pixels not yet decoded), size-checked."""
    if isinstance(image, Image.Image):
        img = image
    else:
        if not image:
            raise UnreadableImage("empty file")
        try:
            with pil_quiet():  # our own limit below decides
                img = Image.open(io.BytesIO(image))
        except Image.DecompressionBombError as exc:
            raise UnreadableImage(f"decompression bomb: {exc}") from exc
        except Exception as exc:  # PIL answers junk with many exception types
            raise UnreadableImage(f"not an image PIL can read: {type(exc).__name__}: {exc}") from exc
    if img.width * img.height > max_pixels:
        raise UnreadableImage(f"decompression bomb: {img.width}x{img.height} pixels, over the limit "
                              f"of {max_pixels} pixels")
    return img


def _grey_to_rgb(arr: np.ndarray) -> Image.Image:
    return Image.fromarray(np.round(arr).astype(np.uint8), mode="L").convert("RGB")


def to_rgb(img: Image.Image) -> Image.Image:
    """``img`` as 8-bit RGB, by the rules in the module docstring."""
    mode = img.mode
    if mode == "RGB":
        return img
    if mode in _INT16_MODES:
        return _grey_to_rgb(np.asarray(img, dtype=np.float64) * (255.0 / 65535.0))
    if mode == "I":
        arr = np.clip(np.asarray(img, dtype=np.float64), 0, None)
        top = 65535.0 if arr.size == 0 or arr.max() <= 65535 else 2.0**31 - 1
        return _grey_to_rgb(arr * (255.0 / top))
    if mode == "F":
        arr = np.nan_to_num(np.asarray(img, dtype=np.float64), nan=0.0, posinf=1.0, neginf=0.0)
        return _grey_to_rgb(np.clip(arr, 0.0, 1.0) * 255.0)
    if mode in _ALPHA_MODES or (mode in ("P", "L", "RGB") and "transparency" in img.info):
        rgba = img.convert("RGBA")
        flat = Image.new("RGB", rgba.size, BACKGROUND)
        flat.paste(rgba, mask=rgba.getchannel("A"))
        return flat
    return img.convert("RGB")


def encode_image(image: Image.Image | bytes, max_side: int, quality: int,
                 max_pixels: int = MAX_PIXELS, chroma: str = "4:2:0") -> tuple[bytes, int, int]:
    """Fit ``image`` within ``max_side`` (never enlarging), upright and RGB, and encode a JPEG.

    ``chroma`` is the JPEG chroma subsampling: libjpeg's usual "4:2:0" halves colour resolution both
    ways, which costs little on large photos and visibly smears a 32-pixel CIFAR image; "4:4:4" keeps it.

    Returns ``(jpeg_bytes, width, height)``; raises :class:`UnreadableImage` for a file that is no
    decodable image or is larger than ``max_pixels``.
    """
    img = open_image(image, max_pixels)
    try:
        # Orientation first, from the header: thumbnail() may decode at a reduced scale (draft)
        # and the transposed size decides which side is the long one.
        with pil_quiet():
            orientation = img.getexif().get(0x0112, 1)
        if img.mode in (*_INT16_MODES, "I", "F"):
            img = to_rgb(img)  # resampling these modes in PIL is partial; convert first
        # thumbnail() shrinks in place keeping the aspect ratio, never enlarges, and for JPEG input
        # lets libjpeg decode at 1/2, 1/4 or 1/8 scale first (draft), which is much faster.
        img.thumbnail((max_side, max_side), Image.Resampling.BICUBIC)
        if orientation != 1:
            exif = Image.Exif()
            exif[0x0112] = orientation
            img.info["exif"] = exif.tobytes()
            img = ImageOps.exif_transpose(img)
        img = to_rgb(img)
        buf = io.BytesIO()
        img.save(buf, format="JPEG", quality=quality, subsampling=chroma)
    except UnreadableImage:
        raise
    except Exception as exc:  # truncated or damaged data fails while decoding
        raise UnreadableImage(f"cannot decode: {type(exc).__name__}: {exc}") from exc
    return buf.getvalue(), img.width, img.height
