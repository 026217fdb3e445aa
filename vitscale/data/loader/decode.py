"""Image bytes -> pixels: fast JPEG decode, crop and resize into a row of a uint8 batch.

The image path is built for speed:

- the JPEG is decoded by libjpeg-turbo (simplejpeg) at 1/2, 1/4 or 1/8 scale whenever the crop
  still covers the output resolution at that scale (DCT-domain scaling: fewer pixels to decode;
  only power-of-two factors, the others are slower than a full decode);
- the crop is a view of the decoded pixels, resized in one antialiased bilinear uint8 call
  (torch's vectorised kernel: same result as PIL's ``resize(size, box=crop)``, ~3x faster);
- the result is written straight into a row of a preallocated ``uint8`` batch (3, R, R) - no
  float conversion, no per-sample tensors kept.

Inputs simplejpeg cannot turn into RGB (CMYK JPEGs, PNGs misnamed ``.jpg``) fall back to PIL; data
that is no decodable image raises :class:`~vitscale.data.loader.tar.BadSample`, whatever the
decoder raised: PIL's plugins answer damaged input with ``OSError``, ``SyntaxError``,
``struct.error``, ``IndexError``, ``EOFError``... and an image is untrusted bytes. An image whose
header claims more than :data:`MAX_PIXELS` pixels is refused before decoding, so a damaged size
field cannot make one sample take seconds or gigabytes.
"""

from __future__ import annotations

import io
import random

import numpy as np
import simplejpeg
import torch
import torch.nn.functional as F
from PIL import Image

from vitscale.data.loader.tar import BadSample
from vitscale.data.loader.transforms import CropBox, TransformSpec, crop_box
from vitscale.data.tools.images import pil_quiet, to_rgb

__all__ = ["MAX_PIXELS", "decode_image_into"]

MAX_PIXELS = 1 << 27
"""Largest image (width x height, about 134 M pixels: 11,585 px square) a sample may claim.

Written shards hold images shrunk to ``max_side`` (384 px by default); anything this large is a
damaged header or a decompression bomb."""


def _reduction(box: CropBox, resolution: int) -> int:
    """Largest k in {1, 2, 4, 8} such that the crop still spans >= ``resolution`` pixels at 1/k."""
    k = 8
    while k > 1 and min(box.width, box.height) / k < resolution:
        k //= 2
    return k


def _decode_rgb(data: bytes, width: int, height: int, k: int) -> np.ndarray:
    """(h', w', 3) uint8 RGB at about 1/k scale; simplejpeg first, PIL for what it cannot do."""
    try:
        return simplejpeg.decode_jpeg(
            data, colorspace="RGB", min_width=-(-width // k), min_height=-(-height // k)
        )
    except ValueError:
        pass  # CMYK/YCCK JPEG or not a JPEG at all: let PIL try, it raises if truly corrupt
    try:
        with pil_quiet(), Image.open(io.BytesIO(data)) as img:  # MAX_PIXELS decides, not PIL's warning
            # draft() picks a power-of-two DCT scale whose size is >= the requested one.
            img.draft("RGB", (-(-width // k), -(-height // k)))
            # The writer's rules for every mode (tools/images.py), not PIL's convert("RGB"): a 16-bit PNG in an
            # adopted tar came out 99% white (clipped at 255), a transparent one black where a written one is white.
            return np.array(to_rgb(img))  # writable: torch.from_numpy wants that
    except Exception as exc:  # any decoder failure on untrusted bytes is a bad sample
        raise BadSample(f"corrupt image: {type(exc).__name__}: {exc}") from exc


def _image_size(data: bytes) -> tuple[int, int]:
    """(width, height) from the JPEG header, or via PIL for anything else."""
    try:
        height, width, _, _ = simplejpeg.decode_jpeg_header(data)
        width, height = int(width), int(height)
    except ValueError:
        try:
            with pil_quiet(), Image.open(io.BytesIO(data)) as img:  # MAX_PIXELS decides, below
                width, height = img.size
        except Exception as exc:  # any decoder failure on untrusted bytes is a bad sample
            raise BadSample(f"corrupt image: {type(exc).__name__}: {exc}") from exc
    if width < 1 or height < 1 or width * height > MAX_PIXELS:
        raise BadSample(f"image header claims {width}x{height} pixels (limit {MAX_PIXELS} pixels)")
    return width, height


def decode_image_into(
    data: bytes, out: np.ndarray, spec: TransformSpec, rng: random.Random | None
) -> None:
    """Decode ``data``, crop/flip/resize per ``spec`` and write the result into ``out`` (3, R, R).

    ``out`` is a row of a preallocated uint8 batch; ``rng`` (from ``sample_rng``) drives the
    training crop and flip. Raises :class:`BadSample` for data that is not a decodable image.
    """
    r = spec.resolution
    if out.shape != (3, r, r) or out.dtype != np.uint8:
        raise ValueError(f"out must be a uint8 array of shape (3, {r}, {r}), got {out.dtype} {out.shape}")
    width, height = _image_size(data)
    box = crop_box(width, height, spec, rng)
    pixels = _decode_rgb(data, width, height, _reduction(box, r))  # (h', w', 3)
    h, w = pixels.shape[:2]
    # The decoder rounds scaled sizes up: map the crop with the actual per-axis factors, to whole
    # pixels (at most half a decoded pixel off; exact when decoding at full scale).
    sx, sy = w / width, h / height
    x0 = min(round(box.left * sx), w - 1)
    y0 = min(round(box.top * sy), h - 1)
    x1 = min(max(round((box.left + box.width) * sx), x0 + 1), w)
    y1 = min(max(round((box.top + box.height) * sy), y0 + 1), h)
    # (1, 3, y1-y0, x1-x0) channels-last view of the crop: no copy. torch's uint8 antialiased
    # bilinear resize matches PIL's to within rounding and is ~3x faster on CPU.
    crop = torch.from_numpy(pixels)[y0:y1, x0:x1].permute(2, 0, 1).unsqueeze(0)
    resized = F.interpolate(crop, size=(r, r), mode="bilinear", antialias=True, align_corners=False)
    chw = resized[0].numpy()  # (3, R, R)
    out[...] = chw[:, :, ::-1] if box.flip else chw
