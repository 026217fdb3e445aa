"""A real `vitscale run` whose run storage is moto behind the fault proxy (tests/helpers/s3_faults.py): its lease,
checkpoint uploads (pyarrow through `data/storage/filesystem.py`'s retry strategy) and records meet 503s,
500s and dropped connections, and the run still ends with complete checkpoints in the bucket."""

from __future__ import annotations

import uuid
from pathlib import Path

import boto3
import pytest
import yaml

from helpers.s3_faults import FaultProxy
from vitscale.data.storage.lease import LEASE_NAME
from vitscale.train import checkpoint as ckpt

pytestmark = pytest.mark.slow


def test_a_run_on_flaky_object_storage_ends_with_complete_checkpoints(tmp_path: Path, moto_s3: str,
                                                                       small_synthetic: str,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from helpers.ray_runs import run

    bucket = f"flakyrun-{uuid.uuid4().hex[:10]}"
    s3 = boto3.client("s3", endpoint_url=moto_s3)
    s3.create_bucket(Bucket=bucket)
    raw = {"name": "flaky", "stages": ["pretrain"], "data": {"url": small_synthetic},
           "model": {"name": "ViT-Ti/8", "img_size": 16, "depth": 1, "width": 32, "heads": 2, "mlp_dim": 32},
           "train": {"global_batch": 8, "micro_batch": 8, "max_steps": 4, "warmup_steps": 0, "checkpoint_every": 2},
           "cluster": {"num_workers": 1, "use_gpu": False, "cpus_per_worker": 1, "max_failures": 0,
                       "storage_path": f"s3://{bucket}/runs", "run_name": "flaky"}}
    pipeline = tmp_path / "pipeline.yaml"
    pipeline.write_text(yaml.safe_dump(raw))
    with FaultProxy(moto_s3, fault_rate=0.15, methods=("PUT", "POST"), seed=11) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)  # driver, lease, Ray's storage and the workers
        output = run(pipeline, tmp_path / "run.log")  # max_failures 0: no restart hides a failed upload
    assert '"ok": true' in output
    assert proxy.faults > 0 and proxy.counts["ok"] > 0, proxy.counts
    keys = [o["Key"] for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix="runs/flaky/")
            for o in page.get("Contents", [])]
    assert f"runs/flaky/{LEASE_NAME}" not in keys  # released at the end
    for step in (2, 4):
        prefix = f"runs/flaky/checkpoint_{step:09d}/"
        local = tmp_path / f"ckpt{step}"
        for key in keys:
            if key.startswith(prefix) and not key.endswith("/"):
                target = local / key[len(prefix):]
                target.parent.mkdir(parents=True, exist_ok=True)
                s3.download_file(bucket, key, str(target))
        assert ckpt.check_complete(local, 1) == [], step
