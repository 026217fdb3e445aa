"""ASHA's rungs (Li et al. 2020, asynchronous successive halving): where a trial is judged.

Ray Tune's `ASHAScheduler` judges a trial at the first result it reports at or past each rung's
milestone (`time_attr` = the optimizer step here). A trial that is scored only every k steps is
judged late, at a score from further along than the rung says, and so costs more steps than the
rung promises. The sweep therefore makes each trial evaluate on its dev split exactly at these
milestones (`TrainJob.eval_steps`). Pure: no Ray here; a test checks it against Ray's bracket.
"""

from __future__ import annotations

import math


def asha_grace(steps: int, grace_period: int | None) -> int:
    """Steps every trial runs before the first cut: `sweep.grace_period`, or an eighth of a trial's."""
    return grace_period or max(1, steps // 8)


def asha_rungs(max_t: int, grace: int, reduction_factor: int) -> tuple[int, ...]:
    """Ascending milestones grace * rf^k below or at `max_t`, as Ray's one-bracket ASHA computes them
    (`int(log(max_t / grace) / log(rf) + 1)` rungs; it uses numpy's log, which equals math.log here)."""
    if grace >= max_t:
        return (max_t,) if grace == max_t else ()
    count = int(math.log(max_t / grace) / math.log(reduction_factor) + 1)
    return tuple(grace * reduction_factor**k for k in range(count))
