"""benchmarks/sweep_efficiency.py's count of the trial-steps ASHA had spent when it reached the grid's best."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

_spec = importlib.util.spec_from_file_location(
    "sweep_efficiency", Path(__file__).resolve().parents[1] / "benchmarks" / "sweep_efficiency.py")
sweep_efficiency = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sweep_efficiency)
steps_to_reach = sweep_efficiency.steps_to_reach


def test_every_trial_counts_up_to_its_first_report_after_the_best_finished() -> None:
    reports = [
        [(0, 0, None), (10, 50, 0.2), (20, 100, 0.61)],  # finishes 100 steps at t=20 within the target
        [(0, 0, None), (12, 50, 0.3), (25, 100, 0.5)],   # mid-way at t=20: counted to its next report
        [(5, 0, None), (15, 50, 0.1)],                   # stopped before t=20
        [(30, 0, None), (40, 50, 0.9)],                  # started after t=20
    ]
    assert steps_to_reach(reports, 100, 0.6) == 100 + 100 + 50 + 0


def test_an_intermediate_score_is_not_reaching() -> None:
    # 0.9 at step 50 of 100 is a rung's score, not a finished trial's.
    reports = [[(0, 0, None), (10, 50, 0.9), (20, 100, 0.4)]]
    assert steps_to_reach(reports, 100, 0.6) is None


trial = st.lists(st.tuples(st.integers(1, 100), st.integers(1, 4), st.sampled_from([None, 0.1, 0.5, 0.9])),
                 min_size=1, max_size=6)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 100), trial), min_size=1, max_size=6))
def test_spent_lies_between_the_reaching_trial_and_everything(raw: list) -> None:
    steps = 4
    reports = []
    for start, rows in raw:  # times and steps increase within a trial, from its start at step 0
        times = sorted({start + dt for dt, _, _ in rows})
        steps_seen = sorted({s for _, s, _ in rows})[: len(times)]
        reports.append([(start, 0, None)] + [(t, s, acc) for t, s, (_, _, acc) in zip(times, steps_seen, rows)])
    spent = steps_to_reach(reports, steps, 0.5)
    finished = [t for trial_ in reports for t, s, acc in trial_ if s == steps and acc is not None and acc >= 0.5]
    if not finished:
        assert spent is None
        return
    everything = sum(max(s for _, s, _ in trial_) for trial_ in reports)
    assert steps <= spent <= everything
