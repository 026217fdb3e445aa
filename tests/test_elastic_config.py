"""`cluster.num_workers: [MIN, MAX]`: the range's rules, checked before Ray starts, and the batch plan
at every world size an elastic run reaches (the global batch never changes)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vitscale.config import ConfigError
from vitscale.stages import build_pipeline
from vitscale.train.batch import derive_batch, elastic_split, loss_weight, resized_batch


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


def test_a_range_the_global_batch_does_not_divide_is_accepted() -> None:
    _pipeline([2, 5], global_batch=48)  # 5 does not divide 48: shares of 9 and 10, weighted
    _pipeline([8, 32], global_batch=4096, micro_batch=64)  # 24 GPUs (3 nodes of 8) among them
    _pipeline([2, 4], global_batch=48)  # 2, 3 and 4 all divide 48


def test_a_range_that_would_leave_a_micro_batch_empty_is_refused_in_one_line() -> None:
    with pytest.raises(ConfigError) as caught:  # micro batch 1: a share of 9 cannot fill ceil(10 / 1) = 10
        _pipeline([4, 5], global_batch=48, micro_batch=1)
    message = str(caught.value)
    assert "train.global_batch" in message and " 5 workers" in message and "train.micro_batch >= 2" in message
    assert "\n" not in message
    _pipeline([3, 4], global_batch=48, micro_batch=1)  # 3 and 4 divide 48: whole micro-batches of 1
    with pytest.raises(ValueError, match="more workers than examples"):
        elastic_split(4, 2, range(2, 6))


def test_the_plan_at_24_of_4096() -> None:
    plan = resized_batch(4096, 64, 24)  # shares of 170 and 171: ceil(171 / 64) = 3 micro-batches
    assert (plan.micro_batch, plan.grad_accum_steps, plan.even) == (57, 3, False)
    assert [plan.share(r) for r in range(24)].count(171) == 4096 - 24 * 170
    assert plan.micro_sizes(0) == (57, 57, 56) and plan.micro_sizes(2) == (57, 57, 57)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 64), st.integers(1, 16), st.integers(1, 64))
def test_the_resized_plan_keeps_the_global_batch(share: int, world: int, micro: int) -> None:
    plan = resized_batch(share * world, micro, world)
    assert plan.micro_batch * plan.grad_accum_steps * plan.world_size == plan.global_batch == share * world
    assert plan.micro_batch <= micro
    if (share * world) % (micro * world) == 0 or share <= micro:  # where the fixed rule accepts, the same plan
        assert derive_batch(share * world, micro, world) == plan


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 512), st.integers(1, 128), st.integers(1, 40))
def test_the_fixed_rule_accepts_a_whole_share_below_the_micro_batch(global_batch: int, micro: int, world: int) -> None:
    """`micro_batch` is a ceiling: a share that fits in one pass is that pass (a laptop's `global_batch: 8` at the
    default 64); a refusal's first suggestion is a global batch the rule accepts."""
    share, left = divmod(global_batch, world)
    try:
        plan = derive_batch(global_batch, micro, world)
    except ValueError as exc:
        assert left or (share > micro and share % micro), (global_batch, micro, world)
        suggested = int(str(exc).split(".global_batch to ")[1].split(" ")[0])
        assert derive_batch(suggested, micro, world).global_batch == suggested
        return
    assert plan == resized_batch(global_batch, micro, world) and plan.even
    assert plan.micro_batch == (share if share < micro else micro)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 512), st.integers(1, 64), st.integers(1, 40))
def test_any_plan_takes_the_whole_global_batch_and_weights_it_to_its_mean(global_batch: int, micro: int,
                                                                          world: int) -> None:
    """Every rank accumulates the same number of micro-batches, none empty, at most `micro` examples each,
    together the global batch; the loss weights make the step's gradient the global batch's mean: the
    weighted per-micro-batch means, each divided by the accumulation steps (DeepSpeed) and averaged over
    the ranks, are (1/G) x the sum of per-example losses. Even plans weigh exactly 1.0."""
    from fractions import Fraction

    try:
        plan = resized_batch(global_batch, micro, world)
    except ValueError:
        assert world > global_batch or (global_batch % world and micro == 1)  # only what cannot work
        return
    sizes = [plan.micro_sizes(r) for r in range(world)]
    assert {len(s) for s in sizes} == {plan.grad_accum_steps} and min(map(min, sizes)) >= 1
    assert sum(map(sum, sizes)) == global_batch and max(map(max, sizes)) == plan.micro_batch <= micro
    # DeepSpeed's assertion holds for the config the engine gets: train_batch_size = micro x accum x world
    assert plan.micro_batch * plan.grad_accum_steps * world >= global_batch
    # per-example losses l_i = 1, 2, 3, ... in global-batch order; each micro-batch's mean L, weighted
    losses = iter(range(1, global_batch + 1))
    step = Fraction(0)
    for s in sizes:
        for n in s:
            mean = Fraction(sum(next(losses) for _ in range(n)), n)
            assert loss_weight(n, plan) == n * world * plan.grad_accum_steps / global_batch
            step += Fraction(n * world * plan.grad_accum_steps, global_batch) * mean / plan.grad_accum_steps
    assert step / world == Fraction(global_batch + 1, 2)  # the global batch's mean loss
    if global_batch % world == 0:
        assert plan.even and all(loss_weight(n, plan) == 1.0 for s in sizes for n in s)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 200), st.integers(1, 8), st.integers(1, 60), st.integers(0, 260))
def test_the_sizes_without_a_plan_are_found_without_trying_each(global_batch: int, micro: int, lo: int,
                                                               extra: int) -> None:
    """`unshareable` (a closed form: a range may reach [1, 10**12], which trying each size hung on) names the
    very sizes at which `resized_batch` has no plan."""
    from vitscale.train.batch import _LISTED, unshareable

    sizes = range(lo, lo + extra + 1)
    failing = []
    for w in sizes:
        try:
            resized_batch(global_batch, micro, w)
        except ValueError:
            failing.append(w)
    uneven, empty = unshareable(global_batch, micro, sizes)
    above = [w for w in failing if w > global_batch]
    assert uneven == [w for w in failing if w <= global_batch][:_LISTED + 1]
    if above:  # one span, from just past the global batch (or the range's start) to its end
        assert empty == (above[0], above[-1]) and above == list(range(above[0], above[-1] + 1))
    else:
        assert empty is None


def test_a_range_reaching_far_past_the_global_batch_is_refused_at_once() -> None:
    """`num_workers: [1, 1099511627776]` walked every size: preflight never returned (and [1, 10**7] took 27 s,
    its line naming ten million sizes)."""
    with pytest.raises(ValueError, match=r"cannot be shared over 9-1099511627776 workers"):
        elastic_split(8, 4, range(1, 2**40 + 1))
    with pytest.raises(ValueError, match=r"over 3, 5, 6, 7, 9, .*, \.\.\. workers"):
        elastic_split(2**40, 1, range(1, 2**40 + 1))
