"""`ray job submit ... -- vitscale run PIPELINE` against a real `ray start --head` cluster on loopback."""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from helpers.pipelines import tiny_pipeline

pytestmark = pytest.mark.slow
RAY = shutil.which("ray", path=str(Path(sys.executable).parent)) or shutil.which("ray")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def head_node():
    """A one-node Ray cluster started the way an operator would, stopped afterwards; its tests share it (each
    job its own folders)."""
    if RAY is None:
        pytest.skip("the ray CLI is not installed")
    temp = tempfile.mkdtemp(prefix="rayjob-")  # short: Ray's unix sockets live under it
    # Ports of its own, not Ray's fixed defaults (10001 for Ray Client, 52365 for the job agent), so
    # another Ray on the machine (a parallel test's) cannot take them first.
    gcs, dashboard, client, agent = _free_port(), _free_port(), _free_port(), _free_port()
    # Token authentication, as every vitscale deployment runs Ray (Ray >= 2.52): the head, the job's
    # driver and `ray job submit` all read the same token, here from a file of this test's own.
    token = Path(temp) / "auth_token"
    token.write_text(secrets.token_hex(32))
    # RAY_JOB_STOP_WAIT_TIME_S as k8s/base/raycluster.yaml sets it: `ray job stop` lets the driver's stop finish.
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "token",
           "RAY_AUTH_TOKEN_PATH": str(token), "RAY_JOB_STOP_WAIT_TIME_S": "150"}
    env.pop("RAY_ADDRESS", None)
    # In a session of its own, so that stopping it stops this cluster only (`ray stop` would stop
    # every Ray on the machine, a parallel test's too).
    start = subprocess.Popen([RAY, "start", "--head", f"--port={gcs}", "--node-ip-address=127.0.0.1",
                              f"--dashboard-port={dashboard}", "--dashboard-host=127.0.0.1", "--num-cpus=2",
                              f"--ray-client-server-port={client}", f"--dashboard-agent-listen-port={agent}",
                              f"--temp-dir={temp}", "--disable-usage-stats"],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        output, _ = start.communicate(timeout=180)
        assert start.returncode == 0, output.decode(errors="replace")[-4000:]
        yield f"http://127.0.0.1:{dashboard}", env
    finally:
        start.kill()
        _kill_session(start.pid)
        shutil.rmtree(temp, ignore_errors=True)


def _kill_session(session: int) -> None:
    """SIGKILL every process of `session` (the head's GCS, raylet, dashboard, workers, job drivers)."""
    members = []
    for process in psutil.process_iter():
        with contextlib.suppress(psutil.Error, OSError):
            if os.getsid(process.pid) == session:
                members.append(process)
                process.kill()
    psutil.wait_procs(members, timeout=30)


def _pipeline(tmp_path: Path, name: str, workers: int, **train: int) -> Path:
    """A one-block ViT on 64 synthetic images the run writes itself, as a job's driver on the head runs it."""
    data = {"url": str(tmp_path / "data"), "num_workers": 0,
            "create_if_missing": {"kind": "synthetic", "count": 64, "classes": 4, "image_size": 32, "shard_size": 20}}
    model = {"name": "ViT-Ti/8", "img_size": 16, "depth": 1, "width": 32, "mlp_dim": 32, "heads": 2}
    return tiny_pipeline(tmp_path, name, data, {"global_batch": 16, "warmup_steps": 1, **train},
                         cluster={"num_workers": workers}, model=model)


def test_job_submit_runs_the_pipeline_on_the_cluster(head_node: tuple[str, dict], tmp_path: Path) -> None:
    address, env = head_node
    path = _pipeline(tmp_path, "submitted", workers=2, micro_batch=8, max_steps=3, zero_stage=2, checkpoint_every=3)
    vitscale = str(Path(sys.executable).parent / "vitscale")
    for _ in range(12):
        done = subprocess.run([RAY, "job", "submit", "--address", address, "--", vitscale, "run", str(path)],
                              env=env, capture_output=True, text=True, timeout=900)
        output = done.stdout + done.stderr
        # A head that has just started may not have its job agent up yet (seen on a loaded machine);
        # that submission was refused before any job started, so submitting again is safe.
        if "No available agent to submit job" not in output:
            break
        time.sleep(5)
    assert done.returncode == 0, output[-4000:]
    assert "joined Ray cluster" in output  # the job's driver used the cluster, it did not start its own Ray
    summary = json.loads(next(line for line in reversed(output.splitlines()) if line.startswith('{"pipeline"')))
    assert summary["ok"] and summary["pretrain"]["step"] == 3
    assert (tmp_path / "runs" / "submitted" / "checkpoint_000000003").is_dir()
    # The console shows vitscale's own lines and its summary table; Ray's per-report dumps and
    # DeepSpeed's tables go to the run's log file instead.
    assert "[vitscale] stage pretrain" in output and "final loss" in output
    assert "TrainingReport(" not in output and "DeepSpeed" not in output
    log = (tmp_path / "runs" / "submitted" / "logs" / "ray.log").read_text()
    assert "TrainingReport(" in log or "DeepSpeed" in log


def test_job_api_refuses_a_submission_without_the_token(head_node: tuple[str, dict], tmp_path: Path) -> None:
    """The ShadowRay hole closed: no token (or a wrong one), no job; the right token, the job runs."""
    import urllib.error
    import urllib.request

    address, env = head_node
    home = tmp_path / "home"  # no ~/.ray/auth_token to fall back on
    home.mkdir()
    no_token = {k: v for k, v in env.items() if not k.startswith("RAY_AUTH")} | {"HOME": str(home)}
    wrong = no_token | {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    for label, client_env in (("no token", no_token), ("wrong token", wrong)):
        for _ in range(12):
            done = subprocess.run([RAY, "job", "submit", "--address", address, "--", "echo", "submitted-ok"],
                                  env=client_env, capture_output=True, text=True, timeout=300)
            if "No available agent to submit job" not in done.stdout + done.stderr:
                break
            time.sleep(5)
        assert done.returncode != 0 and "submitted-ok" not in done.stdout, (label, done.stdout[-2000:], done.stderr[-2000:])
    # The raw job API as a scanner would call it: refused as unauthenticated.
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(f"{address}/api/jobs/", timeout=30)
    assert refused.value.code in (401, 403)
    for _ in range(12):
        done = subprocess.run([RAY, "job", "submit", "--address", address, "--", "echo", "submitted-ok"],
                              env=env, capture_output=True, text=True, timeout=300)
        if "No available agent to submit job" not in done.stdout + done.stderr:
            break
        time.sleep(5)
    assert done.returncode == 0 and "submitted-ok" in done.stdout, done.stdout[-2000:] + done.stderr[-2000:]


def _job(address: str, env: dict, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    for _ in range(12):
        # The address before the rest: after `--` it would be the entrypoint's own argument.
        done = subprocess.run([RAY, "job", args[0], "--address", address, *args[1:]], env=env, capture_output=True,
                              text=True, timeout=timeout)
        # A head that has just started may not have its job agent up yet; nothing was submitted then.
        if "No available agent to submit job" not in done.stdout + done.stderr:
            return done
        time.sleep(5)
    return done


def _said(done: subprocess.CompletedProcess) -> str:
    return done.stdout + done.stderr


def test_job_stop_checkpoints_the_next_step_and_the_job_submitted_again_resumes_there(
        head_node: tuple[str, dict], tmp_path: Path) -> None:
    """`ray job stop` (SIGTERM to the driver, then SIGKILL RAY_JOB_STOP_WAIT_TIME_S later: 150 s, as the
    manifests set it on the head) has the workers checkpoint at their next step; the driver ends in its
    line, and the same job submitted again resumes at that step (launch/stop_request.py)."""
    address, env = head_node
    path = _pipeline(tmp_path, "stopped", workers=1, micro_batch=16, max_steps=100_000, zero_stage=1,
                     checkpoint_every=100_000, log_every=1)
    vitscale = str(Path(sys.executable).parent / "vitscale")
    run = tmp_path / "runs" / "stopped"

    def submit_then_stop(after: str) -> tuple[str, str]:
        """Submit the pipeline, `ray job stop` it once its logs say `after`; (its final logs, its status)."""
        submitted = _job(address, env, "submit", "--no-wait", "--", vitscale, "run", str(path))
        assert submitted.returncode == 0, submitted.stdout[-2000:] + submitted.stderr[-2000:]
        job = re.findall(r"raysubmit_[A-Za-z0-9]+", submitted.stdout)[0]  # coloured output: not split on spaces
        deadline = time.monotonic() + 600
        while after not in (logs := _job(address, env, "logs", job).stdout):
            assert time.monotonic() < deadline and "vitscale: error" not in logs, logs[-4000:]
            time.sleep(1)
        assert _job(address, env, "stop", job).returncode == 0
        # `ray job status` says it in a warning ("Job '...' was stopped"), or "... succeeded", "... failed".
        while not any(end in (status := _said(_job(address, env, "status", job)).lower())
                      for end in ("stopped", "succeeded", "failed")):
            assert time.monotonic() < deadline, status
            time.sleep(1)
        return _job(address, env, "logs", job).stdout, status

    logs, status = submit_then_stop(" step 5/100000 ")
    assert "was stopped" in status, status
    checkpoints = sorted(p.name for p in run.glob("checkpoint_*") if p.is_dir())
    assert len(checkpoints) == 1, (checkpoints, logs[-4000:])
    at = int(checkpoints[0].split("_")[1])
    assert at >= 5 and f"step {at}: the run was asked to stop (SIGTERM to the driver)" in logs, logs[-4000:]
    assert logs.rstrip().splitlines()[-1].startswith("vitscale: interrupted by SIGTERM; the run is kept at"), logs[-4000:]

    # Submitted again: resumed at the stop's own step, the next one trained first.
    logs, status = submit_then_stop(f" step {at + 1}/100000 ")
    assert f"resumed from {run / checkpoints[0]} at step {at} " in logs and f" step {at}/100000 " not in logs, \
        logs[-4000:]
