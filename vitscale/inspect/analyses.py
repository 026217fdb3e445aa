"""The maths of the paper's model analyses (Sec. 4.5, App. D.7-D.8), on plain numpy arrays.

No model, no files, no plotting: each function takes the arrays an analysis reads (embedding
filters, a position table, attention probabilities) and returns the numbers a figure draws.

- :func:`filter_components`: principal components of the patch-embedding filters (Figure 7 left).
- :func:`position_similarity`: cosine similarity of every position embedding to every other,
  laid out on the patch grid (Figure 7 centre).
- :func:`mean_attention_distance`: attention-weighted pixel distance from each query patch to the
  patches it attends to, per head (Figure 7 right; App. D.7).
- :func:`attention_rollout` and :func:`rollout_map`: Abnar & Zuidema (2020) rollout, from the
  output token back to the input patches (Figure 6; App. D.8).

Patch tokens are numbered row-major over a (rows, cols) grid after ``prefix`` leading tokens (the
class token when the model has one), as the model lays them out.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def filter_components(filters: np.ndarray, count: int) -> tuple[np.ndarray, np.ndarray]:
    """Top principal components of the linear patch-embedding filters (PCA over the D filters).

    Args:
        filters: (D, C, P, P) the embedding's kernel, one P x P x C filter per output dimension.
        count: components wanted; at most min(D, C * P * P) are returned.

    Returns:
        components (k, C, P, P), each of unit norm, sign fixed so its largest-magnitude entry is
        positive (PCA's sign is arbitrary; this makes reruns draw the same picture), and the
        fraction of the filters' variance each explains (k,), descending.
    """
    if filters.ndim != 4:
        raise ValueError(f"filters must be (D, C, P, P), got shape {filters.shape}")
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    d = filters.shape[0]
    flat = filters.reshape(d, -1).astype(np.float64)  # (D, C*P*P)
    centred = flat - flat.mean(axis=0, keepdims=True)
    _, singular, vt = np.linalg.svd(centred, full_matrices=False)  # vt: (min(D, CPP), CPP)
    k = min(count, vt.shape[0])
    components = vt[:k]
    peak = np.abs(components).argmax(axis=1)
    components = components * np.sign(components[np.arange(k), peak])[:, None]
    variance = singular**2
    explained = variance[:k] / variance.sum() if variance.sum() > 0 else np.zeros(k)
    return components.reshape(k, *filters.shape[1:]), explained


def position_similarity(table: np.ndarray, grid: tuple[int, int]) -> np.ndarray:
    """Cosine similarity of each patch position's embedding to every other's, on the grid.

    Args:
        table: (N, D) position embeddings of the N = rows * cols patch tokens (no prefix token).
        grid: (rows, cols).

    Returns:
        (rows, cols, rows, cols): entry [r, c] is the tile of position (r, c): its similarity to
        the embedding at every position (r', c'). The diagonal [r, c, r, c] is 1.
    """
    rows, cols = grid
    if table.ndim != 2 or table.shape[0] != rows * cols:
        raise ValueError(f"position table must be ({rows * cols}, D) for a {rows}x{cols} grid, got {table.shape}")
    t = table.astype(np.float64)
    norms = np.linalg.norm(t, axis=1, keepdims=True)
    unit = t / np.where(norms > 0, norms, 1.0)
    return (unit @ unit.T).reshape(rows, cols, rows, cols)


def patch_distances(grid: tuple[int, int], stride: int) -> np.ndarray:
    """(N, N) Euclidean distances in pixels between the centres of the grid's patches.

    `stride` is the pixels one token covers (the patch size; a hybrid's ResNet stride).
    """
    rows, cols = grid
    r, c = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
    centres = np.stack([r.ravel(), c.ravel()], axis=1).astype(np.float64) * stride  # (N, 2), row-major
    return np.linalg.norm(centres[:, None, :] - centres[None, :, :], axis=-1)


def uniform_attention_distance(grid: tuple[int, int], stride: int) -> float:
    """The mean attention distance (pixels) of a head attending to every patch equally: the scale
    against which a head is local (below) or global (near or above)."""
    return float(patch_distances(grid, stride).mean())


def mean_attention_distance(attention: np.ndarray, grid: tuple[int, int], stride: int,
                            prefix: int = 0) -> np.ndarray:
    """Attention-weighted mean pixel distance per image and head ("attention distance", App. D.7).

    For each query patch, sum over key patches of attention x distance between their centres, then
    average over the query patches. The class token has no position, so it is neither a query nor
    a key here, and each query's weights over the key patches are renormalised to sum to 1:
    otherwise a head that puts its mass on the class token would look local.

    Args:
        attention: (B, H, T, T) probabilities, rows summing to 1, T = prefix + rows * cols.
        grid: (rows, cols) of patch tokens. stride: pixels per token. prefix: leading tokens.

    Returns:
        (B, H) mean distance in pixels.
    """
    n = grid[0] * grid[1]
    if attention.ndim != 4 or attention.shape[-1] != prefix + n or attention.shape[-2] != prefix + n:
        raise ValueError(f"attention must be (B, H, {prefix + n}, {prefix + n}) for {prefix} prefix token(s) "
                         f"and a {grid[0]}x{grid[1]} grid, got {attention.shape}")
    patches = attention[..., prefix:, prefix:].astype(np.float64)  # (B, H, N, N)
    mass = patches.sum(axis=-1, keepdims=True)
    weights = patches / np.where(mass > 0, mass, 1.0)
    per_query = (weights * patch_distances(grid, stride)).sum(axis=-1)  # (B, H, N)
    return per_query.mean(axis=-1)


def attention_rollout(attention: Sequence[np.ndarray]) -> np.ndarray:
    """Attention rollout (Abnar & Zuidema 2020) through all layers, first layer first.

    Each layer: average over heads, add the identity for the residual connection, renormalise the
    rows; then multiply the layers' matrices, R = A_L ... A_2 A_1, so R[i, j] is how much output
    token i draws on input token j.

    Args:
        attention: per layer (B, H, T, T) probabilities (or (B, T, T), already head-averaged).

    Returns:
        (B, T, T), rows summing to 1.
    """
    if not attention:
        raise ValueError("attention rollout needs at least one layer")
    matrices = [_with_residual(layer) for layer in attention]
    rollout = matrices[0]
    for a in matrices[1:]:
        rollout = a @ rollout
    return rollout


def _with_residual(layer: np.ndarray) -> np.ndarray:
    """One layer of the rollout: mean over heads, + identity, rows renormalised: (B, T, T)."""
    a = layer.astype(np.float64)
    a = a.mean(axis=1) if a.ndim == 4 else a
    if a.ndim != 3 or a.shape[-1] != a.shape[-2]:
        raise ValueError(f"each layer's attention must be (B, H, T, T) or (B, T, T), got {layer.shape}")
    a = a + np.eye(a.shape[-1])
    return a / a.sum(axis=-1, keepdims=True)


def rollout_map(rollout: np.ndarray, grid: tuple[int, int], prefix: int) -> np.ndarray:
    """(B, rows, cols): how much the model's output draws on each input patch.

    With a class token (prefix >= 1) that is the class token's row of the rollout; without one
    (global average pooling) the output is the mean of the patch tokens, so it is the mean of
    their rows. Only the patch columns are kept (the class token is not a place in the image).
    """
    n = grid[0] * grid[1]
    if rollout.ndim != 3 or rollout.shape[-1] != prefix + n:
        raise ValueError(f"rollout must be (B, {prefix + n}, {prefix + n}), got {rollout.shape}")
    rows = rollout[:, 0] if prefix else rollout.mean(axis=1)  # (B, T)
    return rows[:, prefix:].reshape(-1, *grid)
