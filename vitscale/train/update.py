"""The accumulation boundary's update: applied on every rank or on none, with one host sync where it can.

A step's update is refused when the step's loss was not finite on some rank, when some rank's gradient is
not finite, or when DeepSpeed skips it itself (fp16 loss-scale overflow, ZeRO-3's own non-finite check:
counted in `engine.skipped_steps`). The check sits on the innermost torch optimizer's `step`, the one call
that changes weights and optimizer state, so DeepSpeed's bookkeeping around it (gradient buffers cleared,
micro-step counters) runs as usual whatever the ZeRO stage. It is the one non-finite check of ZeRO 0-2
(DeepSpeed's own is switched off in `engine.deepspeed_config` or replaced in `fused.py`).

Two ways to decide, the same verdict:

- **On the device** (a global norm computed before the update, `_global_norm`: ZeRO 0-2 with `fused.py`'s
  kernels and ZeRO 3's own; and torch's fused optimizer, i.e. a GPU without offload): the verdict is a 0/1
  tensor the fused kernel reads as its `found_inf` (torch's AMP protocol: the kernel leaves weights, moments
  and step counts as they were where it is 1). The global norm is already summed over ranks and the loss
  already all-reduced, so every rank computes the same flag with no collective, and nothing waits for the
  GPU until `Update.read`, the step's one host sync. ZeRO 3 reads its norm on the host to skip a non-finite
  step itself (`is_invalid_grad_norm`), a wait for the GPU before its update is queued that only repeats
  this verdict: for the step, that check answers without reading (`_no_norm_read`).
- **On the host** everywhere else: the loss is read, the gradients the inner optimizer is about to use are
  checked with one multi-tensor norm, the flag all-reduced (MAX) and read, and the inner step not called.
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from vitscale.train.fused import fused_norm_installed


@dataclass(frozen=True)
class Update:
    """What one `apply_update` did, still on the device until `read`."""

    refused: bool | torch.Tensor
    """Whether vitscale's check refused the update: a host bool, or a 0/1 device flag (decided on the device)."""
    deepspeed_applied: bool
    """DeepSpeed's own verdict (its overflow skip), known on the host."""
    grad_norm: Any
    """The engine's global gradient norm before clipping: a tensor, a number, or None (not computed)."""

    def read(self, *also: torch.Tensor) -> tuple[bool, float, list[float]]:
        """(applied, grad_norm, `also`'s values): one host sync for all, `also` being 1-d tensors on the
        device that the step wants on the host anyway (the loop's all-reduced loss and votes)."""
        pending = {"refused": self.refused, "norm": self.grad_norm}
        tensors = {k: v for k, v in pending.items() if torch.is_tensor(v)}
        parts = [t.detach().reshape(1).float() for t in tensors.values()] + [t.detach().reshape(-1).float()
                                                                             for t in also]
        if parts:
            device = parts[0].device
            values = torch.cat([p.to(device) for p in parts]).tolist()
            pending.update(zip(tensors, values))
            values = values[len(tensors):]
        else:
            values = []
        applied = not pending["refused"] and self.deepspeed_applied
        norm = pending["norm"]
        return applied, float("nan") if norm is None else float(norm), values


def apply_update(engine: Any, *, loss: float | torch.Tensor) -> Update:
    """The accumulation boundary's `engine.step()` with the one non-finite check.

    `loss` is the step's loss as every rank sees it (all-reduced): a non-finite value refuses the update
    everywhere. A tensor is not read on the host when the update can be decided on the device.
    """
    inner = engine.basic_optimizer
    skipped_before = engine.skipped_steps
    verdict: bool | torch.Tensor | None = None  # refused (host) or the device flag
    whole = False  # the verdict came from the global norm: it holds for every group of this step
    own = inner.__dict__.get("step")  # an instance-level step someone else installed, kept as it was
    original = inner.step

    def guarded(*args: Any, **kwargs: Any) -> Any:
        nonlocal verdict, whole
        if verdict is None and _decides_on_device(engine, inner):
            verdict, whole = _device_verdict(engine, loss), True
        if verdict is None or (verdict is False and not whole):
            # Without the global norm each group's gradients are checked as it comes; once refused, always.
            verdict, whole = _refuse(engine, inner, not _finite(loss))
        if isinstance(verdict, torch.Tensor):
            inner.found_inf = verdict
            try:
                return original(*args, **kwargs)
            finally:
                del inner.found_inf
        return None if verdict else original(*args, **kwargs)

    inner.step = guarded
    try:
        with _no_norm_read(engine, inner):
            engine.step()
    finally:
        if own is None:
            del inner.step
        else:
            inner.step = own
    return Update(refused=False if verdict is None else verdict,
                  deepspeed_applied=engine.skipped_steps == skipped_before and engine.was_step_applied(),
                  grad_norm=engine.get_global_grad_norm())


def _finite(loss: float | torch.Tensor) -> bool:
    return math.isfinite(float(loss.item()) if isinstance(loss, torch.Tensor) else float(loss))


def _global_norm(engine: Any) -> torch.Tensor | None:
    """This step's gradient norm over every parameter group and rank, where the engine computes it before the
    first inner step: ZeRO 0-2 with `fused.py`'s kernels, and ZeRO 3's own (which has already skipped a step
    whose norm is not finite, unless `_no_norm_read` let the step through to this verdict). None elsewhere."""
    optimizer = getattr(engine, "optimizer", None)
    if fused_norm_installed(engine) or type(optimizer).__name__ == "DeepSpeedZeroOptimizer_Stage3":
        norm = getattr(optimizer, "_global_grad_norm", None)
        return norm if torch.is_tensor(norm) else None
    return None


def _takes_found_inf(inner: Any) -> bool:
    """The inner optimizer is torch's fused one, which takes a `found_inf` flag (`_step_supports_amp_scaling`)."""
    return bool(getattr(inner, "_step_supports_amp_scaling", False)) and bool(inner.defaults.get("fused"))


def _decides_on_device(engine: Any, inner: Any) -> bool:
    """The global norm is a device tensor every rank shares, and the inner optimizer takes a `found_inf` flag."""
    return _global_norm(engine) is not None and _takes_found_inf(inner)


@contextlib.contextmanager
def _no_norm_read(engine: Any, inner: Any) -> Iterator[None]:
    """ZeRO 3's step without its host read of the global norm, where the inner optimizer takes `found_inf`.

    DeepSpeed's ZeRO 3 step asks `is_invalid_grad_norm` of its norm tensor, a `bool` of a device tensor: the
    host waits there for the backward pass and the norm, and the GPU then idles while the host queues the
    update. With a fused inner optimizer the verdict is made on the device from that same norm (a non-finite
    one refuses the update: weights, moments and step counts untouched; `_device_verdict`), so for this step
    the check answers no for a tensor without reading it (a host number is still checked). A non-finite step
    then goes through DeepSpeed's step with its update refused by the kernel, as at ZeRO 0-2, instead of being
    skipped by DeepSpeed (`engine.skipped_steps` does not count it; `Update.read` says not applied either way).
    The check is a name in DeepSpeed's ZeRO 3 module, replaced for the length of the call: a worker steps one
    engine at a time."""
    optimizer = getattr(engine, "optimizer", None)
    module = sys.modules.get(type(optimizer).__module__)
    real = getattr(module, "is_invalid_grad_norm", None)
    if type(optimizer).__name__ != "DeepSpeedZeroOptimizer_Stage3" or real is None or not _takes_found_inf(inner):
        yield
        return

    def unread(norm: Any) -> bool:
        return False if torch.is_tensor(norm) else bool(real(norm))

    module.is_invalid_grad_norm = unread  # type: ignore[union-attr]
    try:
        yield
    finally:
        module.is_invalid_grad_norm = real  # type: ignore[union-attr]


def _device_verdict(engine: Any, loss: float | torch.Tensor) -> torch.Tensor:
    """1.0 where the global norm (summed over ranks, so the same on every rank) or the loss is not finite."""
    norm = engine.optimizer._global_grad_norm.detach().reshape(()).float()
    bad = ~torch.isfinite(norm)
    if isinstance(loss, torch.Tensor):
        bad = bad | ~torch.isfinite(loss.detach().reshape(()).to(norm.device))
    elif not math.isfinite(loss):
        bad = torch.ones_like(bad)
    return bad.float()


def _refuse(engine: Any, inner: Any, skip: bool) -> tuple[bool, bool]:
    """Whether this step's update is refused on every rank (`skip`, or a gradient not finite on some rank),
    and whether that verdict covers every parameter group (it came from the global norm).

    ZeRO 0-3 compute the global gradient norm over every parameter group before the first group's update
    (`_global_norm`): one finite check of that norm covers them all, so no group is updated when another's
    gradient is not finite. Elsewhere the gradients the inner optimizer is about to read are checked with
    one multi-tensor norm (a non-finite entry makes its tensor's norm non-finite). Either way: one
    all-reduce, one host sync. The all-reduce is safe inside the inner step because every rank calls that
    step or none does (DeepSpeed decides its own overflow skip collectively).
    """
    on_gpu = torch.distributed.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    flag = torch.full((1,), float(skip), device=device)
    norm = _global_norm(engine)
    norms: torch.Tensor | None = None
    if torch.is_tensor(norm):
        norms = norm.reshape(1).to(device)
    else:
        grads = [p.grad for group in inner.param_groups for p in group["params"] if p.grad is not None]
        norms = torch.stack([n.to(device) for n in torch._foreach_norm(grads)]) if grads else None
    if norms is not None:
        flag = torch.maximum(flag, (~torch.isfinite(norms)).any().to(flag.dtype).reshape(1))
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    return bool(flag.item() > 0), torch.is_tensor(norm)
