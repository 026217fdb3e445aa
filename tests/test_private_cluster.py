"""vitscale on a cluster of nodes with private disks (tests/helpers/private_cluster.py), one cluster for the file.

First the cluster's shape: each node's /tmp and $HOME are its own; object storage (moto on loopback)
is the only thing nodes share; a node can be SIGKILLed whole and come back with an empty disk; token
authentication is on. Then vitscale on it: a whole worker node SIGKILLed mid-pre-training.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import subprocess
import textwrap
import time
from pathlib import Path

import boto3
import psutil
import pytest
import torch
import yaml

from helpers.private_cluster import RAY, PrivateCluster

pytestmark = pytest.mark.slow

# Run as a Ray job: the driver runs on the head node; each task is placed on one node by its resource.
PROBE = textwrap.dedent("""
    import json, os, sys
    import boto3, ray

    ray.init(log_to_driver=False)
    bucket, endpoint = sys.argv[1], sys.argv[2]

    @ray.remote(num_cpus=0)
    def write(node):
        os.makedirs(os.path.expanduser("~"), exist_ok=True)
        for path in ("/tmp/private-" + node, os.path.expanduser("~/home-" + node)):
            with open(path, "w") as f:
                f.write(node)
        boto3.client("s3", endpoint_url=endpoint).put_object(Bucket=bucket, Key="from-" + node, Body=node.encode())
        return os.environ["HOME"]

    @ray.remote(num_cpus=0)
    def read(node, other):
        seen_local = [os.path.exists(p) for p in ("/tmp/private-" + other, os.path.expanduser("~/home-" + other))]
        body = boto3.client("s3", endpoint_url=endpoint).get_object(Bucket=bucket, Key="from-" + other)["Body"].read()
        return {"local": seen_local, "s3": body.decode()}

    on = lambda node: {"resources": {"node:" + node: 0.01}}
    home = ray.get(write.options(**on("worker1")).remote("worker1"))
    seen = {node: ray.get(read.options(**on(node)).remote(node, "worker1")) for node in ("worker1", "worker2")}
    print("RESULT " + json.dumps({"home": home, **seen}))
""")


@pytest.fixture(scope="module")
def cluster(moto_s3: str, tmp_path_factory: pytest.TempPathFactory):
    from helpers.private_cluster import skip_reason

    reason = skip_reason()
    if reason:
        pytest.skip(f"no private-disk cluster on this machine: {reason}")
    aws = {k: os.environ[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
                                      "AWS_DEFAULT_REGION")}
    with PrivateCluster(workers=2, cpus=1, env={**aws, "AWS_ENDPOINT_URL": moto_s3}) as c:
        yield c


def _probe(cluster: PrivateCluster, moto_s3: str) -> dict:
    bucket = f"probe-{secrets.token_hex(4)}"
    boto3.client("s3", endpoint_url=moto_s3).create_bucket(Bucket=bucket)
    # The script travels in the command line: the head cannot see this machine's /tmp.
    done = cluster.submit("python", "-c", PROBE, bucket, moto_s3)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def test_nodes_share_object_storage_and_nothing_else(cluster: PrivateCluster, moto_s3: str, tmp_path: Path) -> None:
    result = _probe(cluster, moto_s3)
    assert result["home"] == "/tmp/home"
    # Worker 2 cannot see worker 1's /tmp or ~, but reads what it put in the bucket.
    assert result["worker2"] == {"local": [False, False], "s3": "worker1"}
    assert result["worker1"] == {"local": [True, True], "s3": "worker1"}
    # On the host, worker 1's files are on its disk only.
    assert cluster.nodes["worker1"].path("/tmp/private-worker1").read_text() == "worker1"
    assert cluster.nodes["worker1"].path("~/home-worker1").read_text() == "worker1"
    for name in ("head", "worker2"):
        assert not cluster.nodes[name].path("/tmp/private-worker1").exists()


def test_a_killed_node_leaves_and_comes_back_empty(cluster: PrivateCluster, moto_s3: str, tmp_path: Path) -> None:
    _probe(cluster, moto_s3)
    assert cluster.nodes["worker1"].path("/tmp/private-worker1").exists()
    cluster.kill("worker1")
    cluster.wait_for_nodes(2, timeout=120)  # the GCS marks it dead
    assert not cluster.nodes["worker1"].alive
    cluster.add("worker1")
    assert not cluster.nodes["worker1"].path("/tmp/private-worker1").exists()  # a new node, a new disk
    assert _probe(cluster, moto_s3)["worker2"]["s3"] == "worker1"  # placed on the new node, it runs


def test_the_cluster_refuses_a_client_without_its_token(cluster: PrivateCluster, tmp_path: Path) -> None:
    env = {k: v for k, v in cluster.client_env().items() if not k.startswith("RAY_AUTH")} | {"HOME": str(tmp_path)}
    done = subprocess.run([RAY, "job", "submit", "--address", cluster.dashboard_address, "--", "echo", "ran"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "ran" not in done.stdout.split("Running entrypoint")[-1]


# -- a whole worker node lost mid-pre-training ------------------------------------------------------
#
# Two worker nodes of one CPU, one Ray Train worker on each, storage and data in a moto bucket, the run
# submitted with `ray job submit --working-dir`. When the step-4 checkpoint is in the bucket, worker
# node 2 is killed whole; Ray Train waits for a node, a new one is added, and the run resumes from the
# newest complete checkpoint in the bucket. It must end with the uninterrupted run's weights and
# samples per step, and its records must be in the bucket, not on the dead node's disk.

STEPS = 8


def _pipeline(bucket: str, name: str) -> dict:
    return {
        "name": name,
        "stages": ["pretrain"],
        "model": {"name": "ViT-Ti/8", "img_size": 16, "depth": 1, "width": 32, "mlp_dim": 32, "heads": 2},
        "data": {"url": f"s3://{bucket}/data", "num_workers": 0, "shuffle_buffer": 16,
                 "create_if_missing": {"kind": "synthetic", "count": 70, "classes": 4, "image_size": 32,
                                       "shard_size": 20}},
        "train": {"global_batch": 16, "micro_batch": 8, "max_steps": STEPS, "warmup_steps": 1, "base_lr": 2e-3,
                  "zero_stage": 2, "precision": "fp32", "checkpoint_every": 2, "log_every": 1,
                  "record_samples": True},
        "cluster": {"num_workers": 2, "use_gpu": False, "cpus_per_worker": 1, "max_failures": 2,
                    "storage_path": f"s3://{bucket}/runs"},
    }


def _submit(cluster: PrivateCluster, pipeline: dict, tmp_path: Path) -> subprocess.Popen:
    """`ray job submit --working-dir` (the pipeline file travels through the GCS, not a shared disk)."""
    work = tmp_path / pipeline["name"]
    work.mkdir()
    (work / "pipeline.yaml").write_text(yaml.safe_dump(pipeline))
    return subprocess.Popen([RAY, "job", "submit", "--address", cluster.dashboard_address, "--working-dir",
                             str(work), "--", "vitscale", "run", "pipeline.yaml"], env=cluster.client_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(job: subprocess.Popen) -> str:
    output, _ = job.communicate(timeout=900)
    assert job.returncode == 0, output[-6000:]
    return output


def _download(s3, bucket: str, prefix: str, into: Path) -> Path:
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for obj in page.get("Contents", []):
            if obj["Key"].endswith("/"):
                continue  # a folder marker (pyarrow writes them)
            target = into / obj["Key"]
            target.parent.mkdir(parents=True, exist_ok=True)
            s3.download_file(bucket, obj["Key"], str(target))
    return into / prefix


def _effective_samples(records: str) -> dict[int, list[str]]:
    by_step: dict[int, list[str]] = {}
    for line in records.splitlines():  # after a resume, the last line written for a step is the one that counts
        record = json.loads(line)
        by_step[record["step"]] = record["keys"]
    return by_step


@pytest.mark.skipif(not os.environ.get("VITSCALE_CLUSTER_E2E"),
                    reason="two pre-training runs on the private-disk cluster (minutes): make test-cluster runs it")
def test_a_lost_node_resumes_from_storage_to_the_same_weights(cluster: PrivateCluster, moto_s3: str,
                                                              tmp_path: Path) -> None:
    from vitscale.train.export import model_from_checkpoint

    s3 = boto3.client("s3", endpoint_url=moto_s3)
    bucket = f"nodelost-{secrets.token_hex(4)}"
    s3.create_bucket(Bucket=bucket)
    clean_out = _finish(_submit(cluster, _pipeline(bucket, "clean"), tmp_path))
    assert '"ok": true' in clean_out

    job = _submit(cluster, _pipeline(bucket, "lost"), tmp_path)
    deadline = time.monotonic() + 600
    marker = "runs/lost/checkpoint_000000004/train_state.json"
    while time.monotonic() < deadline and job.poll() is None:
        keys = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix="runs/lost/").get("Contents", [])]
        if marker in keys:
            break
        time.sleep(0.5)
    if job.poll() is not None:
        pytest.fail("the run ended before the node could be killed:\n" + job.communicate()[0][-5000:])
    cluster.kill("worker2")
    cluster.wait_for_nodes(2, timeout=120)
    cluster.add("worker3", timeout=300)  # capacity comes back as a new node with an empty disk
    lost_out = _finish(job)
    assert "resumed from" in lost_out or "resum" in lost_out.lower(), lost_out[-4000:]

    runs = _download(s3, bucket, "runs/", tmp_path / "bucket")
    weights = {}
    for name in ("clean", "lost"):
        model, _, facts = model_from_checkpoint(runs / name / f"checkpoint_{STEPS:09d}")
        assert facts["step"] == STEPS
        weights[name] = model.state_dict()
    for key, value in weights["clean"].items():
        torch.testing.assert_close(weights["lost"][key], value, rtol=0, atol=1e-5, msg=key)
    for rank in (0, 1):
        clean = _effective_samples((runs / "clean" / "samples" / f"rank{rank}.jsonl").read_text())
        lost = _effective_samples((runs / "lost" / "samples" / f"rank{rank}.jsonl").read_text())
        assert sorted(lost) == list(range(1, STEPS + 1)) and lost == clean
        assert (runs / "lost" / "metrics" / f"rank{rank}.jsonl").is_file()
    # The driver's records are in the bucket too: nothing the run wrote is only on a node's disk.
    for name in ("config.yaml", "summary.json", "logs/ray.log"):
        assert (runs / "lost" / name).is_file(), name
    assert json.loads((runs / "lost" / "summary.json").read_text())["pretrain"]["step"] == STEPS


# -- the whole pipeline and a study, storage in the bucket only -------------------------------------
#
# The quickstart's stages shrunk ([pretrain, fewshot, sweep]) and a two-cell study, each submitted with
# `ray job submit` to the head. Every artefact must be in the bucket; the sweep's trials must start from
# the pre-trained weights handed over through it; the report and an export must come from the bucket
# alone, on a machine (a fresh $HOME, no cache) that never saw the run.

TINY = {"name": "ViT-Ti/8", "img_size": 16, "depth": 1, "width": 32, "mlp_dim": 32, "heads": 2}


def _whole(bucket: str) -> dict:
    digits = f"s3://{bucket}/digits"
    return {
        "name": "whole", "stages": ["pretrain", "fewshot", "sweep"], "model": TINY,
        "data": {"url": f"s3://{bucket}/data", "num_workers": 0, "shuffle_buffer": 16,
                 "create_if_missing": {"kind": "synthetic", "count": 64, "classes": 4, "image_size": 32,
                                       "shard_size": 20}},
        "train": {"global_batch": 16, "micro_batch": 8, "max_steps": 4, "warmup_steps": 1, "zero_stage": 2,
                  "precision": "fp32", "checkpoint_every": 2, "log_every": 1},
        "fewshot": {"datasets": [digits], "shots": [2], "resolution": 16,
                    "create_if_missing": {"kind": "digits", "splits": {"train": 0.8, "test": 0.2}, "shard_size": 500}},
        "finetune": {"lr_grid": [0.01, 0.1], "dev_fraction": 0.2, "resolution": 16,
                     "data": {"url": digits, "num_workers": 0},
                     "train": {"max_steps": 4, "warmup_steps": 1, "global_batch": 16, "micro_batch": 16,
                               "precision": "fp32", "checkpoint_every": 4, "log_every": 2}},
        "sweep": {"target": "finetune", "scheduler": "grid", "workers_per_trial": 1},
        "cluster": {"num_workers": 2, "use_gpu": False, "cpus_per_worker": 1, "max_failures": 1,
                    "storage_path": f"s3://{bucket}/runs"},
    }


def _study(bucket: str) -> dict:
    whole = _whole(bucket)
    return {**{k: whole[k] for k in ("model", "data", "train", "fewshot", "cluster")},
            "name": "study", "stages": ["study"],
            "study": {"models": [{k: v for k, v in TINY.items() if k != "img_size"}], "data_sizes": [32, None],
                      "max_concurrent": 1}}


def _host_cli(args: list[str], home: Path, moto_s3: str) -> subprocess.CompletedProcess:
    """`vitscale ...` on the host with an empty $HOME and cache: a machine that never saw the run."""
    home.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HOME": str(home), "VITSCALE_CACHE": str(home / "cache"), "AWS_ENDPOINT_URL": moto_s3}
    return subprocess.run([str(Path(RAY).parent / "vitscale"), *args], env=env, capture_output=True, text=True,
                          timeout=600)


@pytest.mark.skipif(not os.environ.get("VITSCALE_CLUSTER_E2E"),
                    reason="the whole pipeline and a study on the private-disk cluster (minutes): make test-cluster runs it")
def test_the_whole_pipeline_and_a_study_keep_everything_in_the_bucket(cluster: PrivateCluster, moto_s3: str,
                                                                     tmp_path: Path) -> None:
    import hashlib

    from vitscale.train.export import model_from_checkpoint
    from vitscale.train.weights import load_model

    s3 = boto3.client("s3", endpoint_url=moto_s3)
    bucket = f"whole-{secrets.token_hex(4)}"
    s3.create_bucket(Bucket=bucket)
    output = _finish(_submit(cluster, _whole(bucket), tmp_path))
    assert '"ok": true' in output
    study_output = _finish(_submit(cluster, _study(bucket), tmp_path))
    assert "2 cells" in study_output and '"done": 2' in study_output, study_output[-4000:]  # both cells trained

    keys = {o["Key"] for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix="runs/")
            for o in page.get("Contents", [])}
    expected = ["whole/config.yaml", "whole/summary.json", "whole/logs/ray.log", "whole/metrics/rank0.jsonl",
                "whole/metrics/rank1.jsonl", "whole/finetune-init.pt", "whole/sweep/results.parquet",
                "whole/sweep/results.csv", "whole/sweep/results.md", "whole/sweep/selected.json",
                "whole/sweep/lr_vs_accuracy.png", "whole/checkpoint_000000004/MANIFEST-rank1.json",
                "study/study/results.md", "study/study/fits.md", "study/study/compute_vs_accuracy.png",
                "study/summary.json"]
    missing = [k for k in expected if f"runs/{k}" not in keys]
    results = s3.get_object(Bucket=bucket, Key="runs/study/study/results.md")["Body"].read().decode() \
        if "runs/study/study/results.md" in keys else ""
    if missing:
        print(study_output[-4000:], results, sorted(keys), sep="\n")
    assert not missing, missing
    assert any(k.startswith("runs/whole/tensorboard/") for k in keys), sorted(keys)
    assert len([k for k in keys if k.startswith("runs/study/study/state/") and k.endswith(".json")]) >= 2

    # The trials started from the pre-trained weights handed over through the bucket: each pre-trained
    # trial names that object and its digest; the export equals the pre-training's last checkpoint.
    runs = _download(s3, bucket, "runs/whole/", tmp_path / "bucket")
    init = runs / "finetune-init.pt"
    digest = hashlib.sha256(init.read_bytes()).hexdigest()
    log = (runs / "logs" / "ray.log").read_text()
    started = [line for line in log.splitlines() if f"initialised from s3://{bucket}/runs/whole/finetune-init.pt" in line]
    assert len(started) >= 2 and all(f"(sha256 {digest})" in line for line in started), started or log[-4000:]
    pretrained, _, _ = model_from_checkpoint(runs / "checkpoint_000000004")
    handed = load_model(init)[0].state_dict()
    for key, value in pretrained.state_dict().items():
        torch.testing.assert_close(handed[key], value, rtol=0, atol=0, msg=key)

    # From the bucket alone: the study's report and an export, with an empty $HOME and cache.
    done = _host_cli(["study", "report", f"s3://{bucket}/runs/study/study", "--json"], tmp_path / "elsewhere", moto_s3)
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(json.loads(done.stdout)["rows"]) == 2
    out = tmp_path / "exported.pt"
    done = _host_cli(["export", f"s3://{bucket}/runs/whole", "--out", str(out)], tmp_path / "elsewhere2", moto_s3)
    assert done.returncode == 0 and out.stat().st_size > 0, done.stderr[-3000:]


# -- a node lost under running sweep trials ---------------------------------------------------------
#
# Two trials at once, one per worker node: a short one and a long one. Once the short one has finished
# and the long one has a checkpoint in the bucket, the node running the long one's training worker is
# killed whole and a new node is added. The sweep must end with both trials once each: the finished one
# not run again, the long one resumed from its checkpoint in the bucket, the results table in the bucket.

LONG_STEPS = 1500


def _sweep(bucket: str) -> dict:
    whole = _whole(bucket)
    return {**{k: whole[k] for k in ("model", "data", "train")}, "name": "sweeplost", "stages": ["pretrain", "sweep"],
            "finetune": {"dev_fraction": 0.2, "resolution": 16, "data": {"url": f"s3://{bucket}/digits", "num_workers": 0},
                         "train": {"base_lr": 0.01, "warmup_steps": 1, "global_batch": 16, "micro_batch": 16,
                                   "precision": "fp32", "checkpoint_every": 100, "log_every": 100}},
            "sweep": {"scheduler": "grid", "workers_per_trial": 1, "retrain": False, "trial_retries": 2,
                      "space": {"finetune.train.max_steps": [4, LONG_STEPS]}},
            "cluster": {**whole["cluster"], "max_failures": 2}}


def _node_running(cluster: PrivateCluster, process_name: str) -> str | None:
    """The worker node one of whose processes is named `process_name` (a Ray actor's title)."""
    from helpers.private_cluster import _session_members

    for name, node in cluster.nodes.items():
        if name != "head" and node.alive:
            for process in _session_members(node.process.pid):
                with contextlib.suppress(psutil.Error):
                    if process_name in " ".join(process.cmdline()):
                        return name
    return None


@pytest.mark.skipif(not os.environ.get("VITSCALE_CLUSTER_E2E"),
                    reason="a sweep on the private-disk cluster with a node lost (minutes): make test-cluster runs it")
def test_a_node_lost_under_running_trials_loses_no_finished_trial(cluster: PrivateCluster, moto_s3: str,
                                                                  tmp_path: Path) -> None:
    import pandas as pd

    from vitscale.data.tools.write import write_dataset

    s3 = boto3.client("s3", endpoint_url=moto_s3)
    bucket = f"sweeplost-{secrets.token_hex(4)}"
    s3.create_bucket(Bucket=bucket)
    write_dataset("digits", f"s3://{bucket}/digits", shard_size=500, seed=0, endpoint_url=moto_s3, progress=False,
                  splits={"train": 0.8, "test": 0.2})
    job = _submit(cluster, _sweep(bucket), tmp_path)
    deadline = time.monotonic() + 900
    victim = None
    while victim is None:
        if job.poll() is not None:
            pytest.fail("the sweep ended before a node could be killed:\n" + job.communicate()[0][-5000:])
        assert time.monotonic() < deadline, "the trials never reached the moment to kill a node"
        keys = [o["Key"] for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix="runs/")
                for o in page.get("Contents", [])]
        short_done = any("/sweep/trials/" in k and "/checkpoint_000000004/MANIFEST-rank0.json" in k for k in keys)
        long_saved = any("/sweep/trials/" in k and "/checkpoint_000000100/MANIFEST-rank0.json" in k for k in keys)
        if short_done and long_saved:
            victim = _node_running(cluster, "RayTrainWorker")
        time.sleep(0.5)
    killed_at = time.time()
    cluster.kill(victim)
    cluster.wait_for_nodes(2, timeout=120)
    cluster.add(f"{victim}-again", timeout=300)
    output = _finish(job)
    assert '"ok": true' in output, output[-4000:]

    runs = _download(s3, bucket, "runs/", tmp_path / "bucket")
    rows = pd.read_parquet(runs / "sweeplost" / "sweep" / "results.parquet").to_dict("records")
    assert sorted(r["finetune.train.max_steps"] for r in rows) == [4, LONG_STEPS], rows  # every trial, once
    assert all(r["status"] == "finished" for r in rows), rows
    short = next(r for r in rows if r["finetune.train.max_steps"] == 4)
    long = next(r for r in rows if r["finetune.train.max_steps"] == LONG_STEPS)
    assert short["finished_at"] < killed_at, (short, killed_at)  # finished before the loss, not run again
    assert long["steps"] == LONG_STEPS
    # The long trial's own Train run resumed from a checkpoint in the bucket, not from step 0.
    log = (runs / "sweeplost" / "logs" / "ray.log").read_text()
    assert any("resumed from" in line and f"[trial {long['trial_id']}" in line for line in log.splitlines()), log[-4000:]
    assert (runs / "sweeplost" / "sweep" / "selected.json").is_file()
