"""Masked patch pre-training as a user runs it: `vitscale run` on a local Ray, 2 Train workers, ZeRO-2, images
without labels in object storage (moto), the run in the bucket, a worker killed mid-run, then the few-shot
probe and fine-tuning of the encoder on labelled digits."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import boto3
import numpy as np
import pytest
import yaml
from PIL import Image

pytestmark = pytest.mark.slow


def test_masked_patch_pre_training_on_a_bucket_survives_a_lost_worker_and_transfers(
        tmp_path: Path, moto_s3: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from helpers.ray_runs import run
    from vitscale.data.tools.write import write_dataset
    from vitscale.train.export import find_checkpoint, model_from_checkpoint

    bucket = f"mpp-{uuid.uuid4().hex[:10]}"
    boto3.client("s3", endpoint_url=moto_s3).create_bucket(Bucket=bucket)
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_s3)  # driver, lease, Ray's storage and the workers
    photos = tmp_path / "photos"
    photos.mkdir()
    rng = np.random.default_rng(0)
    for i in range(96):
        Image.fromarray(rng.integers(0, 255, (2, 2, 3), dtype=np.uint8)).resize((24, 24)).save(photos / f"{i}.jpg")
    write_dataset(f"folder:{photos}", f"s3://{bucket}/images", shard_size=40, max_side=24, seed=0, progress=False)
    digits = tmp_path / "digits"
    write_dataset("digits", str(digits), shard_size=500, seed=0, splits={"train": 0.8, "test": 0.2}, progress=False)
    raw = {"name": "mpp", "stages": ["pretrain", "fewshot", "finetune"],
           "model": {"name": "ViT-Ti/4", "img_size": 16, "depth": 2, "width": 32, "mlp_dim": 64, "heads": 2},
           "data": {"url": f"s3://{bucket}/images", "num_workers": 0, "shuffle_buffer": 32},
           "train": {"objective": "masked_patch", "global_batch": 16, "micro_batch": 8, "max_steps": 8,
                     "warmup_steps": 1, "base_lr": 1e-3, "precision": "fp32", "zero_stage": 2, "checkpoint_every": 3,
                     "log_every": 1, "fault": {"kill_rank": 1, "kill_at_step": 5}},
           "fewshot": {"datasets": [str(digits)], "shots": [2], "resolution": 16},
           "finetune": {"data": {"url": str(digits), "num_workers": 0}, "resolution": 16,
                        "train": {"base_lr": 0.03, "max_steps": 4, "global_batch": 16, "micro_batch": 8,
                                  "precision": "fp32", "checkpoint_every": 4}},
           "cluster": {"num_workers": 2, "use_gpu": False, "cpus_per_worker": 1, "max_failures": 1,
                       "storage_path": f"s3://{bucket}/runs"}}
    pipeline = tmp_path / "pipeline.yaml"
    pipeline.write_text(yaml.safe_dump(raw))
    output = run(pipeline, tmp_path / "run.log")
    summary = json.loads(output.strip().splitlines()[-1])
    assert summary["ok"] is True, output[-3000:]
    assert "patch acc" in output  # the progress lines show the objective's own accuracy
    assert "resumed from" in output  # rank 1 died after step 5: the group restarted from checkpoint 3
    assert 0.0 <= summary["fewshot"]["mean_2shot"] <= 1.0  # the encoder's representation, probed
    assert 0.0 <= summary["finetune"]["test_accuracy"] <= 1.0

    _, _, facts = model_from_checkpoint(find_checkpoint(f"s3://{bucket}/runs/mpp"))
    assert (facts["objective"], facts["step"], facts["num_classes"]) == ("masked_patch", 8, 0)
    metrics = [json.loads(line) for line in _read(bucket, moto_s3, "runs/mpp/metrics/rank0.jsonl").splitlines()]
    last = {m["step"]: m for m in metrics}
    assert sorted(last) == list(range(1, 9)) and all(last[s]["patch_accuracy"] is not None for s in last)
    events = [k for k in _keys(bucket, moto_s3, "runs/mpp/") if "events.out.tfevents" in k]
    assert events, "TensorBoard events in the run's storage"
    tags = _tensorboard_tags(bucket, moto_s3, events, tmp_path)
    assert "train/patch_accuracy" in tags and "train/loss" in tags


def _keys(bucket: str, endpoint: str, prefix: str) -> list[str]:
    s3 = boto3.client("s3", endpoint_url=endpoint)
    return [o["Key"] for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
            for o in page.get("Contents", [])]


def _read(bucket: str, endpoint: str, key: str) -> str:
    return boto3.client("s3", endpoint_url=endpoint).get_object(Bucket=bucket, Key=key)["Body"].read().decode()


def _tensorboard_tags(bucket: str, endpoint: str, keys: list[str], tmp_path: Path) -> set[str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags: set[str] = set()
    s3 = boto3.client("s3", endpoint_url=endpoint)
    for i, key in enumerate(keys):
        local = tmp_path / "tb" / str(i)
        local.mkdir(parents=True)
        s3.download_file(bucket, key, str(local / key.rsplit("/", 1)[-1]))
        acc = EventAccumulator(str(local))
        acc.Reload()
        tags |= set(acc.Tags().get("scalars", []))
    return tags
