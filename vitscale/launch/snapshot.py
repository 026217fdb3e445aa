"""Ray Train's record of a run's checkpoints, repaired from the checkpoints themselves when it is torn.

Ray Train V2's `CheckpointManager` keeps `checkpoint_manager_snapshot.json` in the run's storage folder.
It writes it in place (`open_output_stream`, which truncates first) after every registered checkpoint,
and at every start-up reads it back and refuses to start when it is not JSON of its schema, or names a
checkpoint folder that is gone (`CheckpointManagerInitializationError`). A disk that fills while the
snapshot is written leaves it empty or torn: every later start of the run fails, though its checkpoints
are intact.

vitscale does not write that file, so before Ray reads it (`launch/ray_train.py`, before every
TorchTrainer of a run) :func:`repair_snapshot` checks it as Ray would and, if Ray would refuse it,
writes a new one from the run's complete checkpoint folders (`train/checkpoint.py`): each with the
metrics Ray ranks and rotates by (the step and `checkpoint_score`, from its `train_state.json`), the
newest as the latest. Rebuilding, rather than moving the file aside, is what keeps the run as it was:
without a snapshot Ray starts with no checkpoints, so `train.keep_checkpoints` would never delete the
older ones again (a disk that just filled up would fill again), and a run resumed at its last step
would end with no checkpoint to hand to the next stage. The new file is written whole or not at all
(`data/storage/atomic.py`).

Only a local (or NFS) storage folder can hold a torn snapshot: an object store's put is whole or absent.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ray.train.v2._internal.constants import CHECKPOINT_MANAGER_SNAPSHOT_FILENAME
from ray.train.v2._internal.execution.checkpoint.checkpoint_manager import (
    _CheckpointManagerState,
    _TrainingResultState,
)

from vitscale.config.location import is_url
from vitscale.data.storage.atomic import write_atomic
from vitscale.train import checkpoint as ckpt
from vitscale.train.loop import checkpoint_score

__all__ = ["SNAPSHOT", "repair_snapshot", "snapshot_problem"]

SNAPSHOT = CHECKPOINT_MANAGER_SNAPSHOT_FILENAME


def snapshot_problem(run: Path) -> str | None:
    """Why Ray Train would refuse the run's snapshot at start-up (empty, torn, not its schema, naming a
    checkpoint folder that is gone), or None: it is fine, or there is none (Ray starts afresh)."""
    path = run / SNAPSHOT
    if not path.exists():
        return None
    try:
        state = _CheckpointManagerState.parse_obj(json.loads(path.read_bytes().decode("utf-8")))
    except (OSError, ValueError, TypeError) as exc:  # pydantic's ValidationError is a ValueError
        text = " ".join(str(exc).split())[:200]
        return f"{path.stat().st_size} bytes, unreadable ({type(exc).__name__}: {text})"
    gone = [r.checkpoint_dir_name for r in state.checkpoint_results if not (run / r.checkpoint_dir_name).is_dir()]
    return f"names checkpoint folders that are gone: {', '.join(gone)}" if gone else None


def repair_snapshot(storage: str | os.PathLike[str]) -> str | None:
    """Rebuild the run's snapshot (module doc) if Ray would refuse it; one line saying what was done, or None."""
    text = os.fspath(storage)
    if is_url(text):
        return None
    run = Path(text)
    problem = snapshot_problem(run)
    if problem is None:
        return None
    results = [_result(c) for c in _complete_checkpoints(run)]
    results.sort(key=lambda r: (r.metrics["checkpoint_score"], r.metrics["step"]))  # Ray's order: worst first
    latest = max(results, key=lambda r: r.metrics["step"], default=None)
    state = _CheckpointManagerState(
        checkpoint_results=results, checkpoint_report_indices=list(range(len(results))),
        latest_checkpoint_result=latest, pending_training_results=[], pending_validation_specs=[],
        current_report_index=len(results), validated_checkpoint_dir_names=[],
        timed_out_validation_checkpoint_dir_names=[], failed_validation_checkpoint_dir_names=[])
    write_atomic(run / SNAPSHOT, state.json())
    kept = ", ".join(r.checkpoint_dir_name for r in results) or "none"
    return f"{run / SNAPSHOT} was {problem}; rebuilt from the run's complete checkpoints ({kept})"


def _complete_checkpoints(run: Path) -> list[Path]:
    """The run's checkpoint folders that are complete as their writers left them (sizes checked; a resume
    hashes what it reads)."""
    found = []
    for folder in sorted(run.glob("checkpoint_*")):
        info = ckpt.manifest_info(folder) if folder.is_dir() else None
        if info is not None and not ckpt.check_complete(folder, info[1], hash_ranks=()):
            found.append(folder)
    return found


def _result(folder: Path) -> Any:
    """Ray's record of one checkpoint, with the metrics it ranks by, from the checkpoint's own train state."""
    state = ckpt.read_train_state(folder)
    metrics = {"step": state.step, "examples_seen": state.examples_seen, "cumulative_exaflops": state.flops / 1e18,
               "world_size": state.world_size, "skipped_steps": state.skipped_steps,
               "checkpoint_score": checkpoint_score(state.step, state.first_skipped_step)}
    return _TrainingResultState(checkpoint_dir_name=folder.name, metrics=metrics)
