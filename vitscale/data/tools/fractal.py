"""The ``fractal`` source: formula-driven images in the manner of FractalDB (Kataoka et al., ACCV 2020).

Each class is an iterated function system (IFS): 2-4 random affine maps ``x -> A_k x + b_k`` chosen
with probabilities proportional to ``|det A_k|`` (FractalDB's rule). A class's maps are drawn as
``A = R(theta) diag(s1, s2) R(phi) [reflection]`` with singular values summing to a "sigma factor"
``sum_k (s1_k + 2 s2_k)`` in ``[(5 + N) / 2, (6 + N) / 2]`` for N maps (Anderson & Farrell, "Improving
Fractal Pre-training", WACV 2022): every map contracts, and the attractor is neither a dust of points
nor a filled blob. A candidate system is then kept only if its attractor's **filling rate** (the share
of a 64 x 64 grid its points cover, FractalDB's acceptance test) lies in ``FILL_RATE``; otherwise the
next candidate of the class's random stream is tried. So degenerate classes (a line, a point, a
square filled solid) never appear.

An image is rendered by the chaos game, vectorised over 512 walkers (numpy: ~1-2 ms per image), with
FractalDB's intra-class variation drawn per image:

- one of the six parameters ``a..f`` of every map is multiplied by a factor in ``[0.8, 1.2]``
  (FractalDB's weight perturbation, here continuous instead of its 25 fixed rows);
- a flip (one of FractalDB's four: none, up-down, left-right, both), a rotation of at most 15
  degrees, and a scale (70-100% of the frame) and offset of the attractor in the image;
- FractalDB's "patch" rendering: every point paints a random 3 x 3 binary mask, so strokes are
  2-3 px wide and textured rather than 1-px dust; then (``blur``, default ``image_size / 32`` px) a
  Gaussian blur softens them, as an upscaled scan's strokes are soft.

Images are grey (the three channels are equal) in the polarity given by ``ink``: ``"dark"`` (the
default) draws dark strokes on a light background, as scanned handwriting (sklearn's digits);
``"light"`` light on black (FractalDB's look); ``"random"`` either with probability 1/2. Grey rather
than FractalDB's per-point hue: the quickstart's transfer target (digits) is grey strokes, and colour
is a cue the target never has. The defaults are what transferred best to digits in
``benchmarks/transfer_probe.py`` (the quickstart's tiny ViT, 254 pre-training steps; pilots of one
seed): dark ink on light ground fine-tuned to 0.63 where FractalDB's light-on-black gave 0.47 and a
random polarity 0.52 (from random weights: 0.45); the blur made the pre-training task easier to learn
in that budget (held-out accuracy 0.70 against 0.47) and the few-shot probe a little better, with the
same fine-tuned accuracy.

Everything is a pure function of ``(seed, class, index within the class)``: the class's system of
``(seed, class)``, the image of ``(seed, class, j)``, so random access needs no state and a larger
``count`` keeps every image of a smaller one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from PIL import Image, ImageFilter

from vitscale.config.checks import check, one_of
from vitscale.data.tools.source_base import (
    MAX_DRAWN_SIDE,
    Sample,
    Source,
    SourceKind,
    drawn_classes,
    drawn_count,
    drawn_side,
)

__all__ = [
    "FILL_RATE",
    "IFS",
    "INKS",
    "SOURCE",
    "FractalSource",
    "chaos_game",
    "class_system",
    "filling_rate",
    "sample_system",
]

FILL_RATE = (0.12, 0.45)
"""Accepted filling rate of a class's attractor: share of a 64 x 64 grid (the attractor fitted into
it, aspect kept, 2 px margin) that ``REFERENCE_POINTS`` chaos-game points cover. FractalDB keeps
systems whose rate at 512 px is at least 0.2; here the upper bound also rejects solid blobs."""

REFERENCE_POINTS = 8192
"""Points of the chaos game when a class's filling rate is measured."""

INKS = ("dark", "light", "random")

_MAX_TRIES = 1000
_WALKERS = 512
_BURN_IN = 8


@dataclass(frozen=True)
class IFS:
    """An iterated function system: ``x -> A[k] @ x + b[k]`` with probability ``p[k]``."""

    A: np.ndarray
    """(N, 2, 2) linear parts."""
    b: np.ndarray
    """(N, 2) translations."""
    p: np.ndarray
    """(N,) probabilities, proportional to ``|det A|`` (FractalDB)."""

    @property
    def params(self) -> np.ndarray:
        """(N, 6) FractalDB's ``a b c d e f`` per map: ``[[a, b], [c, d]] x + [e, f]``."""
        return np.concatenate([self.A.reshape(-1, 4), self.b], axis=1)


def _probabilities(A: np.ndarray) -> np.ndarray:
    det = np.abs(np.linalg.det(A)) + 1e-6
    return det / det.sum()


def _rotation(t: float) -> np.ndarray:
    c, s = math.cos(t), math.sin(t)
    return np.array([[c, -s], [s, c]])


def sample_system(rng: np.random.Generator, n_maps: int) -> IFS:
    """One candidate system of ``n_maps`` contractive maps with a sigma factor in the good band."""
    lo, hi = 0.5 * (5 + n_maps), 0.5 * (6 + n_maps)
    target = rng.uniform(lo, hi)
    while True:  # rejection: ~1 in 5 draws fall in the band; only numbers, no rendering
        s1 = rng.uniform(0.25, 0.98, n_maps)
        s2 = s1 * rng.uniform(0.0, 1.0, n_maps)
        total = float((s1 + 2 * s2).sum())
        scale = target / total
        if scale * s1.max() < 0.98:  # rescaled to the target, every map still contracts
            s1, s2 = s1 * scale, s2 * scale
            break
    A = np.empty((n_maps, 2, 2))
    for k in range(n_maps):
        reflect = np.diag([1.0, -1.0 if rng.random() < 0.5 else 1.0])
        A[k] = _rotation(rng.uniform(0, 2 * math.pi)) @ np.diag([s1[k], s2[k]]) @ _rotation(
            rng.uniform(0, 2 * math.pi)) @ reflect
    b = rng.uniform(-1.0, 1.0, (n_maps, 2))
    return IFS(A, b, _probabilities(A))


def chaos_game(system: IFS, rng: np.random.Generator, n_points: int) -> np.ndarray:
    """(n_points, 2) points of the attractor: 512 parallel walkers started on it, a short burn-in dropped.

    Each walker starts at the fixed point of a random map (a point of the attractor, so no long
    burn-in is needed); the first ``_BURN_IN`` steps only diversify the walkers' addresses.
    """
    steps = -(-n_points // _WALKERS)
    n = len(system.p)
    choice = rng.choice(n, size=(_BURN_IN + steps, _WALKERS), p=system.p)
    fixed = np.linalg.solve(np.eye(2)[None] - system.A, system.b[..., None])[..., 0]  # (N, 2)
    start = fixed[rng.integers(n, size=_WALKERS)]
    x0, x1 = start[:, 0].copy(), start[:, 1].copy()
    a, b, c, d, e, f = system.params.T[:, choice]  # each (T, W): the chosen map's parameter per step
    out = np.empty((2, steps, _WALKERS))
    for t in range(_BURN_IN + steps):
        x0, x1 = a[t] * x0 + b[t] * x1 + e[t], c[t] * x0 + d[t] * x1 + f[t]
        if t >= _BURN_IN:
            out[0, t - _BURN_IN], out[1, t - _BURN_IN] = x0, x1
    return out.reshape(2, -1).T[:n_points]


def _fit(points: np.ndarray, size: int, margin: float, fill: float = 1.0, offset: tuple[float, float] = (0.5, 0.5)
         ) -> np.ndarray:
    """Integer pixel coordinates (N, 2) of ``points`` fitted into a ``size`` square, aspect kept.

    The attractor's larger side spans ``fill`` of the frame inside ``margin`` pixels; ``offset`` in
    [0, 1]^2 places it in the room left over (0.5, 0.5: centred).
    """
    lo, hi = points.min(0), points.max(0)
    extent = max(float((hi - lo).max()), 1e-9)
    room = size - 2 * margin
    scale = fill * room / extent
    span = (hi - lo) * scale
    origin = margin + (room - span) * np.asarray(offset)
    px = (points - lo) * scale + origin  # in [margin, size - margin]
    return np.minimum(px, size - 1).astype(np.int64)


def filling_rate(points: np.ndarray, grid: int = 64) -> float:
    """Share of a ``grid`` x ``grid`` image covered by ``points`` fitted into it (FractalDB's test)."""
    if not np.isfinite(points).all():
        return 0.0
    px = _fit(points, grid, margin=2.0)
    covered = np.zeros(grid * grid, bool)
    covered[px[:, 1] * grid + px[:, 0]] = True
    return float(covered.mean())


@lru_cache(maxsize=4096)
def class_system(seed: int, c: int) -> IFS:
    """Class ``c``'s system: the first candidate of the (seed, c) stream whose filling rate passes."""
    rng = np.random.default_rng([seed, c, 0x1F5])
    for _ in range(_MAX_TRIES):
        system = sample_system(rng, int(rng.integers(2, 5)))
        rate = filling_rate(chaos_game(system, np.random.default_rng([seed, c, 1]), REFERENCE_POINTS))
        if FILL_RATE[0] <= rate <= FILL_RATE[1]:
            return system
    raise RuntimeError(f"fractal: no system passed the filling-rate test for class {c} (seed {seed})")


def _perturbed(system: IFS, rng: np.random.Generator) -> IFS:
    """FractalDB's weight perturbation: one of a..f of every map times a factor in [0.8, 1.2]."""
    params = system.params.copy()
    params[:, int(rng.integers(6))] *= rng.uniform(0.8, 1.2)
    A, b = params[:, :4].reshape(-1, 2, 2), params[:, 4:]
    frob2 = (A**2).sum((1, 2))
    det = A[:, 0, 0] * A[:, 1, 1] - A[:, 0, 1] * A[:, 1, 0]
    norms = np.sqrt(0.5 * (frob2 + np.sqrt(np.maximum(frob2**2 - 4 * det**2, 0.0))))  # largest singular value
    A = A * np.minimum(1.0, 0.98 / norms)[:, None, None]  # keep every map contracting
    return IFS(A, b, _probabilities(A))


_PATCH = np.array([(dy, dx) for dy in (-1, 0, 1) for dx in (-1, 0, 1)])  # (9, 2) offsets of a 3 x 3 patch


class FractalSource(Source):
    """FractalDB-style IFS fractal classes, rendered by the chaos game; deterministic by seed."""

    def __init__(
        self,
        *,
        count: int = 1000,
        classes: int = 10,
        image_size: int | None = None,
        points: int | None = None,
        ink: str = "dark",
        blur: float | None = None,
        seed: int = 0,
    ) -> None:
        drawn_count(count, "fractal.count")
        drawn_classes(classes, "fractal.classes")
        size = 64 if image_size is None else image_size
        drawn_side(size, "fractal.image_size", least=16)
        check(points is None or 256 <= points <= MAX_DRAWN_SIDE**2, "fractal.points",
              f"must be in [256, {MAX_DRAWN_SIDE**2}] (one a pixel of the largest side) or None, got {points}")
        one_of(ink, INKS, "fractal.ink")
        blur = size / 32 if blur is None else blur
        check(0.0 <= blur <= size / 4, "fractal.blur", f"must be in [0, image_size / 4], got {blur}")
        self.blur = float(blur)
        """Gaussian blur radius of the strokes in pixels (0: FractalDB's hard-edged patches)."""
        self.samples, self.num_classes, self.image_size, self.seed, self.ink = count, classes, size, seed, ink
        self.points = points if points is not None else max(1024, size * size)
        """Chaos-game points per image (default: one per pixel, at least 1024)."""
        self.name = "fractal"
        self.classes = tuple(f"fractal_{c:04d}" for c in range(classes))
        self.multi_label = False

    def __len__(self) -> int:
        return self.samples

    def system(self, c: int) -> IFS:
        """Class ``c``'s IFS."""
        return class_system(self.seed, c)

    def render(self, c: int, j: int) -> np.ndarray:
        """Image ``j`` of class ``c``: (S, S) uint8 grey."""
        rng = np.random.default_rng([self.seed, c, j, 0xF2])
        size = self.image_size
        pts = chaos_game(_perturbed(self.system(c), rng), rng, self.points)
        flip = int(rng.integers(4))  # FractalDB's four: none, up-down, left-right, both
        pts = pts * np.array([-1.0 if flip & 2 else 1.0, -1.0 if flip & 1 else 1.0])
        pts = pts @ _rotation(math.radians(rng.uniform(-15.0, 15.0))).T
        px = _fit(pts, size, margin=2.0, fill=rng.uniform(0.7, 1.0), offset=tuple(rng.uniform(0, 1, 2)))
        # Patch rendering: each point paints a random 3 x 3 binary mask (FractalDB "patch").
        # The 2 px margin keeps every 3 x 3 patch inside the image.
        mask = rng.random((len(px), 9)) < 0.5
        flat = (px[:, 1] * size + px[:, 0])[:, None] + (_PATCH[:, 0] * size + _PATCH[:, 1])[None]
        ink = np.zeros(size * size, bool)
        ink[flat[mask]] = True
        level = rng.uniform(0.75, 1.0)  # stroke contrast
        grey = ink.reshape(size, size).astype(np.float64)
        if self.blur > 0:  # soft strokes, as an upscaled scan
            soft = Image.fromarray((grey * 255).astype(np.uint8), mode="L").filter(ImageFilter.GaussianBlur(self.blur))
            grey = np.asarray(soft, dtype=np.float64) / max(1.0, float(np.asarray(soft).max()))
        grey = grey * level
        dark = self.ink == "dark" or (self.ink == "random" and rng.random() < 0.5)
        if dark:
            grey = 1.0 - grey
        return (grey * 255.0).round().astype(np.uint8)

    def __getitem__(self, i: int) -> Sample:  # type: ignore[override]
        i = self._check_index(i)
        c, j = i % self.num_classes, i // self.num_classes  # balanced classes
        grey = self.render(c, j)
        img = Image.fromarray(grey, mode="L").convert("RGB")
        return Sample(f"fractal-s{self.seed}-{i:07d}", img, (c,))


SOURCE = SourceKind("fractal", FractalSource, "FractalDB-style IFS fractal classes (formula-driven)",
                    options=("count", "classes", "image_size", "points", "ink", "blur", "seed"))
