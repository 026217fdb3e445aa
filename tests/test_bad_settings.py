"""Every setting that cannot work is refused by `vitscale run` before Ray starts: one line naming the key
and the file, exit code 2, no traceback. One row per impossible setting."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from vitscale.cli import main

NAN, INF = float("nan"), float("inf")


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> str:
    from vitscale.data.tools.write import write_dataset

    out = tmp_path_factory.mktemp("data") / "synthetic"
    write_dataset("synthetic", str(out), shard_size=30, max_side=32, progress=False, splits={"train": 0.75, "test": 0.25},
                  source_options={"count": 60, "classes": 3, "image_size": 32})
    return str(out)


def base(dataset: str, storage: Path) -> dict[str, Any]:
    return {"name": "bad", "stages": ["pretrain"], "data": {"url": dataset},
            "model": {"name": "ViT-Ti/8", "img_size": 16, "depth": 1, "width": 32, "heads": 2, "mlp_dim": 32},
            "train": {"global_batch": 8, "micro_batch": 4, "max_steps": 1, "warmup_steps": 0},
            "fewshot": {"datasets": [dataset], "resolution": 16, "shots": [1, 5]},
            "finetune": {"resolution": 16, "dev_fraction": 0.1, "data": {"url": dataset},
                         "train": {"base_lr": 0.01, "global_batch": 8, "micro_batch": 4, "max_steps": 2}},
            "cluster": {"num_workers": 2, "use_gpu": False, "cpus_per_worker": 1, "storage_path": str(storage)}}


BAD: list[tuple[str, Any, str]] = [
    # non-finite or negative numbers where they make no sense
    ("train.base_lr", NAN, "train.base_lr"), ("train.base_lr", -1e-3, "train.base_lr"),
    ("train.end_lr", INF, "train.end_lr"), ("train.end_lr", 0.5, "train.end_lr"),  # above base_lr
    ("train.epochs", INF, "train.epochs"), ("train.epochs", -1.0, "train.epochs"),
    ("train.warmup_steps", -5, "train.warmup_steps"), ("train.weight_decay", NAN, "train.weight_decay"),
    ("train.seed", -1, "train.seed"), ("train.seed", 2**40, "train.seed"), ("data.seed", 2**33, "data.seed"),
    ("train.label_smoothing", NAN, "train.label_smoothing"), ("train.grad_clip", 0.0, "train.grad_clip"),
    ("train.max_skipped_steps", -1, "train.max_skipped_steps"), ("train.peak_flops", "nan", "train.peak_flops"),
    ("model.head_bias_init", NAN, "model.head_bias_init"), ("model.dropout", 1.0, "model.dropout"),
    ("model.img_size", 20, "model"),  # 20 px is not a whole number of 8 px patches
    ("cluster.cpus_per_worker", NAN, "cluster.cpus_per_worker"), ("cluster.cpus_per_worker", -1, "cluster.cpus_per_worker"),
    # longer than a thread's timer can wait: the SIGTERM and Ctrl-C timers died of an OverflowError
    ("cluster.preemption_grace_s", INF, "cluster.preemption_grace_s"),
    ("cluster.preemption_grace_s", 1e20, "cluster.preemption_grace_s"),
    # a metrics port range that overflows, an address nothing can bind
    ("train.metrics_port", 65535, "train.metrics_port"), ("train.metrics_addr", "my host", "train.metrics_addr"),
    # names that become paths
    ("cluster.run_name", "../elsewhere", "cluster.run_name"), ("cluster.run_name", "a/b", "cluster.run_name"),
    # read differently by pyarrow (Ray Train's storage) and boto3 once part of an s3:// location
    ("cluster.run_name", "exp?x", "cluster.run_name"), ("cluster.run_name", "exp%2Fx", "cluster.run_name"),
    ("cluster.run_name", "exp#1", "cluster.run_name"), ("cluster.run_name", "exp\n1", "cluster.run_name"),
    ("data.split", "../train", "data.split"), ("cluster.storage_path", "", "cluster.storage_path"),
    # a name no file system takes as a folder or file name (255 bytes): an OSError's traceback from the first glob
    ("cluster.run_name", "r" * 300, "cluster.run_name"), ("data.split", "é" * 101, "data.split"),
    ("data.endpoint_url", "minio:9000", "data.endpoint_url"),
    # no host, a space, a port that is not a number: boto3 refused them at the first read, naming no key
    ("data.endpoint_url", "http://", "data.endpoint_url"), ("data.endpoint_url", "http://minio 9000", "data.endpoint_url"),
    ("data.endpoint_url", "http://minio:port", "data.endpoint_url"),
    # a batch the dataset cannot fill; a local Ray that cannot hold the workers (Ray Train would wait forever)
    ("train.global_batch", 64, "train.global_batch"), ("data.subset", 4, "train.global_batch"),
    ("cluster.cpus_per_worker", 64, "cluster.cpus_per_worker"), ("cluster.local_num_cpus", 1, "cluster.cpus_per_worker"),
    ("cluster.gpus_per_worker", 64, "cluster.use_gpu"),
    # few-shot counts the evaluation set cannot supply; probe settings that would fail only after pre-training
    ("fewshot.shots", [1, 40], "fewshot.shots"), ("fewshot.resolution", 32, "fewshot.resolution"),
    ("fewshot.seed", 2**32 - 2, "fewshot.seed"), ("fewshot.train_split", "a/b", "fewshot.train_split"),
    ("finetune.resolution", 20, "finetune.resolution"), ("finetune.train.seed", -1, "finetune.train.seed"),
    ("finetune.data.seed", -1, "finetune.data.seed"), ("finetune.train.global_batch", 12, "finetune.train.global_batch"),
    ("finetune.train.max_steps", 0, "finetune.train.max_steps"),  # was read as "unset": the preset's 10,000 steps
    ("finetune.data.split", "nope", "finetune.data.split"), ("finetune.seed", 1, "finetune.seed"),  # the old shape
    # integers no 64-bit integer holds, and sizes whose tensors none can: torch's TypeError or RuntimeError, a traceback
    ("train.max_steps", 2**63, "train.max_steps"), ("train.max_steps", 1e300, "train.max_steps"),
    ("data.seed", -(2**64), "data.seed"), ("model.img_size", 2**31, "model"), ("model.width", 2**40, "model"),
    ("finetune.resolution", 2**40, "finetune.resolution"),
    # a block is a Python object even on the meta device: the config's own check of 10**9 filled the host's memory
    ("model.depth", 10**9, "model.depth"),
    # an input no model or loader takes (MAX_RESOLUTION): 100,000 px passed and a worker ran out of memory
    ("model.img_size", 100_000, "model.img_size"), ("finetune.resolution", 8192, "finetune.resolution"),
    # an image no generated source can draw: a 112-GiB array and a MemoryError's traceback at 100,000 px
    ("data.create_if_missing.image_size", 100_000, "data.create_if_missing.image_size"),
    ("data.create_if_missing.classes", 10**9, "data.create_if_missing.classes"),  # a name each: out of memory
    # loader processes a DataLoader would fork all at once on every rank
    ("data.num_workers", 10_000, "data.num_workers"), ("finetune.data.num_workers", 65, "finetune.data.num_workers"),
    # a number or a blank where a path or URL goes: a folder named "0" in the working directory, a dataset ''
    ("cluster.storage_path", 0, "cluster.storage_path"), ("data.url", " ", "data.url"),
    ("fewshot.datasets", "", "fewshot.datasets"), ("fewshot.datasets", [1], "fewshot.datasets[0]"),
    ("finetune.data.url", 7, "finetune.data.url"),
    # YAML's .nan as a name; numbers YAML read where a host name goes, which inet_aton reads as addresses
    ("cluster.run_name", NAN, "cluster.run_name"), ("train.metrics_addr", 0, "train.metrics_addr"),
    ("train.metrics_addr", "-1", "train.metrics_addr"), ("train.metrics_addr", "10.1", "train.metrics_addr"),
]
"""(dotted key, value, the key the one-line error must name)."""


def _set(raw: dict, key: str, value: Any) -> None:
    *path, last = key.split(".")
    node = raw
    for part in path:
        node = node.setdefault(part, {})
    node[last] = value


def _stages(key: str) -> list[str]:
    if key.startswith("fewshot."):
        return ["pretrain", "fewshot"]
    if key.startswith("finetune."):
        return ["pretrain", "finetune"]
    return ["pretrain"]


@pytest.mark.parametrize("key, value, named", BAD, ids=[f"{k}={v!r}" for k, v, _ in BAD])
def test_vitscale_run_refuses_it_in_one_line_before_ray(tmp_path: Path, dataset: str, capsys: pytest.CaptureFixture,
                                                        key: str, value: Any, named: str) -> None:
    import ray

    raw = copy.deepcopy(base(dataset, tmp_path / "runs"))
    raw["stages"] = _stages(key)
    if key == "cluster.gpus_per_worker":
        raw["cluster"]["use_gpu"] = True
    _set(raw, key, value)
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(raw))
    code = main(["run", str(path)])
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert code == 2, (out, err)
    assert len(lines) == 1 and "Traceback" not in err + out, err
    assert lines[0].startswith(f"vitscale: error: {named}") and str(path) in lines[0], lines[0]
    assert not ray.is_initialized()
    assert not (tmp_path / "runs").exists()  # nothing of the run was created


def test_the_base_pipeline_passes_every_check(tmp_path: Path, dataset: str) -> None:
    """So each refusal above is the bad setting's, not the base pipeline's."""
    from vitscale.stages import build_pipeline
    from vitscale.stages.run import preflight

    raw = base(dataset, tmp_path / "runs")
    raw["stages"] = ["pretrain", "fewshot", "finetune"]
    preflight(build_pipeline(raw, "base.yaml"))


def test_a_class_short_of_shots_is_named(tmp_path: Path, dataset: str, capsys: pytest.CaptureFixture) -> None:
    """Enough examples in all, too few in one class: found from the index's labels, not after pre-training."""
    import numpy as np

    from vitscale.data.format import read_index

    index = read_index(dataset).to_pylist()
    counts = np.bincount([r["labels"][0] for r in index if r["split"] == "train"], minlength=3)
    shots = int(counts.min()) + 1
    if shots * 3 > counts.sum():
        pytest.skip(f"classes too even for this check: {counts}")
    raw = base(dataset, tmp_path / "runs")
    raw["stages"] = ["pretrain", "fewshot"]
    raw["fewshot"]["shots"] = [shots]
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert main(["run", str(path)]) == 2
    err = capsys.readouterr().err
    assert "fewshot.shots" in err and f"has only {counts.min()} examples" in err
