"""Fine-tuning: Table 4 presets, the recipe as TrainConfig defaults, the dev-then-test protocol, the old
shape refused in one line, and the real loop from pre-trained weights."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from helpers.loop_runs import Recorder
from vitscale.config import ConfigError
from vitscale.data.carve import Carve
from vitscale.data.tools.write import write_dataset
from vitscale.models import ModelConfig, create_model, export_state_dict
from vitscale.stages import build_pipeline
from vitscale.train.config import TrainConfig
from vitscale.train.finetune import PRESETS, RECIPE, FinetuneConfig, finetune_model
from vitscale.train.job import EvalSet, TrainJob, final_job, selection_job

pytest.importorskip("deepspeed")

TINY = ModelConfig.from_mapping({"name": "ViT-Ti/8", "img_size": 16, "depth": 2, "width": 32, "mlp_dim": 64,
                                 "heads": 2, "representation_size": 32})


def test_presets_are_table_4() -> None:
    assert PRESETS["imagenet"].steps == 20_000 and PRESETS["imagenet"].lr_grid == (0.003, 0.01, 0.03, 0.06)
    for name in ("cifar10", "cifar100"):
        assert (PRESETS[name].steps, PRESETS[name].lr_grid, PRESETS[name].dev_fraction) == (
            10_000, (0.001, 0.003, 0.01, 0.03), 0.02)
    for name in ("pets", "flowers"):
        assert (PRESETS[name].steps, PRESETS[name].dev_fraction) == (500, 0.10)
    assert (PRESETS["vtab"].steps, PRESETS["vtab"].lr_grid, PRESETS["vtab"].dev_fraction) == (2500, (0.01,), 0.2)


def test_the_recipe_is_the_papers() -> None:
    cfg = FinetuneConfig(data={"url": "d"}, preset="cifar10")
    recipe = cfg.train_config(0.003)
    assert (recipe.optimizer, recipe.momentum, recipe.global_batch, recipe.lr_decay, recipe.weight_decay,
            recipe.grad_clip, recipe.max_steps, recipe.base_lr) == ("sgd", 0.9, 512, "cosine", 0.0, 1.0, 10_000, 0.003)
    assert cfg.resolution == 384 and cfg.dev_share() == 0.02 and cfg.single_lr() is None
    assert recipe.warmup_steps == 500 and FinetuneConfig(preset="pets").train_config().warmup_steps == 50
    assert FinetuneConfig(data={"url": "d"}, preset="vtab").single_lr() == 0.01  # one setting for every task
    cfg = FinetuneConfig(data={"url": "d"}, preset="pets", train={"max_steps": 7, "base_lr": 0.5})
    assert cfg.train_config(0.5).max_steps == 7 and cfg.single_lr() == 0.5


def test_every_train_and_data_key_reaches_a_finetuning_job() -> None:
    # Fine-tuning is a training job: any train: / data: key applies, over the paper's recipe.
    config = build_pipeline({"finetune": {"preset": "pets", "train": {"max_skipped_steps": 0, "keep_checkpoints": 1,
                                                                      "label_smoothing": 0.1, "base_lr": 0.01},
                                          "data": {"url": "d", "error_budget": 0.0, "shuffle_buffer": 64}}})
    job = final_job(config.finetune, TINY, None, 0.01, use_gpu=False, endpoint_url="http://s3.local")
    assert (job.train.max_skipped_steps, job.train.keep_checkpoints, job.train.label_smoothing) == (0, 1, 0.1)
    assert (job.data.error_budget, job.data.shuffle_buffer, job.data.url) == (0.0, 64, "d")
    assert job.data.endpoint_url == "http://s3.local"  # unset in finetune.data: the pipeline's data.endpoint_url
    # What no key sets is the recipe, and every other key keeps its TrainConfig default.
    defaults = TrainConfig()
    for key, value in RECIPE.items():
        assert getattr(job.train, key) == value
    assert (job.train.max_steps, job.train.warmup_steps) == (500, 50)  # Table 4's pets row; a tenth of it
    assert job.train.checkpoint_every == defaults.checkpoint_every and job.train.loss == defaults.loss


def test_the_old_shape_says_where_each_key_moved() -> None:
    with pytest.raises(ConfigError) as err:
        build_pipeline({"finetune": {"dataset": "d", "base_lr": 0.01, "batch": 64, "micro_batch": 8}})
    message = str(err.value)
    assert "\n" not in message
    for old, new in (("dataset", "data.url"), ("base_lr", "train.base_lr"), ("batch", "train.global_batch"),
                     ("micro_batch", "train.micro_batch")):
        assert f"finetune.{old} moved to finetune.{new}" in message
    with pytest.raises(ConfigError, match="finetune.train.epochs"):  # fine-tuning counts steps
        build_pipeline({"finetune": {"train": {"epochs": 3}}})


def test_the_model_drops_pre_logits_and_takes_the_new_resolution() -> None:
    model = finetune_model(TINY, 32)
    assert model.img_size == 32 and "representation_size" not in model.options and model.options["depth"] == 2


def test_a_selection_job_cannot_read_the_test_split() -> None:
    cfg = FinetuneConfig(data={"url": "d"}, preset="pets")
    job = selection_job(cfg, TINY, None, 0.01, use_gpu=False, endpoint_url=None)
    assert [e.name for e in job.evals] == ["dev"] and job.carve == Carve(0.1, 0, "rest")
    assert job.evals[0].carve == Carve(0.1, 0, "dev") and job.evals[0].split == "train"
    for extra in (EvalSet("test", "d", "test"), EvalSet("train", "d", "train")):
        with pytest.raises(ValueError, match="selecting on a dev carve"):
            TrainJob(model=job.model, data=job.data, train=job.train, carve=job.carve, evals=(*job.evals, extra))
    with pytest.raises(ValueError, match="selecting on a dev carve"):  # training on the dev part itself
        TrainJob(model=job.model, data=job.data, train=job.train, carve=Carve(0.1, 0, "dev"), evals=job.evals)
    final = final_job(cfg, TINY, None, 0.01, use_gpu=False, endpoint_url=None)
    assert [(e.name, e.split, e.carve) for e in final.evals] == [("test", "test", None)] and final.carve is None
    # A fine-tuning job's recipe is set under finetune.train (what its lines name, e.g. a warm-up longer than it).
    assert job.train_key == final.train_key == "finetune.train"
    assert TrainJob(model=job.model, data=job.data, train=job.train).train_key == "train"


@pytest.mark.parametrize("raw, key", [
    ({"preset": "mnist"}, "finetune.preset"),
    ({"checkpoint": ""}, "finetune.checkpoint"),  # was taken for weights given, then failed to read "" as a path
    ({"dev_fraction": 1.0}, "finetune.dev_fraction"),
    ({"train": {"momentum": 1.0}}, "finetune.train.momentum"),
    ({"train": {"base_lr": -1}}, "finetune.train.base_lr"),
    ({"lr_grid": [0.01, float("nan")]}, "finetune.lr_grid[1]"),
    ({"lr_grid": [0.01, 0.03, 0.01]}, "finetune.lr_grid"),  # the sweep would train 0.01 twice
    ({"test_split": "train"}, "finetune.test_split"),
    ({"train": {"polyak": 0.999, "zero_stage": 3}}, "finetune.train.polyak"),
    ({"train": {"bogus": 1}}, "finetune.train.bogus"),
    ({"data": {"error_budget": 2.0}}, "finetune.data.error_budget"),
    ({"data": {"create_if_missing": {"kind": "nope"}}}, "finetune.data.create_if_missing.kind"),
])
def test_bad_finetune_settings_name_the_key(raw: dict, key: str) -> None:
    with pytest.raises(ConfigError) as err:
        build_pipeline({"finetune": {**raw, "data": {"url": "d", **raw.get("data", {})}}})
    assert err.value.key == key


def test_the_stage_needs_weights_and_one_learning_rate() -> None:
    with pytest.raises(ConfigError) as err:
        build_pipeline({"stages": ["finetune"], "finetune": {"data": {"url": "d"}, "train": {"base_lr": 0.01}}})
    assert err.value.key == "finetune.checkpoint"
    with pytest.raises(ConfigError, match="sweep stage") as err:
        build_pipeline({"stages": ["pretrain", "finetune"], "finetune": {"data": {"url": "d"}, "preset": "cifar10"},
                        "cluster": {"num_workers": 2}, "train": {"global_batch": 128}})
    assert err.value.key == "finetune.train.base_lr"
    with pytest.raises(ConfigError, match="try 32 or 64") as err:  # the one batch rule, named for its section
        build_pipeline({"stages": ["pretrain", "finetune"], "finetune": {"data": {"url": "d"}, "preset": "vtab",
                        "train": {"micro_batch": 16, "global_batch": 48}}, "cluster": {"num_workers": 2},
                        "train": {"global_batch": 128}})
    assert err.value.key == "finetune.train.global_batch"
    build_pipeline({"stages": ["pretrain", "finetune"], "finetune": {"data": {"url": "d"}, "preset": "vtab",
                    "train": {"micro_batch": 16, "global_batch": 32}}, "cluster": {"num_workers": 2},
                    "train": {"global_batch": 128}})


@pytest.fixture(scope="module")
def downstream(tmp_path_factory: pytest.TempPathFactory) -> str:
    out = tmp_path_factory.mktemp("ft") / "synthetic"
    write_dataset("synthetic", str(out), shard_size=40, max_side=32, progress=False, seed=3,
                  splits={"train": 0.8, "test": 0.2}, source_options={"count": 200, "classes": 4, "image_size": 32})
    return str(out)


def test_finetuning_runs_through_the_pretraining_loop(downstream: str, tmp_path: Path, process_group: None) -> None:
    from vitscale.train.loop import WorkerContext, train

    # "Pre-trained" weights at 16 px with pre-logits and a 7-class head: all three must be adapted.
    torch.manual_seed(0)
    pretrained = create_model("ViT-Ti/8", num_classes=7, img_size=16, depth=2, width=32, mlp_dim=64, heads=2,
                              representation_size=32)
    init = tmp_path / "pretrained.pt"
    export_state_dict(pretrained, init)
    cfg = FinetuneConfig(data={"url": downstream, "num_workers": 0}, resolution=32, dev_fraction=0.2,
                         train={"max_steps": 12, "global_batch": 16, "micro_batch": 8, "precision": "fp32",
                                "checkpoint_every": 12, "log_every": 4, "eval_every": 6, "polyak": 0.9})
    job = selection_job(cfg, finetune_model(TINY, 32), str(init), 0.05, use_gpu=False, endpoint_url=None)
    job = replace(job, eval_steps=(1, 3, 9))  # ASHA's rungs (a sweep sets them): scored exactly there too
    seen: list[dict] = []
    summary = train(job, WorkerContext(rank=0, world_size=1, run_dir=tmp_path / "run",
                                       report=lambda metrics, directory: seen.append(metrics)))
    assert summary["steps"] == 12 and summary["num_classes"] == 4
    scored = [m for m in seen if "dev_accuracy" in m]
    assert [m["step"] for m in scored] == [1, 3, 6, 9, 12]  # eval_steps, eval_every and the last step
    for m in scored:
        assert 0.0 <= m["dev_accuracy"] <= 1.0 and 0.0 <= m["dev_accuracy_polyak"] <= 1.0
    assert not any("test_accuracy" in m for m in seen)


@pytest.mark.parametrize("pretraining", ["supervised", "masked_patch"])
def test_a_finetuned_run_exports_the_architecture_it_trained(downstream: str, tmp_path: Path, process_group: None,
                                                             pretraining: str) -> None:
    """`vitscale finetune EXPORT --data D` then `vitscale export RUN_DIR` (README): the fine-tuned checkpoint
    is rebuilt as the model it holds (the export's architecture at the fine-tuning resolution, no pre-logits,
    supervised), not as the pipeline's `model:` (ViT-B/16 at 224 when the command names none) and `train:`."""
    from vitscale.config.loader import to_yaml
    from vitscale.models.weights_files import load_pretrained
    from vitscale.stages.finetune import finetune_pipeline
    from vitscale.train.export import export_run
    from vitscale.train.loop import WorkerContext, train

    init = tmp_path / "pretrained.pt"
    export_state_dict(create_model("ViT-Ti/8", num_classes=7, img_size=16, depth=2, width=32, mlp_dim=64, heads=2,
                                   representation_size=32), init)
    raw = finetune_pipeline(str(init), downstream, base_lr=0.05)
    raw["train"] = {"objective": pretraining}  # a pipeline's pre-training objective: fine-tuning is supervised
    config = build_pipeline(raw, "vitscale finetune")
    assert config.model.name == "ViT-B/16"  # what the pipeline says; the weights are a ViT-Ti/8
    cfg = FinetuneConfig(data={"url": downstream, "num_workers": 0}, resolution=32,
                         train={"max_steps": 2, "global_batch": 8, "micro_batch": 8, "precision": "fp32",
                                "checkpoint_every": 2, "log_every": 1})
    job = final_job(cfg, finetune_model(TINY, 32), str(init), 0.05, use_gpu=False, endpoint_url=None,
                    config_yaml=to_yaml(config))
    runs = tmp_path / "runs"  # where Ray Train would keep the checkpoints
    train(job, WorkerContext(rank=0, world_size=1, run_dir=tmp_path / "run", report=Recorder(runs)))
    info = export_run(runs, tmp_path / "tuned.pt")
    assert (info["model"], info["img_size"], info["num_classes"], info["objective"]) == ("ViT-Ti/8", 32, 4,
                                                                                          "supervised")
    model = create_model("ViT-Ti/8", num_classes=4, img_size=32, depth=2, width=32, mlp_dim=64, heads=2)
    load_pretrained(model, tmp_path / "tuned.pt")


@pytest.mark.parametrize("gpus, cpus, expected", [
    (0, 2, {"num_workers": 1, "use_gpu": False, "cpus_per_worker": 2}),
    (4, 32, {"num_workers": 4, "use_gpu": True, "cpus_per_worker": 8}),
])
def test_vitscale_finetune_on_a_local_ray_fits_this_machine(monkeypatch: pytest.MonkeyPatch, gpus: int, cpus: int,
                                                             expected: dict) -> None:
    # ClusterConfig's defaults are a GPU cluster's (8 workers x 8 CPUs x 1 GPU): a local Ray has this
    # machine only, and a CPU one trains in fp32 (bf16 matmuls crawl there).
    from vitscale.stages.finetune import finetune_pipeline

    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(os, "cpu_count", lambda: cpus)
    raw = finetune_pipeline("weights.pth", "shards", model="ViT-B/16", base_lr=0.01, local=True)
    assert raw["cluster"] == expected
    config = build_pipeline(raw, "vitscale finetune")
    assert config.finetune.train_config().precision == ("bf16" if gpus else "fp32")
    assert "cluster" not in finetune_pipeline("weights.pth", "shards", local=False)  # a cluster: its own config


def test_each_pretrained_run_fine_tuned_on_a_dataset_is_a_run_of_its_own() -> None:
    """`vitscale finetune runs/exp1 --data cifar10` then `... runs/exp2 --data cifar10`: two runs, not the second
    refused as a changed resume of the first; the same command again names the same run (so it resumes)."""
    from vitscale.stages.finetune import finetune_pipeline

    def name(checkpoint: str, dataset: str) -> str:
        config = build_pipeline(finetune_pipeline(checkpoint, dataset, base_lr=0.01), "vitscale finetune")
        return config.run_name

    assert name("runs/exp1", "shards/cifar10") == name("runs/exp1/", "shards/cifar10/") == "finetune-exp1-cifar10"
    assert name("runs/exp2", "shards/cifar10") == "finetune-exp2-cifar10"
    assert name("s3://bucket/runs/exp1", "s3://bucket/shards/pets") == "finetune-exp1-pets"
    assert name("weights/ViT-B_16.npz", "cifar10") == "finetune-ViT-B_16-cifar10"  # the file's suffix dropped
    assert name("exp1.safetensors", "cifar10") == "finetune-exp1-cifar10"
    assert name("runs/exp1", ".") == f"finetune-exp1-{Path.cwd().name}"  # "." is the folder it names
    # A local file may be named what a run may not be (a run's name is part of an s3:// location).
    assert name("weights/exp#1.pt", "cifar10") == "finetune-exp-1-cifar10"


def test_a_resumed_finetuning_refuses_other_pretrained_weights(downstream: str, tmp_path: Path,
                                                               process_group: None) -> None:
    """`vitscale finetune runs/pre ...` once at pre-training's step 5, again once it reached step 20: the same
    command, so the second resumed (or, finished, returned) the fine-tuning of the step-5 weights, exit 0. Every
    checkpoint records the weights it started from as loaded; the same weights written again (another export's
    bytes) resume, other weights are refused before anything is loaded."""
    from vitscale.train.loop import WorkerContext, train

    def weights(seed: int) -> str:
        torch.manual_seed(seed)
        export_state_dict(create_model("ViT-Ti/8", num_classes=7, img_size=16, depth=2, width=32, mlp_dim=64,
                                       heads=2, representation_size=32), tmp_path / "init.pt")
        return str(tmp_path / "init.pt")

    cfg = FinetuneConfig(data={"url": downstream, "num_workers": 0}, resolution=16,
                         train={"max_steps": 2, "global_batch": 16, "micro_batch": 16, "precision": "fp32",
                                "checkpoint_every": 1})
    job = final_job(cfg, finetune_model(TINY, 16), weights(0), 0.05, use_gpu=False, endpoint_url=None,
                    config_yaml="stages: [finetune]\n")  # a pipeline's: what resuming compares
    kept = Recorder(tmp_path / "kept")
    train(job, WorkerContext(rank=0, world_size=1, run_dir=tmp_path / "run", report=kept))
    checkpoint = tmp_path / "kept" / "checkpoint_000000001"
    weights(0)  # the same weights exported again
    resumed = train(job, WorkerContext(rank=0, world_size=1, run_dir=tmp_path / "again", report=Recorder(tmp_path / "b"),
                                       resume_from=checkpoint))
    assert resumed["steps"] == 2
    weights(1)
    with pytest.raises(ConfigError, match="other pre-trained weights") as refused:
        train(job, WorkerContext(rank=0, world_size=1, run_dir=tmp_path / "other", report=Recorder(tmp_path / "c"),
                                 resume_from=checkpoint))
    assert refused.value.key == "finetune.checkpoint"
