"""What the launcher tells a worker: who it is, where the run lives, how to report, what to resume.

`launch/train_worker.py` fills it from Ray Train's context; tests and benchmarks fill it by hand to run the
same loop without Ray. Its own module so that the loop's components (`worker.py`, `observers.py`,
`stopvote.py`) read it without importing the loop that composes them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ReportFn = Callable[[dict[str, Any], "Path | None"], None]


@dataclass
class WorkerContext:
    """What the launcher tells a worker: who it is, where the run lives, how to report."""

    rank: int
    world_size: int
    run_dir: Path
    """Local (or shared-filesystem) run directory: metrics JSONL, sample logs, fault markers."""
    local_rank: int = 0
    """Rank among the workers on this node: picks this worker's metrics port."""
    report: ReportFn = field(default=lambda metrics, checkpoint_dir: None)
    """Report metrics (and a checkpoint directory) to the launcher; called by every rank."""
    resume_from: Path | None = None
    """A complete checkpoint directory to resume from, or None to start fresh."""
    restored: Callable[[], None] = field(default=lambda: None)
    """Called once `resume_from` is loaded: the launcher releases a downloaded copy then."""
    storage: str | None = None
    """The run's storage every node shares (a folder or s3:// prefix): fault markers; None = run_dir."""
    run_name: str | None = None
    """The run's name in its metrics (the `run` label); None = run_dir's name. A node's cache folder of an
    object-storage run carries a hash of its location (data/storage/run_cache.py), not a name to show."""
    stop_requested: Callable[[], str | None] = field(default=lambda: None)
    """The driver's request that the run stop (Ctrl-C or SIGTERM to `vitscale run`: one line), or None; asked by
    rank 0 every step, cheap (`launch/stop_request.py` reads its actor at most once a second). Every rank then
    checkpoints at the same step and returns: the run ends, to be resumed at the next step."""
    launched: float = 0.0
    """Unix time the command running the run began (`vitscale run`, a sweep's trial), the same in every attempt
    Ray Train restarts it in: a restart's cost does not include a user's wait before running it again."""
    elastic: bool = False
    """The run's world size may change between restarts (`cluster.num_workers: [MIN, MAX]`): a
    checkpoint of another world size is resharded, not refused."""
    preemption: Callable[[], str | None] = field(default=lambda: None)
    """A notice that a node of the run is being preempted (one line), or None. Every rank calls it at the
    same steps, every `preemption_every_s` (under Ray Train it is a barrier through an actor: too slow
    for every step). On the first notice the loop checkpoints at once."""
    preemption_every_s: float = 5.0
    """How often the loop asks: Ray Train polls node drains every 5 s itself."""
    terminated: Callable[[], str | None] = field(default=lambda: None)
    """A notice that this process was told to stop (SIGTERM held back by `train/termination.py`), or None;
    local and cheap, asked every step. Every rank checkpoints at the step any rank's notice arrives, then
    raises `Terminated` (the told ranks leave; Ray Train restarts the group from that checkpoint)."""
