"""The error budget's verdict: how many samples an epoch may skip, and the one line that names them.

A training run skips a sample it cannot read and counts it; past ``error_budget`` x the epoch's samples
(all ranks together) the run stops, naming the shards the skipped samples came from. Every rank learns the
count at the same step (it rides in the step's all-reduce), but each rank knows only the shards it read: so
the ranks' own counts are gathered then, and whichever rank's error reaches the user names every bad shard.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

SHOWN_SHARDS = 20
"""Bad shards named in the message, the most skipped first; the rest are counted."""


class ErrorBudgetExceeded(RuntimeError):
    """More samples were skipped in an epoch than ``error_budget`` allows. Deterministic: the same
    samples fail again on a retry, so the launcher stops the run instead of restarting it."""


def bad_shards(per_rank: Sequence[Mapping[str, int]]) -> str:
    """``train-000003.tar (12 on rank 1), train-000007.tar (2 on ranks 0, 1)``: each shard with its skipped
    samples and the ranks that met them, the most skipped first (ties in name order); "none" when empty."""
    counts: Counter[str] = Counter()
    ranks: dict[str, list[int]] = {}
    for rank, mine in enumerate(per_rank):
        for shard, count in mine.items():
            if count > 0:
                counts[shard] += count
                ranks.setdefault(shard, []).append(rank)
    if not counts:
        return "none"
    ordered = sorted(counts, key=lambda shard: (-counts[shard], shard))
    several = len(per_rank) > 1
    parts = [f"{shard} ({counts[shard]}" + (_on(ranks[shard]) if several else "") + ")"
             for shard in ordered[:SHOWN_SHARDS]]
    if len(ordered) > SHOWN_SHARDS:
        parts.append(f"and {len(ordered) - SHOWN_SHARDS} more")
    return ", ".join(parts)


def _on(ranks: list[int]) -> str:
    return f" on rank {ranks[0]}" if len(ranks) == 1 else " on ranks " + ", ".join(map(str, ranks))


def budget_error(skipped: int, epoch: int, budget: float, samples: int, ranks: int,
                 per_rank: Sequence[Mapping[str, int]]) -> ErrorBudgetExceeded:
    """The error for an epoch that skipped ``skipped`` samples over its budget (``budget`` as a fraction of
    ``samples``), naming the bad shards of ``per_rank`` (every rank's counts, or this rank's alone)."""
    samples_word = "sample" if skipped == 1 else "samples"
    counted = "" if ranks == 1 else f" (all {ranks} ranks)"
    return ErrorBudgetExceeded(
        f"{skipped} {samples_word} skipped in epoch {epoch}{counted}, over the error budget {budget} "
        f"of {samples} samples ({budget * samples:.0f}); bad shards: {bad_shards(per_rank)}. Repair or rewrite "
        "them, or raise error_budget.")
