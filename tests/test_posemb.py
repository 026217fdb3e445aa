"""Position-embedding resampling and 2-D assembly (vitscale.models.posemb)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vitscale.models.posemb import posemb_2d, resample_1d, resample_posemb, resample_relative_table

grids = st.tuples(st.integers(1, 7), st.integers(1, 7))


@settings(max_examples=40, deadline=None)
@given(grid=grids, prefix=st.integers(0, 2), dim=st.integers(1, 6), batch=st.integers(1, 3), seed=st.integers(0, 99))
def test_identity_resample_is_exact(grid: tuple[int, int], prefix: int, dim: int, batch: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    pe = torch.randn(batch, prefix + grid[0] * grid[1], dim, generator=g)
    out = resample_posemb(pe, grid, prefix, old_grid=grid)
    assert torch.equal(out, pe)
    assert out.data_ptr() != pe.data_ptr()  # a copy, never an alias of the parameter


@settings(max_examples=40, deadline=None)
@given(old=grids, new=grids, prefix=st.integers(0, 2), seed=st.integers(0, 99))
def test_resample_keeps_prefix_and_stays_within_range(
    old: tuple[int, int], new: tuple[int, int], prefix: int, seed: int
) -> None:
    g = torch.Generator().manual_seed(seed)
    pe = torch.randn(1, prefix + old[0] * old[1], 3, generator=g)
    out = resample_posemb(pe, new, prefix, old_grid=old)
    assert out.shape == (1, prefix + new[0] * new[1], 3)
    assert torch.equal(out[:, :prefix], pe[:, :prefix])
    # Bilinear weights are a convex combination: no new extremes per channel.
    patch_in, patch_out = pe[:, prefix:], out[:, prefix:]
    assert (patch_out.amax(1) <= patch_in.amax(1) + 1e-5).all()
    assert (patch_out.amin(1) >= patch_in.amin(1) - 1e-5).all()


def test_vit_b16_224_to_384_keeps_class_token_and_linear_ramp() -> None:
    old, new, d = 14, 24, 8
    r = torch.arange(old, dtype=torch.float64)[:, None, None]
    c = torch.arange(old, dtype=torch.float64)[None, :, None]
    slope_r, slope_c = torch.linspace(-1, 1, d, dtype=torch.float64), torch.linspace(2, 0.5, d, dtype=torch.float64)
    ramp = (0.3 + slope_r * r + slope_c * c).reshape(1, old * old, d)
    cls = torch.randn(1, 1, d, dtype=torch.float64)
    out = resample_posemb(torch.cat([cls, ramp], 1), (new, new), num_prefix_tokens=1)
    assert out.shape == (1, 1 + new * new, d)
    assert torch.equal(out[:, :1], cls)
    # Aligned corners: new index i sits at old coordinate i * (old-1)/(new-1); a ramp stays a ramp.
    scale = (old - 1) / (new - 1)
    rn = torch.arange(new, dtype=torch.float64)[:, None, None] * scale
    cn = torch.arange(new, dtype=torch.float64)[None, :, None] * scale
    expected = (0.3 + slope_r * rn + slope_c * cn).reshape(1, new * new, d)
    torch.testing.assert_close(out[:, 1:], expected, rtol=0, atol=1e-5)


def test_resample_non_square_and_rank2_input() -> None:
    pe = torch.randn(1 + 2 * 3, 4)
    out = resample_posemb(pe, (4, 6), 1, old_grid=(2, 3))
    assert out.shape == (1 + 24, 4)
    grid = out[1:].reshape(4, 6, 4)
    src = pe[1:].reshape(2, 3, 4)
    for (ri, ci), (ro, co) in [((0, 0), (0, 0)), ((0, 2), (0, 5)), ((1, 0), (3, 0)), ((1, 2), (3, 5))]:
        torch.testing.assert_close(grid[ro, co], src[ri, ci])  # corners map to corners


def test_resample_per_layer_tables() -> None:
    pe = torch.randn(3, 1 + 16, 5)
    out = resample_posemb(pe, (2, 2), 1)
    assert out.shape == (3, 5, 5)
    for layer in range(3):
        torch.testing.assert_close(out[layer : layer + 1], resample_posemb(pe[layer : layer + 1], (2, 2), 1))


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((torch.randn(1, 1 + 10, 4), (3, 3), 1), "square"),
        ((torch.randn(1, 17, 4), (3, 0), 1), "new_grid"),
        ((torch.randn(4), (3, 3), 0), "shape"),
        ((torch.randn(1, 17, 4), (3, 3), 18), "num_prefix_tokens"),
    ],
)
def test_resample_rejects_bad_input(args: tuple, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        resample_posemb(*args)


def test_resample_1d_linear_and_relative_centre() -> None:
    table = torch.arange(5, dtype=torch.float32)[:, None].repeat(1, 3)[None]  # (1, 5, 3) ramp 0..4
    out = resample_1d(table, 9)
    torch.testing.assert_close(out[0, :, 0], torch.linspace(0, 4, 9))
    rel = torch.randn(2, 2 * 5 - 1)
    rel_new = resample_relative_table(rel, 8)
    assert rel_new.shape == (2, 15)
    torch.testing.assert_close(rel_new[:, 7], rel[:, 4])  # zero offset stays in the middle
    assert torch.equal(resample_relative_table(rel, 5), rel)


def test_posemb_2d_concatenates_row_and_column() -> None:
    row, col = torch.randn(2, 3, 4), torch.randn(2, 5, 4)
    emb = posemb_2d(row, col)
    assert emb.shape == (2, 15, 8)
    for r in range(3):
        for c in range(5):
            assert torch.equal(emb[:, r * 5 + c], torch.cat([row[:, r], col[:, c]], -1))
