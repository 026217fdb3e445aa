"""A killed driver leaves no Ray process of its own behind: `vitscale run` is SIGKILLed (the driver
alone, not its process group) while its local Ray trains, and every process its tree held is gone
shortly after (launch/local_ray.py). Without the watchdog, Ray's dashboard and runtime-env agents
outlive the driver."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import psutil
import pytest

from helpers.pipelines import tiny_pipeline
from helpers.ray_runs import kill_tree, start

pytestmark = pytest.mark.slow


def test_a_sigkilled_driver_leaves_no_ray_process(tmp_path: Path, small_synthetic: str) -> None:
    pipeline = tiny_pipeline(tmp_path, "orphans", small_synthetic,
                             {"max_steps": 100000, "zero_stage": 0, "checkpoint_every": 100000, "log_every": 1})
    log = tmp_path / "run.log"
    proc = start(pipeline, log)
    metrics = tmp_path / "runs" / "orphans" / "metrics" / "rank0.jsonl"
    try:
        deadline = time.monotonic() + 600
        while not (metrics.exists() and metrics.read_text().count("\n") >= 2):  # Ray up, a worker training
            assert proc.poll() is None, log.read_text()[-4000:]
            assert time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.5)
        tree = psutil.Process(proc.pid).children(recursive=True)
        names = {p.name() for p in tree if p.is_running()}
        assert any("raylet" in n for n in names) and any("RayTrainWorker" in n for n in names), names
        # Nothing drains a local Ray's one node: Ray Train's per-run preemption watcher is left out
        # (local_ray.LOCAL_ENV); it is up before the first step when it runs.
        assert not any("PreemptionWatcher" in n for n in names), names
        os.kill(proc.pid, signal.SIGKILL)  # the driver only: what it started must follow on its own
        proc.wait()
        _, alive = psutil.wait_procs(tree, timeout=30)
        left = [f"{p.pid} {p.name()}" for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert left == [], left
    finally:
        if proc.poll() is None:
            kill_tree(proc)


def test_the_processes_ray_starts_for_its_head_lead_process_groups_of_their_own() -> None:
    """A signal to the driver's whole group (`timeout`, `kill -- -PGID`) must not reach Ray's GCS and raylet: the
    driver needs them to have its workers take the run's last checkpoint (tests/test_interruption.py)."""
    from ray._private import services

    from vitscale.launch.local_ray import own_process_groups

    with own_process_groups():
        inside = services.ConsolePopen(["sleep", "30"])
    outside = services.ConsolePopen(["sleep", "30"])  # Ray's own class again once ray.init is done
    try:
        assert os.getpgid(inside.pid) == inside.pid != os.getpgrp()
        assert os.getpgid(outside.pid) == os.getpgrp()
    finally:
        for proc in (inside, outside):
            proc.kill()
            proc.wait()


def test_a_ray_release_without_the_class_starts_its_head_as_before(monkeypatch: pytest.MonkeyPatch) -> None:
    from ray._private import services

    from vitscale.launch.local_ray import own_process_groups

    monkeypatch.delattr(services, "ConsolePopen")
    with own_process_groups():
        pass
    assert not hasattr(services, "ConsolePopen")  # nothing put in its place
