"""A study run again after a dataset its recorded cells read was written again is refused before Ray starts.

A finished cell is never run again, so its results (and every fit and recommendation made from them) would be
the old data's beside the new data's cells. The study's plan records what each dataset its cells read holds
(`datasets`: the pre-training split, each transfer dataset's splits); the next run compares
(`scaling/study/stage.refuse_changed_data`) and names the setting. Real datasets written by `shards write`'s
code, a real study directory; the end-to-end refusal after a real study is in `test_study_ray.py`.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from vitscale.config.checks import ConfigError
from vitscale.data.tools.write import write_dataset

TINY = {"name": "ViT-Ti/8", "img_size": 16, "depth": 1, "width": 32, "mlp_dim": 32, "heads": 2}


def _write_pre(folder: Path, count: int = 120, seed: int = 0) -> None:
    shutil.rmtree(folder, ignore_errors=True)  # deleted, then written again at the same place
    write_dataset("synthetic", str(folder), shard_size=100, seed=seed, progress=False,
                  source_options={"count": count, "classes": 4, "image_size": 16})


def _config(tmp_path: Path, transfer: list[str], run_name: str = "s") -> Any:
    from vitscale.stages import build_pipeline

    raw = {"name": "s", "stages": ["study"], "model": TINY,
           "data": {"url": str(tmp_path / "pre"), "num_workers": 0},
           "train": {"global_batch": 8, "micro_batch": 8, "epochs": 1, "warmup_steps": 1, "precision": "fp32"},
           "fewshot": {"datasets": [str(tmp_path / "down")], "shots": [1], "resolution": 16},
           "finetune": {"data": {"url": str(tmp_path / "down")}, "resolution": 16,
                        "train": {"global_batch": 8, "micro_batch": 8, "max_steps": 2, "precision": "fp32",
                                              "base_lr": 0.01}},
           "cluster": {"num_workers": 1, "use_gpu": False, "cpus_per_worker": 1, "run_name": run_name,
                       "storage_path": str(tmp_path / "runs")},
           "study": {"models": [TINY], "transfer": transfer}}
    return build_pipeline(raw, "study.yaml")


def _ran(config: Any) -> None:
    """What a study's run leaves before its cells' results: the plan with what they read, and a cell's record."""
    from vitscale.scaling.study.cell_pipelines import resolve_cells
    from vitscale.scaling.study.stage import datasets_read, study_directory
    from vitscale.scaling.study.state import CellRecord, StudyState

    state = StudyState(study_directory(config))
    state.write_plan({"cells": [], "datasets": datasets_read(config)})
    state.write(CellRecord(resolve_cells(config)[0].id, status="done", runs=1))


@pytest.fixture()
def data(tmp_path: Path) -> Path:
    _write_pre(tmp_path / "pre")
    write_dataset("digits", str(tmp_path / "down"), shard_size=500, seed=0, progress=False,
                  splits={"train": 0.8, "test": 0.2})
    return tmp_path


def test_the_pre_training_data_written_again_is_refused_naming_data_url(data: Path) -> None:
    from vitscale.scaling.study.stage import prepare_study

    config = _config(data, ["fewshot"])
    _ran(config)
    prepare_study(config)  # the same data: the study resumes
    _write_pre(data / "pre", seed=0)  # written again, the same bytes: the same dataset
    prepare_study(config)
    _write_pre(data / "pre", count=128)
    with pytest.raises(ConfigError) as err:
        prepare_study(_config(data, ["fewshot"]))
    assert err.value.key == "data.url"
    assert f"{data / 'pre'} is not the dataset this study's cells in {data / 'runs' / 's' / 'study'} read " \
           "(split 'train': 120 samples of 4 classes -> 128 samples of 4 classes)" in err.value.message
    assert "another cluster.run_name" in err.value.message
    prepare_study(_config(data, ["fewshot"], run_name="other"))  # a study with no cell recorded starts anew


@pytest.mark.parametrize(("transfer", "key"), [(["fewshot"], "fewshot.datasets[0]"),
                                               (["finetune"], "finetune.data.url")])
def test_a_transfer_dataset_written_again_is_refused_naming_its_setting(data: Path, transfer: list[str],
                                                                        key: str) -> None:
    from vitscale.scaling.study.stage import prepare_study

    _ran(_config(data, transfer))
    shutil.rmtree(data / "down")
    write_dataset("digits", str(data / "down"), shard_size=500, seed=1, progress=False,
                  splits={"train": 0.8, "test": 0.2})
    with pytest.raises(ConfigError) as err:
        prepare_study(_config(data, transfer))
    assert err.value.key == key and "as before, other shards or labels" in err.value.message, err.value


def test_a_plan_without_the_record_is_not_checked(data: Path) -> None:
    """A study begun by a vitscale that did not record its datasets resumes as before."""
    from vitscale.scaling.study.cell_pipelines import resolve_cells
    from vitscale.scaling.study.stage import prepare_study, study_directory
    from vitscale.scaling.study.state import CellRecord, StudyState

    config = _config(data, ["fewshot"])
    state = StudyState(study_directory(config))
    state.write_plan({"cells": []})
    state.write(CellRecord(resolve_cells(config)[0].id, status="done", runs=1))
    _write_pre(data / "pre", count=128)
    prepare_study(_config(data, ["fewshot"]))
