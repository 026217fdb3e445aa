"""A local Ray that dies with the driver that started it, even when the driver is SIGKILLed.

`ray.init()` starts the head's processes (GCS, raylet, dashboard, log monitor) as the driver's
children, and the raylet starts workers and the dashboard and runtime-env agents. A driver that
exits normally stops them in `ray.shutdown()`; a driver that is killed cannot, and some of them
(the agents, the dashboard's module processes) outlive it. So before starting Ray the driver starts
a watchdog: a small process holding the read end of a pipe whose write end only the driver holds.
The watchdog keeps a list of every process started in the driver's tree since it began (re-read
twice a second), and when the pipe closes (the driver is gone, however it died) it terminates
them, then kills what is left. Processes are matched on (pid, start time), never on a pid alone,
so a reused pid is never hit.

Ray's head processes also lead process groups of their own (`own_process_groups`). Started in the driver's,
a signal to the driver's whole group (a closed terminal's SIGHUP, `timeout`'s SIGTERM, `kill -- -PGID`)
ended the GCS and the raylet with the driver: the driver could not ask its workers for a last checkpoint,
waited 60 s for a GCS that was gone and ended with Ray's "Failed to connect to GCS" line. Ray itself
shields them from only one such signal, the terminal's SIGINT (it starts them with SIGINT blocked).
"""

from __future__ import annotations

import contextlib
import os
import select
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import psutil

_WATCHDOG: subprocess.Popen[bytes] | None = None
SCAN_S = 0.5
"""How often the watchdog re-reads the driver's process tree."""
GRACE_S = 3.0
"""Between SIGTERM and SIGKILL for what the driver left behind."""
LOCAL_ENV = {"RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0"}
"""Settings every process of a local Ray inherits (the raylet starts as this driver's child, with its
environment), unless the user set them. Ray Train's preemption watcher is an actor per Train run (per
sweep trial) that polls for nodes an autoscaler drains; on a cluster it is what turns a spot node's drain
into the workers' checkpoint-now notice (`ray_train._preemption_notice`, docs/elastic.md), and it stays
on there. A local Ray's one node is this machine, which nothing drains: there the watcher would only cost
a process and two CPU-seconds at every start."""


def start_local_ray(num_cpus: int | None) -> Any:
    """`ray.init` a local Ray on this machine, watched so that it cannot outlive this process, its head's
    processes out of this process's group (module doc).

    A Ray of its own (`address="local"`), even where `ray start` left a cluster on this machine: `ray.init()`
    would join that one, with neither this driver's environment (the run's storage endpoint) nor its Python,
    refuse `cluster.local_num_cpus` with a traceback, and the driver would say it had started a local Ray.
    That cluster is `--address auto` (`launch/ray_train.py` `ensure_ray`)."""
    import ray

    start_watchdog()
    for key, value in LOCAL_ENV.items():
        os.environ.setdefault(key, value)
    with own_process_groups():
        return ray.init(address="local", num_cpus=num_cpus, log_to_driver=True)


@contextlib.contextmanager
def own_process_groups() -> Iterator[None]:
    """Within: each process Ray's services start (`ray._private.services.ConsolePopen`: the GCS, the raylet
    and, through it, the agents; the dashboard, the monitors) leads a process group of its own, so a signal
    to this process's group does not reach it. Ray's workers already do (the raylet starts them so).

    Ray has no public setting for it: this reaches into `ray._private`, the one place vitscale does, guarded.
    Should a Ray release move the class, Ray's head starts in this group again, as before, and nothing fails."""
    try:
        from ray._private import services

        started_by_ray = services.ConsolePopen
    except (ImportError, AttributeError):
        started_by_ray = None
    if started_by_ray is None:  # (outside the except: an error of the body is not chained to the ImportError)
        yield
        return

    class OwnGroup(started_by_ray):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs.setdefault("process_group", 0)
            super().__init__(*args, **kwargs)

    setattr(services, "ConsolePopen", OwnGroup)  # noqa: B010 (mypy refuses assigning to a class name)
    try:
        yield
    finally:
        setattr(services, "ConsolePopen", started_by_ray)  # noqa: B010


def start_watchdog() -> None:
    """Start (once per process) the watchdog of this process's tree; idempotent."""
    global _WATCHDOG
    if _WATCHDOG is not None and _WATCHDOG.poll() is None:
        return
    read_end, write_end = os.pipe()
    # The watchdog gets the read end as its stdin; the driver keeps the write end, never written to,
    # and not inherited by anything else it starts (os.pipe's ends are non-inheritable): when the
    # driver dies, the kernel closes it and the watchdog reads EOF.
    _WATCHDOG = subprocess.Popen([sys.executable, "-m", "vitscale.launch.local_ray", str(os.getpid()),
                                  str(time.time())],
                                 stdin=read_end, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                 start_new_session=True)  # a Ctrl-C in the terminal is the driver's to handle
    os.close(read_end)
    _KEEP.append(write_end)


_KEEP: list[int] = []
"""The pipe's write ends, open for this process's lifetime."""


def _tree(root: int, since: float, exclude: int) -> dict[tuple[int, float], psutil.Process]:
    """Processes under `root` started at or after `since` (Unix time), keyed by (pid, start time)."""
    with contextlib.suppress(psutil.Error):
        found = {}
        for proc in psutil.Process(root).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if proc.pid != exclude and proc.create_time() >= since - 1.0:
                    found[(proc.pid, proc.create_time())] = proc
        return found
    return {}


def end_processes(known: dict[tuple[int, float], psutil.Process], grace_s: float = GRACE_S) -> None:
    """SIGTERM the processes still running (and their children), then SIGKILL what is left after `grace_s`."""
    alive: list[psutil.Process] = []
    for (_pid, started), proc in known.items():
        with contextlib.suppress(psutil.Error):
            if proc.is_running() and proc.create_time() == started:
                alive.append(proc)
                alive.extend(proc.children(recursive=True))
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            proc.terminate()
    _, left = psutil.wait_procs(alive, timeout=grace_s)
    for proc in left:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(left, timeout=grace_s)


def watch(driver: int, since: float) -> None:
    """The watchdog's loop: remember the driver's tree until stdin closes, then end what it left."""
    known: dict[tuple[int, float], psutil.Process] = {}
    me = os.getpid()
    while True:
        known.update(_tree(driver, since, me))
        ready, _, _ = select.select([sys.stdin.fileno()], [], [], SCAN_S)
        if ready and not os.read(sys.stdin.fileno(), 1):  # EOF: the driver is gone
            break
    # Children a survivor started since the last scan are found through it (end_processes).
    end_processes(known)


if __name__ == "__main__":
    watch(int(sys.argv[1]), float(sys.argv[2]))
