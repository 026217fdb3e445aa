"""Property tests of the sample order: partition, balance, determinism, resumption, locality;
and the data package's layout (the order module stays pure, no module grows past 400 lines)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import vitscale.data
from vitscale.data.order import num_batches, rank_order, worker_batches

counts_st = st.lists(st.integers(0, 40), min_size=1, max_size=12)
world_st = st.integers(1, 8)
seed_st = st.integers(0, 2**32 - 1)
epoch_st = st.integers(0, 5)
buffer_st = st.integers(1, 64)
FAST = settings(max_examples=150, deadline=None)


def all_ranks(counts, seed, epoch, world, buf, shuffle=True):
    return [rank_order(counts, seed, epoch, r, world, 0, buf, shuffle=shuffle).indices for r in range(world)]


@FAST
@given(counts_st, seed_st, epoch_st, world_st, buffer_st)
def test_epoch_is_a_balanced_partition(counts, seed, epoch, world, buf):
    n = sum(counts)
    orders = all_ranks(counts, seed, epoch, world, buf)
    lengths = {len(o) for o in orders}
    assert lengths == {n // world}  # every rank the same number of samples
    seen = np.concatenate(orders)
    assert len(np.unique(seen)) == len(seen)  # nothing twice, across all ranks
    assert ((seen >= 0) & (seen < n)).all()
    assert n - len(seen) <= world - 1  # at most world-1 samples left out


@FAST
@given(counts_st, seed_st, epoch_st, world_st, buffer_st, st.data())
def test_resume_is_exactly_the_tail(counts, seed, epoch, world, buf, data):
    rank = data.draw(st.integers(0, world - 1))
    full = rank_order(counts, seed, epoch, rank, world, 0, buf)
    k = data.draw(st.integers(0, full.samples_per_rank))
    resumed = rank_order(counts, seed, epoch, rank, world, k, buf)
    np.testing.assert_array_equal(resumed.indices, full.indices[k:])
    assert len(resumed) == full.samples_per_rank - k
    # Any slice of positions agrees with the materialised order (what loader workers compute).
    lo = data.draw(st.integers(0, full.samples_per_rank))
    hi = data.draw(st.integers(lo, full.samples_per_rank))
    np.testing.assert_array_equal(full.global_indices(lo, hi), full.indices[lo:hi])


@FAST
@given(counts_st, seed_st, epoch_st, world_st, buffer_st)
def test_order_is_deterministic(counts, seed, epoch, world, buf):
    a = all_ranks(counts, seed, epoch, world, buf)
    b = all_ranks(list(counts), seed, epoch, world, buf)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)


@FAST
@given(counts_st, seed_st, epoch_st, world_st, st.sampled_from([10**4, 2**62, 10**20]), st.booleans(), st.data())
def test_a_buffer_past_the_epoch_is_one_window_whatever_its_size(counts, seed, epoch, world, huge, batches, data):
    """Any buffer holding the whole epoch gives the same order, a huge one too (10**20 was an OverflowError in
    NumPy's int64, in every training worker); resumes and shard ranges agree with it."""
    gb = world * data.draw(st.integers(1, 4)) if batches else None
    rank = data.draw(st.integers(0, world - 1))
    whole = rank_order(counts, seed, epoch, rank, world, 0, 1000, global_batch=gb)
    big = rank_order(counts, seed, epoch, rank, world, 0, huge, global_batch=gb)
    np.testing.assert_array_equal(whole.indices, big.indices)
    start = data.draw(st.integers(0, big.samples_per_rank))
    tail = rank_order(counts, seed, epoch, rank, world, start, huge, global_batch=gb)
    np.testing.assert_array_equal(tail.indices, big.indices[start:])
    assert set(tail.indices.tolist()) <= set(_range_members(tail).tolist())


def _range_members(p) -> np.ndarray:
    parts = [p.bases[r.shard] + np.arange(r.lo, r.hi) for r in p.ranges]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


@FAST
@given(counts_st, seed_st, epoch_st, world_st, buffer_st, st.data())
def test_rank_reads_only_its_shard_ranges(counts, seed, epoch, world, buf, data):
    rank = data.draw(st.integers(0, world - 1))
    p = rank_order(counts, seed, epoch, rank, world, 0, buf)
    members = _range_members(p)
    # From the start, the ranges are exactly the rank's samples, each shard at most once ...
    np.testing.assert_array_equal(np.sort(members), np.sort(p.indices))
    assert len({r.shard for r in p.ranges}) == len(p.ranges)
    # ... and only the first and last may be partial shards.
    partial = [r for r in p.ranges if (r.lo, r.hi) != (0, counts[r.shard])]
    assert len(partial) <= 2
    assert all(r.lo < r.hi for r in p.ranges)
    # Resumed: a superset of what is left, a subset of the rank's span.
    k = data.draw(st.integers(0, p.samples_per_rank))
    q = rank_order(counts, seed, epoch, rank, world, k, buf)
    rest = set(_range_members(q).tolist())
    assert set(q.indices.tolist()) <= rest <= set(members.tolist())


@FAST
@given(counts_st, seed_st, epoch_st, world_st, buffer_st, st.data())
def test_sample_shuffle_stays_within_its_window(counts, seed, epoch, world, buf, data):
    rank = data.draw(st.integers(0, world - 1))
    shuffled = rank_order(counts, seed, epoch, rank, world, 0, buf).indices
    in_order = rank_order(counts, seed, epoch, rank, world, 0, 1).indices  # same shards, no window shuffle
    for w in range(0, len(shuffled), buf):
        assert set(shuffled[w : w + buf].tolist()) == set(in_order[w : w + buf].tolist())


@FAST
@given(counts_st, world_st, buffer_st)
def test_no_shuffle_keeps_dataset_order(counts, world, buf):
    orders = all_ranks(counts, 7, 3, world, buf, shuffle=False)
    m = sum(counts) // world
    np.testing.assert_array_equal(np.concatenate(orders), np.arange(world * m))


@FAST
@given(st.integers(0, 300), st.integers(1, 8), st.booleans(), st.integers(1, 64))
def test_workers_round_robin_rebuilds_the_batch_order(samples, workers, drop_last, batch):
    nb = num_batches(samples, batch, drop_last)
    per_worker = [list(worker_batches(nb, w, workers)) for w in range(workers)]
    # DataLoader takes one batch from each worker in turn, skipping exhausted ones.
    emitted, cursors = [], [0] * workers
    while len(emitted) < nb:
        for w in range(workers):
            if cursors[w] < len(per_worker[w]):
                emitted.append(per_worker[w][cursors[w]])
                cursors[w] += 1
    assert emitted == list(range(nb))
    if drop_last:
        assert nb * batch <= samples < (nb + 1) * batch  # only full batches, all of them
    else:
        assert nb * batch >= samples > (nb - 1) * batch or samples == nb == 0


def test_epochs_reshuffle_shards_and_samples():
    counts = [50, 30, 45, 60, 25, 40]
    seen = {tuple(rank_order(counts, 3, e, 0, 1).indices.tolist()) for e in range(4)}
    assert len(seen) == 4  # every epoch a new order
    # Sample order alone: one shard, so only the window shuffle can change anything.
    a, b = rank_order([200], 3, 0, 0, 1).indices, rank_order([200], 3, 1, 0, 1).indices
    assert not np.array_equal(a, b) and not np.array_equal(a, np.arange(200))
    # Shard order alone: window of 1 keeps tar order inside shards, yet epochs differ.
    orders = {tuple(rank_order(counts, 3, e, 0, 1, 0, 1).shard_order.tolist()) for e in range(4)}
    assert len(orders) > 1
    # The left-out samples move between epochs.
    left_out = [
        set(range(sum(counts))) - set(np.concatenate(all_ranks(counts, 3, e, 7, 16)).tolist())
        for e in range(4)
    ]
    assert len({frozenset(s) for s in left_out}) > 1
    # Different seeds, different orders.
    assert not np.array_equal(rank_order(counts, 3, 0, 0, 2).indices, rank_order(counts, 4, 0, 0, 2).indices)


def test_jft_scale_order_is_lazy_and_fast():
    # 303M samples in 30,300 shards over 512 ranks: ordering and reading a batch's positions
    # must not materialise the epoch (memory stays flat, start-up stays instant).
    counts = np.full(30_300, 10_000)
    t0 = time.perf_counter()
    p = rank_order(counts, 0, 2, 511, 512, start=123_456)
    batch = p.global_indices(200_000, 204_096)
    assert time.perf_counter() - t0 < 2.0
    assert batch.shape == (4096,) and len(np.unique(batch)) == 4096
    assert len(p.ranges) <= 61  # ~592k samples: 60 whole shards plus partial ends


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(rank=2, world_size=2), "rank"),
        (dict(world_size=0), "world_size"),
        (dict(start=99), "start"),
        (dict(shuffle_buffer=0), "shuffle_buffer"),
        (dict(seed=-1), "seed"),
    ],
)
def test_bad_arguments_are_value_errors(kwargs, match):
    args = dict(counts=[10, 10], seed=0, epoch=0, rank=0, world_size=1) | kwargs
    with pytest.raises(ValueError, match=match):
        rank_order(**args)
    with pytest.raises(ValueError, match="counts"):
        rank_order([3, -1], 0, 0, 0, 1)


def test_order_module_imports_nothing_from_the_loader():
    # The order is pure numpy: importing it must not pull in the loader (torch, decoders).
    code = (
        "import sys, vitscale.data.order\n"
        "bad = sorted(m for m in sys.modules if m.startswith(('vitscale.data.loader', 'torch')))\n"
        "print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_no_data_module_is_over_400_lines():
    root = Path(vitscale.data.__file__).parent
    lines = {str(p.relative_to(root)): len(p.read_text().splitlines()) for p in root.rglob("*.py")}
    assert {name: n for name, n in lines.items() if n > 400} == {}
