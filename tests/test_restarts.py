"""Restarts read back from a rank's metrics lines: each attempt's start, the steps redone, the seconds no
step was made, the world sizes before and after; and the Prometheus series a restarted sink serves."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vitscale.train.metrics import MetricsSink, StepMetrics
from vitscale.train.restarts import read_rows, restarts

# An attempt: (steps back from the last step it resumes behind, steps it makes, its world size, seconds
# from the previous attempt's last step (or its command's start) to its first step's start, and None for a
# restart by Ray Train in the same command, or the seconds the run waited before its command was run again).
attempt_st = st.tuples(st.integers(0, 5), st.integers(1, 6), st.integers(1, 8), st.floats(0, 500),
                       st.none() | st.floats(0, 1e6))


def _rows(attempts: list[tuple[int, int, int, float, float | None]]
          ) -> tuple[list[dict], list[tuple[int, int, float, int, bool]]]:
    """Lines as a rank writes them, and the expected (resumed step, steps redone, seconds lost, world, relaunched)."""
    rows: list[dict] = []
    expected = []
    t, step, step_time, launch = 1000.0, 0, 2.0, 990.0
    for number, (back, made, world, gap, waited) in enumerate(attempts):
        resumed = max(0, step - back)
        if number:
            if waited is not None:  # stopped, and the command run again later: its own launch time
                t += waited
                launch = t
            expected.append((resumed, step - resumed, gap, world, waited is not None))
            t += gap
        began = t
        for s in range(resumed + 1, resumed + made + 1):
            t += step_time
            rows.append({"step": s, "time": t, "step_time_s": step_time, "world_size": world, "attempt": began,
                         "launch": launch})
        step = resumed + made
    return rows, expected


@settings(max_examples=200, deadline=None)
@given(st.lists(attempt_st, min_size=1, max_size=6))
def test_every_restart_is_found_with_its_cost(attempts) -> None:
    """The seconds lost never include the wait before a command was run again: only its start-up."""
    rows, expected = _rows(attempts)
    found = restarts(rows)
    assert [(r.step, r.steps_redone, r.world_after, r.relaunched) for r in found] == \
        [(e[0], e[1], e[3], e[4]) for e in expected]
    for r, e in zip(found, expected):
        assert r.seconds_lost == pytest.approx(e[2], abs=1e-6)
    worlds = [a[2] for a in attempts]
    assert [r.world_before for r in found] == worlds[:-1]


def test_lines_written_before_attempts_were_recorded_are_one_attempt() -> None:
    old = [{"step": s, "time": float(s), "step_time_s": 1.0} for s in (1, 2, 3)]
    assert restarts(old) == []


def _metrics(step: int, world: int, attempt: float) -> StepMetrics:
    return StepMetrics(step=step, loss=1.0, lr=0.1, grad_norm=1.0, images_per_s=10.0, step_time_s=0.5,
                       data_wait_s=0.1, compute_s=0.4, examples_seen=8 * step, cumulative_exaflops=1e-9 * step,
                       mfu=None, skipped_samples=0, epoch=step / 10, world_size=world, attempt=attempt)


def test_a_restarted_sink_counts_the_restart_and_its_seconds(tmp_path: Path) -> None:
    import time

    from prometheus_client import generate_latest

    with MetricsSink(tmp_path, run="r", rank=0) as sink:
        # Served at 0 before any restart: a series that first appears at 1, with the restart, is one whose
        # first sample increase() never counts (promtool: `_x10 1x20` gives no increase, `0x10 1x20` gives 1).
        before = generate_latest(sink.registry).decode()
        assert 'vitscale_restarts_total{rank="0",run="r"} 0.0' in before
        assert 'vitscale_restart_lost_seconds_total{rank="0",run="r"} 0.0' in before
        for step in (1, 2, 3):
            sink.record(_metrics(step, 4, attempt=100.0))
    last = read_rows(tmp_path / "metrics" / "rank0.jsonl")[-1]["time"]
    (tmp_path / "metrics" / "rank0.jsonl").open("a").write('{"step": 4, "ti')  # a line torn by the kill
    with MetricsSink(tmp_path, run="r", rank=0) as sink:  # the restarted attempt: 2 workers, from step 2
        time.sleep(0.6)
        sink.record(_metrics(3, 2, attempt=200.0))
        text = generate_latest(sink.registry).decode()
        assert [(r.step, r.world_after) for r in sink.restarts] == [(2, 2)]  # kept as recorded, not re-read
    assert 'vitscale_world_size{rank="0",run="r"} 2.0' in text
    assert 'vitscale_restarts_total{rank="0",run="r"} 1.0' in text
    seconds = [float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("vitscale_restart_lost_seconds_total{")]
    rows = read_rows(tmp_path / "metrics" / "rank0.jsonl")
    assert len(rows) == 4 and rows[-1]["world_size"] == 2  # the torn line is left out
    assert seconds == [pytest.approx(rows[-1]["time"] - 0.5 - last, abs=1e-3)] and seconds[0] > 0
    [restart] = restarts(rows)
    assert (restart.step, restart.steps_redone, restart.world_before, restart.world_after) == (2, 1, 4, 2)
    assert json.dumps(rows)  # plain data
