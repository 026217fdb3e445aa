"""ZeRO 1/2's gradient norm in one multi-tensor kernel, and its clipping without a host sync.

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
(an infinite norm) and the same multiply on the device.

It leaves any other optimizer (stage 0, ZeRO-3, CPU offload, whose norm is computed on the host)
as DeepSpeed built it, and leaves a method it does not recognise alone (a DeepSpeed release that
renamed it keeps its own, slower norm: correct either way).
"""

from __future__ import annotations

from typing import Any

import torch


def fuse_gradient_norm(engine: Any) -> bool:
    """Install the fused norm on `engine`'s ZeRO 1/2 optimizer; whether it was installed."""
    optimizer: Any = getattr(engine, "optimizer", None)
    if type(optimizer).__name__ != "DeepSpeedZeroOptimizer" or getattr(optimizer, "cpu_offload", True):
        return False
    original = getattr(optimizer, "get_grad_norm_direct", None)
    group = getattr(optimizer, "dp_process_group", None)
    if original is None or getattr(optimizer, "has_moe_layers", False):
        return False

    def grad_norm(gradients: list[torch.Tensor], params: list[torch.Tensor], norm_type: float = 2) -> torch.Tensor:
        if float(norm_type) != 2.0:
            return original(gradients, params, norm_type)
        # DeepSpeed's own filter: padding it appended for alignment is not a gradient.
        grads = [g for g in gradients if g is not None and not getattr(g, "_zero_padding", False) and g.numel()]
        device = optimizer.device
        if grads:
            # (n,) per-tensor norms, fp32 accumulation; the sum of squares is the squared global norm.
            norms = torch._foreach_norm(grads, 2.0, dtype=torch.float32)
            total = torch.stack([n.to(device) for n in norms]).square().sum()
        else:
            total = torch.zeros((), dtype=torch.float32, device=device)
        torch.distributed.all_reduce(total, op=torch.distributed.ReduceOp.SUM, group=group)
        # DeepSpeed's sentinel for a non-finite norm (its `mask_nan_or_inf_with_val_inplace`), without the
        # host-to-device copy of its -1 that waits for the GPU.
        return total.sqrt().nan_to_num_(nan=-1.0, posinf=-1.0, neginf=-1.0)

    optimizer.get_grad_norm_direct = grad_norm
    return True


def fused_norm_installed(engine: Any) -> bool:
    """Whether `engine`'s optimizer computes its global gradient norm with `fuse_gradient_norm`'s kernel."""
    return "get_grad_norm_direct" in getattr(getattr(engine, "optimizer", None), "__dict__", {})



def fuse_clipping(engine: Any) -> bool:
    """Install DeepSpeed's clipping without its host read on `engine`'s ZeRO 1/2 optimizer (one with
    `fuse_gradient_norm`'s norm); whether it was installed."""
    optimizer: Any = getattr(engine, "optimizer", None)
    if not fused_norm_installed(engine) or getattr(optimizer, "unscale_and_clip_grads", None) is None:
        return False

    def unscale_and_clip(grad_groups_flat: list[Any], total_norm: Any) -> None:
        # DeepSpeed 0.19's `DeepSpeedZeroOptimizer.unscale_and_clip_grads`, op for op, so the gradients come
        # out bit for bit the same; only the invalid-norm test stays a tensor instead of a Python bool.
        if optimizer.clip_grad == 0.0 and optimizer.loss_scale == 1.0:
            return
        combined_scale: Any = optimizer.loss_scale
        if optimizer.clip_grad > 0.0:
            norm = total_norm if torch.is_tensor(total_norm) else torch.tensor(float(total_norm),
                                                                                device=optimizer.device)
            invalid = ~torch.isfinite(norm) | (norm < 0)  # DeepSpeed clips an invalid norm as an infinite one
            clip_norm = torch.where(invalid, torch.full_like(norm, float("inf")), norm)
            clip = ((clip_norm / optimizer.loss_scale) + 1e-6) / optimizer.clip_grad
            combined_scale = torch.clamp(clip, min=1.0) * optimizer.loss_scale
        for grad in grad_groups_flat:
            for g in grad if isinstance(grad, list) else [grad]:
                g.data.mul_(1.0 / combined_scale)

    optimizer.unscale_and_clip_grads = unscale_and_clip
    return True
