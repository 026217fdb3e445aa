"""Ctrl-C (and SIGTERM, SIGHUP) of a real `vitscale run` while its workers train: the workers checkpoint at their
next step and stop (at once on a second signal), the terminal's last line says where the run is kept and
the command that resumes it, the exit status is 130, no Ray process of the run is left, and that command
resumes from the last complete checkpoint: the stop's own, so no step is done twice
(launch/interruption.py, launch/stop_request.py).

Ray Train's own SIGINT handler aborted the run and ended the driver with status 1 and nothing said;
runs driven from a thread pool (a sweep's final retrains) held a Ctrl-C up until they finished."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import psutil
import pytest

from helpers.loop_runs import steps
from helpers.pipelines import tiny_pipeline
from helpers.ray_runs import kill_tree, signalled_when, start
from vitscale.launch.interruption import side_by_side


def test_side_by_side_keeps_order_and_width_and_raises_the_first_error_in_order() -> None:
    running, most = 0, 0
    lock = threading.Lock()

    def call(i: int) -> int:
        nonlocal running, most
        with lock:
            running += 1
            most = max(most, running)
        time.sleep(0.05 * (5 - i))  # later calls end first
        with lock:
            running -= 1
        if i in (3, 1):
            raise ValueError(f"call {i}")
        return i * i

    assert side_by_side([lambda i=i: i * i for i in range(5)], 2) == [0, 1, 4, 9, 16]
    with pytest.raises(ValueError, match="call 1"):
        side_by_side([lambda i=i: call(i) for i in range(5)], 2)
    assert most == 2


def test_ctrl_c_is_not_held_up_by_calls_still_running() -> None:
    release = threading.Event()

    def interrupted_while_running() -> bool:
        # Sent once a call runs, so the main thread is inside side_by_side (a timer could fire elsewhere).
        os.kill(os.getpid(), signal.SIGINT)
        return release.wait(60)

    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        side_by_side([interrupted_while_running, lambda: release.wait(60)], 2)
    assert time.monotonic() - started < 10
    release.set()


def _stop(pipeline: Path, log: Path, signum: int, checkpoint: Path, again: bool = False,
          group: bool = False) -> tuple[int, str, list[str]]:
    """Start `vitscale run PIPELINE`, send `signum` to the driver once `checkpoint` exists (`again`: a second
    time once the driver says it is stopping; `group`: to the driver's whole process group, as a closed terminal,
    `timeout` or `kill -- -PGID` send it); (exit code, terminal output, processes of its tree still running 30 s
    after it ended)."""
    proc = start(pipeline, log)  # in a session of its own: its process group's id is its pid

    def send() -> None:
        if group:
            os.killpg(proc.pid, signum)
        else:
            proc.send_signal(signum)

    try:
        deadline = time.monotonic() + 600
        while not checkpoint.is_dir():  # Ray up, a worker training, a checkpoint kept
            assert proc.poll() is None, log.read_text()[-4000:]
            assert time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.2)
        tree = psutil.Process(proc.pid).children(recursive=True)
        send()
        while again and "stopping: the workers checkpoint" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.05)
        if again:
            send()
        ended = proc.wait(timeout=120)
        _, alive = psutil.wait_procs(tree, timeout=30)
        left = [f"{p.pid} {p.name()}" for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    finally:
        if proc.poll() is None:
            kill_tree(proc)
    return ended, log.read_text(), left


@pytest.mark.slow
def test_ctrl_c_or_sigterm_stops_the_workers_says_how_to_resume_and_the_command_resumes(tmp_path: Path,
                                                                                       small_synthetic: str) -> None:
    """Ctrl-C, then SIGTERM to the resumed run's whole process group (`timeout`, `kill -- -PGID`), then the run
    to its end through a SIGHUP it was started ignoring (`nohup`).
    Without the CLI's handler put back after `ray.init`, Ray's own printed a stack dump on SIGTERM and
    aborted the driver (no line, the lease left held). With Ray's head in the driver's process group, the
    group's SIGTERM ended the GCS and the raylet too: no last checkpoint, and after 60 s Ray's "Failed to
    connect to GCS" as the last line, exit status 1."""
    # A step takes 7-50 ms (7 on a fast hour: 140 steps a second) and the workers see a stop up to 2 s after it
    # is asked (rank 0 reads the request once a second): 60 steps with a checkpoint every 4, and later 300 with
    # one every 20 (2026-11-29, twice in a dozen runs), were sometimes all done before the second stop landed.
    steps_total, every = 800, 20
    pipeline = tiny_pipeline(tmp_path, "ctrlc", small_synthetic,
                             {"max_steps": steps_total, "zero_stage": 1, "checkpoint_every": every, "log_every": 1})
    run_dir = tmp_path / "runs" / "ctrlc"
    stopped = [0]
    plan = [(signal.SIGINT, 130, "", False), (signal.SIGTERM, 143, " by SIGTERM", True)]
    for attempt, (signum, code, by, again) in enumerate(plan):
        # The first run stops after its first checkpoint, the resumed one after a checkpoint it wrote itself.
        newer = run_dir / f"checkpoint_{stopped[-1] // every * every + every:09d}"
        ended, output, left = _stop(pipeline, tmp_path / f"stopped{attempt}.log", signum, newer, again,
                                    group=signum == signal.SIGTERM)
        assert ended == code, output[-4000:]
        assert output.rstrip("\n").splitlines()[-1] == (
            f"vitscale: interrupted{by}; the run is kept at {run_dir}: resume it from its last complete checkpoint "
            f"with `vitscale run {pipeline}`"), output[-4000:]
        assert "Traceback" not in output and "SIGTERM received" not in output, output[-4000:]
        assert left == [], left
        stopped.append(max(row["step"] for row in steps(run_dir, 0)))
        assert stopped[-1] < steps_total, "the run was not interrupted: make it longer"
        if not again:  # the workers checkpointed the last step they made: nothing to do twice
            assert f"step {stopped[-1]}: the run was asked to stop (SIGINT to the driver): checkpointing now" \
                in output, output[-4000:]
            assert (run_dir / f"checkpoint_{stopped[-1]:09d}").is_dir()
        if attempt:  # the resumed run went on from the first stop's own checkpoint
            resumed = [line for line in output.splitlines() if "resumed from" in line]
            at = int(resumed[0].split(" at step ")[1].split()[0])
            assert len(resumed) == 1 and at == stopped[1], (resumed, stopped)

    # The command the line gave, started as `nohup` starts it: the SIGHUP of a closed terminal is ignored.
    log = tmp_path / "resumed.log"
    proc = start(pipeline, log, ignoring=(signal.SIGHUP,))
    newer = run_dir / f"checkpoint_{stopped[-1] // every * every + every:09d}"
    code, _ = signalled_when(proc, log, newer.is_dir, signal.SIGHUP)
    assert code == 0, log.read_text()[-4000:]
    output = log.read_text()
    summary = json.loads(output.strip().splitlines()[-1])
    assert summary["ok"] and summary["pretrain"]["step"] == steps_total and summary["pretrain"]["restarts"] == 2
    # Both were resumes by running the command again: each command's lines carry its own start, so the
    # seconds lost count from it, not from the last step before the stop.
    assert summary["pretrain"]["relaunches"] == 2, summary["pretrain"]
    launches = [row["launch"] for row in steps(run_dir, 0)]
    assert len(set(launches)) == 3 and launches == sorted(launches), sorted(set(launches))
    resumed = [line for line in output.splitlines() if "resumed from" in line]
    at = int(resumed[0].split(" at step ")[1].split()[0])
    # SIGTERM twice: aborted at once, from a periodic checkpoint (or the stop's own, had the workers been quick).
    assert len(resumed) == 1 and stopped[1] < at <= stopped[2] and (at % every == 0 or at == stopped[2]), (resumed, stopped)


@pytest.mark.slow
def test_ctrl_c_before_the_first_step_stops_at_once(tmp_path: Path, small_synthetic: str) -> None:
    """No worker has made a step (Ray Train still starting them): nothing to checkpoint, so the driver does not
    wait out the stop's grace for one (120 s), it aborts at once and says how to resume."""
    pipeline = tiny_pipeline(tmp_path, "early", small_synthetic, {"max_steps": 60, "zero_stage": 1},
                             cluster={"preemption_grace_s": 120})
    log = tmp_path / "early.log"
    proc = start(pipeline, log)
    code, took = signalled_when(proc, log, lambda: "stage pretrain" in log.read_text(), signal.SIGINT, within_s=300)
    output = log.read_text()
    assert code == 130, output[-4000:]
    assert took < 60 and output.rstrip("\n").splitlines()[-1].startswith("vitscale: interrupted; the run is kept at"), \
        (took, output[-4000:])
    assert steps(tmp_path / "runs" / "early", 0) == [], "a step was made: the test no longer tests an early stop"


def test_ctrl_c_while_the_run_waits_for_its_dataset_says_nothing_was_written(tmp_path: Path) -> None:
    """Stopped before the run began (its dataset is being written by another process, and the run waits for it):
    the last line says nothing of the run was written and the command that starts it, not where a run that does
    not exist is kept; no run folder, no Ray."""
    from helpers.leases import holder, kill

    data = tmp_path / "data"
    source = {"kind": "synthetic", "count": 40, "classes": 2, "image_size": 16, "shard_size": 20}
    pipeline = tiny_pipeline(tmp_path, "waits", {"url": str(data), "num_workers": 0, "create_if_missing": source},
                             {"max_steps": 2})
    log = tmp_path / "waits.log"
    writer = holder(str(data))
    try:
        proc = start(pipeline, log)
        code, _ = signalled_when(proc, log, lambda: "waiting for it to finish" in log.read_text(), signal.SIGINT,
                                 within_s=120)
    finally:
        kill(writer)
    output = log.read_text()
    assert code == 130, output[-4000:]
    run = tmp_path / "runs" / "waits"
    assert output.rstrip("\n").splitlines()[-1] == (
        f"vitscale: interrupted; before the run began (it was checking its settings and datasets), nothing written "
        f"to {run}: `vitscale run {pipeline}` starts it"), output[-4000:]
    assert "Traceback" not in output and "started a local Ray" not in output, output[-4000:]
    assert not run.exists()
