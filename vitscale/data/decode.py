"""Raw sample bytes -> arrays: tar-record parsing, label parsing, fast JPEG decode + crop.

A sample is read from its shard with one ranged read (``offset``/``size`` from ``_index.parquet``):
the bytes hold the tar headers and padded members ``{key}.jpg`` and ``{key}.cls`` / ``{key}.json``.
Everything that can be wrong with such bytes (short read, broken header, foreign member, corrupt
JPEG, missing or malformed label) raises :class:`BadSample`, which the stream counts and skips.

The image path is built for speed:

- the JPEG is decoded by libjpeg-turbo (simplejpeg) at 1/2, 1/4 or 1/8 scale whenever the crop
  still covers the output resolution at that scale (DCT-domain scaling: fewer pixels to decode;
  only power-of-two factors, the others are slower than a full decode);
- the crop is a view of the decoded pixels, resized in one antialiased bilinear uint8 call
  (torch's vectorised kernel: same result as PIL's ``resize(size, box=crop)``, ~3x faster);
- the result is written straight into a row of a preallocated ``uint8`` batch (3, R, R) - no
  float conversion, no per-sample tensors kept.

Inputs simplejpeg cannot turn into RGB (CMYK JPEGs, PNGs misnamed ``.jpg``) fall back to PIL.
"""

from __future__ import annotations

import io
import json
import random

import numpy as np
import simplejpeg
import torch
import torch.nn.functional as F
from PIL import Image

from vitscale.data.transforms import CropBox, TransformSpec, crop_box

__all__ = ["BadSample", "decode_image_into", "parse_label", "split_tar_record"]

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
        with Image.open(io.BytesIO(data)) as img:
            # draft() picks a power-of-two DCT scale whose size is >= the requested one.
            img.draft("RGB", (-(-width // k), -(-height // k)))
            return np.array(img.convert("RGB"))  # writable: torch.from_numpy wants that
    except (OSError, ValueError, Image.DecompressionBombError) as exc:
        raise BadSample(f"corrupt image: {exc}") from exc


def _image_size(data: bytes) -> tuple[int, int]:
    """(width, height) from the JPEG header, or via PIL for anything else."""
    try:
        height, width, _, _ = simplejpeg.decode_jpeg_header(data)
        return int(width), int(height)
    except ValueError:
        pass
    try:
        with Image.open(io.BytesIO(data)) as img:
            return img.size
    except (OSError, ValueError, Image.DecompressionBombError) as exc:
        raise BadSample(f"corrupt image: {exc}") from exc


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
    x0 = min(int(round(box.left * sx)), w - 1)
    y0 = min(int(round(box.top * sy)), h - 1)
    x1 = min(max(int(round((box.left + box.width) * sx)), x0 + 1), w)
    y1 = min(max(int(round((box.top + box.height) * sy)), y0 + 1), h)
    # (1, 3, y1-y0, x1-x0) channels-last view of the crop: no copy. torch's uint8 antialiased
    # bilinear resize matches PIL's to within rounding and is ~3x faster on CPU.
    crop = torch.from_numpy(pixels)[y0:y1, x0:x1].permute(2, 0, 1).unsqueeze(0)
    resized = F.interpolate(crop, size=(r, r), mode="bilinear", antialias=True, align_corners=False)
    chw = resized[0].numpy()  # (3, R, R)
    out[...] = chw[:, :, ::-1] if box.flip else chw
