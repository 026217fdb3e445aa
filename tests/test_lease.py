"""One writer per run: the run's lease on a local folder (flock) and on S3 (moto's server on loopback).

Holders are real processes (a `python -c` that takes the lease and sleeps), killed with SIGKILL
where a test needs a crashed driver.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import socket
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

import boto3
import pytest
import yaml

from helpers.leases import holder as _holder
from helpers.leases import kill as _kill
from vitscale.cli import main
from vitscale.data.storage import RetryPolicy
from vitscale.data.storage.lease import LEASE_NAME, Holder, LeaseHeld, hold_run_lease

FAST = RetryPolicy(max_attempts=3, base_delay_s=0.001, max_delay_s=0.01)


def test_local_second_writer_is_refused_naming_the_holder_and_a_killed_holder_frees_it(tmp_path: Path) -> None:
    run = tmp_path / "runs" / "r1"
    proc = _holder(str(run))
    try:
        with pytest.raises(LeaseHeld) as err:
            hold_run_lease(str(run))
        message = str(err.value)
        assert "\n" not in message
        assert f"pid {proc.pid} on host {socket.gethostname()} since " in message and str(run) in message
        # --force cannot break a kernel lock held by a live process.
        with pytest.raises(LeaseHeld, match="--force cannot take it"):
            hold_run_lease(str(run), force=True)
    finally:
        _kill(proc)
    # The kernel dropped the SIGKILLed holder's lock: the next writer takes the run at once.
    with hold_run_lease(str(run)) as lease:
        assert Holder.decode((run / LEASE_NAME).read_bytes()) == lease.holder
        with pytest.raises(LeaseHeld, match=f"pid {os.getpid()} "):
            hold_run_lease(str(run))  # a second lease in the same process is refused too
    assert not (run / LEASE_NAME).exists()  # released: removed, the folder is as the run left it
    hold_run_lease(str(run)).release()


def _places_passed(monkeypatch: pytest.MonkeyPatch, module: Any, name: str, position: int) -> list[str]:
    """The place each call of the real `module.name` is given (its positional argument `position`), in order."""
    real, places = getattr(module, name), []

    def counted(*args: Any, **kwargs: Any) -> Any:
        places.append(args[position])
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return places


def _pipeline(tmp_path: Path, dataset: str) -> Path:
    raw = {"name": "lease", "stages": ["pretrain"], "data": {"url": dataset},
           "model": {"name": "ViT-Ti/8", "img_size": 16, "depth": 1, "width": 32, "heads": 2, "mlp_dim": 32},
           "train": {"global_batch": 8, "micro_batch": 4, "max_steps": 1, "warmup_steps": 0},
           "cluster": {"num_workers": 1, "use_gpu": False, "cpus_per_worker": 1,
                       "storage_path": str(tmp_path / "runs"), "run_name": "shared"}}
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_vitscale_run_on_a_held_run_refuses_in_one_line_before_ray(tmp_path: Path, small_synthetic: str,
                                                                    capsys: pytest.CaptureFixture) -> None:
    import ray

    pipeline = _pipeline(tmp_path, small_synthetic)
    proc = _holder(str(tmp_path / "runs" / "shared"))
    try:
        code = main(["run", str(pipeline)])
    finally:
        _kill(proc)
    out, err = capsys.readouterr()
    assert code == 2 and "Traceback" not in out + err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("vitscale: error: run ") and f"pid {proc.pid}" in lines[0], err
    assert not ray.is_initialized()
    assert not (tmp_path / "runs" / "shared" / "config.yaml").exists()  # nothing of the run was written


# ---------------------------------------------------------------------------------------------- S3


@pytest.fixture
def s3_run(moto_s3: str) -> str:
    bucket = f"lease-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=moto_s3).create_bucket(Bucket=bucket)
    return f"s3://{bucket}/runs/r1"


def _lease_object(url: str, endpoint: str) -> dict:
    bucket, _, prefix = url[len("s3://"):].partition("/")
    body = boto3.client("s3", endpoint_url=endpoint).get_object(Bucket=bucket, Key=f"{prefix}/{LEASE_NAME}")["Body"]
    return json.loads(body.read())


def _write_lease(url: str, endpoint: str, holder: Holder) -> None:
    bucket, _, prefix = url[len("s3://"):].partition("/")
    boto3.client("s3", endpoint_url=endpoint).put_object(Bucket=bucket, Key=f"{prefix}/{LEASE_NAME}",
                                                         Body=holder.encode())


def _as_if_elsewhere(url: str, endpoint: str) -> Holder:
    """The lease's holder as a driver on another machine (another boot, another pid namespace) would have
    written it: whether its pid is alive cannot be seen from here. Rewriting it renews it (Last-Modified)."""
    holder = Holder.decode(json.dumps(_lease_object(url, endpoint)).encode())
    assert holder is not None
    elsewhere = dataclasses.replace(holder, machine="another-boot/pid:[4026531836]")
    _write_lease(url, endpoint, elsewhere)
    return elsewhere


def test_s3_second_writer_is_refused_and_release_frees_it(s3_run: str, moto_s3: str) -> None:
    with hold_run_lease(s3_run, endpoint_url=moto_s3, ttl_s=30) as lease:
        assert _lease_object(s3_run, moto_s3)["token"] == lease.holder.token
        with pytest.raises(LeaseHeld) as err:
            hold_run_lease(s3_run, endpoint_url=moto_s3)
        assert f"pid {os.getpid()} on host {socket.gethostname()} since " in str(err.value)
        assert re.search(r"renewed [01] s ago", str(err.value)) and "\n" not in str(err.value)  # whole seconds
        # A live holder on this machine is never forced out.
        with pytest.raises(LeaseHeld, match="alive on this machine"):
            hold_run_lease(s3_run, endpoint_url=moto_s3, force=True)
    with hold_run_lease(s3_run, endpoint_url=moto_s3) as again:  # released: free at once
        assert _lease_object(s3_run, moto_s3)["token"] == again.holder.token


def test_s3_heartbeat_renews_and_a_sigkilled_holder_expires(s3_run: str, moto_s3: str) -> None:
    proc = _holder(s3_run, ttl_s=3.0, endpoint=moto_s3)
    try:
        time.sleep(2.5)  # past a heartbeat (every ttl/3): renewed, so not expired
        with pytest.raises(LeaseHeld, match=f"pid {proc.pid} "):
            hold_run_lease(s3_run, endpoint_url=moto_s3)
    finally:
        _kill(proc)  # a crashed driver: no release, no more heartbeats
    _as_if_elsewhere(s3_run, moto_s3)  # its death cannot be seen from here: only the expiry frees the lease
    with pytest.raises(LeaseHeld, match=f"pid {proc.pid} "):
        hold_run_lease(s3_run, endpoint_url=moto_s3)  # not expired yet
    time.sleep(4.5)  # > ttl since its last renewal (Last-Modified has whole seconds)
    logged: list[str] = []
    with hold_run_lease(s3_run, endpoint_url=moto_s3, log=logged.append) as lease:
        assert _lease_object(s3_run, moto_s3)["token"] == lease.holder.token
    assert len(logged) == 1 and f"from pid {proc.pid}" in logged[0] and "not renewed for" in logged[0]


def test_s3_force_takes_over_a_dead_holders_lease_before_it_expires(s3_run: str, moto_s3: str) -> None:
    proc = _holder(s3_run, ttl_s=600.0, endpoint=moto_s3)
    _kill(proc)
    _as_if_elsewhere(s3_run, moto_s3)  # a holder on this machine that died is taken over without --force
    with pytest.raises(LeaseHeld, match="--force"):
        hold_run_lease(s3_run, endpoint_url=moto_s3)
    logged: list[str] = []
    with hold_run_lease(s3_run, endpoint_url=moto_s3, force=True, log=logged.append) as lease:
        assert _lease_object(s3_run, moto_s3)["token"] == lease.holder.token
    assert "(forced)" in logged[0] and f"pid {proc.pid}" in logged[0]


def test_s3_a_holder_that_died_on_this_machine_is_taken_over_at_once(s3_run: str, moto_s3: str) -> None:
    """No wait for the expiry and no --force: the lease names this machine, and its pid is gone."""
    proc = _holder(s3_run, ttl_s=600.0, endpoint=moto_s3)
    _kill(proc)
    logged: list[str] = []
    started = time.monotonic()
    with hold_run_lease(s3_run, endpoint_url=moto_s3, log=logged.append) as lease:
        assert _lease_object(s3_run, moto_s3)["token"] == lease.holder.token
    assert time.monotonic() - started < 30  # far inside the 600 s ttl
    assert len(logged) == 1 and f"from pid {proc.pid} on host {socket.gethostname()}" in logged[0]
    assert "its process is gone from this machine" in logged[0]


def test_s3_a_reused_pid_is_not_the_holder_and_a_live_one_is(s3_run: str, moto_s3: str) -> None:
    """A live process with the holder's pid but another start time is a later process: the holder is gone.
    With the holder's own start time it is the holder, alive: refused, --force included."""
    me = Holder.me(600.0)
    assert me.machine is not None and me.started is not None  # this test needs Linux's /proc
    _write_lease(s3_run, moto_s3, dataclasses.replace(me, token="live", started=me.started))
    for force in (False, True):
        with pytest.raises(LeaseHeld, match=f"pid {os.getpid()} "):
            hold_run_lease(s3_run, endpoint_url=moto_s3, force=force)
    _write_lease(s3_run, moto_s3, dataclasses.replace(me, token="reused", started=me.started - 1))
    logged: list[str] = []
    with hold_run_lease(s3_run, endpoint_url=moto_s3, log=logged.append):
        pass
    assert len(logged) == 1 and "its process is gone from this machine" in logged[0]


def test_s3_an_older_lease_without_machine_or_start_waits_for_its_expiry(s3_run: str, moto_s3: str) -> None:
    """A lease that names only a host proves nothing about a dead pid (containers share host names)."""
    proc = _holder(s3_run, ttl_s=600.0, endpoint=moto_s3)
    _kill(proc)
    old = json.loads(json.dumps(_lease_object(s3_run, moto_s3)))
    del old["machine"], old["started"]
    bucket, _, prefix = s3_run[len("s3://"):].partition("/")
    boto3.client("s3", endpoint_url=moto_s3).put_object(Bucket=bucket, Key=f"{prefix}/{LEASE_NAME}",
                                                         Body=json.dumps(old).encode())
    with pytest.raises(LeaseHeld, match="--force"):
        hold_run_lease(s3_run, endpoint_url=moto_s3)
    hold_run_lease(s3_run, endpoint_url=moto_s3, force=True, log=lambda line: None).release()  # dead: forceable


def test_s3_a_holder_whose_lease_is_taken_over_is_told(s3_run: str, moto_s3: str) -> None:
    lost: list[str] = []
    lease = hold_run_lease(s3_run, endpoint_url=moto_s3, ttl_s=1.5, on_lost=lost.append)
    try:
        # Another writer takes the lease over behind its back (as an expiry takeover would).
        bucket, _, prefix = s3_run[len("s3://"):].partition("/")
        other = Holder("elsewhere", 4242, time.time(), "other-token", 1.5)
        boto3.client("s3", endpoint_url=moto_s3).put_object(Bucket=bucket, Key=f"{prefix}/{LEASE_NAME}",
                                                             Body=other.encode())
        deadline = time.time() + 5
        while not lost and time.time() < deadline:
            time.sleep(0.1)
    finally:
        lease.release()
    assert len(lost) == 1 and "lost the lease" in lost[0] and "pid 4242 on host elsewhere" in lost[0]
    assert _lease_object(s3_run, moto_s3)["token"] == "other-token"  # the new holder's lease is left alone


def test_holder_decode_never_raises() -> None:
    for junk in (b"", b"{", b"[]", b'{"host": 1}', b"\xff\xfe", b"[" * 5000):
        assert Holder.decode(junk) is None


@pytest.mark.slow
def test_two_vitscale_runs_on_one_run_name_the_second_refuses_and_a_killed_first_frees_it(
        tmp_path: Path, small_synthetic: str) -> None:
    """Two real `vitscale run` processes: the second is refused in one line naming the first, which is
    then SIGKILLed with its whole Ray; the run is free again at once."""
    from helpers.ray_runs import VITSCALE, kill_tree, start

    pipeline = _pipeline(tmp_path, small_synthetic)
    raw = yaml.safe_load(pipeline.read_text())
    raw["train"]["max_steps"] = 10_000  # still running when the second one comes
    pipeline.write_text(yaml.safe_dump(raw))
    lease_file = tmp_path / "runs" / "shared" / LEASE_NAME
    first = start(pipeline, tmp_path / "first.log")
    try:
        deadline = time.time() + 300
        while time.time() < deadline and first.poll() is None:
            holder = Holder.decode(lease_file.read_bytes()) if lease_file.exists() else None
            if holder is not None and holder.pid == first.pid:
                break
            time.sleep(0.5)
        else:
            raise AssertionError(f"the first run never took the lease: {(tmp_path / 'first.log').read_text()[-3000:]}")
        env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
        env.pop("RAY_ADDRESS", None)
        second = subprocess.run([VITSCALE, "run", str(pipeline)], check=False, capture_output=True, text=True, env=env,
                                timeout=300)
        assert second.returncode == 2, second.stdout + second.stderr
        lines = second.stderr.strip().splitlines()
        assert len(lines) == 1 and f"pid {first.pid} on host {socket.gethostname()}" in lines[0], second.stderr
        assert "Traceback" not in second.stdout + second.stderr
        assert first.poll() is None  # the first run goes on untouched
    finally:
        assert kill_tree(first) == []
    hold_run_lease(str(tmp_path / "runs" / "shared")).release()  # the SIGKILLed driver's lock is gone


# ------------------------------------------------------------------- a run inside another live run


def test_a_run_inside_a_live_runs_folder_is_refused_naming_it_and_creates_nothing(tmp_path: Path) -> None:
    outer = tmp_path / "runs" / "tiny"
    proc = _holder(str(outer))
    try:
        for inner in (outer / "finetune", outer / "a" / "b"):
            with pytest.raises(LeaseHeld) as err:
                hold_run_lease(str(inner))
            message = str(err.value)
            assert "\n" not in message and message.startswith(f"run {inner} lies inside {outer}, which is being "
                                                               f"written by pid {proc.pid} "), message
            with pytest.raises(LeaseHeld, match="lies inside"):
                hold_run_lease(str(inner), kind="dataset")  # a dataset written there too
        assert sorted(os.listdir(outer)) == [LEASE_NAME]  # nothing created inside the live run
        hold_run_lease(str(tmp_path / "runs" / "tiny-2")).release()  # beside it: fine
    finally:
        _kill(proc)
    # The outer run ended (its lock went with its process; its lease file is left behind): a run inside
    # a finished run's folder is allowed.
    assert (outer / LEASE_NAME).exists()
    hold_run_lease(str(outer / "finetune")).release()


def test_a_part_of_a_run_inside_it_is_not_refused_by_that_runs_own_lease(tmp_path: Path) -> None:
    """A study's cells run inside the study's run, whose driver holds its lease (scaling/study/runner.py)."""
    study = tmp_path / "runs" / "study"
    cell = study / "study" / "cells" / "c1"
    with hold_run_lease(str(study)):
        hold_run_lease(str(cell), part_of=str(study)).release()
        with pytest.raises(LeaseHeld, match=f"lies inside {study},"):
            hold_run_lease(str(cell))  # without saying so: refused like any other
    # Another live writer between the study's run and the cell: still refused.
    with hold_run_lease(str(study)), hold_run_lease(str(study / "study"), part_of=str(study)), \
            pytest.raises(LeaseHeld, match=f"lies inside {study / 'study'}, .* pid {os.getpid()} "):
        hold_run_lease(str(cell), part_of=str(study))


def test_probing_a_lease_never_refuses_its_own_writer(tmp_path: Path) -> None:
    """A nested writer's probe holds the outer lease's lock for an instant; the outer writer taking its
    lease at that moment waits the instant out instead of being refused."""
    import fcntl
    import threading

    run = tmp_path / "run"
    run.mkdir()
    (run / LEASE_NAME).write_text("")
    fd = os.open(run / LEASE_NAME, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_SH)
    threading.Timer(0.05, lambda: (fcntl.flock(fd, fcntl.LOCK_UN), os.close(fd))).start()
    hold_run_lease(str(run)).release()


def test_s3_a_run_inside_a_live_runs_prefix_is_refused_and_a_dead_ones_is_not(s3_run: str, moto_s3: str) -> None:
    proc = _holder(s3_run, ttl_s=600.0, endpoint=moto_s3)
    bucket = s3_run[len("s3://"):].partition("/")[0]
    try:
        with pytest.raises(LeaseHeld) as err:
            hold_run_lease(f"{s3_run}/finetune", endpoint_url=moto_s3, retry=FAST)
        assert str(err.value).startswith(f"run {s3_run}/finetune lies inside {s3_run}, which is being written by "
                                         f"pid {proc.pid} "), err.value
        keys = [o["Key"] for o in boto3.client("s3", endpoint_url=moto_s3).list_objects_v2(Bucket=bucket)["Contents"]]
        assert keys == [f"runs/r1/{LEASE_NAME}"]  # no lease taken inside it
    finally:
        _kill(proc)
    # Its holder died on this machine: its lease is no live run's, though not expired yet.
    hold_run_lease(f"{s3_run}/finetune", endpoint_url=moto_s3, retry=FAST).release()


def test_vitscale_run_inside_a_live_run_is_one_line_before_ray(tmp_path: Path, small_synthetic: str,
                                                               capsys: pytest.CaptureFixture) -> None:
    import ray

    pipeline = _pipeline(tmp_path, small_synthetic)
    outer = tmp_path / "runs" / "tiny"
    proc = _holder(str(outer))
    try:
        code = main(["run", str(pipeline), "--set", f"cluster.storage_path={outer}", "--set",
                     "cluster.run_name=finetune"])
    finally:
        _kill(proc)
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in out + err, err
    assert lines[0].startswith(f"vitscale: error: run {outer / 'finetune'} lies inside {outer}, which is being "
                               f"written by pid {proc.pid} "), lines[0]
    assert not ray.is_initialized() and not (outer / "finetune").exists()


def test_a_run_around_a_live_run_is_refused_naming_it_and_leaves_no_lease(tmp_path: Path, s3_run: str,
                                                                         moto_s3: str) -> None:
    inner = tmp_path / "runs" / "tiny" / "finetune"
    proc = _holder(str(inner))
    try:
        with pytest.raises(LeaseHeld) as err:
            hold_run_lease(str(tmp_path / "runs" / "tiny"))
        assert str(err.value).startswith(f"run {tmp_path / 'runs' / 'tiny'} holds {inner}, which is being written "
                                         f"by pid {proc.pid} "), err.value
        assert not (tmp_path / "runs" / "tiny" / LEASE_NAME).exists()  # its own lease given back
    finally:
        _kill(proc)
    hold_run_lease(str(tmp_path / "runs" / "tiny")).release()  # the inner run ended: fine

    proc = _holder(f"{s3_run}/finetune", ttl_s=600.0, endpoint=moto_s3)
    try:
        with pytest.raises(LeaseHeld, match=f"^run {s3_run} holds {s3_run}/finetune, .* pid {proc.pid} "):
            hold_run_lease(s3_run, endpoint_url=moto_s3, retry=FAST)
        bucket, _, prefix = s3_run[len("s3://"):].partition("/")
        keys = [o["Key"] for o in boto3.client("s3", endpoint_url=moto_s3).list_objects_v2(Bucket=bucket)["Contents"]]
        assert keys == [f"{prefix}/finetune/{LEASE_NAME}"]  # its own lease given back
    finally:
        _kill(proc)


def test_a_run_whose_dataset_another_process_is_writing_waits_for_it(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Two runs of a pipeline with `create_if_missing`, started together: the second was refused ("is being
    written by pid ...") and its run ended. It now waits for the writer, and writes the dataset itself when that
    writer ends without one (here: killed)."""
    import threading

    from vitscale.data.config import SourceConfig
    from vitscale.data.format import has_dataset
    from vitscale.stages import datasets

    url = str(tmp_path / "data")
    said: list[str] = []
    waiting = threading.Event()

    def record(text: str) -> None:
        said.append(text)
        if "waiting for it to finish" in text:
            waiting.set()

    monkeypatch.setattr(datasets, "say", record)
    monkeypatch.setattr(datasets, "BUSY_POLL_S", 0.05)
    from vitscale.data.storage import lease as leases
    from vitscale.data.tools import write

    attempts = _places_passed(monkeypatch, write, "write_dataset", 1)  # (source, url, ...)
    polls = _places_passed(monkeypatch, leases, "hold_run_lease", 0)  # (url, ...)
    proc = _holder(url)
    got: list[object] = []
    source = SourceConfig(kind="synthetic", count=40, classes=2, image_size=16, shard_size=20)
    worker = threading.Thread(target=lambda: got.append(datasets.ensure_dataset(url, source, None, "data.url")))
    try:
        worker.start()
        deadline = time.monotonic() + 120  # against a hang, not a measure
        while not waiting.wait(timeout=0.1) and worker.is_alive() and time.monotonic() < deadline:
            pass
        assert waiting.is_set(), said  # (a refusal ends the thread at once: no wait)
        assert worker.is_alive() and not has_dataset(url), said  # waiting, not refused, and nothing written
        assert f"{url} is being written by pid {proc.pid} on host {socket.gethostname()}" in said[-1], said
        while len(polls) < 3 and len(attempts) < 3 and time.monotonic() < deadline:  # a few rounds of waiting
            time.sleep(0.01)
    finally:
        _kill(proc)
    worker.join(timeout=300)
    assert not worker.is_alive() and got, said
    meta: Any = got[0]
    assert has_dataset(url) and meta.samples("train") == 40 and meta.num_classes == 2
    assert attempts == [url, url], attempts  # refused once, then written: the source is not opened each poll
