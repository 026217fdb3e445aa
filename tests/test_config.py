"""Pipeline config: YAML -> typed dataclasses, overrides, and errors that name the key and the file."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from vitscale.cli import main
from vitscale.config import ConfigError, PipelineConfig, apply_override, to_dict
from vitscale.stages import build_pipeline, load_pipeline

REPO = Path(__file__).resolve().parents[1]
PIPELINES = sorted((REPO / "pipelines").rglob("*.yaml"))


def write(tmp_path: Path, data: dict, name: str = "p.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize("path", PIPELINES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_shipped_pipeline_loads(path: Path) -> None:
    config = load_pipeline(path)
    assert isinstance(config, PipelineConfig)
    # What is written into run directories loads back to the same config.
    assert build_pipeline(to_dict(config)) == config


def test_pretrain_pipeline_is_the_papers_imagenet21k_recipe() -> None:
    config = load_pipeline(REPO / "pipelines" / "pretrain.yaml")
    t = config.train
    assert (t.adam_beta1, t.adam_beta2, t.global_batch, t.base_lr, t.weight_decay) == (0.9, 0.999, 4096, 1e-3, 0.03)
    assert (t.warmup_steps, t.lr_decay, t.epochs, t.grad_clip, t.zero_stage, t.precision) == (
        10_000, "linear", 90, 1.0, 1, "bf16")
    assert config.model.name == "ViT-B/16" and config.model.img_size == 224 and config.model.options["dropout"] == 0.1
    assert config.cluster.use_gpu


def test_recipes_override_only_what_table3_changes() -> None:
    config = load_pipeline(REPO / "pipelines" / "recipes" / "jft-vit-l16.yaml")
    assert config.model.name == "ViT-L/16" and config.train.base_lr == 4e-4 and config.train.epochs == 7
    assert config.train.weight_decay == 0.1 and config.model.options["dropout"] == 0.0 and config.train.loss == "sigmoid"
    assert config.train.global_batch == 4096  # inherited from pretrain.yaml


def test_precedence_cli_over_file_over_defaults(tmp_path: Path) -> None:
    path = write(tmp_path, {"train": {"base_lr": 0.002, "warmup_steps": 5}})
    config = load_pipeline(path, ["train.base_lr=4e-4"])
    assert config.train.base_lr == 4e-4          # CLI
    assert config.train.warmup_steps == 5        # file
    assert config.train.weight_decay == 0.03     # default


def test_override_parses_yaml_values() -> None:
    raw = apply_override({}, "fewshot.shots=[1, 5]")
    raw = apply_override(raw, "train.grad_clip=null")
    config = build_pipeline(raw)
    assert config.fewshot.shots == (1, 5) and config.train.grad_clip is None


@pytest.mark.parametrize("data, key", [
    ({"train": {"bogus": 1}}, "train.bogus"),
    ({"trian": {}}, "trian"),
    ({"train": {"micro_batch": "lots"}}, "train.micro_batch"),
    ({"train": {"global_batch": -8}}, "train.global_batch"),
    ({"train": {"zero_stage": 4}}, "train.zero_stage"),
    ({"train": {"fault": {"kill_rank": 1}}}, "train.fault"),
    ({"model": {"dropout": 1.5}}, "model.dropout"),
    ({"model": {"classifier": "cls"}}, "model.classifier"),
    ({"train": {"use_gpu": True}}, "train.use_gpu"),
    ({"train": {"global_batch": 100, "micro_batch": 64}}, "train.global_batch"),
    ({"train": {"offload": True, "zero_stage": 0}}, "train.offload"),
    ({"data": {"create_if_missing": {"splits": {"train": 0.5}}}}, "data.create_if_missing.splits"),
    ({"data": {"create_if_missing": {"kind": "fractal", "multi_label": True}}}, "data.create_if_missing.multi_label"),
    ({"fewshot": {"create_if_missing": {"kind": "digits", "multi_label": True}}}, "fewshot.create_if_missing.multi_label"),
    ({"stages": ["pretrain", "dance"]}, "stages"),
])
def test_bad_config_names_the_key_and_the_file(tmp_path: Path, data: dict, key: str) -> None:
    path = write(tmp_path, data, "bad.yaml")
    with pytest.raises(ConfigError) as err:
        load_pipeline(path)
    assert err.value.key == key
    assert str(path) in str(err.value)


def test_indivisible_batch_suggests_a_fix() -> None:
    with pytest.raises(ConfigError, match="try 512 or 1024"):
        build_pipeline({"train": {"global_batch": 600, "micro_batch": 64}, "cluster": {"num_workers": 8}})


def test_bad_yaml_and_missing_file(tmp_path: Path) -> None:
    broken = tmp_path / "broken.yaml"
    broken.write_text("train: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_pipeline(broken)
    with pytest.raises(ConfigError, match="cannot read"):
        load_pipeline(tmp_path / "absent.yaml")


def test_a_file_that_is_not_utf8_is_one_line_naming_it(tmp_path: Path) -> None:
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes("name: caf\xe9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match="not UTF-8") as err:
        load_pipeline(latin1)
    assert err.value.key == "<file>" and err.value.source == str(latin1)


@pytest.mark.parametrize("text", [
    "train: {base_lr: 0.1}\ntrain: {micro_batch: 8}\n",  # a second section would drop the first's settings
    "train:\n  base_lr: 0.1\n  base_lr: 0.2\n",
    "cluster: {num_workers: 1, num_workers: 2}\n",
])
def test_a_key_given_twice_is_refused_not_overwritten(tmp_path: Path, text: str) -> None:
    path = tmp_path / "twice.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match="twice in one mapping"):
        load_pipeline(path)
    with pytest.raises(ConfigError, match="twice in one mapping"):
        load_pipeline(write(tmp_path, {}), ["train.deepspeed={a: 1, a: 2}"])


def test_yaml_merge_keys_are_not_repeats(tmp_path: Path) -> None:
    path = tmp_path / "merge.yaml"
    path.write_text("train: &t {base_lr: 0.1, micro_batch: 8, global_batch: 64}\n"
                    "finetune: {train: {<<: *t, base_lr: 0.2}}\n")
    assert load_pipeline(path).finetune.train["base_lr"] == 0.2


def test_bad_override_names_the_key(tmp_path: Path) -> None:
    path = write(tmp_path, {})
    with pytest.raises(ConfigError, match="train.base_lr"):
        load_pipeline(path, ["train.base_lr=fast"])
    # No value, or a key with an empty part: "=5" was refused as an unknown key named '', "a..b=1" as the key ''.
    for item in ("train.base_lr", "=5", "train.=5", "train..base_lr=1"):
        with pytest.raises(ConfigError, match="dotted.key=value"):
            load_pipeline(path, [item])


def test_extends_cycle_is_an_error(tmp_path: Path) -> None:
    write(tmp_path, {"extends": "b.yaml"}, "a.yaml")
    write(tmp_path, {"extends": "a.yaml"}, "b.yaml")
    with pytest.raises(ConfigError, match="cycle"):
        load_pipeline(tmp_path / "a.yaml")


def test_cli_config_prints_resolved_yaml(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = write(tmp_path, {"train": {"base_lr": 0.002}})
    assert main(["config", str(path), "--set", "train.warmup_steps=7"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["train"]["base_lr"] == 0.002 and printed["train"]["warmup_steps"] == 7


def test_cli_reports_config_errors_without_traceback(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = write(tmp_path, {"train": {"global_batch": -1}})
    assert main(["config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "train.global_batch" in err and str(path) in err and "Traceback" not in err


def test_cli_finds_pipelines_by_name(capsys: pytest.CaptureFixture) -> None:
    assert main(["config", "jft-vit-h14"]) == 0
    assert "ViT-H/14" in capsys.readouterr().out


def test_a_stage_listed_twice_is_refused() -> None:
    """A stage's outputs live at fixed places in the run: a second run of it would resume the first."""
    with pytest.raises(ConfigError, match=r"^stages: each stage runs once in a pipeline; \['pretrain', 'fewshot', "
                                          r"'pretrain'\] lists pretrain more than once"):
        build_pipeline({"name": "p", "stages": ["pretrain", "fewshot", "pretrain"], "data": {"url": "/d"}})
