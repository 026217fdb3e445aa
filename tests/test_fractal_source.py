"""The `fractal` source (FractalDB-style IFS classes): determinism, classes that differ, no degenerate images."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from vitscale.config import ConfigError
from vitscale.data.config import SourceConfig
from vitscale.data.tools.fractal import (
    FILL_RATE,
    REFERENCE_POINTS,
    FractalSource,
    chaos_game,
    class_system,
    filling_rate,
    sample_system,
)
from vitscale.data.tools.sources import open_source


def _grey(src: FractalSource, i: int) -> np.ndarray:
    rgb = np.asarray(src[i].image)
    assert rgb.shape == (src.image_size, src.image_size, 3)
    assert (rgb[..., 0] == rgb[..., 1]).all() and (rgb[..., 0] == rgb[..., 2]).all()  # grey
    return rgb[..., 0]


def test_deterministic_by_seed_class_and_index() -> None:
    a, b = FractalSource(count=12, classes=4, image_size=32, seed=3), FractalSource(count=12, classes=4,
                                                                                    image_size=32, seed=3)
    for i in range(12):
        assert np.array_equal(_grey(a, i), _grey(b, i))
        assert a[i].key == b[i].key and a[i].labels == b[i].labels == (i % 4,)
    # A larger count keeps every image of a smaller one: image j of class c depends on (seed, c, j) only.
    bigger = FractalSource(count=40, classes=4, image_size=32, seed=3)
    assert all(np.array_equal(_grey(a, i), _grey(bigger, i)) for i in range(12))
    other = FractalSource(count=12, classes=4, image_size=32, seed=4)
    assert not np.array_equal(_grey(a, 0), _grey(other, 0)) and a[0].key != other[0].key
    sa, so = a.system(0), other.system(0)
    assert sa.A.shape != so.A.shape or not np.allclose(sa.A, so.A)  # a seed draws its own classes
    assert len({s.key for s in bigger}) == 40


def test_systems_contract_and_pick_maps_by_determinant() -> None:
    rng = np.random.default_rng(0)
    for _ in range(20):
        s = sample_system(rng, int(rng.integers(2, 5)))
        assert 2 <= len(s.p) <= 4 and s.A.shape == (len(s.p), 2, 2) and s.b.shape == (len(s.p), 2)
        assert (np.linalg.norm(s.A, ord=2, axis=(1, 2)) < 1).all()  # every map contracts
        det = np.abs(np.linalg.det(s.A))
        np.testing.assert_allclose(s.p, det / det.sum(), rtol=1e-3, atol=1e-6)
        pts = chaos_game(s, rng, 1000)
        assert pts.shape == (1000, 2) and np.isfinite(pts).all()


def test_classes_pass_the_filling_rate_test_and_images_are_not_degenerate() -> None:
    rates = []
    for c in range(12):
        pts = chaos_game(class_system(0, c), np.random.default_rng([0, c, 1]), REFERENCE_POINTS)
        rates.append(filling_rate(pts))
    assert all(FILL_RATE[0] <= r <= FILL_RATE[1] for r in rates), rates
    # Candidates that fail it exist (a line, a dust): the test is not vacuous.
    rng = np.random.default_rng(1)
    raw = [filling_rate(chaos_game(sample_system(rng, 2), rng, REFERENCE_POINTS)) for _ in range(60)]
    assert min(raw) < FILL_RATE[0]
    # Every image has strokes and background: ink covers neither nothing nor everything.
    src = FractalSource(count=48, classes=12, image_size=32, seed=0)
    for i in range(len(src)):
        g = _grey(src, i).astype(np.float64) / 255.0
        background = np.median(np.concatenate([g[0], g[-1], g[:, 0], g[:, -1]]))
        ink = np.abs(g - background) > 0.3
        assert 0.05 < ink.mean() < 0.7, (i, ink.mean())


def test_images_of_a_class_are_alike() -> None:
    """Nearest class centroid of a flip- and shift-invariant statistic (the log power spectrum of the
    ink) classifies held-out images far above chance: the class, not the per-image variation, sets
    the look."""
    k, n = 8, 10
    src = FractalSource(count=k * n, classes=k, image_size=32, seed=0)
    g = np.stack([_grey(src, i) for i in range(k * n)]).astype(np.float64) / 255.0
    labels = np.arange(k * n) % k
    border = np.concatenate([g[:, 0], g[:, -1], g[:, :, 0], g[:, :, -1]], axis=1)
    ink = np.where(np.median(border, axis=1)[:, None, None] > 0.5, 1.0 - g, g)  # either polarity -> ink high
    power = np.abs(np.fft.fft2(ink))  # shift-invariant
    power = power + power[:, ::-1] + power[:, :, ::-1] + power[:, ::-1, ::-1]  # and (about) flip-invariant
    f = np.log1p(power).reshape(k * n, -1)
    dist = ((f[:, None] - f[None]) ** 2).sum(-1)
    same = labels[:, None] == labels[None]
    np.fill_diagonal(same, False)
    assert dist[same].mean() < 0.8 * dist[labels[:, None] != labels[None]].mean()
    correct = 0
    for i in range(k * n):  # leave-one-out nearest centroid
        keep = np.arange(k * n) != i
        centroids = np.stack([f[keep & (labels == c)].mean(0) for c in range(k)])
        correct += int(np.argmin(((centroids - f[i]) ** 2).sum(1)) == labels[i])
    assert correct / (k * n) > 0.4  # chance is 1/8; typically ~0.7


def test_ink_polarity_and_blur() -> None:
    dark = _grey(FractalSource(count=1, image_size=32), 0)  # the default: dark ink, soft strokes
    light = _grey(FractalSource(count=1, image_size=32, ink="light"), 0)
    assert dark[0, 0] == 255 and light[0, 0] == 0  # background
    assert dark.min() < 80 and light.max() > 180  # strokes
    sharp = _grey(FractalSource(count=1, image_size=32, blur=0), 0)
    assert len(np.unique(sharp)) == 2 and len(np.unique(dark)) > 10  # FractalDB's hard edges vs soft ones
    with pytest.raises(ConfigError, match="fractal.blur"):
        FractalSource(image_size=32, blur=20)


def test_open_source_and_config(tmp_path: Path) -> None:
    src = open_source("fractal", count=6, classes=3, image_size=24, seed=1, ink="light")
    assert isinstance(src, FractalSource) and src.classes == ("fractal_0000", "fractal_0001", "fractal_0002")
    assert not src.multi_label and len(src) == 6 and src[0].image.size == (24, 24)
    with pytest.raises(ValueError, match="does not take option"):
        open_source("fractal", multi_label=True)
    with pytest.raises(ValueError, match="takes no path"):
        open_source("fractal:somewhere")
    with pytest.raises(ConfigError, match="fractal.ink"):
        FractalSource(ink="blue")
    with pytest.raises(ConfigError, match="fractal.classes"):
        FractalSource(classes=1)
    cfg = SourceConfig(kind="fractal", count=30, classes=3, image_size=32, splits={"train": 0.8, "test": 0.2})
    cfg.validate("data.create_if_missing")
    assert cfg.source_options() == {"count": 30, "classes": 3, "image_size": 32}

    from vitscale.data.tools.write import write_dataset

    meta = write_dataset("fractal", str(tmp_path / "f"), shard_size=10, max_side=32, progress=False, seed=5,
                         splits={"train": 0.8, "test": 0.2}, source_options=cfg.source_options(), workers=1)
    assert meta["num_classes"] == 3 and meta["source_options"]["seed"] == 5  # the writer's seed seeds it
    assert sum(s["samples"] for s in meta["splits"].values()) == 30
