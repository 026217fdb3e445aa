"""A resumed trial's wall time adds the attempts that died before the one that finished."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from vitscale.stages.sweep_results import earlier_attempts_s


def _attempt(start: float, seconds: list[float]) -> list[dict[str, float]]:
    return [{"time_total_s": s, "timestamp": start + s} for s in seconds]


def test_a_killed_attempt_counts_and_the_last_does_not() -> None:
    reports = _attempt(1000, [5, 10, 42]) + _attempt(2000, [3, 8])
    assert earlier_attempts_s(reports, started_at=2000) == 42


def test_a_replayed_final_report_is_not_counted_twice() -> None:
    # The trial finished (started 1000, finished 1050) before the driver died; the restarted trial
    # reported the same final result again at once.
    reports = _attempt(1000, [20, 50]) + [{"time_total_s": 0.1, "timestamp": 3000}]
    assert earlier_attempts_s(reports, started_at=1000) == 0


@given(st.lists(st.lists(st.floats(0.1, 1000), min_size=1, max_size=5, unique=True), min_size=1, max_size=5))
def test_sum_of_every_earlier_attempt(attempts: list[list[float]]) -> None:
    reports, starts, lasts, start = [], [], [], 0.0
    for durations in attempts:
        elapsed = [0.05, *sorted(durations)]  # every attempt's first report is below any earlier one's last
        reports += _attempt(start, elapsed)
        starts.append(start)
        lasts.append(elapsed[-1])
        start += elapsed[-1] + 1.0
    assert earlier_attempts_s(reports, starts[-1]) == sum(lasts[:-1])
