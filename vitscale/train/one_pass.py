"""AdamW in one pass over memory, ZeRO 1-3: the bf16 gradient read, the fp32 master weight and both moments
updated, the bf16 weight written, in one compiled kernel.

DeepSpeed's update in bf16 passes over each parameter's memory five times (bytes per parameter, read +
written): the gradients flattened into one bf16 buffer (2 + 2), that buffer cast to a new fp32 gradient
(2 + 4), the clip's multiply (4 + 4), the inner AdamW (16 + 12: weight, gradient and both moments read; weight
and moments written) and the copy of the fp32 master to the bf16 weight the model reads (4 + 2). With the
norm's read (2), 54 bytes where Adam's own arithmetic needs 28 (the hand-written peer's fused AdamW over fp32
gradients). The update is memory-bound: ViT-L/16's took 5.6 ms of GPU time inside a step on an H200
(2026-11-30), the peer's 2.6, in a 205-ms step that was 0.4 MFU points short of its target (47%; 47.6% with this pass).

`one_pass_update` keeps DeepSpeed's sequence and replaces those passes, where vitscale trains (bf16 weights
over fp32 masters, torch's fused AdamW, no offload), with `adamw_pass`: its scalars (the bias corrections)
computed once in a 0-d kernel (`adamw_scalars`), then its pass over memory (`adamw_elements`), which reads the
bf16 gradient, the master and the moments (14 bytes) and writes the master, the moments and the bf16 weight
(14 bytes), the clip's factor applied to the gradient in registers. With the flatten and the norm, 34 bytes
where DeepSpeed's took 54, and no fp32 gradient allocated (4 bytes per parameter off the peak). Where the
gradients already lie end to end in one buffer, in parameter order, as ZeRO 1's do on one rank and ZeRO 3's
of a sub-group do, the pass reads them there (`end_to_end`): no flatten, 30 bytes. Copied: ZeRO 2's (its
buffer holds them in the order the backward pass made them) and a group DeepSpeed padded to its alignment (an
odd count of elements; none of the paper's ViTs with 1,000 classes has one).

- ZeRO 1/2 (`DeepSpeedZeroOptimizer`, whose `step` is one method): the step is DeepSpeed 0.19's for bf16
  without offload, re-stated in `_zero_step`: the global norm (`fused.py`'s kernel), the loss-scale
  bookkeeping, per group the flat gradient of this rank's partition and the inner step, then the all-gather of
  the updated bf16 partitions over ranks and the weights pointed at their slices. On one rank the norm and the
  clip's factor are one compiled call over the groups' flat gradients (`fused.one_rank_norm`): the update's host
  time is most of a small ViT's optimizer phase, and the GPU waits for it (ViT-Ti/16 on an H200, 2026-12-01).
- ZeRO 3 (`DeepSpeedZeroOptimizer_Stage3`, whose step calls a method per stage of each sub-group's update):
  DeepSpeed's step runs as it is, with four of those methods replaced (`_install_zero_3`).

What stays: the optimizer state is torch's AdamW's, held by the inner optimizer as before (`step`, `exp_avg`,
`exp_avg_sq` for each flat partition), so checkpoints, resume, reshard and universal checkpoints are the same and
load either way; the arithmetic is torch's fused AdamW's, op for op (decoupled decay, bias corrections from the
step count, fp32), equal to it up to the compiler's rounding; the clip's factor is DeepSpeed's, bit for bit
(`fused.clip_factor`, for any finite norm); `train/update.py`'s verdict (`found_inf`: a non-finite norm or loss) leaves
weights, moments and step counts as they were, as torch's kernel does.

Installed only where it is exactly this case and its kernel is compiled (`train.compile`, on a GPU by default:
uncompiled, its dozen operators would each pass over memory); everywhere else DeepSpeed's own update runs:
ZeRO 0, CPU or NVMe offload, fp16 (loss scaling and its overflow check), fp32 weights, SGD, amsgrad or maximize,
DeepSpeed's Muon or ZenFlow, torch autocast. On an H200 (2026-12-01, `benchmarks/RESULTS.md`) the update took
0.8 ms of a ViT-B/16 step's GPU time (DeepSpeed's passes 1.8) and 2.5 of ViT-L/16's (5.6).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import torch

from vitscale.train.fused import GLOBAL_NORM, clip_factor, one_rank_norm

ONE_PASS = "vitscale_one_pass"
"""The attribute marking a ZeRO optimizer whose update `one_pass_update` installed."""


def adamw_pass(gradient: torch.Tensor, master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
               step: torch.Tensor, weight: torch.Tensor, lr: torch.Tensor, factor: torch.Tensor,
               refused: torch.Tensor, *, beta1: float, beta2: float, eps: float, weight_decay: float) -> None:
    """One AdamW update (Loshchilov & Hutter's decoupled decay, as torch's fused kernel computes it), in place.

    `gradient` (any float dtype) times `factor` (the clip coefficient, a 0-d tensor) is the gradient;
    `master`, `exp_avg`, `exp_avg_sq` (fp32) and `step` (a 0-d fp32 count) are updated and `weight` gets the
    new master in its own dtype, all unchanged (`weight` re-rounded from `master`) where `refused` (0-d) is
    not 0. `lr` is a 0-d tensor, so that a schedule's new rate is data, not a new graph."""
    _adamw(adamw_scalars, adamw_elements, gradient, master, exp_avg, exp_avg_sq, step, weight, lr, factor, refused,
           beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay)


def adamw_scalars(step: torch.Tensor, lr: torch.Tensor, refused: torch.Tensor, weight_decay: torch.Tensor, *,
                  beta1: float, beta2: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The update's scalars, once per pass (0-d tensors), as torch's fused kernel computes them once per
    launch: whether the step is kept, the step size `lr / (1 - beta1^t)`, `sqrt(1 - beta2^t)` and the decay
    `lr * weight_decay`, `t` the advanced count, written to `step` where the step is kept. Computed inside the
    elementwise kernel instead, the two powers would be computed per element: on a CPU that made the kernel
    compute-bound (1.6-2x slower at ViT-B/16's size); on an H200, by estimate, they would take about half of the
    instructions it can spend per element at its memory bandwidth."""
    keep = refused == 0
    count = step + 1
    step_size = lr / (1 - torch.pow(beta1, count))
    bias2_sqrt = (1 - torch.pow(beta2, count)).sqrt()
    step.copy_(torch.where(keep, count, step))
    return keep, step_size, bias2_sqrt, lr * weight_decay


def adamw_elements(gradient: torch.Tensor, master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                   weight: torch.Tensor, factor: torch.Tensor, keep: torch.Tensor, step_size: torch.Tensor,
                   bias2_sqrt: torch.Tensor, decay: torch.Tensor, *, beta1: float, beta2: float, eps: float) -> None:
    """The update's pass over memory, given `adamw_scalars`' values: the bf16 gradient, the master and both
    moments read (14 bytes per parameter), the master, the moments and the bf16 weight written (14)."""
    grad = gradient.float() * factor
    decayed = master - decay * master
    m = beta1 * exp_avg + (1 - beta1) * grad
    v = beta2 * exp_avg_sq + (1 - beta2) * grad * grad
    updated = torch.where(keep, decayed - step_size * m / (v.sqrt() / bias2_sqrt + eps), master)
    exp_avg.copy_(torch.where(keep, m, exp_avg))
    exp_avg_sq.copy_(torch.where(keep, v, exp_avg_sq))
    weight.copy_(updated.to(weight.dtype))
    master.copy_(updated)


def _adamw(scalars: Callable[..., Any], elements: Callable[..., None], gradient: torch.Tensor, master: torch.Tensor,
           exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, step: torch.Tensor, weight: torch.Tensor,
           lr: torch.Tensor, factor: torch.Tensor, refused: torch.Tensor, *, beta1: float, beta2: float, eps: float,
           weight_decay: float) -> None:
    # What the compiled functions are handed is the same kind of thing every call, so that a process compiles
    # each once whatever it trains (torch compiles a function again for each new kind of input, and refuses it
    # past 8, an error under `fullgraph`): the weight decay as data, like the rate (a sweep varies it); gradients
    # off; the tensors detached, which writes the same storage but drops what torch would also guard on (a ZeRO
    # partition is a leaf that requires grad, a tensor elsewhere not; a gradient that is a view of a buffer is
    # guarded on that buffer's shape); any length (`compiled_pass`).
    with torch.no_grad():
        keep, step_size, bias2_sqrt, decay = scalars(step, lr, refused, constant(weight_decay, lr.device),
                                                     beta1=beta1, beta2=beta2)
        elements(gradient.detach(), master.detach(), exp_avg.detach(), exp_avg_sq.detach(), weight.detach(), factor,
                 keep, step_size, bias2_sqrt, decay, beta1=beta1, beta2=beta2, eps=eps)


@functools.lru_cache(maxsize=64)
def constant(value: float, device: torch.device) -> torch.Tensor:
    """A 0-d fp32 tensor of `value` on `device`, made once: a weight decay, a clip factor of 1, a step not refused
    are the same every step, and each fill would be a launch per group per step. Only read, never written."""
    return torch.full((), value, dtype=torch.float32, device=device)


def compiled_pass() -> Callable[..., None]:
    """`adamw_pass` as a worker runs it: its scalars and its pass over memory compiled apart (a 0-d kernel,
    then one elementwise kernel that reads them; compiled as one function, the compiler would inline the
    scalars' powers into every element), a new rate or weight decay being data, the pass compiled for any
    length (one kernel for every partition and sub-group)."""
    return functools.partial(_adamw, torch.compile(adamw_scalars, fullgraph=True),
                             torch.compile(adamw_elements, fullgraph=True, dynamic=True))


@functools.cache
def compiled_norm() -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """`fused.one_rank_norm` compiled once for any group lengths: a reduction per group and the scalars' epilogue
    where the eager norm, its combination over groups and the clip's factor dispatched about 30 operators, each
    a launch queued by the host after the backward pass (`_one_rank_lengths`)."""
    return torch.compile(one_rank_norm, fullgraph=True, dynamic=True)


def one_pass_update(engine: Any, compile_kernel: bool = True) -> bool:
    """Install the one-pass update on `engine`'s ZeRO 1/2 or ZeRO 3 optimizer (see the module's docstring);
    whether it was installed. `compile_kernel=False` runs `adamw_pass` eagerly: the same arithmetic, for tests."""
    optimizer: Any = getattr(engine, "optimizer", None)
    zero_3 = _supported_zero_3(optimizer)
    if not (zero_3 or _supported_zero_1_2(optimizer)):
        return False
    kernel = compiled_pass() if compile_kernel else adamw_pass
    inner = optimizer.optimizer
    staged: dict[int, list[Any]] = {}  # a flat master's id: [its gradient, its bf16 weight, the clip factor]
    plain = inner.step

    def inner_step(closure: Any = None) -> Any:
        if not staged:  # not called from a step below (a caller with fp32 gradients): torch's own
            return plain(closure)
        refused = getattr(inner, "found_inf", None)  # `train/update.py`'s verdict, as torch's kernel reads it
        for group in inner.param_groups:
            for master in group["params"]:
                if id(master) in staged:
                    gradient, weight, factor = staged[id(master)]
                    _update(kernel, inner, group, master, gradient, weight, factor, refused)
        return None

    inner.step = inner_step
    if zero_3:
        _install_zero_3(optimizer, staged)
    else:
        lengths = _one_rank_lengths(optimizer)
        norm = (compiled_norm() if compile_kernel else one_rank_norm) if lengths is not None else None
        optimizer.step = lambda closure=None: _zero_step(optimizer, staged, norm, lengths)
    setattr(optimizer, ONE_PASS, True)
    return True


def one_pass_installed(engine: Any) -> bool:
    """Whether `engine`'s optimizer steps with `one_pass_update`'s kernel."""
    return bool(vars(getattr(engine, "optimizer", None) or object()).get(ONE_PASS, False))


def _supported_zero_1_2(optimizer: Any) -> bool:
    """DeepSpeed's ZeRO 1/2 optimizer in bf16 on the device, with `fused.py`'s norm and clipping and torch's
    fused AdamW inside, and none of the features whose step differs (see the module's docstring)."""
    inner = getattr(optimizer, "optimizer", None)
    return (type(optimizer).__name__ == "DeepSpeedZeroOptimizer" and not getattr(optimizer, "cpu_offload", True)
            and getattr(optimizer, "dtype", None) == torch.bfloat16 and bool(vars(optimizer).get(GLOBAL_NORM))
            and not getattr(optimizer, "check_grad_overflow", True) and getattr(optimizer, "compute_grad_norm", False)
            and not getattr(optimizer, "zenflow", True)
            and getattr(optimizer, "torch_autocast_gradscaler", 1) is None
            and not getattr(optimizer, "has_moe_layers", True)
            and _fused_adamw(inner)
            # Everything `_zero_step` touches, by DeepSpeed 0.19's names: a release that renamed one keeps its own.
            and all(getattr(optimizer, name, None) is not None for name in (
                "bit16_groups", "bit16_groups_flat", "single_partition_of_fp32_groups",
                "parallel_partitioned_bit16_groups", "real_dp_process_group", "params_in_partition",
                "params_not_in_partition", "averaged_gradients", "all_grad_tensors", "partition_size",
                "nccl_start_alignment_factor", "allgather_bucket_size", "loss_scale", "_optimizer_step",
                "_get_preflattened_grad_partition", "scaled_global_norm", "_update_model_bit16_weights",
                "_release_preflattened_grad_buffers", "_wait_for_offload_copies", "_update_scale",
                "_commit_muon_momentum", "free_grad_in_param_list", "flatten", "flatten_dense_tensors_aligned"))
            and all(hasattr(sys.modules.get(type(optimizer).__module__), name)
                    for name in ("INITIAL_MICRO_STEP_ID", "all_gather_dp_groups")))


def _supported_zero_3(optimizer: Any) -> bool:
    """DeepSpeed's ZeRO 3 optimizer in bf16 without offload (its gradients, masters and moments on the device),
    torch's fused AdamW inside, none of the features whose update differs."""
    inner = getattr(optimizer, "optimizer", None)
    return (type(optimizer).__name__ == "DeepSpeedZeroOptimizer_Stage3"
            and getattr(optimizer, "offload_optimizer", True) is False and getattr(optimizer, "offload_param", True)
            is False and getattr(optimizer, "swap_optimizer", True) is False
            and getattr(optimizer, "dtype", None) == torch.bfloat16 and getattr(optimizer, "loss_scale", 0) == 1.0
            and getattr(optimizer, "use_muon", True) is False and getattr(optimizer, "zenflow", True) is False
            and getattr(optimizer, "torch_autocast_gradscaler", 1) is None
            and _fused_adamw(inner)
            and all(getattr(optimizer, name, None) is not None for name in ("clip_grad", "loss_scale", "device"))
            and all(callable(getattr(optimizer, name, None)) for name in (
                "_prepare_fp32_grad_for_sub_group", "unscale_and_clip_grads", "_optimizer_step",
                "_reassign_or_swap_out_partitioned_parameters", "_unflatten_partitioned_parameters", "flatten"))
            and all(getattr(optimizer, name, None) is not None for name in (
                "fp16_partitioned_groups_flat", "fp32_partitioned_groups_flat", "averaged_gradients")))


def _install_zero_3(optimizer: Any, staged: dict[int, list[Any]]) -> None:
    """ZeRO 3's step calls a method per stage of each sub-group's update, its own order kept: the flat bf16
    gradient staged instead of cast to fp32, the clip's factor staged instead of multiplied, DeepSpeed's inner
    step (the pass, which writes the bf16 partition), and of the copy back only the weights' re-pointing."""

    def prepare(sub_group: int) -> None:
        # DeepSpeed's `_prepare_fp32_grad_for_sub_group` without its `.to(fp32)`: the same flat gradient (a view of
        # its buffer where the gradients lie end to end there), kept alive for the pass on the stream that reads it.
        master = optimizer.fp32_partitioned_groups_flat[sub_group]
        gradients = optimizer.averaged_gradients[sub_group]
        gradient = end_to_end(gradients)
        if gradient is None or gradient.numel() != master.numel():
            gradient = optimizer.flatten(gradients)
        if gradient.numel() != master.numel():
            raise RuntimeError(f"the gradient partition of sub-group {sub_group} holds {gradient.numel()} "
                               f"elements, its parameters {master.numel()}")
        if gradient.is_cuda:
            for grad in gradients:
                grad.record_stream(torch.cuda.current_stream(gradient.device))
        staged[id(master)] = [gradient, optimizer.fp16_partitioned_groups_flat[sub_group], None]
        optimizer.averaged_gradients[sub_group] = None

    def unscale_and_clip(sub_group: int, total_norm: Any) -> None:
        # ZeRO 3's `unscale_and_clip_grads` computes ZeRO 1/2's factor for a finite norm; a non-finite one it
        # lets through as NaN or 0 where `clip_factor` gives 0, a step `train/update.py` refuses either way.
        staged[id(optimizer.fp32_partitioned_groups_flat[sub_group])][2] = clip_factor(optimizer, total_norm)

    step_group = optimizer._optimizer_step

    def optimizer_step(sub_group: int) -> None:
        try:
            step_group(sub_group)
        finally:
            staged.clear()

    def reassign(sub_group: int) -> None:
        # The pass wrote the bf16 partition: of DeepSpeed's copy and re-pointing, the re-pointing.
        optimizer._unflatten_partitioned_parameters(sub_group)

    optimizer._prepare_fp32_grad_for_sub_group = prepare
    optimizer.unscale_and_clip_grads = unscale_and_clip
    optimizer._optimizer_step = optimizer_step
    optimizer._reassign_or_swap_out_partitioned_parameters = reassign


def _fused_adamw(inner: Any) -> bool:
    """torch's fused AdamW, with none of the options its kernel takes that `adamw_pass` does not."""
    return (type(inner) is torch.optim.AdamW and bool(inner.defaults.get("fused")) and "step" not in vars(inner)
            and not any(g["amsgrad"] or g["maximize"] or g.get("capturable") or g.get("differentiable")
                        or torch.is_tensor(g["lr"]) for g in inner.param_groups))


def _zero_step(optimizer: Any, staged: dict[int, list[Any]],
               alone: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None,
               lengths: list[int] | None = None) -> None:
    """DeepSpeed 0.19's `DeepSpeedZeroOptimizer.step` for bf16 without offload (no overflow check there: bf16's
    is off, `engine.deepspeed_config`), the fp32 gradient, its clip and the copy back left to `adamw_pass`; on one
    rank the norm and the clip's factor in one call, `alone`, over the first `lengths[i]` elements (the
    parameters', `_one_rank_lengths`) of each group's flat gradient."""
    module = sys.modules[type(optimizer).__module__]
    optimizer.micro_step_id = module.INITIAL_MICRO_STEP_ID
    optimizer._wait_for_offload_copies()
    optimizer.overflow = False
    groups = range(len(optimizer.bit16_groups))
    flats: dict[int, torch.Tensor] = {}
    if alone is not None and lengths is not None:  # the whole group is this rank's partition, from offset 0
        flats = {i: _flat_gradient(optimizer, i, 0) for i in groups}
        # Detached: a view of a gradient buffer would be guarded on the buffer's shape, a recompile per model.
        real = [flats[i].detach().narrow(0, 0, lengths[i]) for i in groups]
        norm, one_rank_factor = alone(real, constant(float(optimizer.clip_grad) or 1.0, real[0].device))
    else:
        norm = optimizer.scaled_global_norm()  # `fused.py`'s kernel per group; inf where any is not finite
    previous_scale = optimizer.loss_scale
    optimizer._update_scale(False)
    optimizer._commit_muon_momentum()
    optimizer._global_grad_norm = norm / previous_scale
    if alone is None:
        factor = clip_factor(optimizer, norm)  # None (no clip), or the gradients' multiplier
    else:
        factor = one_rank_factor if optimizer.clip_grad > 0.0 else None
    for i in groups:
        rank = torch.distributed.get_rank(group=optimizer.real_dp_process_group[i])
        optimizer.free_grad_in_param_list(optimizer.params_not_in_partition[i])
        gradient = flats[i] if i in flats else _flat_gradient(optimizer, i, rank)
        master = optimizer.single_partition_of_fp32_groups[i]
        staged[id(master)] = [gradient, optimizer.parallel_partitioned_bit16_groups[i][rank], factor]
        optimizer.free_grad_in_param_list(optimizer.params_in_partition[i])
        try:
            optimizer._optimizer_step(i)  # the inner step over this group alone, then the hp state linked
        finally:
            staged.clear()
        optimizer._release_preflattened_grad_buffers(i)
        optimizer.averaged_gradients[i] = None
        optimizer.all_grad_tensors[i] = None
    module.all_gather_dp_groups(groups_flat=optimizer.bit16_groups_flat,
                                partitioned_param_groups=optimizer.parallel_partitioned_bit16_groups,
                                dp_process_group=optimizer.real_dp_process_group,
                                start_alignment_factor=optimizer.nccl_start_alignment_factor,
                                allgather_bucket_size=optimizer.allgather_bucket_size)
    for i in range(len(optimizer.bit16_groups)):
        optimizer._update_model_bit16_weights(i)


def _one_rank_lengths(optimizer: Any) -> list[int] | None:
    """Each group's count of parameter elements (its flat gradient's, alignment padding left out), where one rank
    holds every group whole, from offset 0, at a loss scale of 1 (bf16's): the global norm needs no collective,
    and the factor is `fused.one_rank_norm`'s. None elsewhere. Counted once: the partitions never change."""
    if not (all(torch.distributed.get_world_size(group=g) == 1 for g in optimizer.real_dp_process_group)
            and all(offset == 0 for offset in getattr(optimizer, "first_offset", [None]))
            and float(optimizer.loss_scale) == 1.0 and not getattr(optimizer, "use_muon", False)):
        return None
    return [sum(p.numel() for p in params) for params in optimizer.params_in_partition]


def _flat_gradient(optimizer: Any, group: int, rank: int) -> torch.Tensor:
    """This rank's gradient partition of `group` as one flat tensor in its own dtype: the buffer DeepSpeed
    reduced it into where there is one, else a view of its gradients where they lie end to end in one buffer,
    else its gradients flattened (padded to the partition on the last rank), as DeepSpeed's step does."""
    flat = optimizer._get_preflattened_grad_partition(group)
    if flat is None:
        gradients = optimizer.averaged_gradients[group]
        flat = end_to_end(gradients)
        if flat is None or flat.numel() != optimizer.partition_size[group]:
            last = rank == torch.distributed.get_world_size(group=optimizer.real_dp_process_group[group]) - 1
            flat = (optimizer.flatten_dense_tensors_aligned(gradients, int(optimizer.partition_size[group])) if last
                    else optimizer.flatten(gradients))
    if flat.numel() != optimizer.partition_size[group]:
        raise RuntimeError(f"the gradient partition of group {group} holds {flat.numel()} elements, its "
                           f"parameters {optimizer.partition_size[group]}")
    return flat


def end_to_end(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """The one flat view that `torch.cat` of `tensors` would copy, where they already lie end to end in one
    buffer (each contiguous, one storage, dtype and device, each starting where the one before ends); None
    where they do not. ZeRO 3's gradients of a sub-group are such slices of its gradient buffer: the pass
    reads them there instead of from a copy (4 bytes a parameter fewer)."""
    if not tensors:
        return None
    first = tensors[0]
    offset = first.storage_offset()
    for tensor in tensors:
        if (not tensor.is_contiguous() or tensor.dtype != first.dtype or tensor.device != first.device
                or tensor.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
                or tensor.storage_offset() != offset):
            return None
        offset += tensor.numel()
    return first.as_strided((offset - first.storage_offset(),), (1,), first.storage_offset())


def _update(kernel: Callable[..., None], inner: torch.optim.AdamW, group: dict[str, Any], master: torch.Tensor,
            gradient: torch.Tensor, weight: torch.Tensor, factor: Any, refused: Any) -> None:
    """`adamw_pass` over one flat partition, its state made as torch's fused AdamW makes it (a refused first
    step still creates it, as torch's does)."""
    state = inner.state[master]
    if not state:
        state["step"] = torch.zeros((), dtype=torch.float32, device=master.device)
        state["exp_avg"] = torch.zeros_like(master, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(master, memory_format=torch.preserve_format)
    device = master.device
    # A fill kernel each, not a copy from host memory (which would wait for the GPU).
    lr = torch.full((), float(group["lr"]), dtype=torch.float32, device=device)
    flag = (constant(0.0, device) if refused is None
            else refused.detach().reshape(()).to(device=device, dtype=torch.float32))
    if not torch.is_tensor(factor):  # nothing clipped it: 1, or a number where only a static loss scale divides
        factor = constant(1.0 if factor is None else float(factor), device)
    beta1, beta2 = group["betas"]
    kernel(gradient.view(-1), master, state["exp_avg"], state["exp_avg_sq"], state["step"], weight.view(-1), lr,
           factor.to(device=device, dtype=torch.float32).reshape(()), flag, beta1=float(beta1), beta2=float(beta2),
           eps=float(group["eps"]), weight_decay=float(group["weight_decay"]))
