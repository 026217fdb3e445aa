"""The sweep stage's driver side: search spaces, trial jobs, and one-line errors before any trial starts."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from vitscale.config import ConfigError
from vitscale.config.loader import merge
from vitscale.data.tools.write import write_dataset
from vitscale.stages import build_pipeline
from vitscale.stages.run import preflight
from vitscale.stages.sweep import trial_job
from vitscale.stages.sweep_space import combinations, search_space, with_params

MODEL = {"name": "ViT-Ti/8", "img_size": 16, "depth": 1, "width": 32, "mlp_dim": 32, "heads": 2}
CLUSTER = {"num_workers": 1, "use_gpu": False, "cpus_per_worker": 1}


def sweep_pipeline(**sections: dict) -> dict:
    raw = {"stages": ["sweep"], "model": MODEL, "cluster": CLUSTER,
           "finetune": {"checkpoint": "w.npz", "preset": "pets", "resolution": 16, "data": {"url": "d"},
                        "train": {"global_batch": 8, "micro_batch": 8}}}
    return merge(raw, sections)


def test_a_finetune_sweep_defaults_to_table_4s_grid() -> None:
    config = build_pipeline(sweep_pipeline())
    assert search_space(config) == {"finetune.train.base_lr": (0.001, 0.003, 0.01, 0.03)}


def test_combinations_are_the_grid_in_order() -> None:
    grid = combinations({"a": (1, 2), "b": ("x", "y", "z")})
    assert len(grid) == 6 and grid[0] == {"a": 1, "b": "x"} and grid[-1] == {"a": 2, "b": "z"}
    assert combinations({}) == [{}]


@pytest.mark.parametrize("sweep, key", [
    ({"space": {"finetune.bogus": [1]}}, "sweep.space.finetune.bogus"),
    ({"space": {"finetune.train.bogus": [1]}}, "sweep.space.finetune.train.bogus"),
    ({"space": {"finetune.train.base_lr": [0.01, -1.0]}}, "sweep.space.finetune.train.base_lr"),
    ({"space": {"finetune.data.error_budget": [0.0, 2.0]}}, "sweep.space.finetune.data.error_budget"),
    ({"space": {"train.weight_decay": [0.1]}}, "sweep.space.train.weight_decay"),  # not a fine-tuning knob
    ({"space": {"model.dropout": [0.1, 1.5]}}, "sweep.space.model.dropout"),
    ({"space": {"model.bogus_option": [1]}}, "sweep.space.model.bogus_option"),
    ({"space": {"finetune.train.base_lr": []}}, "sweep.space.finetune.train.base_lr"),
    ({"scheduler": "hyperband"}, "sweep.scheduler"),
    ({"space": {"finetune.train.base_lr": [0.01, 0.01]}}, "sweep.space.finetune.train.base_lr"),  # a trial twice
    ({"space": {"model.resnet_layers": [[1, 1], [1, 1]]}}, "sweep.space.model.resnet_layers"),
    ({"scheduler": "asha", "space": {"finetune.train.base_lr": [0.01, 0.03, 0.01]}}, "sweep.space.finetune.train.base_lr"),
    ({"metric": "dev_acc"}, "sweep.metric"),  # no trial reports it: found out only after every trial ran
    ({"metric": "loss"}, "sweep.metric"),  # maximised: a loss would select the worst trial
    ({"metric": "dev_accuracy_polyak"}, "sweep.metric"),  # reported only with finetune.train.polyak
    ({"target": "pretrain", "space": {"finetune.train.base_lr": [0.1]}}, "sweep.space.finetune.train.base_lr"),
    ({"workers_per_trial": 3}, "finetune.train.global_batch"),  # 8 images do not split evenly over 3 workers
    ({"space": {"finetune.train.micro_batch": [4, 3]}}, "finetune.train.global_batch"),  # trial 2: 8 % 3
    # a trial's model or objective that its workers would refuse: checked per trial, not for the base alone
    ({"space": {"finetune.resolution": [16, 20]}}, "finetune.resolution"),  # 20 px: no whole 8 px patches
    ({"target": "pretrain", "space": {"train.objective": ["supervised", "masked_patch"]}}, "sweep.target"),
])
def test_bad_sweeps_are_refused_before_any_trial(sweep: dict, key: str) -> None:
    raw = sweep_pipeline(sweep=sweep)
    if "finetune.resolution" in str(sweep):  # the pretrain stage's model (a checkpoint's is checked with the data)
        raw["stages"], raw["finetune"]["checkpoint"] = ["pretrain", "sweep"], None
        raw["train"] = {"global_batch": 8, "micro_batch": 8}
    with pytest.raises(ConfigError) as err:
        build_pipeline(raw)
    assert err.value.key == key


def test_a_sweep_may_select_on_the_polyak_averaged_weights() -> None:
    config = build_pipeline(sweep_pipeline(sweep={"metric": "dev_accuracy_polyak"},
                                           finetune={"train": {"polyak": 0.999}}))
    assert config.sweep.metric == "dev_accuracy_polyak"


def test_a_regularisation_sweep_tunes_pretraining() -> None:
    space = {"train.weight_decay": [0.03, 0.1], "model.dropout": [0.0, 0.1], "train.label_smoothing": [0.0, 0.1]}
    config = build_pipeline({"stages": ["sweep"], "model": MODEL, "cluster": CLUSTER,
                             "train": {"global_batch": 8, "micro_batch": 8, "max_steps": 5},
                             "sweep": {"target": "pretrain", "space": space, "scheduler": "asha"}})
    assert len(combinations(search_space(config))) == 8
    trial = with_params(config, {"train.weight_decay": 0.1, "model.dropout": 0.1})
    assert trial.train.weight_decay == 0.1 and trial.model.options["dropout"] == 0.1
    job = trial_job(trial, None, None, final=False)
    assert [e.name for e in job.evals] == ["dev"] and job.carve.part == "rest" and job.evaluations == 4
    assert job.eval_steps == (1, 3)  # ASHA's rungs for 5 steps: grace max(1, 5 // 8), factor 3
    final = trial_job(trial, None, None, final=True)
    assert final.carve is None and final.evals == ()


def test_finetune_trials_score_on_dev_and_only_the_winner_sees_test() -> None:
    config = build_pipeline(sweep_pipeline(sweep={"scheduler": "asha", "evaluations": 4},
                                           finetune={"train": {"max_steps": 40}}))
    trial = with_params(config, {"finetune.train.base_lr": 0.01})
    job = trial_job(trial, None, "w.npz", final=False)
    assert job.train.base_lr == 0.01 and job.train.optimizer == "sgd" and job.evaluations == 4
    assert job.eval_steps == (5, 15)  # scored exactly where ASHA judges: grace 40 // 8, then x3
    assert [(e.name, e.split, e.carve.part) for e in job.evals] == [("dev", "train", "dev")]
    final = trial_job(trial, None, "w.npz", final=True)
    assert [(e.name, e.split) for e in final.evals] == [("test", "test")] and final.carve is None


def test_a_trial_of_steps_gets_its_own_warmup_and_any_training_key_can_be_swept() -> None:
    # What the preset and the recipe derive stays derived per trial: warm-up is a tenth of each trial's steps.
    config = build_pipeline(sweep_pipeline(sweep={"space": {"finetune.train.max_steps": [40, 4000],
                                                            "finetune.train.label_smoothing": [0.0, 0.1]}}))
    short, long = (trial_job(with_params(config, {"finetune.train.max_steps": s, "finetune.train.label_smoothing": 0.1}),
                             None, "w.npz", final=False).train for s in (40, 4000))
    assert (short.warmup_steps, long.warmup_steps) == (4, 400) and short.label_smoothing == 0.1
    assert short.base_lr == 0.001  # no rate in the space: the preset grid's first

def test_fine_tuning_needs_weights() -> None:
    raw = sweep_pipeline()
    raw["finetune"].pop("checkpoint")
    with pytest.raises(ConfigError) as err:
        build_pipeline(raw)
    assert err.value.key == "finetune.checkpoint"
    build_pipeline({**raw, "stages": ["pretrain", "sweep"], "train": {"global_batch": 8, "micro_batch": 8}})


@pytest.fixture(scope="module")
def datasets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("sweep-data")
    opts = {"classes": 3, "image_size": 16}
    write_dataset("synthetic", str(root / "small"), shard_size=20, max_side=16, progress=False,
                  splits={"train": 0.7, "test": 0.3}, source_options={"count": 30, **opts})
    write_dataset("synthetic", str(root / "no-test"), shard_size=20, max_side=16, progress=False,
                  source_options={"count": 30, **opts})
    write_dataset("synthetic", str(root / "multi"), shard_size=20, max_side=16, progress=False,
                  splits={"train": 0.7, "test": 0.3}, source_options={"count": 30, "multi_label": True, **opts})
    return {name: str(root / name) for name in ("small", "no-test", "multi")}


def test_data_that_cannot_serve_the_protocol_is_refused_on_the_driver(datasets: dict, tmp_path: Path) -> None:
    import torch

    from vitscale.models import create_model, export_state_dict

    weights = tmp_path / "w.pt"
    torch.manual_seed(0)
    export_state_dict(create_model("ViT-Ti/8", num_classes=5, img_size=16, depth=1, width=32, mlp_dim=32, heads=2),
                      weights)
    cases = [
        ({"data": {"url": datasets["no-test"]}}, "finetune.test_split"),              # no test split
        ({"data": {"url": datasets["small"]}, "dev_fraction": 0.01}, "finetune.dev_fraction"),  # dev carve of 21: empty
        ({"data": {"url": datasets["small"]}, "train": {"global_batch": 32, "micro_batch": 32}},
         "finetune.train.global_batch"),  # 21 cannot fill 32
        ({"data": {"url": datasets["small"]}, "checkpoint": str(tmp_path / "absent.pt")}, "finetune.checkpoint"),
        ({"data": {"url": datasets["small"], "split": "nope"}}, "finetune.data.split"),
    ]
    for finetune, key in cases:
        config = build_pipeline(sweep_pipeline(finetune={"checkpoint": str(weights), **finetune}))
        with pytest.raises(ConfigError) as err:
            preflight(config)
        assert err.value.key == key, (finetune, err.value)
    # A timm file names no architecture: the `model:` section does, and one that does not fit is refused.
    from vitscale.models import timm_state_dict

    other = create_model("ViT-Ti/8", num_classes=5, img_size=16, depth=2, width=64, mlp_dim=64, heads=2)
    torch.save(timm_state_dict(other), tmp_path / "other.pth")
    config = build_pipeline(sweep_pipeline(finetune={"data": {"url": datasets["small"]},
                                                     "checkpoint": str(tmp_path / "other.pth")}))
    with pytest.raises(ConfigError, match="does not fit") as err:
        preflight(config)
    assert err.value.key == "finetune.checkpoint"


TRIAL_DATA = [
    # (the sweep, the pipeline's other sections, the key named): each value of the space checked against the
    # data, as the stage it trains checks it; the base pipeline alone passed, and the trial failed in its workers
    ({"target": "pretrain", "dev_fraction": 0.3, "space": {"train.global_batch": [8, 32]}}, {},
     "train.global_batch"),  # 21 samples
    ({"target": "pretrain", "dev_fraction": 0.3, "space": {"data.split": ["train", "nope"]}}, {}, "data.split"),
    # 21 samples hold the base's 16, but a trial trains on the rest of its dev carve (about 10)
    ({"target": "pretrain", "dev_fraction": 0.5, "space": {"train.base_lr": [0.001]}},
     {"train": {"global_batch": 16, "micro_batch": 8}}, "train.global_batch"),
    # scored by top-1 accuracy on the dev carve: multi-hot labels broke it (a RuntimeError, or accuracy > 1)
    ({"target": "pretrain", "dev_fraction": 0.3, "space": {"train.base_lr": [0.001]}}, {"data": {"url": "multi"}},
     "data.url"),
    ({"space": {"finetune.train.global_batch": [8, 32]}}, {}, "finetune.train.global_batch"),
    ({"space": {"finetune.data.split": ["train", "nope"]}}, {}, "finetune.data.split"),
]


@pytest.mark.parametrize("sweep, sections, key", TRIAL_DATA, ids=[k for _, _, k in TRIAL_DATA])
def test_every_trial_is_checked_against_its_data_on_the_driver(datasets: dict, tmp_path: Path, sweep: dict,
                                                                sections: dict, key: str) -> None:
    from vitscale.models import create_model, export_state_dict

    weights = tmp_path / "w.pt"
    export_state_dict(create_model("ViT-Ti/8", num_classes=5, img_size=16, depth=1, width=32, mlp_dim=32, heads=2),
                      weights)
    url = datasets["multi"] if sections.get("data", {}).get("url") == "multi" else datasets["small"]
    raw = sweep_pipeline(sweep=sweep, finetune={"checkpoint": str(weights), "data": {"url": datasets["small"]}},
                         data={"url": url}, train={"global_batch": 8, "micro_batch": 8, "max_steps": 1})
    raw = merge(raw, {k: v for k, v in sections.items() if k != "data"})
    raw["cluster"] = {**CLUSTER, "storage_path": str(tmp_path / "runs")}
    config = build_pipeline(raw)  # nothing wrong without the data
    with pytest.raises(ConfigError) as err:
        preflight(config)
    assert err.value.key == key and "trial" in err.value.message, err.value


def test_a_finetune_checkpoint_run_is_checked_at_the_fine_tuning_resolution(datasets: dict, tmp_path: Path) -> None:
    """A run directory names its own model: a `finetune.resolution` its patches cannot tile failed in every worker."""
    import yaml

    from vitscale.train import checkpoint as ckpt

    run = tmp_path / "run"
    directory = run / "checkpoint_000000001"
    directory.mkdir(parents=True)
    (directory / "weights.bin").write_bytes(b"x" * 10)
    ckpt.write_rank_part(directory, rank=0, stream_state={"epoch": 0, "position": 1, "seed": 0},
                         train_state=ckpt.TrainState(step=1, world_size=1),
                         config_yaml=yaml.safe_dump({"stages": ["pretrain"], "model": MODEL}))
    for resolution, refused in ((16, False), (20, True)):
        raw = sweep_pipeline(finetune={"checkpoint": str(run), "resolution": resolution,
                                       "data": {"url": datasets["small"]}})
        raw["stages"] = ["finetune"]
        raw["finetune"]["train"]["base_lr"] = 0.01
        raw["cluster"] = {**CLUSTER, "storage_path": str(tmp_path / "runs")}
        config = build_pipeline(raw)
        if not refused:
            preflight(config)
            continue
        with pytest.raises(ConfigError) as err:
            preflight(config)
        assert err.value.key == "finetune.resolution" and "ViT-Ti/8" in err.value.message, err.value


@settings(max_examples=300, deadline=None)
@given(max_t=st.integers(1, 5000), grace=st.integers(1, 600), rf=st.integers(2, 6))
def test_asha_rungs_are_the_milestones_ray_judges_at(max_t: int, grace: int, rf: int) -> None:
    from ray.tune.schedulers.async_hyperband import _Bracket

    from vitscale.stages.sweep_asha import asha_rungs

    assume(grace <= max_t)
    ray_rungs = sorted(milestone for milestone, _ in _Bracket(grace, max_t, rf, s=0)._rungs)
    assert list(asha_rungs(max_t, grace, rf)) == ray_rungs


def test_the_two_final_retrains_are_tagged_like_trials(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Both winners retrain at once: their workers' lines read `[final pretrained]` and `[final scratch]`."""
    import vitscale.launch.ray_train as ray_train
    from vitscale.stages.sweep import _retrain

    labels: list[str | None] = []

    def launched(*args: object, label: str | None = None, **kwargs: object) -> tuple[None, dict]:
        labels.append(label)
        return None, {"test_accuracy": 0.5, "cumulative_exaflops": 1e-9}

    monkeypatch.setattr(ray_train, "launch_training", launched)
    config = build_pipeline(sweep_pipeline())
    selected = {"params": {"finetune.train.base_lr": 0.01}}
    for init in ("weights.pt", None):
        _retrain(config, None, init, tmp_path, "pretrained" if init else "scratch", selected)
    assert labels == ["final pretrained", "final scratch"]


def test_a_pre_training_sweep_refuses_the_masked_patch_objective() -> None:
    raw = sweep_pipeline(sweep={"target": "pretrain", "space": {"train.weight_decay": [0.01, 0.1]}})
    raw["train"] = {**raw.get("train", {}), "objective": "masked_patch"}
    with pytest.raises(ConfigError) as err:
        build_pipeline(raw)
    assert err.value.key == "sweep.target" and "masked_patch" in err.value.message


def test_a_sweep_resumed_with_other_settings_is_refused_before_ray(tmp_path: Path) -> None:
    """Tune's restore keeps the first run's trials, values and finished scores whatever the pipeline says now:
    re-run with another grid and recipe, a finished sweep answered with its old trials (lr 0.01/0.03) and exit 0.
    The search's folder records the config it began with; a re-run is compared with it, as a resumed run is."""
    import torch

    from vitscale.models import create_model, export_state_dict
    from vitscale.stages.sweep_checks import SETTINGS, refuse_changed_sweep, sweep_record
    from vitscale.stages.sweep_space import sweep_part

    def downstream(seed: int) -> str:
        write_dataset("synthetic", str(tmp_path / "data"), shard_size=20, max_side=16, progress=False, seed=seed,
                      splits={"train": 0.7, "test": 0.3}, source_options={"count": 30, "classes": 3, "image_size": 16})
        return str(tmp_path / "data")

    url = downstream(0)
    weights = tmp_path / "w.pt"
    torch.manual_seed(0)
    export_state_dict(create_model("ViT-Ti/8", num_classes=5, img_size=16, depth=1, width=32, mlp_dim=32, heads=2),
                      weights)

    def pipeline(sweep: dict | None = None, **train: object) -> dict:
        raw = sweep_pipeline(finetune={"checkpoint": str(weights), "data": {"url": url},
                                       "train": {"base_lr": 0.01, **train}},
                             sweep={"space": {"finetune.train.base_lr": [0.01, 0.03]}, **(sweep or {})})
        raw["cluster"] = {**CLUSTER, "storage_path": str(tmp_path / "runs")}
        return raw

    first = preflight(build_pipeline(pipeline()))
    folder = tmp_path / "runs" / first.run_name / sweep_part("")
    folder.mkdir(parents=True)
    (folder / SETTINGS).write_text(sweep_record(first))  # what `_search` writes as the Tune experiment begins
    for sweep, train, key in [({"space": {"finetune.train.base_lr": [0.1, 0.3]}}, {}, "sweep.space.finetune.train.base_lr"),
                              ({}, {"weight_decay": 0.5}, "finetune.train.weight_decay"),
                              ({"scheduler": "asha"}, {}, "sweep.scheduler")]:
        with pytest.raises(ConfigError) as err:
            preflight(build_pipeline(pipeline(sweep, **train)))
        assert err.value.key == key and "cannot resume the sweep in" in err.value.message, err.value
    # How the search is scheduled and watched may change, and so may the swept key's own value outside the grid.
    preflight(build_pipeline(pipeline({"max_concurrent": 1, "trial_retries": 3, "retrain": False}, base_lr=0.5,
                                      log_every=3)))
    refuse_changed_sweep(first, tmp_path / "elsewhere")  # no record: a new sweep (or one an older vitscale began)
    # The same settings on the dataset written again with other images: the finished trials scored the old one.
    import shutil

    shutil.rmtree(url)
    downstream(1)
    with pytest.raises(ConfigError) as err:
        preflight(build_pipeline(pipeline()))
    assert err.value.key == "finetune.data.url" and "not the one it was trained on" in err.value.message, err.value
