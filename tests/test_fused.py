"""The training path's fused pieces against DeepSpeed's own: the ZeRO 1/2 gradient norm in one
multi-tensor kernel (`train/fused.py`), the one non-finite check (`train/update.py`), torch's fused
optimizer on a GPU, `train.compile`'s switch, and the CPU Adam of `train.offload` built ahead. Real
DeepSpeed engines on a one-rank gloo group."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from vitscale.models import REPEATED_UNITS, create_model
from vitscale.train.batch import derive_batch
from vitscale.train.config import TrainConfig
from vitscale.train.engine import build_cpu_adam, build_engine, check_settings, deepspeed_config
from vitscale.train.optim import optimizer_for, param_groups
from vitscale.train.update import apply_update

pytest.importorskip("deepspeed")

TINY = {"img_size": 16, "depth": 2, "width": 32, "mlp_dim": 64, "heads": 2}


def _engine(stage: int, grad_clip: float | None = 1e-3, fuse: bool = True,  # type: ignore[no-untyped-def]
            precision: str = "fp32"):
    torch.manual_seed(0)
    model = create_model("ViT-Ti/8", num_classes=5, **TINY)
    for p in model.parameters():  # the zero-initialised head would leave most gradients zero
        torch.nn.init.normal_(p, std=0.05)
    train = TrainConfig(global_batch=4, micro_batch=4, zero_stage=stage, precision=precision, grad_clip=grad_clip,
                        weight_decay=0.1, base_lr=1e-2)
    engine = build_engine(model, train, deepspeed_config(train, derive_batch(4, 4, 1), on_gpu=False), on_gpu=False)
    if not fuse:  # DeepSpeed's own per-parameter fp64 norm, as it ships
        engine.optimizer.__dict__.pop("get_grad_norm_direct", None)
        engine.optimizer.__dict__.pop("unscale_and_clip_grads", None)
    return engine


def _step(engine, poison: bool = False) -> bool:  # type: ignore[no-untyped-def]
    torch.manual_seed(1)
    dtype = next(engine.module.parameters()).dtype
    images, labels = torch.randn(4, 3, 16, 16, dtype=dtype), torch.randint(0, 5, (4,))
    loss = torch.nn.functional.cross_entropy(engine(images), labels)
    if poison:
        loss = loss * float("inf")
    engine.backward(loss)
    return apply_update(engine, loss=0.0).read()[0]


@pytest.mark.parametrize("stage", [1, 2])
def test_fused_norm_is_deepspeeds_norm_and_clips_the_same(process_group: None, stage: int) -> None:
    fused, plain = _engine(stage), _engine(stage, fuse=False)
    assert "get_grad_norm_direct" in fused.optimizer.__dict__  # installed on this engine's optimizer
    assert _step(fused) and _step(plain)
    a, b = float(fused.get_global_grad_norm()), float(plain.get_global_grad_norm())
    assert a > 1e-3 and a == pytest.approx(b, rel=1e-6), (a, b)  # the clip (1e-3) acts on this step
    for (name, p), q in zip(fused.module.named_parameters(), plain.module.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6, msg=name)


@pytest.mark.parametrize("stage", [1, 2])
def test_the_weights_are_pointed_at_their_slices_again_only_where_they_moved(process_group: None,
                                                                            monkeypatch: pytest.MonkeyPatch,
                                                                            stage: int) -> None:
    """`keep_weight_views`: DeepSpeed's re-pointing of every weight after each step runs only where the flat
    buffers moved, and the weights after each step are those of DeepSpeed's own step, bit for bit."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    repointed: list[int] = []
    real = DeepSpeedZeroOptimizer._update_model_bit16_weights

    def counted(self: Any, group_index: int) -> None:
        repointed.append(group_index)
        real(self, group_index)

    monkeypatch.setattr(DeepSpeedZeroOptimizer, "_update_model_bit16_weights", counted)
    ours, theirs = _engine(stage, precision="bf16"), _engine(stage, precision="bf16")
    del theirs.optimizer._update_model_bit16_weights  # DeepSpeed's own: every weight, every step
    repointed.clear()
    for _ in range(3):
        assert _step(ours) and _step(theirs)
    assert len(repointed) == 3 * len(theirs.optimizer.bit16_groups)  # theirs alone
    for (name, p), q in zip(ours.module.named_parameters(), theirs.module.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)

    # A buffer that moved (as offloaded states come back): the next step points its weights at the new one.
    flat = ours.optimizer.bit16_groups_flat[0]
    flat.data = flat.data.clone()
    repointed.clear()
    assert _step(ours)
    assert repointed == [0]
    first = ours.optimizer.round_robin_bit16_groups[0][0]
    assert first.data_ptr() == flat.data_ptr() + ours.optimizer.round_robin_bit16_offsets[0][0] * flat.element_size()


@pytest.mark.parametrize("stage", [1, 2])
def test_a_non_finite_gradient_is_not_applied_with_the_fused_norm(process_group: None, stage: int) -> None:
    engine = _engine(stage)
    before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    assert not _step(engine, poison=True)
    assert all(torch.equal(before[n], p) for n, p in engine.module.named_parameters())
    assert _step(engine)  # the next, finite step is applied
    assert any(not torch.equal(before[n], p) for n, p in engine.module.named_parameters())


def test_deepspeed_skips_its_own_overflow_check_in_bf16() -> None:
    train = TrainConfig(global_batch=4, micro_batch=4, zero_stage=1, precision="bf16")
    config = deepspeed_config(train, derive_batch(4, 4, 1), on_gpu=True)
    assert config["bf16"] == {"enabled": True, "check_grad_overflow": False}


def test_stages_0_and_3_carry_no_fused_norm_mark(process_group: None) -> None:
    """The fused norm's mark (`GLOBAL_NORM`) is ZeRO 1 and 2's: ZeRO 3 computes its global norm itself, before
    its update, with the fused kernel (`fuse_zero_3_norm`, `test_one_rank_at_zero_3_takes_the_fused_norm`)."""
    from vitscale.train.fused import fused_norm_installed

    assert "get_grad_norm_direct" not in _engine(0).optimizer.__dict__
    assert not fused_norm_installed(_engine(3))


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_fused_optimizer_is_asked_for_only_on_request(name: str) -> None:
    model = create_model("ViT-Ti/8", num_classes=5, **TINY)
    train = TrainConfig(optimizer=name)
    groups = param_groups(model, train.weight_decay)
    assert optimizer_for(train, groups).defaults.get("fused") in (None, False)
    assert optimizer_for(train, param_groups(model, train.weight_decay), fused=True).defaults["fused"] is True


@pytest.mark.parametrize(("value", "stage", "world", "offload", "gpu", "cpu"), [
    ("auto", 1, 1, False, True, False), ("auto", 0, 1, False, True, False), ("auto", 2, 4, True, True, False),
    ("auto", 3, 1, False, True, False), ("auto", 3, 2, False, False, False), ("auto", 3, 1, True, False, False),
    (True, 1, 1, False, True, True), (True, 3, 2, False, True, True), (False, 1, 1, False, False, False)])
def test_compile_auto_means_on_a_gpu_where_the_graph_holds(value: bool | str, stage: int, world: int,
                                                           offload: bool, gpu: bool, cpu: bool) -> None:
    """ "auto": on a GPU at ZeRO 0-2, and at ZeRO 3 on one rank without offload (its units compiled alone)."""
    train = TrainConfig(compile=value, zero_stage=stage, offload=offload)
    train.validate()
    assert (train.compiles(on_gpu=True, world_size=world), train.compiles(on_gpu=False, world_size=world)) == (
        gpu, cpu)


@pytest.mark.parametrize("stage", [1, 2])
def test_a_non_finite_gradient_in_one_group_updates_no_group(process_group: None, stage: int) -> None:
    """Without clipping, a NaN only in a no-decay parameter's gradient (a bias: the second group) must not
    let the first group's update through: one verdict for the whole step. In bf16, where DeepSpeed's own
    overflow check is off and vitscale's is the only one."""
    engine = _engine(stage, grad_clip=None, precision="bf16")
    bias = engine.module.blocks[0].mlp.fc1.bias
    handle = bias.register_hook(lambda g: g * float("nan"))
    before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    assert not _step(engine)
    assert all(torch.equal(before[n], p) for n, p in engine.module.named_parameters())
    handle.remove()
    assert _step(engine)


@pytest.mark.parametrize(("key", "value"), [("compile", "yes"), ("compile_mode", "fast")])
def test_compile_settings_are_checked(key: str, value: str) -> None:
    from vitscale.config.checks import ConfigError

    with pytest.raises(ConfigError, match=f"train.{key}"):
        TrainConfig(**{key: value}).validate()


GATHERED = {"stage3_param_persistence_threshold": 0, "memory_efficient_linear": True}
"""One rank gathering every parameter block by block, as many ranks gather all but the smallest."""


def _zero3(leaves: bool, checkpointing: bool, gathered: bool = True,  # type: ignore[no-untyped-def]
           micro: int = 4):
    torch.manual_seed(0)
    model = create_model("ViT-Ti/8", num_classes=5, activation_checkpointing=checkpointing, **TINY)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.05)
    zero: dict = {} if leaves else {"leaf_module": {"classes": []}}
    overrides = {"zero_optimization": {**zero, **(GATHERED if gathered else {})}}
    train = TrainConfig(global_batch=4, micro_batch=micro, zero_stage=3, precision="fp32", grad_clip=1e-3,
                        weight_decay=0.1, base_lr=1e-2, deepspeed=overrides)
    parameters = sum(p.numel() for p in model.parameters())  # as a worker passes it: a bucket the model's size
    return build_engine(model, train, deepspeed_config(train, derive_batch(4, micro, 1), on_gpu=False,
                                                       parameters=parameters), on_gpu=False)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_zero_3_gathers_each_block_whole_and_trains_the_same(process_group: None, checkpointing: bool) -> None:
    """ZeRO-3's hooks sit on each transformer block instead of each layer (`deepspeed_config`): fewer hooks,
    the same partitioned parameters, the same steps (with activation checkpointing's recompute too)."""
    from vitscale.train.engine import whole_weights

    leaves, layers = _zero3(True, checkpointing), _zero3(False, checkpointing)
    assert [type(m).__name__ for m in leaves.module.modules() if getattr(m, "_z3_leaf", False)] == ["Block"] * 2
    assert not any(getattr(m, "_z3_leaf", False) for m in layers.module.modules())
    assert all(p.ds_numel and p.numel() == 0 for p in leaves.module.parameters())  # still partitioned
    for _ in range(3):
        assert _step(leaves) and _step(layers)
    with whole_weights(leaves) as a, whole_weights(layers) as b:
        for (name, p), q in zip(a.named_parameters(), b.parameters()):
            torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)


def test_zero_3_names_the_zoos_units_as_leaves_wherever_it_gathers() -> None:
    """Leaves where ZeRO 3 gathers weights (several ranks, offload, a persistence threshold set back by the user,
    under either of DeepSpeed's names); none where one rank keeps them whole (a leaf's backward hook would break
    the compiled graph at every block) or below ZeRO 3; a user's own kept."""
    from vitscale.models import create_model as make
    from vitscale.train.engine import gathers

    def zero(stage: int = 3, world: int = 1, **train: Any) -> dict:
        plan = derive_batch(4 * world, 4, world)
        return deepspeed_config(TrainConfig(zero_stage=stage, global_batch=4 * world, micro_batch=4, **train), plan,
                                on_gpu=True)["zero_optimization"]

    units = {"classes": list(REPEATED_UNITS)}
    assert zero(world=2)["leaf_module"] == zero(offload=True)["leaf_module"] == units
    for back in ({"stage3_param_persistence_threshold": 0}, {"stage3_model_persistence_threshold": 10**6},
                 {"model_persistence_threshold": 10**6}):
        assert zero(deepspeed={"zero_optimization": back})["leaf_module"] == units, back
    assert "leaf_module" not in zero()
    assert not gathers({"param_persistence_threshold": sys.maxsize})  # DeepSpeed's other name, read the same
    assert gathers({"param_persistence_threshold": sys.maxsize, "model_persistence_threshold": 10**6})
    assert gathers({}) and gathers({"stage3_param_persistence_threshold": 10**9})
    assert zero(deepspeed={"zero_optimization": {"leaf_module": {"classes": []}}})["leaf_module"] == {"classes": []}
    for stage in (0, 1, 2):
        assert "leaf_module" not in zero(stage) and "leaf_module" not in zero(stage, world=2)
    named = {f"{type(m).__module__}.{type(m).__qualname__}" for name in ("ViT-Ti/16", "R26x1", "R26x1+ViT-Ti/16")
             for m in make(name, num_classes=2, img_size=32).modules()}
    assert set(REPEATED_UNITS) <= named  # each unit exists in the zoo: no name DeepSpeed would fail to match


def test_zero_sizes_its_gradient_bucket_to_the_model() -> None:
    """ZeRO allocates its bucket whole (ZeRO 3 at start, ZeRO 1 and 2 at every step): no larger than the model's
    gradients, where the worker knows their count; DeepSpeed's default where it does not, or where the model is
    larger; a user's kept; none at ZeRO 0."""
    from vitscale.train.engine import REDUCE_BUCKET

    def bucket(stage: int = 3, parameters: int | None = 5_000, **train: Any) -> int | None:
        return deepspeed_config(TrainConfig(zero_stage=stage, **train), derive_batch(4, 4, 1), on_gpu=True,
                                parameters=parameters)["zero_optimization"].get("reduce_bucket_size")

    assert bucket() == 5_000 and bucket(parameters=10**9) == REDUCE_BUCKET
    assert bucket(parameters=None) is None and bucket(stage=0) is None
    assert bucket(stage=1) == bucket(stage=2) == 5_000
    assert bucket(deepspeed={"zero_optimization": {"reduce_bucket_size": 123}}) == 123


def test_zero_3_keeps_one_ranks_parameters_whole() -> None:
    """Only where the partition is the whole parameter (one rank) and the weights stay on the GPU (no offload)."""
    from vitscale.train.one_rank import ONE_RANK_ZERO_3

    def zero(world: int, **train: Any) -> dict:
        plan = derive_batch(4 * world, 4, world)
        return deepspeed_config(TrainConfig(zero_stage=3, global_batch=4 * world, micro_batch=4, **train), plan,
                                on_gpu=True)["zero_optimization"]

    assert ONE_RANK_ZERO_3.items() <= zero(1).items()
    for kept in (zero(2), zero(1, offload=True), zero(1, deepspeed={"zero_optimization": GATHERED})):
        assert not {k: v for k, v in ONE_RANK_ZERO_3.items() if kept.get(k) == v}
    # A threshold set back under DeepSpeed's other name for it wins too, and is not set twice (DeepSpeed refuses a
    # section holding both names): what the pipeline's check, which parses it with DeepSpeed's own model, accepts.
    back = TrainConfig(zero_stage=3, deepspeed={"zero_optimization": {"param_persistence_threshold": 0}})
    check_settings(back)
    named = zero(1, deepspeed=back.deepspeed)
    assert named["param_persistence_threshold"] == 0 and "stage3_param_persistence_threshold" not in named


def _count_regathers(engine: Any) -> list[int]:
    """A list that counts the times `engine` frees every weight to gather it again (DeepSpeed's own path, which
    its step takes unless `skip_regather` finds the weights in place, and a checkpoint's save always takes)."""
    count: list[int] = [0]
    original = engine.optimizer.parameter_offload.partition_all_parameters

    def counted() -> None:
        count[0] += 1
        original()

    engine.optimizer.parameter_offload.partition_all_parameters = counted
    return count


@pytest.mark.parametrize("checkpointing", [False, True])
def test_one_rank_at_zero_3_never_gathers_and_trains_as_when_it_does(process_group: None,
                                                                     checkpointing: bool) -> None:
    """With every parameter persistent, each one is whole from the engine's start and after every step, so
    DeepSpeed's gather hooks are removed (they would find nothing to gather or free); the steps are those of
    the engine that gathers them block by block (with activation checkpointing's recompute too)."""
    from vitscale.train.engine import whole_weights
    from vitscale.train.one_rank import weights_kept_whole

    whole, gathered = _zero3(True, checkpointing, gathered=False), _zero3(True, checkpointing)
    assert all(p.ds_persist for p in whole.module.parameters())
    assert not any(p.ds_persist for p in gathered.module.parameters())
    assert weights_kept_whole(whole)  # `skip_regather` installed ...
    assert not weights_kept_whole(gathered)  # ... only where every parameter persists
    hooks = [len(e.optimizer.parameter_offload.forward_hooks + e.optimizer.parameter_offload.backward_hooks)
             for e in (whole, gathered)]
    assert hooks[0] == 0 and hooks[1] > 0  # the engine that gathers keeps its hooks
    regathered = _count_regathers(whole)
    for _ in range(3):
        assert _step(whole) and _step(gathered)
        assert all(p.numel() == p.ds_numel and p.data.data_ptr() == p.ds_tensor.data_ptr()
                   for p in whole.module.parameters())  # each weight a view of its partition, updated in place
        assert all(p.numel() == 0 for p in gathered.module.parameters())
    assert regathered == [0]  # the weights were views of their partitions from the start
    weight = next(whole.module.parameters())
    weight.data = weight.data.clone()  # no longer a view of its partition: the update would not reach it
    for _ in range(2):
        assert _step(whole) and _step(gathered)
    assert regathered == [1] and weight.data.data_ptr() == weight.ds_tensor.data_ptr()  # DeepSpeed's round trip
    with whole_weights(whole) as a, whole_weights(gathered) as b:
        for (name, p), q in zip(a.named_parameters(), b.parameters()):
            torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)


def test_one_rank_at_zero_3_resumes_to_the_uninterrupted_weights(process_group: None, tmp_path: Path) -> None:
    """A checkpoint loaded into an engine whose weights are views of their partitions: the steps after it land
    bit for bit where the uninterrupted run does, so no weight is left a view of storage the load replaced."""
    from vitscale.train.engine import whole_weights

    def steps(engine: Any, seeds: range) -> None:
        for seed in seeds:
            torch.manual_seed(seed)
            images, labels = torch.randn(4, 3, 16, 16), torch.randint(0, 5, (4,))
            engine.backward(torch.nn.functional.cross_entropy(engine(images), labels))
            assert apply_update(engine, loss=0.0).read()[0]

    straight, resumed = _zero3(True, False, gathered=False), _zero3(True, False, gathered=False)
    fresh, gathered = _zero3(True, False, gathered=False), _zero3(True, False)  # never stepped; gathering
    steps(straight, range(3))
    straight.save_checkpoint(str(tmp_path), tag="state")
    steps(resumed, range(10, 12))  # elsewhere: other weights, moments and step counts, all to be replaced
    for engine in (resumed, fresh, gathered):  # the checkpoint's form is ZeRO 3's whichever engine loads it
        engine.load_checkpoint(str(tmp_path), tag="state")
    for engine in (straight, resumed, fresh):  # whole again after the save and the loads, with no hook to gather
        assert not engine.optimizer.parameter_offload.forward_hooks
        assert all(p.numel() == p.ds_numel for p in engine.module.parameters())
    regathered = _count_regathers(resumed)
    for engine in (straight, resumed, fresh, gathered):
        steps(engine, range(3, 6))
    assert regathered[0] <= 1  # at most the first step after the load gathers the views again
    for other in (resumed, fresh, gathered):
        with whole_weights(straight) as a, whole_weights(other) as b:
            for (name, p), q in zip(a.named_parameters(), b.parameters()):
                torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize(("checkpointing", "gathered", "micro"), [(False, False, 4), (True, False, 2),
                                                                  (False, True, 2)])
def test_one_rank_at_zero_3_sends_each_gradient_straight_to_its_partition(process_group: None, checkpointing: bool,
                                                                          gathered: bool, micro: int) -> None:
    """`skip_reduction`: one rank's gradients go from their hooks to their partitions, copied at a step's first
    micro-batch and added after, without ZeRO 3's bucket, reduction and second copy; the weights after every
    step are DeepSpeed's own bit for bit (kept whole or gathered, with activation checkpointing's recompute, two
    micro-batches a step)."""
    from vitscale.train.engine import whole_weights

    hook = "reduce_independent_p_g_buckets_and_remove_grads"
    ours, theirs = (_zero3(True, checkpointing, gathered=gathered, micro=micro) for _ in range(2))
    assert hook in vars(ours.optimizer)  # installed by `build_engine` on this engine's optimizer
    del theirs.optimizer.__dict__[hook]  # DeepSpeed's own: the bucket, its reduction, `partition_grads`
    reduced, deepspeeds = [], getattr(theirs.optimizer, hook)

    def counted(param: Any) -> None:
        reduced.append(param.ds_id)
        deepspeeds(param)

    theirs.optimizer.__dict__[hook] = counted
    for seed in range(3):
        for engine in (ours, theirs):
            torch.manual_seed(seed)
            for _ in range(4 // micro):
                images, labels = torch.randn(micro, 3, 16, 16), torch.randint(0, 5, (micro,))
                engine.backward(torch.nn.functional.cross_entropy(engine(images), labels))
                assert all(p.grad is None for p in engine.module.parameters())  # each in its partition now
                if not engine.is_gradient_accumulation_boundary():
                    engine.step()
            assert apply_update(engine, loss=0.0).read()[0]
    assert len(reduced) == 3 * (4 // micro) * len(list(theirs.module.parameters()))  # the comparison is real
    assert not any(bucket.params for bucket in ours.optimizer.ipg_buckets.values())
    with whole_weights(ours) as a, whole_weights(theirs) as b:
        for (name, p), q in zip(a.named_parameters(), b.parameters()):
            torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)
    for p, q in zip(ours.optimizer.fp32_partitioned_groups_flat, theirs.optimizer.fp32_partitioned_groups_flat):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


@pytest.mark.parametrize(("stage", "micro", "precision"), [(1, 4, "bf16"), (1, 2, "fp32"), (2, 4, "fp32"),
                                                          (2, 2, "bf16")])
def test_one_rank_at_zero_1_and_2_sends_each_gradient_straight_to_its_partition(
        process_group: None, stage: int, micro: int, precision: str) -> None:
    """`skip_reduction` at ZeRO 1 and 2: one rank's gradients go into the contiguous gradient partition where
    ZeRO's bucket, divided by one and reduce-scattered over one rank, would have put them; the steps are
    DeepSpeed's own bit for bit, in bf16 and fp32, at one and two micro-batches a step."""
    from vitscale.train.one_rank import REDUCE_HOOK

    def engine() -> Any:
        torch.manual_seed(0)
        model = create_model("ViT-Ti/8", num_classes=5, **TINY)
        for p in model.parameters():
            torch.nn.init.normal_(p, std=0.05)
        train = TrainConfig(global_batch=4, micro_batch=micro, zero_stage=stage, precision=precision,
                            grad_clip=1e-3, weight_decay=0.1, base_lr=1e-2)
        return build_engine(model, train, deepspeed_config(train, derive_batch(4, micro, 1), on_gpu=False),
                            on_gpu=False)

    ours, theirs = engine(), engine()
    assert REDUCE_HOOK in vars(ours.optimizer)  # installed by `build_engine`
    del theirs.optimizer.__dict__[REDUCE_HOOK]  # DeepSpeed's own: the bucket, its reduction, the copy after
    bucketed: list[int] = []
    deepspeeds = getattr(theirs.optimizer, REDUCE_HOOK)

    def counted(param: Any, group: int) -> None:
        bucketed.append(group)
        deepspeeds(param, group)

    theirs.optimizer.__dict__[REDUCE_HOOK] = counted
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32

    def layout(each: Any) -> list[list[int | None]]:
        """Where each gradient the step reads lies in the one buffer of the first (None: a tensor of its own,
        such as the zeros that pad a group to its alignment)."""
        grads = each.optimizer.averaged_gradients
        buffer = grads[0][0].untyped_storage().data_ptr()
        return [[g.storage_offset() if g.untyped_storage().data_ptr() == buffer else None for g in grads[i]]
                for i in range(len(each.optimizer.bit16_groups))]

    for seed in range(3):
        layouts = []
        for each in (ours, theirs):
            torch.manual_seed(seed)
            for _ in range(4 // micro):
                images, labels = torch.randn(micro, 3, 16, 16, dtype=dtype), torch.randint(0, 5, (micro,))
                each.backward(torch.nn.functional.cross_entropy(each(images), labels))
                if not each.is_gradient_accumulation_boundary():
                    each.step()
            layouts.append(layout(each))
            assert apply_update(each, loss=0.0).read()[0]
        assert layouts[0] == layouts[1]  # each gradient where DeepSpeed's bucket would have put it
        assert sum(offset is not None for group in layouts[0] for offset in group) == len(list(ours.parameters()))
    assert bucketed  # the comparison is with DeepSpeed's bucket
    for p, q in zip(ours.module.parameters(), theirs.module.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    for p, q in zip(ours.optimizer.single_partition_of_fp32_groups, theirs.optimizer.single_partition_of_fp32_groups):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_one_rank_at_zero_3_takes_the_fused_norm(process_group: None) -> None:
    """`fuse_zero_3_norm`: one rank's ZeRO 3 norm is ZeRO 1 and 2's fused one, DeepSpeed's up to rounding, a
    non-finite one marked -1 as DeepSpeed marks it, and the steps it clips (1e-3 acts) and refuses land
    where DeepSpeed's own do."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    from vitscale.train.fused import fuse_zero_3_norm

    ours, theirs = _zero3(True, False, gathered=False), _zero3(True, False, gathered=False)
    assert "get_grad_norm_direct" in vars(ours.optimizer)  # installed on this engine's optimizer
    assert not fuse_zero_3_norm(ours)  # once
    assert not fuse_zero_3_norm(_engine(1))  # ZeRO 3 only
    del theirs.optimizer.get_grad_norm_direct  # DeepSpeed's own
    params = ours.optimizer.fp16_groups[0]
    generator = torch.Generator().manual_seed(0)
    for poison in (None, float("inf"), float("nan")):
        grads = [torch.randn(p.ds_numel, generator=generator) for p in params]
        if poison is not None:
            grads[-1][3] = poison
        a = ours.optimizer.get_grad_norm_direct(grads, params)
        b = DeepSpeedZeroOptimizer_Stage3.get_grad_norm_direct(theirs.optimizer, grads, params)
        assert a.shape == b.shape == () and a.device == b.device
        assert float(a) == pytest.approx(float(b), rel=1e-6), (poison, a, b)
        assert (float(a) == -1.0) == (poison is not None)
    for poison in (False, False, True, False):
        assert _step(ours, poison) == _step(theirs, poison) == (not poison)
        if not poison:
            a, b = float(ours.get_global_grad_norm()), float(theirs.get_global_grad_norm())
            assert a > 1e-3 and a == pytest.approx(b, rel=1e-6), (a, b)  # the clip (1e-3) acts
    for p, q in zip(ours.optimizer.fp32_partitioned_groups_flat, theirs.optimizer.fp32_partitioned_groups_flat):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)


def _compiled_engine(compiled: bool, stage: int = 3, checkpointing: bool = False, micro: int = 4,
                     **zero: Any) -> Any:
    torch.manual_seed(0)
    model = create_model("ViT-Ti/8", num_classes=5, activation_checkpointing=checkpointing, **TINY)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.05)
    train = TrainConfig(global_batch=4, micro_batch=micro, zero_stage=stage, precision="fp32", grad_clip=1e-3,
                        weight_decay=0.1, base_lr=1e-2, compile=compiled,
                        deepspeed={"zero_optimization": zero} if zero else {})
    parameters = sum(p.numel() for p in model.parameters())
    return build_engine(model, train, deepspeed_config(train, derive_batch(4, micro, 1), on_gpu=False,
                                                       parameters=parameters), on_gpu=False)


def _micro_steps(engine: Any, seed: int, micro: int) -> bool:
    """One step of 4 images in micro-batches of `micro`, as `train/step.py` takes it; whether it was applied."""
    torch.manual_seed(seed)
    for _ in range(4 // micro):
        images, labels = torch.randn(micro, 3, 16, 16), torch.randint(0, 5, (micro,))
        engine.backward(torch.nn.functional.cross_entropy(engine(images), labels))
        if not engine.is_gradient_accumulation_boundary():
            engine.step()  # inside the accumulation: DeepSpeed counts the micro-step
    return apply_update(engine, loss=0.0).read()[0]


def _graphs_and_breaks() -> tuple[int, int]:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


@pytest.mark.parametrize(("checkpointing", "micro"), [(False, 4), (True, 2)])
def test_one_rank_at_zero_3_compiles_the_whole_model_and_steps_as_zero_1(process_group: None,
                                                                         checkpointing: bool, micro: int) -> None:
    """`train.compile` at one rank's ZeRO 3 compiles the whole forward pass, as at ZeRO 1 (one graph, no graph
    break: no gather hook and no leaf module's backward hook left on it), and its steps are compiled ZeRO 1's bit
    for bit, with activation checkpointing's recompute and two micro-batches a step too."""
    from vitscale.train.engine import whole_weights

    torch._dynamo.reset()  # a graph compiled earlier in this process would be served from the cache, uncounted
    before = _graphs_and_breaks()
    whole = _compiled_engine(True, checkpointing=checkpointing, micro=micro)
    zero_1 = _compiled_engine(True, stage=1, checkpointing=checkpointing, micro=micro)
    assert "forward" in vars(whole.module) and not any("forward" in vars(b) for b in whole.module.blocks)
    assert not whole.optimizer._leaf_module_hooks and not whole.is_compiled
    for seed in range(3):
        assert _micro_steps(whole, seed, micro) and _micro_steps(zero_1, seed, micro)
    assert _graphs_and_breaks() == (before[0] + 2, before[1])  # one graph each, nothing broken
    with whole_weights(whole) as a:
        for (name, p), q in zip(a.named_parameters(), zero_1.module.parameters(), strict=True):
            assert torch.equal(p, q), name


def test_one_rank_at_zero_3_compiles_each_block_between_hooks_left_on_it(process_group: None) -> None:
    """Where a leaf module's gradient hook is still on one rank's ZeRO 3 (a `leaf_module` of the user's), each
    block is compiled alone between the hooks (one graph for both, no break) and trains as the eager engine
    does; where weights are gathered (not one rank's persistent ones), the whole model is compiled, hooks and
    all, as at any stage."""
    from vitscale.train.engine import whole_weights

    torch._dynamo.reset()
    before = _graphs_and_breaks()
    units = _compiled_engine(True, leaf_module={"classes": list(REPEATED_UNITS)})
    eager = _compiled_engine(False)
    assert all("forward" in vars(b) for b in units.module.blocks) and "forward" not in vars(units.module)
    assert not any("forward" in vars(b) for b in eager.module.blocks) and "forward" not in vars(eager.module)
    for _ in range(3):
        assert _step(units) and _step(eager)
    assert _graphs_and_breaks() == (before[0] + 1, before[1])  # one graph for both blocks
    with whole_weights(units) as a, whole_weights(eager) as b:
        for (name, p), q in zip(a.named_parameters(), b.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=name)
    gathered = _compiled_engine(True, stage3_param_persistence_threshold=0)
    assert gathered.is_compiled and "forward" not in vars(gathered.module.blocks[0])


def test_the_cpu_adam_built_ahead_steps_as_torchs_adamw() -> None:
    """`make cpu-adam` builds DeepSpeed's CPU Adam once (`build_cpu_adam`), so offloaded workers load it
    instead of compiling it; what it loads must take AdamW's steps (decoupled decay) as torch's does."""
    build_cpu_adam()
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    start = torch.randn(64, generator=torch.Generator().manual_seed(0))
    ours, theirs = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    adamw_settings = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1}
    cpu_adam = DeepSpeedCPUAdam([ours], adamw_mode=True, **adamw_settings)
    adamw = torch.optim.AdamW([theirs], **adamw_settings)
    for step in range(5):
        grad = torch.randn(64, generator=torch.Generator().manual_seed(step + 1))
        ours.grad, theirs.grad = grad.clone(), grad.clone()
        cpu_adam.step()
        adamw.step()
    assert not torch.equal(ours.data, start)
    torch.testing.assert_close(ours.data, theirs.data, rtol=1e-5, atol=1e-6)
