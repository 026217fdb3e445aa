"""The analyses' PNGs, drawn as the paper's Figures 6 and 7 draw them (matplotlib, Agg backend).

Each function takes the numbers :mod:`vitscale.inspect.analyses` computed and writes one PNG whose
title says what is drawn; nothing is computed here but display scaling.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from vitscale.eval.tables import save_figure


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: Path) -> Path:
    save_figure(fig, path, bbox_inches="tight")
    _pyplot().close(fig)
    return path


def _as_picture(component: np.ndarray) -> np.ndarray:
    """(C, P, P) filter -> (P, P, 3) in [0, 1]: RGB when C == 3, else its channel mean in grey.

    Min-max scaled per component, as filter pictures are: the sign and scale of a principal
    component carry no meaning, its pattern does.
    """
    img = component.transpose(1, 2, 0) if component.shape[0] == 3 else component.mean(axis=0)[..., None]
    lo, hi = img.min(), img.max()
    img = (img - lo) / (hi - lo) if hi > lo else np.zeros_like(img)
    return np.repeat(img, 3, axis=-1) if img.shape[-1] == 1 else img


def plot_filter_components(components: np.ndarray, explained: np.ndarray, path: Path, *, title: str) -> Path:
    """Figure 7 (left): each principal component of the embedding filters as a P x P RGB patch."""
    plt = _pyplot()
    k = len(components)
    cols = min(7, k)
    rows = -(-k // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(1.3 * cols, 1.45 * rows + 0.6), dpi=120, squeeze=False,
                             layout="constrained")
    for i, ax in enumerate(axes.ravel()):
        ax.axis("off")
        if i < k:
            ax.imshow(_as_picture(components[i]), interpolation="nearest")
            ax.set_title(f"PC{i + 1} {100 * explained[i]:.1f}%", fontsize=7)
    fig.suptitle(title, fontsize=9)
    return _save(fig, path)


def similarity_mosaic(similarity: np.ndarray) -> np.ndarray:
    """(rows, cols, rows, cols) -> one 2-D array of tiles, tile (r, c) at grid place (r, c), NaN gaps."""
    rows, cols = similarity.shape[:2]
    gap = 1
    out = np.full((rows * (rows + gap) - gap, cols * (cols + gap) - gap), np.nan)
    for r in range(rows):
        for c in range(cols):
            y, x = r * (rows + gap), c * (cols + gap)
            out[y:y + rows, x:x + cols] = similarity[r, c]
    return out


def plot_position_similarity(similarity: np.ndarray, path: Path, *, title: str) -> Path:
    """Figure 7 (centre): tile (r, c) shows the cosine similarity of position (r, c) to every position."""
    plt = _pyplot()
    rows, cols = similarity.shape[:2]
    mosaic = similarity_mosaic(similarity)
    fig, ax = plt.subplots(figsize=(6.4, 6.4 * rows / cols + 0.4), dpi=140)
    cmap = plt.get_cmap("viridis").with_extremes(bad="white")  # the gaps between tiles
    image = ax.imshow(mosaic, cmap=cmap, vmin=-1, vmax=1, interpolation="nearest")
    # One tick per tile, at its centre: the query position's row / column (1-based, as the paper).
    ax.set_xticks([c * (cols + 1) + (cols - 1) / 2 for c in range(cols)], [str(c + 1) for c in range(cols)],
                  fontsize=6)
    ax.set_yticks([r * (rows + 1) + (rows - 1) / 2 for r in range(rows)], [str(r + 1) for r in range(rows)],
                  fontsize=6)
    ax.tick_params(length=0)
    ax.set_xlabel("Input patch column")
    ax.set_ylabel("Input patch row")
    for side in ax.spines.values():
        side.set_visible(False)
    fig.colorbar(image, ax=ax, fraction=0.046, pad=0.03, label="Cosine similarity")
    ax.set_title(title, fontsize=9)
    return _save(fig, path)


def plot_attention_distance(distance: np.ndarray, path: Path, *, title: str, image_px: int,
                            uniform_px: float) -> Path:
    """Figure 7 (right): one dot per head at its layer's depth; y = mean attention distance (px).

    `distance` is (layers, heads), already averaged over the images; a dashed line marks
    `uniform_px`, the distance of attention spread evenly over all patches.
    """
    plt = _pyplot()
    layers, heads = distance.shape
    fig, ax = plt.subplots(figsize=(5.2, 3.8), dpi=130)
    depth = np.arange(1, layers + 1)
    colours = plt.get_cmap("tab20" if heads > 10 else "tab10")
    for h in range(heads):
        ax.scatter(depth, distance[:, h], s=16, color=colours(h % colours.N), label=f"head {h + 1}")
    ax.axhline(uniform_px, color="grey", linestyle="--", linewidth=1, label="uniform attention")
    ax.set_xlabel("Network depth (layer)")
    ax.set_ylabel("Mean attention distance (pixels)")
    ax.set_xticks(depth)
    # At least half the image side, so models at one resolution share a scale (the paper's axis
    # runs to about 0.57 x 224 px); higher when a head reaches further.
    ax.set_ylim(0, max(float(np.nanmax(distance)) * 1.1, 1e-6, image_px * 0.5))
    ax.grid(True, alpha=0.3)
    if heads <= 16:  # more heads than that: the colours alone, a legend would cover the dots
        ax.legend(fontsize=6, ncol=2 if heads > 8 else 1, loc="best", frameon=False)
    ax.set_title(title, fontsize=9)
    return _save(fig, path)


def upsample(mask: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """(rows, cols) map -> (H, W), bilinear (as Figure 6's smooth masks), scaled to max 1."""
    from PIL import Image

    big = np.asarray(Image.fromarray(mask.astype(np.float32), mode="F").resize(size[::-1], Image.Resampling.BILINEAR))
    peak = big.max()
    return big / peak if peak > 0 else big


def plot_rollout(images: np.ndarray, maps: np.ndarray, captions: list[str], path: Path, *, title: str) -> Path:
    """Figure 6: per image, the input, the input weighted by its attention rollout, and the map itself.

    images: (B, H, W, 3) uint8; maps: (B, rows, cols) rollout from the output token to the patches.
    The middle row is the paper's picture (image x mask scaled to max 1); the bottom row shows the
    map on its own colour scale, so a nearly flat map (an untrained model) still shows its shape.
    """
    plt = _pyplot()
    b = len(images)
    fig, axes = plt.subplots(3, b, figsize=(1.5 * b + 0.6, 5.4), dpi=130, squeeze=False, layout="constrained")
    for i in range(b):
        mask = upsample(maps[i], images.shape[1:3])  # (H, W) in [0, 1]
        axes[0, i].imshow(images[i])
        axes[1, i].imshow((images[i] * mask[..., None]).astype(np.uint8))
        axes[2, i].imshow(maps[i], cmap="inferno", interpolation="nearest")
        axes[0, i].set_title(captions[i], fontsize=6)
        for ax in axes[:, i]:
            ax.set_xticks([])
            ax.set_yticks([])
    for row, label in enumerate(("input", "input x rollout", "rollout per patch")):
        axes[row, 0].set_ylabel(label, fontsize=8)
    fig.suptitle(title, fontsize=9)
    return _save(fig, path)
