"""`train.deepspeed`: DeepSpeed settings merged over the generated config, vitscale's own keys refused."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vitscale.config.checks import ConfigError
from vitscale.stages import build_pipeline
from vitscale.train.deepspeed_keys import OWNED, check_overrides, merge_overrides

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


@pytest.mark.parametrize(("overrides", "named", "instead"), [
    ({"train_batch_size": 64}, "train.deepspeed.train_batch_size", "train.global_batch"),
    ({"zero_optimization": {"stage": 3}}, "train.deepspeed.zero_optimization.stage", "train.zero_stage"),
    ({"optimizer": {"type": "Lamb"}}, "train.deepspeed.optimizer", "train.optimizer"),
    ({"zero_optimization": {"offload_optimizer": {"device": "nvme"}}},
     "train.deepspeed.zero_optimization.offload_optimizer", "train.offload"),
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
