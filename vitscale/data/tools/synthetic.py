"""The ``synthetic`` source: procedural images whose class is a learnable visual pattern.

Each class is a fixed pattern (hue, grating orientation and frequency, shape) placed at random
position and scale over a noisy random background; multi-label images hold 1-3 objects of distinct
classes. Class patterns depend only on the class index, so sets drawn with different seeds share
them (train on one seed, test on another). Deterministic by (seed, index), so random access needs
no state.
"""

from __future__ import annotations

import colorsys
import math
from dataclasses import dataclass

import numpy as np
from PIL import Image

from vitscale.config.checks import check
from vitscale.data.tools.source_base import Sample, Source, SourceKind, drawn_classes, drawn_count, drawn_side

__all__ = ["SOURCE", "ClassPattern", "SyntheticSource", "class_pattern"]


@dataclass(frozen=True)
class ClassPattern:
    """The fixed look of one synthetic class."""

    hue: float
    """Foreground hue in [0, 1)."""
    angle: float
    """Grating orientation in radians, [0, pi)."""
    cycles: float
    """Grating cycles across the object."""
    shape: int
    """0 disc, 1 square, 2 diamond."""


def class_pattern(c: int) -> ClassPattern:
    """Class ``c``'s pattern: golden-ratio sequences keep neighbouring classes far apart."""
    return ClassPattern(
        hue=(c * 0.6180339887) % 1.0,
        angle=math.pi * ((c * 0.3819660113 + 0.125) % 1.0),
        cycles=2.0 + (c % 3),
        shape=(c // 3) % 3,
    )


def _draw_object(canvas: np.ndarray, pat: ClassPattern, rng: np.random.Generator) -> None:
    """Paint one object of pattern ``pat`` into ``canvas`` (H, W, 3) float in [0, 1], in place."""
    h, w, _ = canvas.shape
    side = min(h, w)
    r = side * rng.uniform(0.18, 0.32)  # half-size of the object
    cy, cx = rng.uniform(r, h - r), rng.uniform(r, w - r)
    y0, y1 = max(0, int(cy - r)), min(h, int(cy + r) + 1)
    x0, x1 = max(0, int(cx - r)), min(w, int(cx + r) + 1)
    yy, xx = np.mgrid[y0:y1, x0:x1].astype(np.float32)  # (h', w') pixel coordinates
    dy, dx = (yy - cy) / r, (xx - cx) / r  # object-relative, in [-1, 1]
    if pat.shape == 0:
        mask = dx**2 + dy**2 <= 1.0
    elif pat.shape == 1:
        mask = np.maximum(np.abs(dx), np.abs(dy)) <= 0.85
    else:
        mask = np.abs(dx) + np.abs(dy) <= 1.0
    angle = pat.angle + rng.normal(0.0, 0.08)
    phase = rng.uniform(0, 2 * math.pi)
    u = dx * math.cos(angle) + dy * math.sin(angle)
    grating = 0.5 + 0.5 * np.sin(math.pi * pat.cycles * u + phase)  # (h', w') in [0, 1]
    hue = (pat.hue + rng.normal(0.0, 0.02)) % 1.0
    bright = np.array(colorsys.hsv_to_rgb(hue, rng.uniform(0.75, 1.0), rng.uniform(0.8, 1.0)), np.float32)
    dark = bright * rng.uniform(0.1, 0.3)
    fill = dark + (bright - dark) * grating[..., None]  # (h', w', 3)
    region = canvas[y0:y1, x0:x1]
    region[mask] = fill[mask]


class SyntheticSource(Source):
    """Procedural images whose class is a learnable visual pattern; deterministic by seed."""

    def __init__(
        self,
        *,
        count: int = 1000,
        classes: int = 10,
        image_size: int | None = None,
        multi_label: bool = False,
        seed: int = 0,
    ) -> None:
        drawn_count(count, "synthetic.count")
        drawn_classes(classes, "synthetic.classes")
        if image_size is not None:  # None: each image's own side, drawn in [256, 512]
            drawn_side(image_size, "synthetic.image_size", least=8)
        check(not multi_label or classes >= 3, "synthetic.multi_label", "needs classes >= 3")
        self.samples, self.num_classes, self.image_size, self.seed = count, classes, image_size, seed
        self.name = "synthetic"
        self.classes = tuple(f"class_{c:03d}" for c in range(classes))
        self.multi_label = multi_label

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, i: int) -> Sample:  # type: ignore[override]
        i = self._check_index(i)
        # One independent stream per (seed, index): random access and order-free determinism.
        rng = np.random.default_rng([self.seed, i])
        if self.image_size is None:
            h, w = (int(v) for v in rng.integers(256, 513, size=2))
        else:
            h = w = self.image_size
        if self.multi_label:
            n_obj = int(rng.integers(1, 4))
            labels = tuple(sorted(int(c) for c in rng.choice(self.num_classes, n_obj, replace=False)))
        else:
            labels = (i % self.num_classes,)  # balanced classes
        # Background: a grey-ish linear gradient between two random colours, (H, W, 3).
        c0, c1 = rng.uniform(0.2, 0.8, size=(2, 3)).astype(np.float32) * 0.5 + 0.25
        if rng.random() < 0.5:
            grad = np.linspace(0.0, 1.0, w, dtype=np.float32)[None, :, None]  # (1, W, 1)
        else:
            grad = np.linspace(0.0, 1.0, h, dtype=np.float32)[:, None, None]  # (H, 1, 1)
        canvas = np.broadcast_to(c0 + (c1 - c0) * grad, (h, w, 3)).copy()
        # Plus smooth random blotches (a 6x6 grid upsampled): real photos have structured
        # backgrounds, and a near-flat one would make distinct images alike to perceptual hashes.
        # Mostly brightness, little colour: hue is a class cue and must stay the object's.
        grid = rng.uniform(-0.2, 0.2, size=(6, 6, 1)) + rng.uniform(-0.05, 0.05, size=(6, 6, 3))
        blotch = Image.fromarray(((grid + 0.5) * 255).astype(np.uint8), mode="RGB")
        blotch = blotch.resize((w, h), Image.Resampling.BICUBIC)
        canvas += np.asarray(blotch, dtype=np.float32) / 255.0 - 0.5
        for c in rng.permutation(labels):
            _draw_object(canvas, class_pattern(int(c)), rng)
        canvas += rng.normal(0.0, 0.04, size=canvas.shape).astype(np.float32)
        pixels = (np.clip(canvas, 0.0, 1.0) * 255.0).round().astype(np.uint8)
        return Sample(f"synth-s{self.seed}-{i:07d}", Image.fromarray(pixels, mode="RGB"), labels)


SOURCE = SourceKind("synthetic", SyntheticSource, "procedural images whose class is a learnable pattern",
                    options=("count", "classes", "image_size", "multi_label", "seed"))
