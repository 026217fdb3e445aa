"""Property tests of the global-batch layout (elastic training): the samples each optimizer step
consumes do not depend on the world size, so any sequence of resizes consumes each sample of the
epoch exactly once; and the layout keeps the span layout's guarantees (partition, balance, exact
resume, bounded window shuffle)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vitscale.data.order import rank_order, samples_per_rank

counts_st = st.lists(st.integers(0, 40), min_size=1, max_size=12)
seed_st = st.integers(0, 2**32 - 1)
epoch_st = st.integers(0, 5)
buffer_st = st.integers(1, 64)
FAST = settings(max_examples=150, deadline=None)
WORLDS = (1, 2, 3, 4, 6, 12)  # the divisors of G = 12: every world size a range may hold
G = 12


def step_samples(counts, seed, epoch, world, buf, step):
    """The samples optimizer step `step` (0-based) consumes: every rank's share, rank order."""
    share = G // world
    return np.concatenate([rank_order(counts, seed, epoch, r, world, 0, buf, global_batch=G)
                           .global_indices(step * share, (step + 1) * share) for r in range(world)])


@FAST
@given(counts_st, seed_st, epoch_st, st.sampled_from(WORLDS), buffer_st)
def test_epoch_is_a_balanced_partition_of_whole_global_batches(counts, seed, epoch, world, buf):
    n = sum(counts)
    orders = [rank_order(counts, seed, epoch, r, world, 0, buf, global_batch=G).indices for r in range(world)]
    assert {len(o) for o in orders} == {(n // G) * (G // world)}
    seen = np.concatenate(orders)
    assert len(np.unique(seen)) == len(seen) and ((seen >= 0) & (seen < n)).all()
    assert n - len(seen) < G  # the remainder: less than one global batch


@FAST
@given(counts_st, seed_st, epoch_st, st.sampled_from(WORLDS), st.sampled_from(WORLDS), buffer_st, st.data())
def test_a_step_consumes_the_same_samples_at_any_world_size(counts, seed, epoch, w1, w2, buf, data):
    steps = sum(counts) // G
    if steps == 0:
        return
    step = data.draw(st.integers(0, steps - 1))
    a, b = step_samples(counts, seed, epoch, w1, buf, step), step_samples(counts, seed, epoch, w2, buf, step)
    np.testing.assert_array_equal(np.sort(a), np.sort(b))
    np.testing.assert_array_equal(a, b)  # and in the same order: rank r's share is a slice of the batch


@FAST
@given(counts_st, seed_st, epoch_st, buffer_st,
       st.lists(st.tuples(st.sampled_from(WORLDS), st.integers(1, 5)), min_size=1, max_size=6))
def test_random_resizes_consume_every_sample_exactly_once(counts, seed, epoch, buf, resizes):
    """Resizes at random steps (world size, steps run at it): every rank of each new world opens at
    `start = step * G / W` (what a resumed stream does) and runs to the next resize; the epoch's
    samples are consumed exactly once and each step's batch is the fixed-size run's."""
    steps = sum(counts) // G
    consumed: list[np.ndarray] = []
    step = 0
    for world, run in [*resizes, (G, steps)]:  # the last world finishes the epoch
        stop = min(step + run, steps)
        share = G // world
        for r in range(world):
            order = rank_order(counts, seed, epoch, r, world, step * share, buf, global_batch=G)
            mine = order.indices[: (stop - step) * share]
            np.testing.assert_array_equal(mine, order.global_indices(step * share, stop * share))
            consumed.append(mine)
        step = stop
    seen = np.concatenate(consumed) if consumed else np.zeros(0, np.int64)
    whole = np.concatenate([rank_order(counts, seed, epoch, 0, 1, 0, buf, global_batch=G).indices])
    assert len(np.unique(seen)) == len(seen) == steps * G
    np.testing.assert_array_equal(np.sort(seen), np.sort(whole))


@FAST
@given(counts_st, seed_st, epoch_st, st.sampled_from(WORLDS), buffer_st, st.data())
def test_resume_is_exactly_the_tail(counts, seed, epoch, world, buf, data):
    rank = data.draw(st.integers(0, world - 1))
    full = rank_order(counts, seed, epoch, rank, world, 0, buf, global_batch=G)
    k = data.draw(st.integers(0, full.samples_per_rank))
    np.testing.assert_array_equal(rank_order(counts, seed, epoch, rank, world, k, buf, global_batch=G).indices,
                                  full.indices[k:])
    lo = data.draw(st.integers(0, full.samples_per_rank))
    hi = data.draw(st.integers(lo, full.samples_per_rank))
    np.testing.assert_array_equal(full.global_indices(lo, hi), full.indices[lo:hi])


@FAST
@given(counts_st, seed_st, epoch_st, st.sampled_from(WORLDS), buffer_st, st.data())
def test_ranges_cover_every_remaining_sample(counts, seed, epoch, world, buf, data):
    rank = data.draw(st.integers(0, world - 1))
    full = rank_order(counts, seed, epoch, rank, world, 0, buf, global_batch=G)
    k = data.draw(st.integers(0, full.samples_per_rank))
    order = rank_order(counts, seed, epoch, rank, world, k, buf, global_batch=G)
    covered = {(r.shard, i) for r in order.ranges for i in range(r.lo, r.hi)}
    shard, local = order.locate(order.indices)
    assert {(int(s), int(i)) for s, i in zip(shard, local)} <= covered


@FAST
@given(counts_st, seed_st, epoch_st, buffer_st, st.data())
def test_window_shuffle_stays_within_its_window(counts, seed, epoch, buf, data):
    """Each global batch's samples come from the window(s) of epoch positions it spans: a reader
    holds one window, whatever the world size."""
    order = rank_order(counts, seed, epoch, 0, 1, 0, buf, global_batch=G)
    plain = rank_order(counts, seed, epoch, 0, 1, 0, 1, global_batch=G)  # same shards, no window shuffle
    shuffled, unshuffled = order.indices, plain.indices
    for w in range(0, len(shuffled), buf):
        assert set(shuffled[w : w + buf].tolist()) == set(unshuffled[w : w + buf].tolist())


def test_jft_scale_global_batches_are_lazy_and_fast():
    import time

    counts = np.full(30_300, 10_000)
    t0 = time.perf_counter()
    p = rank_order(counts, 0, 2, 2047, 2048, start=123, global_batch=4096)
    batch = p.global_indices(200, 200 + 2 * 8)  # rank 2047's share of steps 100 and 101 (2 samples each)
    assert time.perf_counter() - t0 < 2.0
    assert batch.shape == (16,) and len(np.unique(batch)) == 16


@pytest.mark.parametrize("samples, world, batch, expected", [(100, 4, 12, 24), (100, 3, 12, 32), (11, 1, 12, 0),
                                                             (100, 4, None, 25)])
def test_samples_per_rank(samples, world, batch, expected):
    assert samples_per_rank(samples, world, batch) == expected


def test_a_global_batch_the_world_cannot_split_is_a_value_error():
    with pytest.raises(ValueError, match="global_batch"):
        rank_order([10, 10], 0, 0, 0, 3, global_batch=10)
