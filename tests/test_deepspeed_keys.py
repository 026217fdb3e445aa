"""`train.deepspeed`: DeepSpeed settings merged over the generated config, vitscale's own keys refused."""

from __future__ import annotations

import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vitscale.config.checks import ConfigError
from vitscale.stages import build_pipeline
from vitscale.train.deepspeed_keys import OWNED, check_overrides, merge_overrides

PIPELINE = {"stages": ["pretrain"], "data": {"url": "/nowhere/data"}, "train": {"global_batch": 8, "micro_batch": 8},
            "cluster": {"num_workers": 1, "use_gpu": False, "cpus_per_worker": 1, "storage_path": "/nowhere/runs"}}
"""A pipeline whose stage checks run (they hold the DeepSpeed settings' check), with nothing on disk."""

_keys = st.sampled_from(["a", "b", "c", "zero_optimization", "reduce_bucket_size"])
_trees = st.recursive(st.integers(), lambda inner: st.dictionaries(_keys, inner, max_size=3), max_leaves=8)


@given(st.dictionaries(_keys, _trees, max_size=4), st.dictionaries(_keys, _trees, max_size=4))
def test_merge_keeps_every_override_and_every_other_generated_key(generated: dict, overrides: dict) -> None:
    merged = merge_overrides(generated, overrides)

    def leaves(tree: object, prefix: tuple = ()) -> dict:
        if isinstance(tree, dict):  # an empty mapping adds no key
            return {k: v for key, sub in tree.items() for k, v in leaves(sub, (*prefix, key)).items()}
        return {prefix: tree}

    for path, value in leaves(overrides).items():  # every override is in the result
        node = merged
        for part in path:
            node = node[part]
        assert node == value
    for key in generated.keys() - overrides.keys():  # untouched keys are the generated ones
        assert merged[key] == generated[key]


def test_engine_config_takes_unowned_keys() -> None:
    from vitscale.train.batch import derive_batch
    from vitscale.train.config import TrainConfig
    from vitscale.train.engine import deepspeed_config

    train = TrainConfig(global_batch=16, micro_batch=8, zero_stage=2, deepspeed={
        "zero_optimization": {"reduce_bucket_size": 500000, "overlap_comm": True}, "communication_data_type": "fp32"})
    config = deepspeed_config(train, derive_batch(16, 8, 1), on_gpu=False)
    assert config["zero_optimization"]["reduce_bucket_size"] == 500000
    assert config["zero_optimization"]["overlap_comm"] is True
    assert config["zero_optimization"]["stage"] == 2  # what vitscale generated stays
    assert config["communication_data_type"] == "fp32" and config["train_batch_size"] == 16
    # The sections a user's settings merge into key by key, checked to be mappings (`MERGED_SECTIONS`): every
    # section vitscale writes that it does not own, at any stage.
    from vitscale.train.deepspeed_keys import MERGED_SECTIONS

    for stage in (0, 1, 2, 3):
        plain = deepspeed_config(TrainConfig(zero_stage=stage), derive_batch(4, 4, 1), on_gpu=True)
        assert {k for k, v in plain.items() if isinstance(v, dict) and k not in OWNED} == set(MERGED_SECTIONS)


@pytest.mark.parametrize(("overrides", "named", "instead"), [
    ({"train_batch_size": 64}, "train.deepspeed.train_batch_size", "train.global_batch"),
    ({"zero_optimization": {"stage": 3}}, "train.deepspeed.zero_optimization.stage", "train.zero_stage"),
    ({"optimizer": {"type": "Lamb"}}, "train.deepspeed.optimizer", "train.optimizer"),
    ({"zero_optimization": {"offload_optimizer": {"device": "nvme"}}},
     "train.deepspeed.zero_optimization.offload_optimizer", "train.offload"),
    # DeepSpeed's deprecated spelling of offload_optimizer: every worker's engine refused vitscale's torch optimizer
    ({"zero_optimization": {"cpu_offload": True}}, "train.deepspeed.zero_optimization.cpu_offload", "train.offload"),
    # autocast: another precision than train.precision, which the run directory records
    ({"torch_autocast": {"enabled": True}}, "train.deepspeed.torch_autocast", "train.precision"),
])
def test_owned_keys_are_refused_when_the_pipeline_loads(overrides: dict, named: str, instead: str) -> None:
    with pytest.raises(ConfigError) as error:
        build_pipeline({"stages": [], "train": {"deepspeed": overrides}})
    assert error.value.key == named and instead in error.value.message


def test_every_owned_key_is_refused() -> None:
    for dotted in OWNED:
        tree: dict = {}
        node = tree
        *path, last = dotted.split(".")
        for part in path:
            node = node.setdefault(part, {})
        node[last] = 1
        with pytest.raises(ConfigError):
            check_overrides(tree)
    check_overrides({"zero_optimization": {"reduce_bucket_size": 1}, "flops_profiler": {"enabled": True}})


@pytest.mark.parametrize(("overrides", "named", "says"), [
    # A section DeepSpeed's own model refuses, when the pipeline loads instead of on every worker.
    ({"zero_optimization": {"overlap_com": True}}, "train.deepspeed.zero_optimization.overlap_com",
     "refuses it: Extra inputs are not permitted (did you mean 'overlap_comm'?)"),
    ({"zero_optimization": {"reduce_bucket_size": "big"}}, "train.deepspeed.zero_optimization.reduce_bucket_size",
     "valid integer"),
    ({"tensorboard": {"enabeld": True}}, "train.deepspeed.tensorboard.enabeld", "(did you mean 'enabled'?)"),
    # A value DeepSpeed's parser asserts on.
    ({"communication_data_type": "fp7"}, "train.deepspeed", "Invalid communication_data_type"),
    # A key this DeepSpeed no longer supports (its DeepSpeedConfigError was a traceback from `vitscale config`).
    ({"amp": {"enabled": True}}, "train.deepspeed.amp", "Apex AMP integration has been removed"),
    ({"zero_optimization": {"mics_shard_size": 2}}, "train.deepspeed.zero_optimization.mics_shard_size", "removed"),
    # A misspelt section, which DeepSpeed would have ignored.
    ({"zero_optimisation": {"reduce_bucket_size": 1}}, "train.deepspeed.zero_optimisation",
     "reads no such key (did you mean 'zero_optimization'?)"),
    # One setting under both of the names DeepSpeed reads it by (its field's and its alias).
    ({"zero_optimization": {"param_persistence_threshold": 0, "stage3_param_persistence_threshold": 5}},
     "train.deepspeed.zero_optimization.param_persistence_threshold",
     "refuses it: Extra inputs are not permitted (the section sets it under its other name too: set it once)"),
])
def test_settings_deepspeed_refuses_are_named_when_the_pipeline_loads(overrides: dict, named: str, says: str) -> None:
    with pytest.raises(ConfigError) as error:
        build_pipeline({**PIPELINE, "train": {**PIPELINE["train"], "deepspeed": overrides}})
    assert error.value.key == named and says in error.value.message and "DeepSpeed 0." in error.value.message


@pytest.mark.parametrize("stage", [1, 3])
@pytest.mark.parametrize(("overrides", "named"), [({"zero_optimization": "x"}, "zero_optimization"),
                                                  ({"zero_optimization": None}, "zero_optimization"),
                                                  ({"timers": [1]}, "timers")])
def test_a_merged_section_that_is_no_mapping_is_named_when_the_pipeline_loads(overrides: dict, named: str,
                                                                               stage: int) -> None:
    """A section vitscale writes keys of its own into, given as something else than a mapping: named, at every
    stage (at ZeRO 3 it was a traceback from vitscale's own reading of the section; at ZeRO 1 DeepSpeed's
    refusal, naming no key)."""
    with pytest.raises(ConfigError) as error:
        build_pipeline({**PIPELINE, "train": {**PIPELINE["train"], "zero_stage": stage, "deepspeed": overrides}})
    assert error.value.key == f"train.deepspeed.{named}", error.value
    assert f"must be a mapping of DeepSpeed's {named} settings" in error.value.message, error.value


def test_settings_deepspeed_reads_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """DeepSpeed's sections load as they are, and a key like none DeepSpeed reads is left to it (which ignores it).
    The driver's environment is as it was: its DS_ACCELERATOR would reach every worker, GPU ones too."""
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    settings = {"zero_optimization": {"reduce_bucket_size": 1000, "overlap_comm": True},
                "flops_profiler": {"enabled": False}, "activation_checkpointing": {}, "aio": {},
                "tensorboard": {"enabled": False}, "communication_data_type": "fp32", "my_own_notes": "kept"}
    config = build_pipeline({**PIPELINE, "train": {**PIPELINE["train"], "deepspeed": settings}})
    assert config.train.deepspeed == settings
    assert "DS_ACCELERATOR" not in os.environ


def test_a_fine_tuning_recipes_settings_are_checked_too() -> None:
    raw = {**PIPELINE, "stages": ["pretrain", "finetune"],
           "finetune": {"data": {"url": "/nowhere/downstream"}, "train": {
               "base_lr": 0.01, "global_batch": 8, "micro_batch": 8,
               "deepspeed": {"zero_optimization": {"overlap_com": True}}}}}
    with pytest.raises(ConfigError) as error:
        build_pipeline(raw)
    assert error.value.key == "finetune.train.deepspeed.zero_optimization.overlap_com"


def test_every_key_kept_on_resume_is_one_deepspeed_reads() -> None:
    """`FIXED_ON_RESUME` names DeepSpeed's own keys (a misspelt one would guard nothing): the top-level ones its
    config parser asks for, the ZeRO ones fields (or aliases) of its ZeRO config, none of them vitscale's own."""
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    from vitscale.train.batch import derive_batch
    from vitscale.train.config import TrainConfig
    from vitscale.train.deepspeed_keys import FIXED_ON_RESUME, ReadKeys
    from vitscale.train.engine import deepspeed_config

    train = TrainConfig(global_batch=8, micro_batch=8, precision="fp32")
    config = ReadKeys(deepspeed_config(train, derive_batch(8, 8, 1), on_gpu=False))
    DeepSpeedConfig(config)
    zero = {name for name, f in DeepSpeedZeroConfig.model_fields.items() for name in (name, f.alias) if name}
    for key in FIXED_ON_RESUME:
        section, _, inner = key.partition(".")
        assert (inner in zero) if section == "zero_optimization" else (section in config.read and not inner), key
        assert not any(key == owned or key.startswith(f"{owned}.") for owned in OWNED), key
