"""`vitscale run` refuses a broken pipeline on the driver, before Ray or any worker starts."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from vitscale.cli import main


@pytest.fixture(scope="module")
def dataset(small_synthetic: str) -> str:
    return small_synthetic


def run(tmp_path: Path, capsys: pytest.CaptureFixture, pipeline: dict) -> tuple[int, str]:
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(pipeline))
    code = main(["run", str(path)])
    return code, capsys.readouterr().err


def base(dataset: str, tmp_path: Path) -> dict:
    return {"stages": ["pretrain"], "data": {"url": dataset},
            "model": {"name": "ViT-Ti/8", "img_size": 16, "depth": 1, "width": 32, "heads": 2, "mlp_dim": 32},
            "train": {"global_batch": 8, "micro_batch": 4, "max_steps": 1},
            "cluster": {"num_workers": 2, "use_gpu": False, "cpus_per_worker": 1, "storage_path": str(tmp_path)}}


def assert_no_ray_started() -> None:
    import ray

    assert not ray.is_initialized()


def test_unknown_model_fails_before_ray(tmp_path: Path, capsys: pytest.CaptureFixture, dataset: str) -> None:
    pipeline = base(dataset, tmp_path)
    pipeline["model"]["name"] = "ViT-Q/16"
    code, err = run(tmp_path, capsys, pipeline)
    assert code == 2 and "ViT-Q/16" in err
    assert_no_ray_started()


def test_missing_dataset_fails_before_ray(tmp_path: Path, capsys: pytest.CaptureFixture, dataset: str) -> None:
    pipeline = base(dataset, tmp_path)
    pipeline["data"]["url"] = str(tmp_path / "nowhere")
    code, err = run(tmp_path, capsys, pipeline)
    assert code == 2 and "nowhere" in err and "vitscale shards write" in err
    assert_no_ray_started()


def test_missing_split_fails_before_ray(tmp_path: Path, capsys: pytest.CaptureFixture, dataset: str) -> None:
    pipeline = base(dataset, tmp_path)
    pipeline["data"]["split"] = "minival"
    code, err = run(tmp_path, capsys, pipeline)
    assert code == 2 and "data.split" in err and "minival" in err
    assert_no_ray_started()


def test_missing_shard_fails_before_ray(tmp_path: Path, capsys: pytest.CaptureFixture, dataset: str) -> None:
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(dataset, broken)
    next(broken.glob("*.tar")).unlink()
    pipeline = base(str(broken), tmp_path)
    code, err = run(tmp_path, capsys, pipeline)
    assert code == 2 and ".tar" in err
    assert_no_ray_started()


@pytest.mark.parametrize("key, value, named", [
    ("zero_stage", 5, "train.zero_stage"),
    ("global_batch", 7, "train.global_batch"),  # 6 is two shares of 3, each one pass under micro_batch 4
    ("bogus", 1, "train.bogus"),
])
def test_bad_train_settings_fail_before_ray(tmp_path: Path, capsys: pytest.CaptureFixture, dataset: str,
                                            key: str, value: object, named: str) -> None:
    pipeline = base(dataset, tmp_path)
    pipeline["train"][key] = value
    code, err = run(tmp_path, capsys, pipeline)
    assert code == 2 and named in err
    assert_no_ray_started()


def test_stage_without_a_runner_fails_before_ray(tmp_path: Path, capsys: pytest.CaptureFixture, dataset: str) -> None:
    pipeline = base(dataset, tmp_path)
    pipeline["stages"] = ["pretrain", "study"]
    code, err = run(tmp_path, capsys, pipeline)
    assert code == 2 and "study" in err
    assert_no_ray_started()


def test_a_cluster_named_by_address_is_not_sized_against_this_machine(
        tmp_path: Path, capsys: pytest.CaptureFixture, dataset: str) -> None:
    # 2 x 64 CPUs cannot fit this machine, but `--address` joins another cluster: the local-size
    # check is skipped, and the next check (the missing dataset) is the one that speaks.
    pipeline = base(dataset, tmp_path)
    pipeline["cluster"]["cpus_per_worker"] = 64
    pipeline["data"]["url"] = str(tmp_path / "nowhere")
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(pipeline))
    code = main(["run", str(path), "--address", "127.0.0.1:9"])
    err = capsys.readouterr().err
    assert code == 2 and "nowhere" in err and "cpus_per_worker" not in err, err
    assert_no_ray_started()


def test_object_storage_that_cannot_be_reached_is_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture, dataset: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    with socket.socket() as s:  # a loopback port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    pipeline = base(dataset, tmp_path)
    pipeline["data"] = {"url": "s3://vitscale-nowhere/ds", "endpoint_url": f"http://127.0.0.1:{port}"}
    code, err = run(tmp_path, capsys, pipeline)
    assert code == 2 and "s3://vitscale-nowhere/ds" in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert_no_ray_started()


def test_an_offloaded_adamw_this_machine_cannot_build_is_refused_before_ray(
        tmp_path: Path, capsys: pytest.CaptureFixture, dataset: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """`train.offload` has every local worker JIT-build DeepSpeed's CPU Adam: without ninja or a compiler each one
    failed as it built its engine. The driver builds it once (the workers load it), or says it cannot."""
    import vitscale.train.engine as engine

    built: list[bool] = []

    def cannot_build() -> None:
        built.append(True)
        raise RuntimeError("Unable to JIT load the cpu_adam op due to ninja not being installed.")

    monkeypatch.setattr(engine, "build_cpu_adam", cannot_build)
    pipeline = base(dataset, tmp_path)
    pipeline["train"].update(offload=True, zero_stage=1)
    code, err = run(tmp_path, capsys, pipeline)
    assert code == 2 and built and "train.offload" in err and "ninja" in err and "train.optimizer: sgd" in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert_no_ray_started()
    built.clear()
    pipeline["train"]["optimizer"] = "sgd"  # the torch optimizer steps the offloaded state: nothing to build
    pipeline["data"]["url"] = str(tmp_path / "nowhere")  # the next check speaks
    code, err = run(tmp_path, capsys, pipeline)
    assert code == 2 and not built and "nowhere" in err, err


def test_a_cpu_adam_build_killed_mid_way_is_one_line_not_a_hang(tmp_path: Path, dataset: str) -> None:
    """A build of DeepSpeed's CPU Adam SIGKILLed mid-way (a first offloaded run killed while its driver compiled)
    leaves torch's `lock` in the build folder, and torch waits for it forever: the next `vitscale run` with
    `train.offload` hung before Ray started, saying nothing. Now one line naming the file, exit 2."""
    import subprocess
    import sys

    extensions = tmp_path / "extensions"
    (extensions / "cpu_adam").mkdir(parents=True)
    (extensions / "cpu_adam" / "lock").touch()  # what the killed build left (torch's FileBaton: an empty file)
    pipeline = base(dataset, tmp_path)
    pipeline["train"].update(offload=True, zero_stage=1)
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(pipeline))
    done = subprocess.run([sys.executable, "-m", "vitscale", "run", str(path)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "TORCH_EXTENSIONS_DIR": str(extensions)})
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1] == (
        f"vitscale: error: train.offload: offloads AdamW to DeepSpeed's CPU Adam: {extensions}/cpu_adam/lock is there "
        f"and nothing is building DeepSpeed's CPU Adam: a build killed mid-way left it, and torch waits for it "
        f"forever; remove that file and run again (in {path})")


def test_a_live_build_is_waited_for_and_a_dead_ones_lock_is_not(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Two offloaded runs starting at once on one machine: the second finds the first's lock while the first
    builds (its compiler working in the build folder) and waits for it; a lock with no build behind it is a
    dead build's once the grace (a built extension's load holds the lock a moment) has passed."""
    import subprocess
    import threading
    import time

    from vitscale.train import engine

    monkeypatch.setattr(engine, "LOCK_GRACE_S", 1.0)
    folder = tmp_path / "cpu_adam"
    folder.mkdir()
    lock = folder / "lock"
    lock.touch()
    started = time.monotonic()
    assert engine._left_by_a_dead_build(lock) and time.monotonic() - started < 10
    compiler = subprocess.Popen(["sleep", "60"], cwd=folder)  # a live build's process, working in the folder
    try:
        threading.Timer(4.0, lock.unlink).start()  # the build ends
        started = time.monotonic()
        assert not engine._left_by_a_dead_build(lock)
        assert time.monotonic() - started >= 3.5  # waited past the grace, for as long as the build ran
    finally:
        compiler.kill()
        compiler.wait()


WORKER_ENGINE = """
import os, socket, sys
import torch
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1",
                   "LOCAL_RANK": "0"})
torch.distributed.init_process_group("gloo", rank=0, world_size=1)
from vitscale.models.factory import create_model
from vitscale.train import engine
from vitscale.train.batch import derive_batch
from vitscale.train.config import TrainConfig
engine.LOCK_GRACE_S = 1.0
engine.init_distributed(on_gpu=False)
model = create_model("ViT-Ti/8", num_classes=3, img_size=16, depth=1, width=32, heads=2, mlp_dim=32)
train = TrainConfig(global_batch=2, micro_batch=2, zero_stage=1, precision="fp32", offload=True)
try:
    engine.build_engine(model, train, engine.deepspeed_config(train, derive_batch(2, 2, 1), on_gpu=False),
                        on_gpu=False)
except engine.BuildLockLeft as exc:
    print(exc)
    sys.exit(3)
"""


def test_a_worker_node_with_a_dead_builds_lock_fails_in_one_line_not_a_hang(tmp_path: Path) -> None:
    """The driver checks its own machine; a worker on another node (a first offloaded run's rank killed while it
    JIT-built CPU Adam there) found the same lock and hung in DeepSpeed's load for good, Ray Train waiting with
    it. The engine a worker builds now refuses it in one line (a deterministic failure: not retried)."""
    import subprocess
    import sys

    extensions = tmp_path / "extensions"
    (extensions / "cpu_adam").mkdir(parents=True)
    (extensions / "cpu_adam" / "lock").touch()
    done = subprocess.run([sys.executable, "-c", WORKER_ENGINE], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "TORCH_EXTENSIONS_DIR": str(extensions)})
    assert done.returncode == 3, done.stdout[-2000:] + done.stderr[-3000:]
    assert done.stdout.strip() == (f"{extensions}/cpu_adam/lock is there and nothing is building DeepSpeed's CPU "
                                   f"Adam: a build killed mid-way left it, and torch waits for it forever; remove "
                                   f"that file and run again")

    from vitscale.launch.failures import deterministic_cause
    from vitscale.train.engine import BuildLockLeft

    assert deterministic_cause(BuildLockLeft("x")) is not None
