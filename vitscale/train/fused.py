"""The optimizer step's norm, clipping and copies in multi-tensor kernels without host syncs, ZeRO 0-3; no
redundant host work after it.

DeepSpeed's `DeepSpeedZeroOptimizer.get_grad_norm_direct` (ZeRO 1 and 2, the norm that clipping and
`engine.get_global_grad_norm()` use) casts every parameter's gradient to fp64 and takes its norm one
tensor at a time: about three kernel launches per parameter (ViT-B/16 has 152), launched after the
backward pass while the GPU waits, every step. Its other branches serve tensor and pipeline model
parallelism, which vitscale's models do not use. `fuse_gradient_norm` replaces that method on one
engine's optimizer with `torch._foreach_norm` over the same gradients: the same L2 norm (accumulated
in fp32 per tensor, then summed over tensors and ranks as DeepSpeed does), the same non-finite sentinel
(-1), in one launch per dtype and no host sync.

`fuse_clipping` replaces `unscale_and_clip_grads`, which DeepSpeed calls once per parameter group: its
`is_invalid_grad_norm(norm)` reads the norm on the host (a sync per group, the GPU idle while the host
then launches the update). The replacement computes the same clip coefficient, the same invalid-norm rule
(an infinite norm) and the same multiply on the device; `clip_factor` is that coefficient, which
`train/one_pass.py` applies inside its AdamW kernel instead of in a pass of its own.

`fuse_bf16_step` does the same for ZeRO 0 in bf16, where DeepSpeed wraps the optimizer in its
`FP16_UnfusedOptimizer`: that step checks every gradient for overflow with a host read each (152 for
ViT-B/16, although `bf16.check_grad_overflow` is off) and sums the norm on the host. The replacement: the
same fp32 master gradients, one multi-tensor norm, the same clip, the inner step, one multi-tensor copy
back to the bf16 weights, no host read; a non-finite gradient is refused by `train/update.py`'s one check
instead of DeepSpeed's overflow skip. It also undoes the step with zero gradients that wrapper takes when
it is built, so a run's first update at ZeRO 0 is the same as at ZeRO 1-3.

`keep_weight_views` trims the host's side of ZeRO 1/2's step: after every update DeepSpeed points each bf16
weight at its slice of the flat buffer again (`_update_model_bit16_weights`, "TODO: we probably don't need
this? just to be safe"), a narrow, a view and a `.data` assignment per parameter, although the weights
already are those slices: the update wrote into the buffer itself. For ViT-B/16's 152 parameters that was
0.59 ms of host time a step on this project's 2-core CPU (about a fifth of the update's), the check that
replaces it 0.05 ms; the optimizer phase timed from an idle GPU is mostly the host's time. It now runs only
where some weight is not its slice (the buffers were moved: offloaded states reloaded, a checkpoint
loaded), checked pointer by pointer; a step whose buffers stayed put skips it.

Each of these installers marks the optimizer (`GLOBAL_NORM`): its `_global_grad_norm` is then this step's
norm over every group and rank, on the device, before the inner optimizer steps (what `train/update.py`
decides from). It leaves any other optimizer (ZeRO-3, CPU offload, whose norm is computed on the host) as
DeepSpeed built it, and leaves a method it does not recognise alone (a DeepSpeed release that renamed it
keeps its own, slower path: correct either way).

`fuse_zero_3_norm` gives ZeRO 3 the same norm kernel, at any number of ranks (its docstring). On one rank
ZeRO 1/2's one-pass update takes the norm and the clip's factor over each group's flat gradient instead
(`one_rank_norm`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

GLOBAL_NORM = "vitscale_global_norm"
"""The attribute marking an optimizer whose `_global_grad_norm` one of these installers computes."""


def fuse_gradient_norm(engine: Any) -> bool:
    """Install the fused norm on `engine`'s ZeRO 1/2 optimizer; whether it was installed."""
    optimizer: Any = getattr(engine, "optimizer", None)
    if type(optimizer).__name__ != "DeepSpeedZeroOptimizer" or getattr(optimizer, "cpu_offload", True):
        return False
    original = getattr(optimizer, "get_grad_norm_direct", None)
    group = getattr(optimizer, "dp_process_group", None)
    if original is None or getattr(optimizer, "has_moe_layers", False):
        return False

    alone = torch.distributed.get_world_size(group) == 1  # nothing to sum over: no collective to queue

    def grad_norm(gradients: list[torch.Tensor], params: list[torch.Tensor], norm_type: float = 2) -> torch.Tensor:
        if float(norm_type) != 2.0:
            return original(gradients, params, norm_type)
        return l2_norm(gradients, optimizer.device, None if alone else group)

    optimizer.get_grad_norm_direct = grad_norm
    setattr(optimizer, GLOBAL_NORM, True)
    return True


def fuse_zero_3_norm(engine: Any) -> bool:
    """Install the fused norm on `engine`'s ZeRO 3 optimizer, at any number of ranks; whether it was installed.

    DeepSpeed's ZeRO 3 norm (its own `get_grad_norm_direct`) casts every gradient partition to fp64 and takes
    its norm one tensor at a time (about three launches per parameter), sums the squares over the partition's
    ranks, then marks a non-finite norm -1 with a constant it makes on the host and copies to the device
    (`torch.tensor(-1.0, device=...)`): a copy from pageable memory, which waits for everything queued before
    it, the whole backward pass (CUDA's sync debug mode found it, `tests/test_gpu_training.py`). Here: this
    rank's partitions in one multi-tensor kernel, the squares summed over the same ranks, the same -1, no host
    copy. Only the 2-norm without model parallelism, offload or experts, where every rank's partition counts
    once (DeepSpeed's `_grad_norm_counts_every_rank`); anything else keeps DeepSpeed's. ZeRO 3 computes its
    global norm before its update itself, so the optimizer carries no `GLOBAL_NORM` mark."""
    optimizer: Any = getattr(engine, "optimizer", None)
    real = getattr(optimizer, "get_grad_norm_direct", None)
    group_of = getattr(optimizer, "_get_param_partition_group", None)
    experts = getattr(optimizer, "_autoep_expert_parallel_group", None)
    if (type(optimizer).__name__ != "DeepSpeedZeroOptimizer_Stage3" or real is None or not callable(group_of)
            or getattr(optimizer, "model_parallel_group", True) is not None
            or getattr(optimizer, "offload_optimizer", True) or "get_grad_norm_direct" in vars(optimizer)):
        return False

    def grad_norm(gradients: list[torch.Tensor], params: list[Any], norm_type: float = 2) -> torch.Tensor:
        if float(norm_type) != 2.0 or not params or (callable(experts) and experts(params) is not None):
            return real(gradients, params, norm_type)
        group = group_of(params[0])
        return l2_norm(gradients, optimizer.device, None if torch.distributed.get_world_size(group) == 1 else group)

    optimizer.get_grad_norm_direct = grad_norm
    return True


def l2_norm(gradients: Sequence[torch.Tensor | None], device: torch.device | str, group: Any = None) -> torch.Tensor:
    """The L2 norm of `gradients` on `device` (summed over `group`'s ranks where one is given), in one
    multi-tensor kernel and with no host sync; -1 where it is not finite, DeepSpeed's sentinel. ZeRO 1 and 2's
    norm (`fuse_gradient_norm`) and ZeRO 3's (`fuse_zero_3_norm`)."""
    # DeepSpeed's own filter: padding it appended for alignment is not a gradient.
    grads = [g for g in gradients if g is not None and not getattr(g, "_zero_padding", False) and g.numel()]
    if grads:
        # (n,) per-tensor norms, fp32 accumulation; the sum of squares is the squared global norm.
        # Every gradient is on the optimizer's device (no offload here): one stack, not a call per tensor.
        norms = torch._foreach_norm(grads, 2.0, dtype=torch.float32)
        total = torch.stack(norms).to(device).square().sum()
    else:
        total = torch.zeros((), dtype=torch.float32, device=device)
    if group is not None:
        torch.distributed.all_reduce(total, op=torch.distributed.ReduceOp.SUM, group=group)
    # DeepSpeed's sentinel for a non-finite norm (its `mask_nan_or_inf_with_val_inplace`), without the
    # host-to-device copy of its -1 that waits for the GPU.
    return total.sqrt().nan_to_num_(nan=-1.0, posinf=-1.0, neginf=-1.0)


def fused_norm_installed(engine: Any) -> bool:
    """Whether `engine`'s optimizer computes its global gradient norm with one of these installers' kernels."""
    return bool(getattr(getattr(engine, "optimizer", None), "__dict__", {}).get(GLOBAL_NORM))



def fuse_clipping(engine: Any) -> bool:
    """Install DeepSpeed's clipping without its host read on `engine`'s ZeRO 1/2 optimizer (one with
    `fuse_gradient_norm`'s norm); whether it was installed."""
    optimizer: Any = getattr(engine, "optimizer", None)
    # `fuse_gradient_norm`'s own method, not the shared marker: ZeRO 0's wrapper has an `unscale_and_clip_grads`
    # of another signature, which this must never replace.
    if "get_grad_norm_direct" not in getattr(optimizer, "__dict__", {}):
        return False

    def unscale_and_clip(grad_groups_flat: list[Any], total_norm: Any) -> None:
        factor = clip_factor(optimizer, total_norm)
        if factor is None:
            return
        for grad in grad_groups_flat:
            for g in grad if isinstance(grad, list) else [grad]:
                g.data.mul_(factor)

    optimizer.unscale_and_clip_grads = unscale_and_clip
    return True


def clip_factor(optimizer: Any, total_norm: Any) -> Any:
    """What DeepSpeed 0.19's `DeepSpeedZeroOptimizer.unscale_and_clip_grads` multiplies `optimizer`'s gradients
    by, op for op, so the gradients come out bit for bit the same: None where it leaves them as they are. Only
    the invalid-norm test stays a tensor instead of a Python bool (no host read): a device tensor wherever the
    gradients are clipped."""
    if optimizer.clip_grad == 0.0 and optimizer.loss_scale == 1.0:
        return None
    if optimizer.clip_grad <= 0.0:
        return 1.0 / optimizer.loss_scale
    norm = total_norm if torch.is_tensor(total_norm) else torch.tensor(float(total_norm), device=optimizer.device)
    invalid = ~torch.isfinite(norm) | (norm < 0)  # DeepSpeed clips an invalid norm as an infinite one
    clip_norm = torch.where(invalid, torch.full_like(norm, float("inf")), norm)
    return clip_multiplier(clip_norm, optimizer.loss_scale, optimizer.clip_grad)


def clip_multiplier(norm: torch.Tensor, loss_scale: Any, clip_grad: Any) -> torch.Tensor:
    """DeepSpeed 0.19's clip coefficient for a valid (or infinite) `norm` of loss-scaled gradients, op for op:
    1 / (max((norm / scale + 1e-6) / clip, 1) * scale); 0 for an infinite norm."""
    return 1.0 / (torch.clamp(((norm / loss_scale) + 1e-6) / clip_grad, min=1.0) * loss_scale)


def one_rank_norm(gradients: list[torch.Tensor], clip: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The global gradient norm of one rank's flat gradients (one per parameter group, the whole group each)
    and the clip's factor at a loss scale of 1, as 0-d fp32 tensors: DeepSpeed's norm up to rounding (squares
    summed in fp32 over each group, then over the groups; its per-tensor norms then squared sum the same
    squares in another order), infinite where it is not finite (`combine_grad_norm_groups`' rule), and
    `clip_multiplier`'s factor (0 for an infinite norm), `clip` being `clip_grad`. `train/one_pass.py` compiles
    it: one graph where the per-group norms, their combination and the factor dispatched about 30 operators."""
    norm = torch.stack([g.float().square().sum() for g in gradients]).sum().sqrt()
    norm = torch.where(torch.isfinite(norm), norm, torch.full_like(norm, float("inf")))
    return norm, clip_multiplier(norm, 1.0, clip)


def fuse_bf16_step(engine: Any) -> bool:
    """Install the sync-free step on `engine`'s ZeRO 0 bf16 wrapper (DeepSpeed's `FP16_UnfusedOptimizer` with a
    static loss scale, no model parallelism); whether it was installed."""
    optimizer: Any = getattr(engine, "optimizer", None)
    if (type(optimizer).__name__ != "FP16_UnfusedOptimizer" or getattr(optimizer, "fused_lamb_legacy", True)
            or getattr(optimizer, "mpu", None) is not None
            or getattr(getattr(optimizer, "loss_scale_config", None), "dynamic_loss_scale", True)):
        return False

    def step(closure: Any = None) -> bool:
        low = [p for group in optimizer.fp16_groups for p in group]
        master = [p for group in optimizer.fp32_groups for p in group]  # copied into in place when loaded
        # Data parallelism has already averaged the gradients over ranks (the engine's backward): every rank's
        # norm is the global one, with no collective.
        grads = [p.grad for p in low if p.grad is not None]
        device = master[0].device
        if grads:
            norm = torch.stack([n.to(device) for n in torch._foreach_norm(grads, 2.0, dtype=torch.float32)])
            # DeepSpeed reports a step it skipped for a non-finite gradient with an infinite norm.
            norm = norm.square().sum().sqrt().nan_to_num(nan=float("inf"))
        else:
            norm = torch.zeros((), dtype=torch.float32, device=device)
        for p32, p16 in zip(master, low):  # DeepSpeed's fp32 master gradients (zeros for a parameter without one)
            p32.grad = torch.zeros_like(p32) if p16.grad is None else p16.grad.to(p32.dtype)
        optimizer._global_grad_norm = norm
        optimizer.overflow = False
        optimizer._update_scale(False)
        scale = optimizer.loss_scale_config.cur_scale
        combined: Any = scale
        if optimizer.clip_grad > 0.0:  # DeepSpeed's rule: scale down only when the norm exceeds the clip
            clip = ((norm / scale) + 1e-6) / optimizer.clip_grad
            combined = torch.clamp(clip, min=1.0) * scale
        if optimizer.clip_grad > 0.0 or scale != 1.0:
            torch._foreach_mul_([p.grad for p in master], 1.0 / combined)
        optimizer.optimizer.step()
        for p32 in master:
            p32.grad = None
        torch._foreach_copy_([p.data for p in low], [p.data for p in master])
        return False

    # DeepSpeed's wrapper stepped the inner optimizer once with zero gradients when it was built
    # (`initialize_optimizer_states`, to create its state): Adam's count started at 1, which made the first
    # real update 0.74x the size it is at ZeRO 1-3, and AdamW's decay shrank the fp32 masters once. Undone:
    # the state is created by the first real step, the masters are again the copies of the model's weights
    # they were made as. A resumed run loads both from its checkpoint afterwards.
    optimizer.optimizer.state.clear()
    for group16, group32 in zip(optimizer.fp16_groups, optimizer.fp32_groups):
        for p16, p32 in zip(group16, group32):
            p32.data.copy_(p16.data)
    optimizer.step = step
    setattr(optimizer, GLOBAL_NORM, True)
    return True


def keep_weight_views(engine: Any) -> bool:
    """On `engine`'s ZeRO 1/2 optimizer, point the weights at their flat buffer's slices only where one is not
    already (see the module's docstring); whether it was installed."""
    optimizer: Any = getattr(engine, "optimizer", None)
    repoint = getattr(optimizer, "_update_model_bit16_weights", None)
    if type(optimizer).__name__ != "DeepSpeedZeroOptimizer" or repoint is None or not all(
            hasattr(optimizer, name) for name in ("bit16_groups", "bit16_groups_flat", "round_robin_bit16_groups",
                                                  "round_robin_bit16_meta", "round_robin_bit16_offsets")):
        return False
    # DeepSpeed's second loop points each model weight at its round-robin twin's data: the same tensors,
    # reordered, where this holds, so the first loop's slices are all there is to check.
    if any({id(p) for p in model} != {id(p) for p in robin}
           for model, robin in zip(optimizer.bit16_groups, optimizer.round_robin_bit16_groups, strict=True)):
        return False

    def repoint_where_moved(group_index: int) -> None:
        flat = optimizer.bit16_groups_flat[group_index]
        base, size = flat.data_ptr(), flat.element_size()
        for p, meta, offset in zip(optimizer.round_robin_bit16_groups[group_index],
                                   optimizer.round_robin_bit16_meta[group_index],
                                   optimizer.round_robin_bit16_offsets[group_index]):
            if (p.data_ptr() != base + offset * size or p.shape != meta.shape or p.dtype != flat.dtype
                    or not p.is_contiguous()):
                repoint(group_index)
                return

    optimizer._update_model_bit16_weights = repoint_where_moved
    return True
