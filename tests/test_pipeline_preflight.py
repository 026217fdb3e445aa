"""`vitscale run` refuses a broken pipeline on the driver, before Ray or any worker starts."""

from __future__ import annotations

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
    ("global_batch", 6, "train.global_batch"),
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
