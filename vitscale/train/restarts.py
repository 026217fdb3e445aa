"""Restarts of a run's worker group (a failure, a preemption, an elastic resize) and what each cost,
read back from a rank's metrics lines (``metrics/rank{r}.jsonl``, continued by every attempt).

Each line carries ``attempt``, the Unix time its attempt began: a line whose ``attempt`` differs
from the line before starts a new attempt. The seconds lost run from the previous attempt's last
step to the start of the new attempt's first step (start-up, reloading, resharding: the time no step
was made), and the steps redone are those the previous attempt had made past the checkpoint the new
one resumed from. A line also carries ``launch``, when the command running it began: an attempt of a
new command (a run stopped, then resumed by running it again) is ``relaunched``, and its seconds lost
count from that command's start, not from the previous attempt's last step: the hours a stopped run
waited for its user are not a restart's cost. Pure; property-tested in ``tests/test_restarts.py``.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Restart", "read_rows", "restarts"]


@dataclass(frozen=True)
class Restart:
    """One restart of the worker group (a failure, a preemption or a resize), read from a rank's lines."""

    step: int
    """Optimiser steps done when the new attempt began (its checkpoint's)."""
    steps_redone: int
    """Steps the previous attempt had done past that checkpoint, done again."""
    seconds_lost: float
    """From the previous attempt's last step to the start of the new attempt's first step."""
    world_before: int
    world_after: int
    relaunched: bool = False
    """The new attempt is a new command's (the run resumed by running it again), not Ray Train's restart."""


def restarts(rows: Iterable[Mapping[str, object]]) -> list[Restart]:
    """The restarts in one rank's metrics lines, in file order (pure): each line whose ``attempt`` differs
    from the line before. Lines from before ``attempt`` was recorded count as one attempt."""
    out, prev = [], None
    for row in rows:
        if prev is not None and row.get("attempt", 0.0) != prev.get("attempt", 0.0):
            first_started = _number(row["time"]) - _number(row["step_time_s"])
            launch = _number(row.get("launch", 0.0))
            # Lost since the previous attempt's last step, or since a new command began if it came later (a
            # restart by Ray Train keeps its command's launch, which came before any step).
            since = max(_number(prev["time"]), launch)
            out.append(Restart(step=int(_number(row["step"])) - 1,
                               steps_redone=max(0, int(_number(prev["step"])) - int(_number(row["step"])) + 1),
                               seconds_lost=max(0.0, first_started - since),
                               world_before=int(_number(prev.get("world_size", 1))),
                               world_after=int(_number(row.get("world_size", 1))),
                               relaunched=launch != _number(prev.get("launch", 0.0))))
        prev = row
    return out


def read_rows(path: Path) -> list[dict[str, object]]:
    """A metrics file's lines as dicts (a torn last line, from a killed process, left out)."""
    rows = []
    if path.exists():
        for line in path.read_text(encoding="utf-8").splitlines():
            with contextlib.suppress(ValueError):
                rows.append(json.loads(line))
    return rows


def _number(value: object) -> float:
    return float(value) if isinstance(value, (int, float)) else 0.0
