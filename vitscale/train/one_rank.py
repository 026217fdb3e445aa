"""ZeRO on one rank: ZeRO 3's parameters kept whole, never gathered, without gather hooks, compiled whole,
its reduction stream awaited on the GPU; every stage's gradients sent straight to their partitions.

ZeRO 3 partitions every parameter over the ranks and gathers a block's parameters before the block runs
(`train/engine.py` makes a transformer block or ResNet unit one gather). On one rank the partition is the
whole parameter, and DeepSpeed's gather there is no copy: the weight becomes a view of its partition
(`NoGatherHandle`). But each gather still waits for the GPU: the handle synchronises the device's stream
(`current_stream().synchronize()`, wherever the accelerator does not resolve data dependencies itself, as
CUDA does not), and the coordinator synchronises the oldest gather event whenever more than two are in
flight. ViT-B/16's forward took 86 ms at ZeRO 3 against 23 ms at ZeRO 1 on an H200 (gathering a layer at a
time then), the host and the GPU taking turns.

`ONE_RANK_ZERO_3` marks every parameter persistent, DeepSpeed's own mechanism for small parameters (it
keeps them whole on every rank; here every one is "small"): the forward and backward pass gather nothing.
`memory_efficient_linear` goes with it: DeepSpeed's linear that keeps no reference to a gathered weight
exists for weights freed after use, and costs an autograd Function per linear layer.

`skip_regather` removes the last gather: ZeRO 3's step frees every parameter before it updates the
partitions and gathers the persistent ones again after (so that on many ranks each sees the others'
updated pieces). On one rank, with every weight already a view of its partition, the update writes into
the weights themselves and the round trip only costs the host 152 frees and gathers (ViT-B/16) and the GPU a
stream synchronisation. The check is made at every step, on the host, pointer by pointer: where any weight
is not a view of its partition (after a load that replaced the partitions' storage, say), DeepSpeed's own
free-and-gather runs, and the step after finds the views again. Only the step's round trip is skipped: a
checkpoint's save still frees every weight first, so the module state it writes holds ZeRO 3's empty
placeholders, which an engine that has not stepped yet can load.

`remove_gather_hooks` then removes the hooks themselves. With nothing to gather, DeepSpeed's hooks around every
module (a gather before its forward and backward pass, a free after each, the output and input of each wrapped
in an autograd function of DeepSpeed's for the backward ones) were all that was left of ZeRO 3 in the forward
pass and half of it in the backward: on 2 CPU cores, ViT-B/16's layout at width 48 (`benchmarks/host_cost.py`),
its forward pass took 7.4 ms of host time against ZeRO 1's 3.2. The weights are gathered once (views, no copy)
when the hooks go; what frees them later (a checkpoint's save or load, DeepSpeed's own step where a weight is not
in place) gathers every persistent one again before it returns. DeepSpeed's `unwrap_model_for_generation`
removes the same hooks around weights it has gathered.

`skip_reduction` sends each gradient straight to its partition, at every ZeRO stage. ZeRO copies a gradient, as
DeepSpeed takes it over, into a bucket; at the end of the backward pass it averages the bucket over the ranks,
reduce-scatters it and copies each rank's piece into the gradient partition the step reads: at least three
passes over the gradients more than one (12 bytes per parameter in bf16, about 3.6 GB for ViT-L/16 at the end
of every backward pass, which the update waits for) and a few operators per parameter queued by Python, where
one rank's piece is the whole gradient and the average a division by one. Now the gradient goes where that
sequence ends: ZeRO 3's partition (copied, or added at a step's later micro-batches), ZeRO 1 and 2's contiguous
partition (DeepSpeed's `copy_grads_in_partition`, the same place in the same order). The steps are
DeepSpeed's bit for bit (`tests/test_fused.py`). On 2 CPU cores (ViT-B/16's layout at width 48,
`benchmarks/host_cost.py`): with the hooks gone too, one rank's ZeRO 3 step took less host time than ZeRO 1's
(9.8 against 11.2 ms; 20.4 before), and ZeRO 1's and 2's backward passes 6.1-7.3 ms against 8.6-8.8.

`order_on_the_gpu` removes the backward pass's wait: at its end ZeRO 3 synchronises its reduction stream on
the host (`independent_gradient_partition_epilogue`) before the step reads the gradient partitions. On one
rank without offload the gradients go no further than this GPU, and every later reader runs on a stream of
this device, so the caller's stream waiting for the reduction stream on the GPU orders them the same (with
offload the host reads the gradients the stream copied to it, and keeps its wait); the host goes on to
queue the update while the backward pass runs (with DeepSpeed's norm read gone too, `train/update.py`, the
GPU had idled while the host queued ZeRO 3's update: a ViT-B/16 step on an H200 ran at 0.85x of ZeRO 1's).

ZeRO 3's norm, at one rank as at many, is `fused.fuse_zero_3_norm`'s: DeepSpeed's waited for the whole
backward pass on the host (a -1 it copies from host memory) and launched about three kernels per parameter.
Removing the wait alone did not make the step faster on an H200 (a compiled ViT-B/16 step at ZeRO 3: 0.78x of
ZeRO 1's before, 0.79x after; its update 11-14 ms of a step's GPU time against ZeRO 1's 1.8, with no host sync
left in it). With the norm's launches fused too, no gather hooks, no reduction and the whole model compiled
(below), it ran at 0.999x of ZeRO 1's, its update 0.9 ms of a step (2026-12-01, `benchmarks/RESULTS.md`).

`compile_kept_whole` compiles the whole forward pass, as ZeRO 0-2 do, where nothing of ZeRO 3's hooks is left:
the gather hooks gone and no leaf modules (`engine.deepspeed_config` names none where nothing is gathered: a leaf's
gradients are handed over by a module-level backward hook, which torch.compile cannot trace and breaks its graph
at, where each parameter's own gradient hook, as at ZeRO 1 and 2, sits outside it). One rank's ZeRO 3 then runs
the same graph as ZeRO 1 and its steps are ZeRO 1's bit for bit (`tests/test_fused.py`). Where hooks are left
(a `leaf_module` of the user's), each transformer block or ResNet unit (`models.REPEATED_UNITS`) is compiled on
its own, the hooks around it left eager, as every unit was until 2026-11-30 (its forward and backward passes
2 ms each slower than ZeRO 1's whole graph for ViT-B/16 on an H200): compiling the whole model traces the hooks,
which torch.compile recompiles per module until it gives up (a compiled ZeRO-3 ViT-B/16 step ran at two thirds
of the eager one's speed on an H200). A compiled graph may keep views of the weights for the backward pass: on
one rank they stay valid, the weights being views of partitions that never move (a gather there frees no
storage); on several ranks a gathered weight is freed after its unit, which such a view would not follow.

None of this changes what is partitioned, updated or saved: the optimizer's flat fp32 groups, the bf16
partitions and the checkpoints are ZeRO 3's as at any world size (a run resized to more ranks resumes from
them, `train/reshard.py`), and the weights after every eager step are the same bit for bit
(`tests/test_fused.py`). Not with parameter offload, whose point is the weights off the GPU.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any

import torch

from vitscale.models import REPEATED_UNITS

ONE_RANK_ZERO_3: dict[str, Any] = {"stage3_param_persistence_threshold": sys.maxsize,
                                   "memory_efficient_linear": False}
"""`zero_optimization` keys for ZeRO 3 on one rank without parameter offload (`train.deepspeed` may set them
back, under either of DeepSpeed's names: the thresholds are DeepSpeed's to interpret)."""

KEPT_WHOLE = "vitscale_weights_kept_whole"
"""The attribute marking an optimizer whose step `skip_regather` installed."""


def skip_regather(engine: Any) -> bool:
    """Install the step that keeps one rank's whole weights in place on `engine`'s ZeRO 3 optimizer; whether
    it was installed (one rank, no parameter offload, every parameter persistent)."""
    optimizer: Any = getattr(engine, "optimizer", None)
    partition_all = getattr(optimizer, "_partition_all_parameters", None)
    module: Any = getattr(engine, "module", None)
    params = list(module.parameters()) if module is not None else []
    if (type(optimizer).__name__ != "DeepSpeedZeroOptimizer_Stage3" or partition_all is None
            or getattr(optimizer, "partition_count", 0) != 1 or getattr(optimizer, "offload_param", True)
            or not params
            or not all(getattr(p, "ds_persist", False) and getattr(p, "ds_tensor", None) is not None
                       and p.ds_tensor.numel() == p.ds_numel for p in params)):
        return False

    def partition_all_parameters() -> None:
        if not all(_is_view_of_partition(p) for p in params):
            partition_all()

    step = optimizer.step

    def step_in_place(*args: Any, **kwargs: Any) -> Any:
        # The step's own free-and-gather only: a checkpoint's prologue still frees every weight, so that the
        # module state DeepSpeed saves holds ZeRO 3's empty placeholders, which any engine loads.
        optimizer._partition_all_parameters = partition_all_parameters
        try:
            return step(*args, **kwargs)
        finally:
            del optimizer._partition_all_parameters

    optimizer.step = step_in_place
    setattr(optimizer, KEPT_WHOLE, True)
    return True


class _OrderedOnTheGpu(torch.cuda.ExternalStream):
    """ZeRO 3's reduction stream, whose `synchronize` makes the calling stream wait for it on the GPU."""

    wrapped: torch.cuda.Stream

    def synchronize(self) -> None:
        torch.cuda.current_stream(self.device).wait_stream(self)


def order_on_the_gpu(engine: Any) -> bool:
    """On one rank's ZeRO 3 on a GPU, turn the host's waits for the reduction stream into the GPU's (see the
    module's docstring); whether it did. DeepSpeed's copies, collectives and `record_stream` calls keep their
    stream: the wrapper is that stream, by its handle. Not with offload: there the reduction stream copies the
    gradients into host memory (non-blocking), which the host's optimizer then reads, and only the host's
    wait makes those copies complete before it does."""
    optimizer: Any = getattr(engine, "optimizer", None)
    stream = getattr(optimizer, "reduce_and_partition_stream", None)
    if (type(optimizer).__name__ != "DeepSpeedZeroOptimizer_Stage3" or getattr(optimizer, "partition_count", 0) != 1
            or getattr(optimizer, "offload_optimizer", True) or getattr(optimizer, "offload_param", True)
            or not isinstance(stream, torch.cuda.Stream) or isinstance(stream, _OrderedOnTheGpu)):
        return False
    ordered = _OrderedOnTheGpu(stream.cuda_stream, device=stream.device)
    ordered.wrapped = stream  # an external stream's owner keeps it alive (torch's pool streams are never freed)
    optimizer.reduce_and_partition_stream = ordered
    return True


def remove_gather_hooks(engine: Any) -> int:
    """Remove the forward and backward hooks ZeRO 3 put on `engine`'s modules to gather and free their
    parameters, where one rank keeps every weight whole (`weights_kept_whole`) and they would gather and free
    nothing (see the module's docstring); how many. DeepSpeed's own `unwrap_model_for_generation` removes the
    same hooks around weights it gathered once."""
    offload: Any = getattr(getattr(engine, "optimizer", None), "parameter_offload", None)
    if (not weights_kept_whole(engine) or offload is None or getattr(offload, "zenflow", True)
            or not isinstance(getattr(offload, "forward_hooks", None), list)
            or not isinstance(getattr(offload, "backward_hooks", None), list)):
        return 0
    # Every weight whole before the first forward pass, as the hooks would have gathered them (on one rank, a
    # view of its partition each). Checkpoint loads and saves and DeepSpeed's own step end with every persistent
    # parameter gathered again; a weight left freed would be gathered where it is read, registered to whichever
    # engine's module DeepSpeed's global stack holds last, which would free it after its own forward pass.
    params = list(engine.module.parameters())
    params[0].all_gather(param_list=params)
    hooks = offload.forward_hooks + offload.backward_hooks
    for hook in hooks:
        hook.remove()
    offload.forward_hooks, offload.backward_hooks = [], []
    return len(hooks)


GRADIENT_PARTITIONS = "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition"
"""DeepSpeed 0.19's map of a parameter's id to its gradient partition (a slice of one flat buffer), by its
mangled name: where ZeRO 3's epilogue copies each reduced gradient and its step reads them."""


REDUCE_HOOK = "reduce_independent_p_g_buckets_and_remove_grads"
"""The method of DeepSpeed's ZeRO 1/2 and ZeRO 3 optimizers that takes a finished gradient into the reduction."""


def skip_reduction(engine: Any) -> bool:
    """On one rank without offload, send each gradient straight to its partition as its hook fires, ZeRO 1-3
    (see the module's docstring); whether it did."""
    optimizer: Any = getattr(engine, "optimizer", None)
    if type(optimizer).__name__ == "DeepSpeedZeroOptimizer":
        return _skip_zero_1_2_reduction(optimizer)
    partitions = getattr(optimizer, GRADIENT_PARTITIONS, None)
    params = [p for group in getattr(optimizer, "fp16_groups", []) for p in group]
    if (type(optimizer).__name__ != "DeepSpeedZeroOptimizer_Stage3" or not isinstance(partitions, dict)
            or getattr(optimizer, "partition_count", 0) != 1 or getattr(optimizer, "offload_optimizer", True)
            or getattr(optimizer, "offload_param", True) or getattr(optimizer, "zenflow", True)
            or getattr(optimizer, "autoep_folding_tp_group", None) is not None
            or getattr(optimizer, "gradient_predivide_factor", None) != 1.0
            or getattr(optimizer, "sequence_parallel_size", None) != 1 or not params
            or not all(p.partition_numel() == p.ds_numel for p in params)):
        return False

    def to_partition(param: Any) -> None:
        # What ZeRO 3's bucket, reduction and `partition_grads` end in, at one rank: the partition is the whole
        # gradient, averaged over one rank (a division by 1.0), copied at a micro-batch's first backward pass and
        # added after (in the partition's dtype, as DeepSpeed adds it).
        if not getattr(param, "ds_grad_is_ready", True):
            return
        partition = getattr(optimizer, GRADIENT_PARTITIONS)[param.ds_id]  # looked up each time: a load re-points it
        gradient = param.grad.reshape(-1)
        if optimizer.micro_step_id == 0:
            partition.copy_(gradient)
        else:
            partition.add_(gradient.to(partition.dtype))
        param.grad = None

    setattr(optimizer, REDUCE_HOOK, to_partition)
    return True


def _skip_zero_1_2_reduction(optimizer: Any) -> bool:
    """ZeRO 1/2's part of `skip_reduction`: a gradient goes into the rank's contiguous gradient partition
    (`copy_grads_in_partition`) as soon as DeepSpeed hands it over, not first into a bucket that is divided by
    one and reduce-scattered over one rank. Where the bucket would have held it: the same place in the same
    order, so the partition's layout is DeepSpeed's (parameter order at ZeRO 1, backward order at ZeRO 2)."""
    groups = range(len(getattr(optimizer, "bit16_groups", [])))
    compact = getattr(optimizer, "_use_compact_grad_partition_buffer", None)
    copy = getattr(optimizer, "copy_grads_in_partition", None)
    if (compact is None or copy is None or "group_idx" not in inspect.signature(copy).parameters  # DeepSpeed 0.19's
            or list(getattr(optimizer, "partition_count", [])) != [1] * len(groups) or not groups
            or getattr(optimizer, "cpu_offload", True) or not getattr(optimizer, "contiguous_gradients", False)
            or getattr(optimizer, "overlap_comm", True) or getattr(optimizer, "zenflow", True)
            or getattr(optimizer, "use_grad_accum_attribute", True) or getattr(optimizer, "has_moe_layers", True)
            or getattr(optimizer, "autoep_folding_tp_group", None) is not None
            or getattr(optimizer, "gradient_predivide_factor", None) != 1.0
            or getattr(optimizer, "sequence_parallel_size", None) != 1
            or getattr(optimizer, "_offload_gradient_safety_enabled", True)
            or any(compact(i) for i in groups)):
        return False

    def to_partition(param: Any, group: int) -> None:
        # DeepSpeed's own method up to the bucket (an empty parameter, a gradient not ready yet, one reduction
        # per parameter and step), then what the bucket's reduction ends in at one rank.
        if param.numel() == 0 or not getattr(param, "ds_grad_is_ready", True):
            return
        param_id = optimizer.get_param_id(param)
        if optimizer.params_already_reduced[param_id]:
            raise RuntimeError(f"ZeRO {2 if optimizer.partition_gradients else 1}: the gradient of parameter "
                               f"{param_id} was handed over twice in one backward pass")
        optimizer.params_already_reduced[param_id] = True
        optimizer.copy_grads_in_partition(param, group)

    setattr(optimizer, REDUCE_HOOK, to_partition)
    return True


def weights_kept_whole(engine: Any) -> bool:
    """Whether `skip_regather` is installed on `engine`'s optimizer (one rank's ZeRO 3, weights in place)."""
    return bool(vars(getattr(engine, "optimizer", None) or object()).get(KEPT_WHOLE, False))


def _is_view_of_partition(param: Any) -> bool:
    """Whether `param`'s weight is its whole partition's storage, so that updating one updates the other."""
    part = param.ds_tensor
    # DeepSpeed's `ZeroParamStatus.AVAILABLE`, by name: DeepSpeed is imported by `engine.py` alone.
    return (getattr(param.ds_status, "name", None) == "AVAILABLE" and not param.ds_active_sub_modules
            and param.data.data_ptr() == part.data_ptr() and param.numel() == part.numel()
            and param.dtype == part.dtype and param.device == part.device)


def compile_kept_whole(engine: Any, mode: str) -> str:
    """Compile `engine`'s module, whose weights are kept whole (`weights_kept_whole`: one rank's ZeRO 3), as its
    hooks allow; what was compiled: "model" (its whole forward) or "units" (each repeated unit alone, where
    DeepSpeed's gather hooks or a leaf module's gradient hook are still on the module)."""
    optimizer: Any = engine.optimizer
    offload: Any = getattr(optimizer, "parameter_offload", None)
    hooked = (getattr(optimizer, "_leaf_module_hooks", True) or offload is None
              or getattr(offload, "forward_hooks", True) or getattr(offload, "backward_hooks", True))
    # The instance's `forward`, not its `__call__`: the module hooks left (DeepSpeed's engine's, the gather
    # coordinator's reset) stay outside the graph, and the module, its names and its hooks are unchanged.
    if not hooked:
        module = engine.module
        module.forward = torch.compile(module.forward, backend="inductor", mode=mode)
        return "model"
    units = [m for m in engine.module.modules() if f"{type(m).__module__}.{type(m).__qualname__}" in REPEATED_UNITS]
    for unit in units:
        unit.forward = torch.compile(unit.forward, backend="inductor", mode=mode)
    return "units"
