"""The function every Ray Train worker runs: the `TrainJob` from its payload, with what Ray gives a worker.

The worker takes the typed job from its payload on its first line, finds the checkpoint to resume from
(`resume_point.py`), and hands a `WorkerContext` to the loop: how to report a step and a checkpoint, Ray
Train's preemption notice, the driver's stop request, and SIGTERM held back as a notice. A failure leaves
as a `WorkerFailed` naming the rank, marked when a restart would fail the same way.
"""

from __future__ import annotations

import contextlib
import functools
import posixpath
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import ray
import ray.train

from vitscale.data.storage import open_storage
from vitscale.data.storage.filesystem import clear_stale, copy_folder, ensure_uploaded
from vitscale.data.storage.mirror import RunMirror
from vitscale.launch.console import labelled_lines
from vitscale.launch.failures import deterministic_cause
from vitscale.launch.resume_point import agree_on_resume, resume_directory
from vitscale.launch.run_place import RunPlace
from vitscale.launch.stop_request import StopPoll
from vitscale.say import say
from vitscale.train import checkpoint as ckpt
from vitscale.train.termination import Terminated, TerminationNotice

if TYPE_CHECKING:
    from vitscale.train.job import TrainJob

__all__ = ["WorkerFailed", "train_worker"]


class WorkerFailed(RuntimeError):
    """A training worker raised: carries the rank and the worker's own traceback."""

    deterministic: bool = False
    """A restart would fail the same way (launch/failures.py): set by the worker, read by the driver."""
    traceback: str = ""
    """Where the cause was raised, formatted by the worker: an attribute survives the pickling to Ray Train's
    controller and the driver, which drops the cause chain and its traceback (`launch/failures.py`)."""


def train_worker(payload: dict[str, Any]) -> None:
    """Entry point of every Ray Train worker: run the `TrainJob` in the payload.

    The payload carries the validated, frozen `TrainJob` itself (Ray pickles it): the driver
    checked every value in it, so the worker only runs it.
    """
    job: TrainJob = payload["job"]
    from vitscale.train.loop import WorkerContext, train  # torch/deepspeed load inside the worker

    context = ray.train.get_context()
    rank, world_size = context.get_world_rank(), context.get_world_size()
    place: RunPlace = payload["place"]
    run_dir = place.local_dir()  # on this node, as this node's user: never the driver's path
    storage = place.storage
    mirror = _rank_mirror(run_dir, storage, rank)
    # SIGTERM (a spot VM's shutdown, a pod's deletion, `kill`) becomes a checkpoint, then this exit.
    termination = TerminationNotice(float(payload.get("grace_s", 120.0)), label=f"rank {rank}")
    try:
        with contextlib.ExitStack() as downloaded, labelled_lines(payload.get("label")), termination:
            resume_from = resume_directory(world_size, rank, downloaded, storage)
            agree_on_resume(rank, resume_from)
            # `restored` releases a downloaded checkpoint as soon as the loop has loaded it.
            ctx = WorkerContext(rank=rank, world_size=world_size, run_dir=run_dir,
                                report=functools.partial(_report, mirror=mirror, storage=storage),
                                resume_from=resume_from, local_rank=context.get_local_rank(),
                                restored=downloaded.close, storage=storage, run_name=place.label,
                                elastic=bool(payload.get("elastic")), preemption=_preemption_notice,
                                launched=float(payload.get("launched", 0.0)),
                                stop_requested=_stop_poll(payload.get("stop"), place.storage),
                                terminated=termination.notice)
            train(job, ctx)  # its last step reports the final checkpoint and metrics
    except Terminated as stopped:
        say(f"{stopped}: " + ("leaving" if stopped.signalled else "stopping for the restart"))
        if stopped.signalled:
            _leave(termination, stopped)
        # A peer's SIGTERM: this worker ends its attempt in one line, not with a failed collective's traceback.
        raise WorkerFailed(str(stopped)) from None
    except Exception as exc:
        # Ray shows its own traceback of the actor; print the worker's with its rank so the driver's
        # log says which rank failed and why, then re-raise for Ray's failure handling.
        where = traceback.format_exc()
        say(f"rank {rank} failed: {type(exc).__name__}: {exc}\n{where}")
        failure = WorkerFailed(f"rank {rank}: {ckpt.one_line(exc, storage, world_size)}")
        failure.deterministic = deterministic_cause(exc) is not None  # survives pickling; the cause does not
        failure.traceback = where
        raise failure from exc
    finally:
        if mirror is not None:
            try:
                mirror.close()
            except OSError as exc:  # never hide the run's own outcome behind a failed last upload
                say(f"rank {rank}: could not push its records to {mirror.storage.url}: {exc}")


def _leave(termination: TerminationNotice, told: Terminated) -> NoReturn:
    """End this worker's process as the SIGTERM it held back would have (Ray's handler: SystemExit in the
    actor's main thread); Ray Train then restarts the group from the checkpoint the loop just wrote."""
    import time

    termination.leave()
    time.sleep(60)  # the main thread ends the process meanwhile; this thread must not return "finished"
    raise WorkerFailed(f"{told}, but the process did not end within 60 s of the signal's own handler")


def _stop_poll(requests: Any, run: str) -> Callable[[], str | None]:
    """Rank 0's reading of the driver's stop request; a run fitted from a thread (a sweep's) has none."""
    return (lambda: None) if requests is None else StopPoll(requests, run)


def _preemption_notice() -> str | None:
    """Ray Train's notice that a node of this run is being preempted (drained with a deadline), as one
    line, or None. A barrier: every rank calls it once per step."""
    import time

    info = ray.train.get_preemption_info()
    if info is None:
        return None
    left = "" if info.deadline_ms is None else f", {info.deadline_ms / 1000 - time.time():.0f} s before its deadline"
    nodes = ", ".join(n[:12] for n in info.preempted_node_ids)
    return f"node(s) {nodes} (ranks {info.preempted_ranks}) preempted{left}"


def _rank_mirror(run_dir: Path, storage: str | None, rank: int) -> RunMirror | None:
    """What this rank writes on its node's disk (metrics, sample records; rank 0 also TensorBoard), pushed to
    the run's storage: a node's disk is only a cache, and a lost node's files must not be lost with it."""
    if storage is None:
        return None
    mine = f"rank{rank}."

    def include(name: str) -> bool:
        return mine in name.rsplit("/", 1)[-1] or (rank == 0 and name.startswith("tensorboard/"))

    mirror = RunMirror(run_dir, open_storage(storage), include=include)
    # A rank that starts on a node that is not its predecessor's (a lost node replaced) continues the
    # records its predecessor pushed instead of overwriting them with a file that starts at the resume; and
    # its files the storage lacks (a deleted run's, on a node that ran it) are removed before it writes.
    mirror.pull()
    mirror.push_every(30.0)
    return mirror


def _report(metrics: dict[str, Any], checkpoint_dir: Path | None, mirror: RunMirror | None = None,
            storage: str | None = None) -> None:
    if checkpoint_dir is None:
        ray.train.report(metrics)
        return
    if mirror is not None:  # the records up to this checkpoint reach storage before the checkpoint does
        mirror.push()
    name = f"checkpoint_{int(metrics['step']):09d}"
    if storage is not None:  # a step saved again: its torn save's files must not pass for this one's
        cleared = clear_stale(checkpoint_dir, posixpath.join(storage, name))
        if cleared:
            say(f"{name}: removed {len(cleared)} file(s) an earlier, failed save of this step left")
    upload = _upload_once if storage is not None and storage.startswith("s3://") else None
    try:
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(str(checkpoint_dir)),
                         checkpoint_dir_name=name, checkpoint_upload_fn=upload)
    except _UploadFailed as failed:
        raise failed.error from None  # as the copy raised it: `ckpt.space_for` makes it the run's one line
    if storage is not None:  # Ray's copy can lose a file without a word (filesystem.py): check, copy again
        copied = ensure_uploaded(checkpoint_dir, posixpath.join(storage, name))
        if copied:
            say(f"{name}: stored again what the first upload lost: {', '.join(copied)}")


class _UploadFailed(Exception):
    """A checkpoint's upload failed: ``error``, kept out of this exception's own words.

    Ray Train tries a checkpoint's upload 3 times, with its own backoff of 1 and 2 s, when the error's text
    names an AWS SDK error it counts as transient (throttling, 5xx, a lost connection); each of those tries
    already spent the retry budget's tries of the SDK (``data/storage/filesystem.py``), so a store that stayed
    throttled held a save for three budgets and more, against the one the run's last line reports. Raised
    from the upload with this text, Ray's retry lets the failure through at once."""

    def __init__(self, error: OSError) -> None:
        super().__init__("the checkpoint's upload failed (the worker raises its error)")
        self.error = error


def _upload_once(checkpoint: ray.train.Checkpoint, name: str) -> ray.train.Checkpoint:
    """Ray Train's upload of a checkpoint into the run's object storage, in one retry budget (`_UploadFailed`)."""
    storage = ray.train.get_context().get_storage()  # the filesystem and folder Ray's own upload writes to
    destination = posixpath.join(storage.experiment_fs_path, name)
    try:
        copy_folder(checkpoint.path, storage.storage_filesystem, destination)
    except OSError as exc:
        raise _UploadFailed(exc) from None
    return ray.train.Checkpoint(filesystem=storage.storage_filesystem, path=destination)
