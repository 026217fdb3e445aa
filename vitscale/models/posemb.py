"""Position-embedding helpers: 2-D (row/column) assembly and resampling to a new grid.

Resampling is **bilinear with aligned corners**, the same as the official vision_transformer
code's `scipy.ndimage.zoom(order=1)` (whose default grid mode maps corner cells to corner
cells): a linear ramp over the grid stays exactly linear, and the corner embeddings are kept.
The prefix (class-token) embeddings are copied unchanged (Sec. 3.2). All functions are pure.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor


def _as_grid(value: tuple[int, int], what: str) -> tuple[int, int]:
    if (
        not isinstance(value, (tuple, list))
        or len(value) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in value)
    ):
        raise ValueError(f"{what} must be a pair of positive ints (rows, cols), got {value!r}")
    return int(value[0]), int(value[1])


def resample_posemb(
    posemb: Tensor,
    new_grid: tuple[int, int],
    num_prefix_tokens: int,
    old_grid: tuple[int, int] | None = None,
) -> Tensor:
    """Resample 1-D learned position embeddings to a new patch grid.

    Args:
        posemb: (T, D) or (B, T, D) with T = num_prefix_tokens + rows * cols; tokens row-major.
            B may be 1 (the usual (1, T, D) parameter) or the number of layers (per-layer embeddings).
        new_grid: target (rows, cols).
        num_prefix_tokens: leading tokens (class token) that are copied, not interpolated.
        old_grid: source (rows, cols); None = a square grid inferred from T.

    Returns:
        Tensor of the input's rank and dtype, T' = num_prefix_tokens + new_rows * new_cols.
        Identity resampling returns an exact copy.
    """
    new_grid = _as_grid(new_grid, "new_grid")
    squeeze = posemb.dim() == 2
    if squeeze:
        posemb = posemb.unsqueeze(0)
    if posemb.dim() != 3:
        raise ValueError(f"posemb must be (T, D) or (B, T, D), got shape {tuple(posemb.shape)}")
    if not 0 <= num_prefix_tokens <= posemb.shape[1]:
        raise ValueError(f"num_prefix_tokens={num_prefix_tokens} out of range for {posemb.shape[1]} tokens")
    prefix, grid = posemb[:, :num_prefix_tokens], posemb[:, num_prefix_tokens:]
    n = grid.shape[1]
    if old_grid is None:
        side = math.isqrt(n)
        if side * side != n:
            raise ValueError(f"{n} patch embeddings do not form a square grid; pass old_grid=(rows, cols)")
        old_grid = (side, side)
    old_grid = _as_grid(old_grid, "old_grid")
    if old_grid[0] * old_grid[1] != n:
        raise ValueError(f"old_grid {old_grid} has {old_grid[0] * old_grid[1]} cells but posemb has {n}")
    if tuple(old_grid) == new_grid:
        out = posemb.clone()
    else:
        b, _, d = grid.shape
        # (B, N, D) -> (B, D, rows, cols): interpolate over the two spatial axes.
        img = grid.reshape(b, old_grid[0], old_grid[1], d).permute(0, 3, 1, 2).float()
        img = F.interpolate(img, size=new_grid, mode="bilinear", align_corners=True)
        grid = img.permute(0, 2, 3, 1).reshape(b, new_grid[0] * new_grid[1], d).to(posemb.dtype)
        out = torch.cat([prefix, grid], dim=1)
    return out.squeeze(0) if squeeze else out


def resample_1d(table: Tensor, new_len: int) -> Tensor:
    """Linearly resample the second-to-last axis of (..., L, C) to new_len (aligned ends)."""
    if new_len < 1:
        raise ValueError(f"new_len must be >= 1, got {new_len}")
    old_len = table.shape[-2]
    if old_len == new_len:
        return table.clone()
    lead = table.shape[:-2]
    flat = table.reshape(-1, old_len, table.shape[-1]).transpose(1, 2).float()  # (M, C, L)
    if old_len == 1:
        out = flat.expand(-1, -1, new_len)
    else:
        out = F.interpolate(flat, size=new_len, mode="linear", align_corners=True)
    return out.transpose(1, 2).reshape(*lead, new_len, table.shape[-1]).to(table.dtype)


def resample_relative_table(table: Tensor, new_seq_len: int) -> Tensor:
    """Resample a (heads, 2T-1) relative-bias table to (heads, 2T'-1), linearly, centre kept.

    Best effort: the bias is over flattened token offsets, so a new grid changes what an
    offset means; this keeps the table smooth and the zero offset in the middle.
    """
    out = resample_1d(table.unsqueeze(-1), 2 * new_seq_len - 1)
    return out.squeeze(-1)


def posemb_2d(row: Tensor, col: Tensor) -> Tensor:
    """Assemble 2-D embeddings: token (r, c) gets concat(row[r], col[c]).

    Args:
        row: (B, rows, D/2); col: (B, cols, D/2).

    Returns:
        (B, rows * cols, D), tokens row-major like a flattened conv feature map.
    """
    b, rows, half = row.shape
    cols = col.shape[1]
    r = row[:, :, None, :].expand(b, rows, cols, half)
    c = col[:, None, :, :].expand(b, rows, cols, col.shape[2])
    return torch.cat([r, c], dim=-1).reshape(b, rows * cols, half + col.shape[2])
