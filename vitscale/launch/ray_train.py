"""Ray Train wiring: a TorchTrainer whose workers run `vitscale.train.loop.train` on a `TrainJob`.

Ray stays at this edge. This is the driver's side: where a run lives (`RunPlace`), the trainer for a job,
its launch, and the one line a failure ends in. Each worker runs `train_worker.py`'s function, which
resumes from `resume_point.py`'s checkpoint. Fault tolerance is Ray Train V2's: `FailureConfig(max_failures)`
restarts the worker group after a crash and `ray.train.get_checkpoint()` returns the latest reported checkpoint;
a re-submitted job with the same (storage_path, name) resumes the same way.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from typing import Any

import ray
import ray.train
from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig

from vitscale.config.checks import ConfigError
from vitscale.config.pipeline import ClusterConfig, ray_address
from vitscale.data.storage.endpoint import endpoint_env
from vitscale.data.storage.filesystem import run_filesystem
from vitscale.data.storage.retry import RETRY_ENV
from vitscale.data.storage.space import is_no_space, no_space_line
from vitscale.launch.errors import PipelineFailed
from vitscale.launch.failures import (
    DeterministicFailure,
    StopOnDeterministicFailure,
    StopWithoutRoom,
    WorkersUnavailable,
    alike,
    ranks_named,
    worker_traceback,
)
from vitscale.launch.interruption import InterruptibleTrainer, keeping_handlers
from vitscale.launch.node_loss import RestartAtLiveSize
from vitscale.launch.poll import set_controller_poll
from vitscale.launch.run_place import RunPlace
from vitscale.launch.snapshot import repair_snapshot
from vitscale.launch.stop_request import stop_requests
from vitscale.launch.train_worker import WorkerFailed, train_worker
from vitscale.say import line, say
from vitscale.train import checkpoint as ckpt
from vitscale.train.job import TrainJob

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
        log_tracebacks(exc, what)
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


def log_tracebacks(exc: BaseException, what: str) -> None:
    """Where each failed rank's error was raised, as Ray Train handed it over, into the run's log (ranks that
    failed alike under one traceback, `failures.alike`); `exc` is what a Train run's `fit` raised.

    A rank prints its own traceback as it fails, and Ray forwards it to the driver's log from a thread of its
    own, which the driver's exit can outrun: the run's last line names the cause, but no log held where it was
    raised. What Ray Train returns to the driver does not depend on that race: the workers' errors of a run
    that spent its restarts, or those `StopOnDeterministicFailure` kept in the error that stopped it. A failure
    to write them is one line, never in place of the run's own error."""
    from vitscale.launch.console import to_log

    try:
        stopped = getattr(exc, "controller_failure", None)
        told = list(getattr(stopped, "tracebacks", None) or [])
        failures = getattr(exc, "worker_failures", None) or {}
        told += alike({rank: worker_traceback(failure) for rank, failure in failures.items()})
        for ranks, text in told:
            to_log(line(f"{what}: the traceback of {ranks_named(ranks)}, as Ray Train returned it to the "
                        f"driver:\n{text}"))
    except Exception as unlogged:  # noqa: BLE001 -- the run's own error, not this log's, is the one to tell
        say(f"{what}: the failed ranks' tracebacks could not be written to the run's log: {unlogged!r}")


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
