"""Running `vitscale run` as a user would, in its own process group, and killing it from outside."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

VITSCALE = str(Path(sys.executable).parent / "vitscale")
RUN_TIMEOUT_S = 1200  # one `vitscale run`; Ray Train's start-up dominates on a busy 2-core machine


def start(pipeline: Path, log: Path, ignoring: tuple[int, ...] = ()) -> subprocess.Popen:
    """`vitscale run PIPELINE` in its own session (process group), its output in `log`; started with the
    signals in `ignoring` ignored, as `nohup` starts a command with SIGHUP ignored."""
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)  # a local Ray of its own, which dies with the driver

    def ignore() -> None:
        for signum in ignoring:
            signal.signal(signum, signal.SIG_IGN)

    with log.open("w") as out:
        return subprocess.Popen([VITSCALE, "run", str(pipeline)], stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True, preexec_fn=ignore if ignoring else None)


def kill_tree(proc: subprocess.Popen) -> list[Any]:
    """SIGKILL the driver's process group and every process it started (Ray's GCS, raylet, workers).

    Returns the processes still alive 30 s later (none, when the kill worked).
    """
    tree = _tree(proc)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    for process in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    proc.wait()
    _, alive = psutil.wait_procs(tree, timeout=30)
    return [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def _tree(proc: subprocess.Popen) -> list[Any]:
    """The driver and every process it started (Ray's GCS, raylet, workers), as psutil sees them now."""
    try:
        root = psutil.Process(proc.pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def pause(proc: subprocess.Popen, paused: bool) -> None:
    """SIGSTOP (or SIGCONT) a `vitscale run` and every process it started: it holds still meanwhile."""
    for process in _tree(proc):
        with contextlib.suppress(psutil.NoSuchProcess):
            process.send_signal(signal.SIGSTOP if paused else signal.SIGCONT)


def signalled_when(proc: subprocess.Popen, log: Path, ready: Callable[[], bool], signum: int,
                   within_s: float = 600.0) -> tuple[int, float]:
    """Once `ready()` holds (polled while `proc` runs), send `proc` `signum`; (its exit code, the seconds from the
    signal to its end). An assertion with the log's tail where it ended first or never got ready within `within_s`;
    its tree is killed if it has not ended by then."""
    try:
        deadline = time.monotonic() + within_s
        while not ready():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.05)
        asked = time.monotonic()
        proc.send_signal(signum)
        code = proc.wait(timeout=within_s)
        return code, time.monotonic() - asked
    finally:
        if proc.poll() is None:
            kill_tree(proc)


def finished(pipeline: Path, log: Path) -> tuple[int, str]:
    """Run the pipeline until it ends (killed with its tree after RUN_TIMEOUT_S); (exit code, terminal output)."""
    proc = start(pipeline, log)
    try:
        proc.wait(timeout=RUN_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            kill_tree(proc)
    return proc.returncode, log.read_text()


def run(pipeline: Path, log: Path) -> str:
    """Run the pipeline to the end; returns its terminal output."""
    code, output = finished(pipeline, log)
    assert code == 0, output[-6000:]
    return output
