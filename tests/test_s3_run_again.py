"""A run stored in object storage (moto on loopback), run again as a user does: after it ended, after its
storage was emptied, after its first checkpoint's upload was refused part-way.

- Ray Train puts the folder marker `runs/<name>/` when it starts a run: the next `vitscale run` at the
  same place must not crash on a file named '' (data/storage/s3.py, mirror.py).
- A run deleted from its storage leaves nothing on the node for the next run at the same place: its
  metrics lines and TensorBoard events are not pushed again (mirror.py, `pull`).
- A refused checkpoint upload stops the run on its first attempt in one line (launch/failures.py); the
  torn checkpoint it leaves is ignored by the next run, which starts from step 1 and saves that step
  again, complete (launch/resume_point.py, `resume_directory`; launch/train_worker.py, `clear_stale`).
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import boto3
import pytest
import yaml

from helpers.s3_faults import FaultProxy
from vitscale.train import checkpoint as ckpt

pytestmark = pytest.mark.slow


def _pipeline(tmp_path: Path, data: str, bucket: str, steps: int, max_failures: int = 0) -> Path:
    raw = {"name": "again", "stages": ["pretrain"], "data": {"url": data},
           "model": {"name": "ViT-Ti/8", "img_size": 16, "depth": 1, "width": 32, "heads": 2, "mlp_dim": 32},
           "train": {"global_batch": 8, "micro_batch": 8, "max_steps": steps, "warmup_steps": 0,
                     "checkpoint_every": 2},
           "cluster": {"num_workers": 1, "use_gpu": False, "cpus_per_worker": 1, "max_failures": max_failures,
                       "storage_path": f"s3://{bucket}/runs", "run_name": "exp"}}
    path = tmp_path / f"pipeline-{steps}-{max_failures}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _keys(s3, bucket: str) -> list[str]:  # type: ignore[no-untyped-def]
    return sorted(o["Key"] for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket)
                  for o in page.get("Contents", []))


def _steps(s3, bucket: str) -> list[int]:  # type: ignore[no-untyped-def]
    body = s3.get_object(Bucket=bucket, Key="runs/exp/metrics/rank0.jsonl")["Body"].read().decode()
    return [json.loads(line)["step"] for line in body.splitlines() if line.strip()]


def _saves(proxy: FaultProxy, step: int) -> int:
    """How many times a worker began to save the checkpoint of `step` through `proxy`: each save first lists
    that checkpoint's folder once, for a torn earlier save's files (`clear_stale`, one listing per call). A
    restart, which starts over from step 1, saves it again."""
    prefix = f"prefix=runs%2Fexp%2Fcheckpoint_{step:09d}%2F"
    return sum(method == "GET" and prefix in path for method, path, _ in proxy.log)


def _complete(s3, bucket: str, step: int, into: Path) -> list[str]:  # type: ignore[no-untyped-def]
    prefix = f"runs/exp/checkpoint_{step:09d}/"
    for key in _keys(s3, bucket):
        if key.startswith(prefix) and not key.endswith("/"):
            target = into / key[len(prefix):]
            target.parent.mkdir(parents=True, exist_ok=True)
            s3.download_file(bucket, key, str(target))
    return ckpt.check_complete(into, 1)


def test_run_again_then_after_the_storage_was_emptied(tmp_path: Path, moto_s3: str, small_synthetic: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from helpers.ray_runs import run

    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_s3)
    monkeypatch.setenv("VITSCALE_RUNS_LOCAL", str(tmp_path / "node"))
    bucket = f"again-{uuid.uuid4().hex[:10]}"
    s3 = boto3.client("s3", endpoint_url=moto_s3)
    s3.create_bucket(Bucket=bucket)
    run(_pipeline(tmp_path, small_synthetic, bucket, 4), tmp_path / "first.log")
    assert _steps(s3, bucket) == [1, 2, 3, 4]
    for key in _keys(s3, bucket):  # the run is deleted from its storage, all but Ray Train's folder marker
        s3.delete_object(Bucket=bucket, Key=key)
    s3.put_object(Bucket=bucket, Key="runs/exp/", Body=b"")  # (put here, whatever Ray does itself)
    again = run(_pipeline(tmp_path, small_synthetic, bucket, 2), tmp_path / "again.log")
    assert '"ok": true' in again and "Traceback" not in again  # the marker is not a file to pull
    assert _steps(s3, bucket) == [1, 2]  # not the deleted run's lines before them
    events = [k for k in _keys(s3, bucket) if k.startswith("runs/exp/tensorboard/")]
    assert len(events) == 1, events  # the new run's events only


def test_a_refused_checkpoint_upload_stops_at_once_and_the_next_run_starts_over(
        tmp_path: Path, moto_s3: str, small_synthetic: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from helpers.ray_runs import finished, run

    monkeypatch.setenv("VITSCALE_RUNS_LOCAL", str(tmp_path / "node"))
    bucket = f"torn-{uuid.uuid4().hex[:10]}"
    s3 = boto3.client("s3", endpoint_url=moto_s3)
    s3.create_bucket(Bucket=bucket)
    with FaultProxy(moto_s3, methods=("PUT", "POST")) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        proxy.schedule("403", path="checkpoint_000000002/rank0.pt")  # the rest of the checkpoint arrives
        started = time.monotonic()
        code, output = finished(_pipeline(tmp_path, small_synthetic, bucket, 4, max_failures=3), tmp_path / "refused.log")
        took = time.monotonic() - started
        assert code != 0 and proxy.pending == 0, output[-4000:]
        last = output.strip().splitlines()[-1]
        assert "CheckpointNotWritten: the checkpoint of step 2 was not written to " in last, last
        assert "(not retried: a restart would fail the same way)" in last and "ACCESS_DENIED" in last, last
        # One attempt, not max_failures + 1. The terminal shows at most that attempt's worker line: Ray forwards
        # it, and a driver that ends first can outrun it (CI, 2026-11-30), so the attempts are counted at the store.
        assert _saves(proxy, 2) == 1, proxy.log
        assert output.count("rank 0 failed: ") <= 1, output[-4000:]
        keys = _keys(s3, bucket)
        assert "runs/exp/checkpoint_000000002/MANIFEST-rank0.json" in keys or any(
            k.startswith("runs/exp/checkpoint_000000002/") for k in keys), keys
        assert "runs/exp/checkpoint_000000002/rank0.pt" not in keys

        output = run(_pipeline(tmp_path, small_synthetic, bucket, 4, max_failures=3), tmp_path / "over.log")
    assert "no complete checkpoint to resume from: starting from step 1, ignoring 1 incomplete: " \
           "checkpoint_000000002 (" in output, output[-4000:]
    for step in (2, 4):
        assert _complete(s3, bucket, step, tmp_path / f"ckpt{step}") == [], step
    print(f"refused run ended after {took:.0f} s")


def test_throttling_that_outlasts_the_retry_budget_stops_the_run_once(
        tmp_path: Path, moto_s3: str, small_synthetic: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A store that stays throttled: the upload gives up within the budget, and Ray does not restart the run
    to wait it out again (max_failures 3 would have been 4 budgets); the line says the tries and the budget."""
    from helpers.ray_runs import finished

    monkeypatch.setenv("VITSCALE_RUNS_LOCAL", str(tmp_path / "node"))
    monkeypatch.setenv("VITSCALE_S3_RETRY_S", "5")  # 3 tries per request
    bucket = f"slow-{uuid.uuid4().hex[:10]}"
    boto3.client("s3", endpoint_url=moto_s3).create_bucket(Bucket=bucket)
    with FaultProxy(moto_s3, methods=("PUT", "POST")) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        proxy.schedule(*["503"] * 500, path="checkpoint_000000002/")
        code, output = finished(_pipeline(tmp_path, small_synthetic, bucket, 4, max_failures=3), tmp_path / "slow.log")
    assert code != 0, output[-4000:]
    last = output.strip().splitlines()[-1]
    assert "CheckpointNotWritten: the checkpoint of step 2 was not written to " in last and "SLOW_DOWN" in last, last
    assert "(gave up after 3 tries per request (retry budget $VITSCALE_S3_RETRY_S: 5 s))" in last, last
    assert "(not retried: a restart would fail the same way)" in last, last
    assert _saves(proxy, 2) == 1, proxy.log  # one attempt, not max_failures + 1 (counted at the store, as above)
    # The 3 tries the line says, of the first request that met the throttling: Ray Train's own retry of an upload
    # (3 times, on the SDK's text) is not on top of them (9 tries, three budgets and Ray's backoff, before).
    assert proxy.counts["503"] == 3, [entry for entry in proxy.log if entry[2] != "ok"]
    assert output.count("rank 0 failed: ") <= 1, output[-4000:]
