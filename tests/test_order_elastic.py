"""Property tests of the global-batch layout (elastic training): the samples each optimizer step
consumes do not depend on the world size, whether it divides the global batch or not (uneven shares
differ by at most one sample), so any sequence of resizes consumes each sample of the epoch exactly
once; and the layout keeps the span layout's guarantees (partition, balance, exact resume, bounded
window shuffle). Also the pure batch cutting the stream uses (`micro_batch_sizes`, `batch_bounds`)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vitscale.data.order import (
    batch_bounds,
    cycled_batches,
    micro_batch_sizes,
    num_batches,
    rank_order,
    samples_per_rank,
    share_bounds,
    split_evenly,
)

counts_st = st.lists(st.integers(0, 40), min_size=1, max_size=12)
seed_st = st.integers(0, 2**32 - 1)
epoch_st = st.integers(0, 5)
buffer_st = st.integers(1, 64)
FAST = settings(max_examples=150, deadline=None)
G = 12
WORLDS = tuple(range(1, G + 1))  # every world size a range may hold: divisors of G and not (5, 7-11)
DIVISORS = tuple(w for w in WORLDS if G % w == 0)


def share(world: int, rank: int) -> int:
    lo, hi = share_bounds(G, world, rank)
    return hi - lo


def step_samples(counts, seed, epoch, world, buf, step):
    """The samples optimizer step `step` (0-based) consumes: every rank's share, rank order."""
    return np.concatenate([rank_order(counts, seed, epoch, r, world, 0, buf, global_batch=G)
                           .global_indices(step * share(world, r), (step + 1) * share(world, r))
                           for r in range(world)])


@FAST
@given(counts_st, seed_st, epoch_st, st.sampled_from(WORLDS), buffer_st)
def test_epoch_is_a_balanced_partition_of_whole_global_batches(counts, seed, epoch, world, buf):
    n = sum(counts)
    orders = [rank_order(counts, seed, epoch, r, world, 0, buf, global_batch=G).indices for r in range(world)]
    assert [len(o) for o in orders] == [(n // G) * share(world, r) for r in range(world)]
    assert {share(world, r) for r in range(world)} <= {G // world, -(-G // world)}  # balanced: differ by <= 1
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
        batch = [[] for _ in range(stop - step)]  # each step's samples, all ranks of this world
        for r in range(world):
            n = share(world, r)
            order = rank_order(counts, seed, epoch, r, world, step * n, buf, global_batch=G)
            mine = order.indices[: (stop - step) * n]
            np.testing.assert_array_equal(mine, order.global_indices(step * n, stop * n))
            consumed.append(mine)
            for k in range(stop - step):
                batch[k].extend(mine[k * n:(k + 1) * n].tolist())
        for k in range(stop - step):  # the step's global batch is the fixed-size (W = 1) run's, as a set
            assert sorted(batch[k]) == sorted(step_samples(counts, seed, epoch, 1, buf, step + k).tolist())
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


def test_uneven_shares_per_rank():
    # 12 over 5 ranks: bounds 0, 2, 4, 7, 9, 12; 100 samples fill 8 global batches
    assert [share_bounds(12, 5, r) for r in range(5)] == [(0, 2), (2, 4), (4, 7), (7, 9), (9, 12)]
    assert [samples_per_rank(100, 5, 12, rank=r) for r in range(5)] == [16, 16, 24, 16, 24]


@FAST
@given(counts_st, seed_st, epoch_st, st.sampled_from(DIVISORS), buffer_st, st.data())
def test_a_dividing_world_keeps_the_equal_share_layout(counts, seed, epoch, world, buf, data):
    """Where W divides G, rank r takes positions [k*G + r*G/W, k*G + (r+1)*G/W) of step k, as before
    uneven shares existed: existing runs and their checkpoints read the same samples."""
    b = G // world
    rank = data.draw(st.integers(0, world - 1))
    assert share_bounds(G, world, rank) == (rank * b, (rank + 1) * b)
    whole = rank_order(counts, seed, epoch, 0, 1, 0, buf, global_batch=G).indices  # the epoch's steps in order
    mine = rank_order(counts, seed, epoch, rank, world, 0, buf, global_batch=G).indices
    expected = [whole[k * G + rank * b + i] for k in range(len(whole) // G) for i in range(b)]
    np.testing.assert_array_equal(mine, np.asarray(expected, dtype=np.int64))


def test_a_global_batch_smaller_than_the_world_is_a_value_error():
    rank_order([10, 10], 0, 0, 0, 3, global_batch=10)  # uneven shares: 3, 3, 4
    with pytest.raises(ValueError, match="global_batch"):
        rank_order([10, 10], 0, 0, 0, 3, global_batch=2)


@given(st.integers(0, 200), st.integers(1, 20))
def test_split_evenly_is_balanced_and_larger_first(total, parts):
    sizes = split_evenly(total, parts)
    assert len(sizes) == parts and sum(sizes) == total
    assert max(sizes) - min(sizes) <= 1 and list(sizes) == sorted(sizes, reverse=True)


@given(st.integers(1, 4096), st.integers(1, 64), st.integers(1, 64), st.data())
def test_micro_batches_are_as_many_on_every_rank(global_batch, world, batch_size, data):
    if world > global_batch:
        return
    plans = [micro_batch_sizes(global_batch, world, r, batch_size) for r in range(world)]
    assert len({len(p) for p in plans}) == 1  # the same accumulation count everywhere
    assert len(plans[0]) == math.ceil(math.ceil(global_batch / world) / batch_size)  # ceil(ceil(G/W)/micro)
    for r, p in enumerate(plans):
        lo, hi = share_bounds(global_batch, world, r)
        assert sum(p) == hi - lo and max(p) <= batch_size and max(p) - min(p) <= 1
    if global_batch % world == 0 and (global_batch // world) % batch_size == 0:  # today's even plan
        assert all(p == (batch_size,) * (global_batch // world // batch_size) for p in plans)


@given(st.lists(st.integers(1, 9), min_size=1, max_size=5), st.integers(0, 200), st.booleans())
def test_cycled_batches_tile_the_positions(sizes, samples, drop_last):
    count = cycled_batches(samples, sizes, drop_last)
    bounds = [batch_bounds(b, sizes) for b in range(count)]
    assert all(hi - lo == sizes[b % len(sizes)] for b, (lo, hi) in enumerate(bounds))
    assert all(bounds[b][1] == bounds[b + 1][0] for b in range(count - 1))
    covered = bounds[-1][1] if bounds else 0
    if drop_last:
        assert covered <= samples < covered + sizes[count % len(sizes)]
    else:
        assert covered >= samples and (count == 0 or bounds[-1][0] < samples)
    if len(sizes) == 1:
        assert count == num_batches(samples, sizes[0], drop_last)
