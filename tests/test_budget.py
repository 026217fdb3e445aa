"""The error budget's message: every rank's bad shards, counted and attributed (data/loader/budget.py)."""

from __future__ import annotations

import re

from hypothesis import given
from hypothesis import strategies as st

from vitscale.data.loader.budget import SHOWN_SHARDS, bad_shards, budget_error

shards = st.sampled_from([f"train-{i:06d}.tar" for i in range(8)])
per_rank = st.lists(st.dictionaries(shards, st.integers(0, 50), max_size=5), min_size=1, max_size=6)


@given(per_rank)
def test_every_bad_shard_is_named_once_with_its_total_and_its_ranks(counts):
    text = bad_shards(counts)
    totals = {s: sum(c.get(s, 0) for c in counts) for c in counts for s in c}
    bad = {s: t for s, t in totals.items() if t > 0}
    if not bad:
        assert text == "none"
        return
    named = re.findall(r"(train-\d{6}\.tar) \((\d+)(?: on ranks? ([\d, ]+))?\)", text)
    assert {s: int(t) for s, t, _ in named} == bad and len(named) == len(bad)
    for shard, _, ranks in named:
        met = [r for r, c in enumerate(counts) if c.get(shard, 0) > 0]
        assert ([int(r) for r in ranks.split(", ")] if ranks else [0]) == met
        assert bool(ranks) == (len(counts) > 1)  # one rank: no rank to name
    assert [int(t) for _, t, _ in named] == sorted((int(t) for _, t, _ in named), reverse=True)


def test_the_most_skipped_are_named_and_the_rest_counted():
    counts = [{f"s{i:03d}.tar": i + 1 for i in range(SHOWN_SHARDS + 5)}]
    text = bad_shards(counts)
    assert text.startswith(f"s{SHOWN_SHARDS + 4:03d}.tar ({SHOWN_SHARDS + 5})") and text.endswith("and 5 more")
    assert "s000.tar" not in text and text.count(".tar") == SHOWN_SHARDS


def test_the_error_says_the_count_the_budget_and_the_shards():
    error = budget_error(4, 2, 0.01, 300, 2, [{}, {"train-000003.tar": 4}])
    assert str(error) == ("4 samples skipped in epoch 2 (all 2 ranks), over the error budget 0.01 of 300 samples "
                          "(3); bad shards: train-000003.tar (4 on rank 1). Repair or rewrite them, or raise "
                          "error_budget.")
