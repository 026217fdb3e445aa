"""Ray Train wiring: a TorchTrainer whose workers run `vitscale.train.loop.train` on a `TrainJob`.

Ray stays at this edge. The worker function takes the typed job from its payload on its first
line, finds the checkpoint to resume from, and hands a `WorkerContext` to the loop. Fault tolerance
is Ray Train V2's: `FailureConfig(max_failures)` restarts the worker group
after a crash and `ray.train.get_checkpoint()` returns the latest reported checkpoint; a
re-submitted job with the same (storage_path, name) resumes the same way.
"""

from __future__ import annotations

import contextlib
import functools
import os
import posixpath
import socket
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import pyarrow.fs
import ray
import ray.train
from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
from ray.train.collective import broadcast_from_rank_zero

from vitscale.config.checks import ConfigError
from vitscale.config.location import is_url, part_location
from vitscale.config.pipeline import ClusterConfig, ray_address
from vitscale.data.storage import open_storage
from vitscale.data.storage.base import StorageError
from vitscale.data.storage.endpoint import endpoint_env
from vitscale.data.storage.filesystem import clear_stale, ensure_uploaded, run_filesystem
from vitscale.data.storage.mirror import RunMirror
from vitscale.data.storage.retry import RETRY_ENV, final_reason
from vitscale.data.storage.run_cache import run_cache_dir, run_cache_key
from vitscale.data.storage.space import is_no_space, no_space_line
from vitscale.launch.abandoned_downloads import remove_abandoned_downloads
from vitscale.launch.console import labelled_lines
from vitscale.launch.errors import PipelineFailed
from vitscale.launch.failures import (
    DeterministicFailure,
    StopOnDeterministicFailure,
    StopWithoutRoom,
    WorkersUnavailable,
    deterministic_cause,
)
from vitscale.launch.interruption import InterruptibleTrainer, keeping_handlers
from vitscale.launch.node_loss import RestartAtLiveSize
from vitscale.launch.poll import set_controller_poll
from vitscale.launch.snapshot import repair_snapshot
from vitscale.launch.stop_request import StopPoll, stop_requests
from vitscale.say import say
from vitscale.train import checkpoint as ckpt
from vitscale.train.job import TrainJob
from vitscale.train.termination import Terminated, TerminationNotice


class WorkerFailed(RuntimeError):
    """A training worker raised: carries the rank and the worker's own traceback."""

    deterministic: bool = False
    """A restart would fail the same way (launch/failures.py): set by the worker, read by the driver."""


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
            resume_from = _resume_directory(world_size, rank, downloaded, storage)
            _agree_on_resume(rank, resume_from)
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
        say(f"rank {rank} failed: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        failure = WorkerFailed(f"rank {rank}: {ckpt.one_line(exc, storage, world_size)}")
        failure.deterministic = deterministic_cause(exc) is not None  # survives pickling; the cause does not
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
    ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(str(checkpoint_dir)),
                     checkpoint_dir_name=name)
    if storage is not None:  # Ray's copy can lose a file without a word (filesystem.py): check, copy again
        copied = ensure_uploaded(checkpoint_dir, posixpath.join(storage, name))
        if copied:
            say(f"{name}: stored again what the first upload lost: {', '.join(copied)}")


def _resume_directory(world_size: int, rank: int, downloads: contextlib.ExitStack,
                      storage: str | None = None) -> Path | None:
    """The newest COMPLETE checkpoint of this run as a local directory, or None for a fresh start.

    The newer of the latest checkpoint Ray hands back and the newest in the run's storage (a worker
    that died right after its upload, a rank that left on SIGTERM, leaves a checkpoint Ray may never
    have registered; a re-submitted run must not start from scratch or step back past it). If the latest is
    incomplete (a rank died while uploading, a damaged manifest), older checkpoints are searched in
    the run's storage itself
    (a local folder, NFS or object storage: never a temporary download folder). A copy fetched
    from object storage stays until `downloads` is closed; incomplete ones are released at once.
    A checkpoint written by another world size is handed on as it is: the loop reshards it (an
    elastic run) or refuses it naming the change (`train/resume.py`), never falls back past it.

    When the storage shows every checkpoint incomplete (the first upload failed part-way), the run starts
    from step 1, saying which it ignores: its saves of those steps write them again. Storage that cannot be
    read (listed or downloaded) is never taken for a run without checkpoints: that raises a
    :class:`StorageError` naming the place, and the run does not start over.
    """
    known = [c for c in (ray.train.get_checkpoint(), newest_in_storage(storage)) if c is not None]
    if not known:
        return None
    latest = max(known, key=lambda c: posixpath.basename(c.path.rstrip("/")))  # checkpoint_{step:09d}
    if not isinstance(latest.filesystem, pyarrow.fs.LocalFileSystem):  # as_directory() downloads it, below
        removed = remove_abandoned_downloads()
        if removed:
            say(f"rank {rank}: removed {len(removed)} checkpoint download(s) that killed processes left in "
                f"{tempfile.gettempdir()}: {', '.join(removed)}")
    ignored: list[str] = []
    for candidate in _newest_first(latest):
        name = posixpath.basename(candidate.path.rstrip("/"))
        fetched = contextlib.ExitStack()
        try:
            directory = Path(fetched.enter_context(candidate.as_directory()))
        except FileNotFoundError:  # the storage says it is gone (deleted since Ray recorded it)
            fetched.close()
            ignored.append(f"{name} (not in storage)")
            continue
        except (OSError, ValueError) as exc:
            fetched.close()
            raise _unreadable(f"cannot read checkpoint {_url(candidate)}", exc) from exc
        info = ckpt.manifest_info(directory)
        # Complete as its writers left it (the loop reshards one of another world size, or refuses it).
        saved_world = info[1] if info is not None else world_size
        found = ckpt.check_complete(directory, saved_world, hash_ranks={0, rank if rank < saved_world else 0})
        if not found:
            downloads.callback(fetched.close)
            if candidate is not latest:
                say(f"latest checkpoint {posixpath.basename(latest.path)} is incomplete; "
                      f"resuming from {name}")
            return directory
        fetched.close()
        more = f"; {len(found) - 1} more problem(s)" if len(found) > 1 else ""
        ignored.append(f"{name} ({found[0].replace(f'{directory}/', '').replace(str(directory), name)}{more})")
    if rank == 0:
        say(f"no complete checkpoint to resume from: starting from step 1, ignoring {len(ignored)} incomplete: "
            + ", ".join(ignored))
    return None


def _agree_on_resume(rank: int, resume_from: Path | None) -> None:
    """Every rank resumes from rank 0's step, or the attempt fails in one line. Each rank checks the hashes of
    the files it reads (`_resume_directory`), so a rank whose own part of the newest checkpoint is damaged
    chooses an older one, or none, and would train from another step than its peers. A barrier."""
    info = ckpt.manifest_info(resume_from) if resume_from is not None else None
    step = info[0] if info is not None else 0
    chosen = broadcast_from_rank_zero(step)
    if step != chosen:
        raise RuntimeError(f"rank {rank} found no complete checkpoint at step {chosen}, from which rank 0 resumes "
                           f"(its own files of it are missing or damaged: see its lines above); it would resume "
                           f"from step {step}")


def _url(checkpoint: Any) -> str:
    """A checkpoint's address for messages: `s3://bucket/...` on object storage, else its path."""
    s3 = isinstance(checkpoint.filesystem, pyarrow.fs.S3FileSystem)
    return ("s3://" if s3 else "") + checkpoint.path


def _unreadable(what: str, exc: BaseException) -> StorageError:
    """`what` failed reading the run's storage: one line with the storage's error; final as that error is
    (data/storage/retry.py: a refusal, or one that outlasted the retry budget)."""
    why = final_reason(exc)
    return StorageError(f"{what}: {' '.join(str(exc).split())[:300] or type(exc).__name__}"
                        + (f" ({why})" if why else ""), final=why is not None)


def newest_in_storage(storage: str | None) -> Any:
    """The newest `checkpoint_*` folder in the run's storage as a `ray.train.Checkpoint`, or None (none there).
    A storage that cannot be listed raises a `StorageError`: it is not a run without checkpoints."""
    if storage is None:
        return None
    filesystem, path = run_filesystem(storage)
    if filesystem is None:
        filesystem, path = pyarrow.fs.LocalFileSystem(), storage
    try:
        infos = filesystem.get_file_info(pyarrow.fs.FileSelector(path, allow_not_found=True))
    except (OSError, ValueError) as exc:
        raise _unreadable(f"cannot list the checkpoints of {storage}", exc) from exc
    names = [posixpath.basename(i.path) for i in infos
             if i.type == pyarrow.fs.FileType.Directory and posixpath.basename(i.path).startswith("checkpoint_")]
    if not names:
        return None
    return ray.train.Checkpoint(posixpath.join(path, max(names)), filesystem=filesystem)


def _newest_first(latest: Any) -> Iterator[Any]:
    """`latest`, then the run's other `checkpoint_*` folders beside it in storage, newest first."""
    yield latest
    parent = posixpath.dirname(latest.path.rstrip("/"))
    try:
        infos = latest.filesystem.get_file_info(pyarrow.fs.FileSelector(parent))
    except (OSError, ValueError) as exc:
        raise _unreadable(f"cannot list the checkpoints beside {_url(latest)}", exc) from exc
    folders = (posixpath.basename(i.path) for i in infos if i.type == pyarrow.fs.FileType.Directory)
    names = sorted((name for name in folders if name.startswith("checkpoint_")),
                   reverse=True)  # checkpoint_{step:09d}: the name orders by step
    for name in names:
        path = posixpath.join(parent, name)
        if path.rstrip("/") != latest.path.rstrip("/"):
            yield ray.train.Checkpoint(path, filesystem=latest.filesystem)


@dataclass(frozen=True)
class RunPlace:
    """Where one Ray Train run of a pipeline run lives: in storage, and on whichever node asks.

    A pipeline run's Train runs all live inside it (`storage_path/run_name/<part>`: the pretraining at
    the run itself, `finetune`, `sweep/trials/<id>`, ...), never beside it. On object storage each node
    keeps its files in its own cache folder (`data/storage/run_cache.py`), found from `cache_key` on
    that node: the driver ships the key, not a path of its own disk.
    """

    storage: str
    """This Train run's canonical location: a shared folder or an `s3://` prefix."""
    cache_key: str | None
    """The pipeline run's node-local cache name; None when the storage is a folder every node reads."""
    part: str = ""
    """This Train run's path inside the pipeline run ("" for the run itself)."""

    @property
    def name(self) -> str:
        """The Train run's name (the last segment of its location: the run's name, `finetune`, a trial id)."""
        return posixpath.basename(self.storage)

    @property
    def label(self) -> str:
        """The pipeline run's name and this Train run's part inside it (`vit-b16`, `vit-b16/finetune`,
        `vit-b16/sweep/trials/<id>`): its metrics' `run` label, which `name` alone (`finetune`, `final`) would
        give every pipeline's fine-tuning alike."""
        depth = len(self.part.strip("/").split("/")) if self.part.strip("/") else 0
        return "/".join(self.storage.rstrip("/").split("/")[-1 - depth:])

    def local_dir(self) -> Path:
        """This node's folder for the run: the storage itself, or this node's cache of it (its root created)."""
        if self.cache_key is None:
            return Path(self.storage)
        return run_cache_dir(self.cache_key, self.part)

    def sub(self, part: str) -> RunPlace:
        """The Train run at `part` inside this one (a sweep's trials inside `sweep/trials`)."""
        inner = posixpath.join(self.part, part) if self.part else part
        return RunPlace(part_location(self.storage, part), self.cache_key, inner)

    def ray_storage(self) -> tuple[str, str]:
        """(`RunConfig.storage_path`, `RunConfig.name`): Ray Train stores the run at their join."""
        return posixpath.dirname(self.storage), self.name


def run_place(cluster: ClusterConfig, run_name: str, part: str = "") -> RunPlace:
    """Where the run `run_name` (or its `part`) lives: `cluster.run_storage(run_name)` is the one rule
    (config/location.py), and an object-storage run's node cache is keyed by that location and the
    endpoint in force, never by the name alone."""
    storage = cluster.run_storage(run_name)
    cache = run_cache_key(storage) if is_url(storage) else None
    place = RunPlace(storage, cache)
    return place.sub(part) if part else place


FINAL_METRICS = ("step", "epoch", "loss", "examples_seen", "cumulative_exaflops", "images_per_s", "mfu",
                 "skipped_samples", "world_size", "restarts", "relaunches", "restart_lost_s")
"""The final step's metrics a stage keeps (plus every `*_accuracy*` the job's evaluations report)."""


def concurrent_runs(cluster: ClusterConfig, resources: dict[str, float]) -> int:
    """Runs of `cluster`'s width the Ray cluster fits at once: the limiting resource over one run's workers."""
    fits = [int(resources.get("CPU", 0) // (cluster.cpus_per_worker * cluster.max_workers))]
    if cluster.use_gpu:
        fits.append(int(resources.get("GPU", 0) // (cluster.gpus_per_worker * cluster.max_workers)))
    return max(1, min(fits))


def trainer_for(job: TrainJob, cluster: ClusterConfig, place: RunPlace,
                callbacks: list[Any] | None = None, label: str | None = None,
                workers_key: str = "cluster.num_workers") -> InterruptibleTrainer:
    """The TorchTrainer that runs `job` as the Train run at `place` (resumes it if it has checkpoints).

    `label` (a sweep trial and its hyper-parameters) goes into every "[vitscale]" line its workers print.
    `workers_key` is the key that set `cluster.num_workers` (a sweep's `sweep.workers_per_trial`): the
    line of a run stopped for want of room (`cluster.worker_wait_s`) says to lower it.
    """
    parent, name = place.ray_storage()
    # Ray reads its record of the run's checkpoints when the trainer starts: a torn one (a disk that filled
    # while Ray wrote it) would keep the run from ever resuming (launch/snapshot.py).
    repaired = repair_snapshot(place.storage)
    if repaired:
        say(f"{repaired}")
    # Object storage: checkpoint uploads retry with backoff a bounded number of times (data/storage/filesystem.py).
    filesystem, storage = run_filesystem(parent)
    resources = {"CPU": cluster.cpus_per_worker}
    if cluster.use_gpu:
        resources["GPU"] = cluster.gpus_per_worker
    set_controller_poll(cluster.max_workers)  # reports and failures seen sooner in a small run (launch/poll.py)
    # Ctrl-C asks the workers to checkpoint and end, then ends in the CLI's line saying how to resume
    # (launch/interruption.py, launch/stop_request.py). Only a run fitted from the main thread gets the
    # signal (not a sweep's trials, nor its final retrains): only it needs the channel.
    requests = stop_requests() if threading.current_thread() is threading.main_thread() else None
    return InterruptibleTrainer(
        train_worker, stop=None if requests is None else (requests, place.storage, cluster.preemption_grace_s),
        # "launched": this command's start, the same in every attempt Ray Train restarts; a command run again
        # (a resume) has its own, so the wait before it is not counted as a restart's cost (train/restarts.py).
        train_loop_config={"job": job, "place": place, "launched": time.time(), "stop": requests,
                           "label": label, "elastic": cluster.elastic, "grace_s": cluster.preemption_grace_s},
        # An int, or (min, max): Train V2's elastic scaling (its type stubs are the V1 class's).
        scaling_config=ScalingConfig(num_workers=cluster.scaling(), use_gpu=cluster.use_gpu,  # type: ignore[arg-type,call-arg]
                                     resources_per_worker=resources,
                                     elastic_resize_monitor_interval_s=cluster.elastic_resize_s),
        run_config=RunConfig(
            name=name, storage_path=storage, storage_filesystem=filesystem,
            # A preemption (a node drained with a deadline: a spot reclaim, k8s/components/spot) restarts the
            # run from the checkpoint the loop writes on the notice, without counting as a failure.
            # (Train V2's FailureConfig; the type stubs Ray ships are the V1 class's.)
            failure_config=FailureConfig(max_failures=cluster.max_failures,  # type: ignore[call-arg]
                                         preemption_grace_s=cluster.preemption_grace_s),
            # Ranked by the loop's `checkpoint_score` (the step, lowered once a step was skipped as
            # non-finite): rotation keeps the last checkpoint before the first bad step; Ray keeps
            # the newest one whatever its score.
            checkpoint_config=CheckpointConfig(num_to_keep=job.train.keep_checkpoints,
                                               checkpoint_score_attribute="checkpoint_score",
                                               checkpoint_score_order="max"),
            # Train V2 options below (worker_runtime_env, callbacks); the type stubs Ray ships are the V1 class's.
            worker_runtime_env={"env_vars": _worker_env()},
            # Bad data or an exceeded error budget ends the run at once: a restart repeats it.
            # No room for MIN workers for cluster.worker_wait_s ends the run in one line (launch/worker_wait.py);
            # an elastic run's restart after a lost node starts at the live size (launch/node_loss.py).
            callbacks=[StopOnDeterministicFailure(), *_room_callbacks(cluster, resources, workers_key),  # type: ignore[list-item]
                       *(callbacks or [])],
        ),
    )


def _room_callbacks(cluster: ClusterConfig, resources: dict[str, float], workers_key: str) -> list[Any]:
    # An elastic run restarts after a lost node at the size the live nodes hold, not at a stale MAX whose
    # placement waits out Ray Train's start timeout (launch/node_loss.py).
    callbacks: list[Any] = [RestartAtLiveSize()] if cluster.elastic else []
    if cluster.worker_wait_s is None:  # wait forever, as Ray Train does
        return callbacks
    return [*callbacks, StopWithoutRoom(cluster.min_workers, resources, cluster.worker_wait_s,
                                        elastic=cluster.elastic, workers_key=workers_key)]


def final_metrics(result: Any) -> dict[str, Any]:
    """The metrics Ray kept with the latest checkpoint: the final step's, accuracies included."""
    last = dict(result.metrics or {})
    out = {key: last.get(key) for key in FINAL_METRICS}
    # The run's (all ranks, every epoch, the attempts before a restart), not rank 0's since its process began.
    out["skipped_samples"] = last.get("run_skipped_samples", out["skipped_samples"])
    out.update({k: v for k, v in last.items() if "_accuracy" in k})
    return out


def launch_training(job: TrainJob, cluster: ClusterConfig, place: RunPlace, what: str = "training",
                    workers_key: str = "cluster.num_workers", label: str | None = None) -> tuple[Any, dict[str, Any]]:
    """Run `job` on Ray Train at `place`; returns (the final `ray.train.Checkpoint`, the final metrics).
    `label` tags the workers' console lines (`[final pretrained]`) as a sweep's trials are tagged."""
    place.local_dir().mkdir(parents=True, exist_ok=True)
    try:
        result = trainer_for(job, cluster, place, workers_key=workers_key, label=label).fit()
    except Exception as exc:  # re-raised with the workers' own errors up front
        ended = "stopped" if isinstance(getattr(exc, "controller_failure", None), WorkersUnavailable) else "failed"
        cause = _root_cause(exc, place.storage, cluster.max_workers)
        raise PipelineFailed(f"{what} {ended}: {cause}") from exc
    # `checkpoint` is a ray.train.Checkpoint: later stages read it wherever it lives (disk, NFS, S3).
    return result.checkpoint, final_metrics(result)


def _worker_env() -> dict[str, str]:
    # Workers inherit the driver's choice of accelerator and thread counts; DeepSpeed must not
    # probe for CUDA on CPU-only nodes.
    # Ray Train's print patch would echo every worker print a second time through its logger.
    env = {"RAY_TRAIN_ENABLE_PRINT_PATCH": "0"}
    # The retry budget too: a worker gives up on a broken store when the driver would.
    for key in ("DS_ACCELERATOR", "OMP_NUM_THREADS", "VITSCALE_S3_ENDPOINT_URL", "AWS_ENDPOINT_URL", RETRY_ENV):
        if key in os.environ:
            env[key] = os.environ[key]
    return env


def _root_cause(exc: BaseException, storage: str | None = None, parts: int = 1) -> str:
    """One line per failed rank ("rank 1: ValueError: ...") rather than Ray's wrapper exceptions; a full
    disk met by Ray Train itself (its record of the checkpoints, its storage check) as one line naming the
    run's storage and the space needed, not pyarrow's "Error writing bytes to file" naming nothing."""
    stopped = getattr(exc, "controller_failure", None)
    if isinstance(stopped, (DeterministicFailure, WorkersUnavailable)):
        return str(stopped)
    ray_own = stopped if stopped is not None else exc
    if not getattr(exc, "worker_failures", None) and is_no_space(ray_own):
        detail = f"Ray Train could not write into the run: {' '.join(str(ray_own).split())[:200]}"
        where = getattr(ray_own, "filename", None) or storage or "the run's storage"
        needed = ckpt.next_checkpoint_bytes(storage, parts) if storage else None
        return "DiskFull: " + no_space_line(where, detail, needed=needed)
    failures = getattr(exc, "worker_failures", None) or {}
    lines = []
    for rank, failure in sorted(failures.items()):
        cause: BaseException | None = failure
        while cause is not None and not isinstance(cause, WorkerFailed):
            cause = cause.__cause__
        if cause is not None:
            lines.append(str(cause))
        else:
            text = [line for line in str(failure).splitlines() if line.strip()]
            lines.append(f"rank {rank}: {text[-1] if text else type(failure).__name__}")
    return "; ".join(lines) if lines else f"{type(exc).__name__}: {exc}"


def ensure_ray(address: str | None, local_num_cpus: int | None) -> str:
    """Connect to a Ray cluster (address, $RAY_ADDRESS) or start a local one; returns a description.

    A local Ray's head processes lead process groups of their own and are tied to this process
    (`launch/local_ray.py`): a signal to this driver's group does not reach them, and when this driver dies,
    even by SIGKILL, they die too.
    """
    if ray.is_initialized():
        return "already connected"
    address = ray_address(address)
    if address:
        check_reachable(address)
        try:
            # The run's object-storage endpoint reaches every worker and trial this driver starts.
            env = endpoint_env()
            with keeping_handlers():  # not Ray's SIGTERM handler, a stack dump and an abort (launch/interruption.py)
                context = ray.init(address=address, log_to_driver=True, runtime_env={"env_vars": env} if env else None)
        except ConnectionError as exc:  # "auto" with no cluster on this machine, a GCS that refuses us
            raise ConfigError("cluster.address",
                              f"cannot join a Ray cluster at {address}: {exc}{_token_hint()}") from None
        return f"joined Ray cluster at {address}{_dashboard(context)}"
    from vitscale.launch.local_ray import start_local_ray

    # The dashboard also serves the state API that Ray Train's controller polls (and the Train view).
    with keeping_handlers():
        context = start_local_ray(local_num_cpus)
    return f"started a local Ray with {ray.cluster_resources().get('CPU', 0):.0f} CPUs{_dashboard(context)}"


def _token_hint() -> str:
    """Why a cluster that answers may still refuse us: it has token authentication on (`ray start` turns
    it on when it finds a token: RAY_AUTH_TOKEN, or ~/.ray/auth_token), and a client sends its token only
    with RAY_AUTH_MODE=token, even from the head's own machine; Ray then says only "Failed to connect"."""
    if os.environ.get("RAY_AUTH_MODE", "").lower() == "token":
        return "; check the cluster's token (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token)"
    return ("; a cluster with token authentication needs RAY_AUTH_MODE=token and its token (RAY_AUTH_TOKEN, "
            "or ~/.ray/auth_token) in this environment")


def check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """A wrong address is one line within seconds: `ray.init` would retry the GCS for minutes.

    `host:port` (the GCS) and `ray://host:port` (Ray Client) are checked with one TCP connect;
    "auto" (the cluster `ray start` left on this machine) is Ray's to find, and it fails fast.
    """
    if address == "auto":
        return
    target = address.split("://", 1)[-1].rstrip("/")
    host, colon, port = target.rpartition(":")
    if not colon or not port.isdigit() or not host:
        raise ConfigError("cluster.address", f"{address!r} is not HOST:PORT, ray://HOST:PORT or auto")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise ConfigError("cluster.address", f"no Ray cluster answers at {address} ({reason}); check --address, "
                          "$RAY_ADDRESS or cluster.address") from None


def _dashboard(context: Any) -> str:
    url = getattr(context, "dashboard_url", None)
    return f"; dashboard http://{url}" if url else ""
