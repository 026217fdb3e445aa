"""The masked patch corruption plan (data/corruption.py): exact counts, a pure function of (seed, epoch, key)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vitscale.data.corruption import Corruption, corrupted_positions

keys = st.lists(st.text(min_size=1, max_size=12), min_size=1, max_size=12, unique=True)
grids = st.integers(min_value=2, max_value=400)


@settings(max_examples=60, deadline=None)
@given(keys=keys, patches=grids, seed=st.integers(0, 2**40), epoch=st.integers(0, 10**6))
def test_every_row_corrupts_exactly_the_counts_at_distinct_positions(keys: list[str], patches: int, seed: int,
                                                                     epoch: int) -> None:
    c = Corruption(patches)
    corrupted, masked, swapped = c.counts
    positions, sources = corrupted_positions(seed, epoch, keys, c)
    assert positions.shape == (len(keys), corrupted) and sources.shape == (len(keys), swapped)
    assert positions.dtype == np.int64 and sources.dtype == np.int64
    for row, src in zip(positions, sources):
        assert len(set(row.tolist())) == corrupted  # no patch corrupted twice
        assert row.min() >= 0 and row.max() < patches
        swap_at = row[masked:masked + swapped]
        assert (src != swap_at).all()  # another patch, never its own
        assert src.min(initial=0) >= 0 and src.max(initial=0) < patches


@settings(max_examples=40, deadline=None)
@given(keys=keys, seed=st.integers(0, 2**40), epoch=st.integers(0, 1000), data=st.data())
def test_a_sample_s_plan_does_not_depend_on_its_batch(keys: list[str], seed: int, epoch: int, data: st.DataObject) -> None:
    """Any batch, any order, any cut into micro-batches (an elastic resize): each key gets the same plan."""
    c = Corruption(64)
    positions, sources = corrupted_positions(seed, epoch, keys, c)
    shuffled = data.draw(st.permutations(list(range(len(keys)))))
    again, again_src = corrupted_positions(seed, epoch, [keys[i] for i in shuffled], c)
    assert (again == positions[shuffled]).all() and (again_src == sources[shuffled]).all()
    alone, alone_src = corrupted_positions(seed, epoch, keys[:1], c)
    assert (alone[0] == positions[0]).all() and (alone_src[0] == sources[0]).all()


def test_the_plan_changes_with_the_epoch_and_the_seed_but_not_between_calls() -> None:
    c = Corruption(196)
    names = [f"img-{i:05d}" for i in range(64)]
    base, _ = corrupted_positions(3, 7, names, c)
    assert (corrupted_positions(3, 7, names, c)[0] == base).all()
    for other in (corrupted_positions(3, 8, names, c)[0], corrupted_positions(4, 7, names, c)[0]):
        same = [set(a.tolist()) == set(b.tolist()) for a, b in zip(base, other)]
        assert not any(same)  # 98 of 196 drawn again: the same set twice is astronomically unlikely


def test_the_plan_is_pinned_arithmetic() -> None:
    """BLAKE2b and SplitMix64, no library generator: these exact numbers on every install, for ever
    (a change here would make resumed runs corrupt other patches than the run they continue)."""
    positions, sources = corrupted_positions(0, 0, ["a"], Corruption(16))
    assert positions.tolist() == [PINNED_POSITIONS] and sources.tolist() == [PINNED_SOURCES]


PINNED_POSITIONS = [5, 3, 13, 8, 12, 9, 10, 1]  # 6 masked, 1 swapped (takes patch 11), 1 kept
PINNED_SOURCES = [11]


@pytest.mark.parametrize("patches, expected", [(196, (98, 78, 10)), (64, (32, 26, 3)), (4, (2, 2, 0)),
                                               (16, (8, 6, 1)), (1, (1, 1, 0))])
def test_counts_are_the_papers_shares_rounded_half_up(patches: int, expected: tuple[int, int, int]) -> None:
    assert Corruption(patches).counts == expected


@pytest.mark.parametrize("kwargs, message", [
    ({"patches": 0}, "at least one patch"), ({"patches": 16, "rate": 1.5}, "rate"),
    ({"patches": 16, "mask": 0.95, "swap": 0.1}, r"mask \+ swap"), ({"patches": 16, "rate": 0.01}, "corrupts no patch"),
])
def test_impossible_plans_are_refused(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Corruption(**kwargs)  # type: ignore[arg-type]


def test_a_negative_seed_or_epoch_is_refused() -> None:
    with pytest.raises(ValueError, match="seed and epoch"):
        corrupted_positions(-1, 0, ["a"], Corruption(4))
