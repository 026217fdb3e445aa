"""Augmentation geometry (pure functions of a per-sample RNG) and on-device normalisation.

Decoding lives in :mod:`vitscale.data.loader.decode`; this module only decides *which* pixels to
take:

- training: Inception-style random-resized crop (area ``scale`` = (0.08, 1), aspect ``ratio`` =
  (3/4, 4/3), the torchvision/timm recipe) then a horizontal flip with probability 1/2, resized to
  ``resolution`` (224 for pre-training, 384 for fine-tuning: ``TransformSpec(resolution=384)``).
  The ViT paper itself pre-trains with "random crop + flip" only, and its official fine-tuning code
  uses an Inception crop with area (0.05, 1); pass ``scale=(0.05, 1.0)`` to match that, or
  ``scale=(1.0, 1.0), ratio=(1.0, 1.0)`` for a full-image square-ish crop + flip.
- evaluation: the centre square covering ``eval_crop`` of the shorter side, resized to
  ``resolution`` (0.875 = the classic "resize to 256, centre-crop 224"; 1.0 = the largest centre
  square).

Augmentation randomness is a pure function of (seed, epoch, global sample index) through
:func:`sample_rng`, so a resumed stream reproduces every crop and flip bit for bit, whatever the
number of ranks or loader workers that decoded the sample.

Images stay ``uint8`` all the way to the accelerator; :func:`normalize_on_device` turns a batch into
floats there (ViT convention: ``(x / 255 - 0.5) / 0.5``, i.e. values in [-1, 1]).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch

from vitscale.config.checks import check, image_side

__all__ = [
    "CropBox",
    "TransformSpec",
    "crop_box",
    "normalize_on_device",
    "sample_rng",
]

_U64 = (1 << 64) - 1


@dataclass(frozen=True)
class TransformSpec:
    """How one image becomes a ``resolution`` x ``resolution`` uint8 tensor."""

    resolution: int = 224
    """Output side in pixels: 224 for pre-training, 384 for fine-tuning (paper defaults)."""
    train: bool = True
    """Random-resized crop + flip when True; deterministic centre crop when False."""
    scale: tuple[float, float] = (0.08, 1.0)
    """Training crop area range, as fractions of the image area (Inception: 0.08-1)."""
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    """Training crop aspect-ratio (width / height) range, sampled log-uniformly."""
    flip: bool = True
    """Training only: mirror left-right with probability 1/2."""
    eval_crop: float = 0.875
    """Evaluation only: side of the centre square as a fraction of the shorter image side."""

    def __post_init__(self) -> None:
        image_side(self.resolution, "resolution")
        lo, hi = self.scale
        check(0.0 < lo <= hi <= 1.0, "scale", f"must satisfy 0 < lo <= hi <= 1, got {self.scale}")
        rlo, rhi = self.ratio
        check(0.0 < rlo <= rhi, "ratio", f"must satisfy 0 < lo <= hi, got {self.ratio}")
        check(0.0 < self.eval_crop <= 1.0, "eval_crop", f"must be in (0, 1], got {self.eval_crop}")


@dataclass(frozen=True)
class CropBox:
    """A crop in source-pixel coordinates (may be fractional), plus whether to mirror it."""

    left: float
    top: float
    width: float
    height: float
    flip: bool = False


def sample_rng(seed: int, epoch: int, index: int) -> random.Random:
    """The RNG for one sample's augmentation: a pure function of (seed, epoch, global index).

    ``random.Random`` seeded with one non-negative integer is stable across Python versions and
    platforms, and costs a few microseconds (negligible next to a JPEG decode).
    """
    if seed < 0 or epoch < 0 or index < 0:
        raise ValueError(f"seed, epoch and index must be >= 0, got {seed}, {epoch}, {index}")
    # Pack the three numbers into disjoint 64-bit fields of one integer: distinct triples can
    # never collide, unlike an arithmetic mix.
    return random.Random(((seed & _U64) << 128) | ((epoch & _U64) << 64) | (index & _U64))


def _random_resized_crop(
    width: int, height: int, scale: tuple[float, float], ratio: tuple[float, float], rng: random.Random
) -> tuple[int, int, int, int]:
    """(left, top, w, h) of an Inception crop, torchvision's algorithm (10 tries, then fallback)."""
    area = width * height
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    for _ in range(10):
        target = area * rng.uniform(scale[0], scale[1])
        aspect = math.exp(rng.uniform(log_lo, log_hi))
        w = round(math.sqrt(target * aspect))
        h = round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            left = rng.randint(0, width - w)
            top = rng.randint(0, height - h)
            return left, top, w, h
    # Fallback: the whole image, clamped to the allowed aspect range, centred.
    in_ratio = width / height
    if in_ratio < ratio[0]:
        w, h = width, round(width / ratio[0])
    elif in_ratio > ratio[1]:
        w, h = round(height * ratio[1]), height
    else:
        w, h = width, height
    w, h = max(1, min(w, width)), max(1, min(h, height))
    return (width - w) // 2, (height - h) // 2, w, h


def crop_box(width: int, height: int, spec: TransformSpec, rng: random.Random | None) -> CropBox:
    """Which region of a ``width`` x ``height`` image becomes the output, and whether to flip it.

    Training needs ``rng`` (from :func:`sample_rng`); evaluation ignores it.
    """
    if width < 1 or height < 1:
        raise ValueError(f"image size must be positive, got {width}x{height}")
    if spec.train:
        if rng is None:
            raise ValueError("a training crop needs an rng (use sample_rng(seed, epoch, index))")
        left, top, w, h = _random_resized_crop(width, height, spec.scale, spec.ratio, rng)
        flip = spec.flip and rng.random() < 0.5
        return CropBox(float(left), float(top), float(w), float(h), flip)
    side = spec.eval_crop * min(width, height)
    return CropBox((width - side) / 2.0, (height - side) / 2.0, side, side, False)


def normalize_on_device(x: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 images (B, 3, H, W) -> ``dtype`` in [-1, 1], ViT convention ``(x / 255 - 0.5) / 0.5``.

    Call it after moving the uint8 batch to the accelerator: the transfer is 4x smaller than
    float32 and the arithmetic runs there, not per sample in Python.
    """
    if x.dtype != torch.uint8:
        raise ValueError(f"normalize_on_device expects a uint8 tensor, got {x.dtype}")
    # x / 127.5 - 1 == (x / 255 - 0.5) / 0.5; computed in float32 then cast, so bf16 outputs
    # round once.
    y = x.to(torch.float32).div_(127.5).sub_(1.0)
    return y if dtype == torch.float32 else y.to(dtype)
