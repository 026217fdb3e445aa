"""`cluster.num_workers: [MIN, MAX]`: the range's rules, checked before Ray starts, and the batch plan
at every world size an elastic run reaches (the global batch never changes)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vitscale.config import ConfigError
from vitscale.stages import build_pipeline
from vitscale.train.optim import derive_batch, resized_batch


def _pipeline(num_workers: object, global_batch: int = 48, micro_batch: int = 4):
    return build_pipeline({"stages": ["pretrain"],
                           "model": {"name": "ViT-Ti/8", "img_size": 16, "depth": 1, "width": 32, "mlp_dim": 32,
                                     "heads": 2},
                           "data": {"url": "/nowhere"},
                           "train": {"global_batch": global_batch, "micro_batch": micro_batch, "max_steps": 2},
                           "cluster": {"num_workers": num_workers, "use_gpu": False}})


def test_a_range_is_elastic_and_an_int_is_not() -> None:
    cluster = _pipeline([2, 4]).cluster
    assert (cluster.min_workers, cluster.max_workers, cluster.elastic) == (2, 4, True)
    assert cluster.scaling() == (2, 4) and cluster.fixed_world_size is None and list(cluster.world_sizes) == [2, 3, 4]
    fixed = _pipeline(4).cluster
    assert (fixed.elastic, fixed.scaling(), fixed.fixed_world_size) == (False, 4, 4)
    assert _pipeline([3, 3]).cluster.scaling() == 3  # a range of one size is a fixed run


@pytest.mark.parametrize("bad", [[4, 2], [0, 2], [1, 2, 3], [2]])
def test_a_bad_range_names_the_key(bad: list[int]) -> None:
    with pytest.raises(ConfigError, match=r"cluster\.num_workers"):
        _pipeline(bad)


def test_a_range_the_global_batch_cannot_split_is_refused_in_one_line() -> None:
    with pytest.raises(ConfigError) as caught:
        _pipeline([2, 5], global_batch=48)  # 5 does not divide 48
    message = str(caught.value)
    assert "train.global_batch" in message and " 5 workers" in message and "60" in message  # lcm(2..5)
    assert "\n" not in message
    _pipeline([2, 4], global_batch=48)  # 2, 3 and 4 all divide 48


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 64), st.integers(1, 16), st.integers(1, 64))
def test_the_resized_plan_keeps_the_global_batch(share: int, world: int, micro: int) -> None:
    plan = resized_batch(share * world, micro, world)
    assert plan.micro_batch * plan.grad_accum_steps * plan.world_size == plan.global_batch == share * world
    assert plan.micro_batch <= micro
    if (share * world) % (micro * world) == 0:  # where the fixed rule accepts the split, it is that same plan
        assert derive_batch(share * world, micro, world) == plan
