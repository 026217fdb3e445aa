"""Optimiser pieces: the learning-rate schedule, weight-decay parameter groups, the optimiser (batch rule: batch.py).

Everything here is a pure function of its arguments (no DeepSpeed, no Ray), so the engine and the
worker loop can call it and the tests can prove its properties without a cluster.

Paper facts (ViT, Table 3 / App. B.1): Adam(W) with β=(0.9, 0.999), batch 4096, 10k linear warm-up
steps, then *linear* decay for JFT-300M / ImageNet-21k pre-training and *cosine* decay for ImageNet
pre-training and for fine-tuning. Weight decay is "high" (0.03-0.3) and decoupled; following the
official code (and timm / big_vision) it is not applied to biases, normalisation weights, the class
token or the position embeddings.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Literal

import torch
from torch import nn

from vitscale.config.checks import non_negative_int, number, positive_int

if TYPE_CHECKING:
    from vitscale.train.config import TrainConfig

__all__ = [
    "DEFAULT_NO_DECAY_NAMES",
    "epoch_at",
    "lr_at",
    "param_groups",
    "schedule_length",
    "split_decay",
    "steps_for",
]

Decay = Literal["linear", "cosine"]
_DECAYS: tuple[str, ...] = ("linear", "cosine")


# --------------------------------------------------------------------------------------------
# Learning-rate schedule
# --------------------------------------------------------------------------------------------


def lr_at(
    step: int,
    *,
    base_lr: float,
    total_steps: int,
    warmup_steps: int,
    decay: Decay = "linear",
    end_lr: float = 0.0,
) -> float:
    """Learning rate for optimiser step ``step`` (0-based: the LR used by the first update is lr_at(0)).

    Shape of the schedule:
      * warm-up, ``0 <= step < warmup_steps``: ``base_lr * step / warmup_steps`` — linear from 0,
        reaching exactly ``base_lr`` at ``step == warmup_steps`` (as in the paper's code);
      * decay, ``warmup_steps <= step <= total_steps``: from ``base_lr`` to ``end_lr`` over the
        remaining ``total_steps - warmup_steps`` steps, either ``"linear"`` (JFT / ImageNet-21k
        pre-training) or ``"cosine"`` (half cosine: ImageNet pre-training, fine-tuning);
      * ``step >= total_steps``: ``end_lr`` (a loop that runs one step past the end gets the final
        value instead of an error).

    ``end_lr`` is an absolute learning rate (not a ratio of ``base_lr``), ``0 <= end_lr <= base_lr``;
    the paper's code decays to (almost) zero, which is the default.

    ``warmup_steps >= total_steps``: the run ends before warm-up does. The schedule is then the
    warm-up ramp cut off at ``total_steps`` — it never exceeds the ramp, never jumps, and there is
    no decay phase; the last step's LR is ``base_lr * total_steps / warmup_steps``. (Quick local
    runs that keep the paper's 10k warm-up therefore train at a small LR rather than crash; set
    ``warmup_steps`` below ``total_steps`` to get the decay.) ``warmup_steps == 0`` means no warm-up.

    Raises:
        ValueError: an argument is out of range; the message names it.
    """
    non_negative_int(step, "step")
    base = number(base_lr, "base_lr")
    if base <= 0:
        raise ValueError(f"base_lr must be > 0, got {base_lr}")
    positive_int(total_steps, "total_steps")
    non_negative_int(warmup_steps, "warmup_steps")
    if decay not in _DECAYS:
        raise ValueError(f"decay must be one of {_DECAYS}, got {decay!r}")
    end = number(end_lr, "end_lr")
    if not 0.0 <= end <= base:
        raise ValueError(f"end_lr must be in [0, base_lr={base}] (an absolute LR, not a ratio), got {end_lr}")

    step = min(step, total_steps)
    if step < warmup_steps:
        return base * step / warmup_steps
    if warmup_steps >= total_steps:  # only reachable with step == total_steps == warmup_steps
        return base
    progress = (step - warmup_steps) / (total_steps - warmup_steps)  # in [0, 1]
    if decay == "linear":
        lr = base + (end - base) * progress
    else:
        lr = end + (base - end) * 0.5 * (1.0 + math.cos(math.pi * progress))
    # Rounding can land a hair outside [end, base]; clamp so the documented bounds hold exactly.
    return min(base, max(end, lr))


def warmup_outlasts(total_steps: int, warmup_steps: int, key: str) -> str | None:
    """The line saying a run ends before its warm-up does (`lr_at`'s ramp cut off: the learning rate never
    reaches the base LR, and never decays), or None when the warm-up ends within the run. `key` names the
    setting (`train.warmup_steps`)."""
    if warmup_steps == 0 or warmup_steps < total_steps:
        return None
    # The last (0-based) step's LR over the base LR: the highest the cut-off ramp reaches.
    reached = lr_at(total_steps - 1, base_lr=1.0, total_steps=total_steps, warmup_steps=warmup_steps)
    return (f"{key} ({warmup_steps:,}) is not below the run's {total_steps:,} steps: the whole run is warm-up, "
            f"its learning rate rises to {100 * reached:.3g}% of the base LR and never decays (set {key} below "
            "the run's steps for the paper's schedule)")


# --------------------------------------------------------------------------------------------
# Weight-decay parameter groups
# --------------------------------------------------------------------------------------------

#: Parameter names (last dotted component) excluded from weight decay when a model has no
#: ``no_weight_decay()`` method: the usual names of the class token and 1-D position embeddings.
DEFAULT_NO_DECAY_NAMES: frozenset[str] = frozenset({"cls_token", "pos_embed"})


def _matches(param_name: str, key: str) -> bool:
    # Exact name, or the same name under a wrapper prefix ("module.pos_embed" for DDP/DeepSpeed).
    return param_name == key or param_name.endswith("." + key)


def split_decay(model: nn.Module) -> tuple[list[str], list[str]]:
    """Split the trainable parameter names of ``model`` into (decayed, not decayed).

    Not decayed: every parameter with ``ndim <= 1`` (biases, LayerNorm/GroupNorm scales, scalar
    gates) and every parameter named by ``model.no_weight_decay()`` (a set of parameter names such
    as ``{"cls_token", "pos_embed"}``, as timm's ViT defines). A name matches the parameter of the
    same full name or one ending in ``"." + name``. Without that method, names whose last component
    is in ``DEFAULT_NO_DECAY_NAMES`` are not decayed. Frozen parameters (``requires_grad=False``)
    appear in neither list.

    Raises:
        ValueError: ``no_weight_decay()`` names a parameter the model does not have (a typo that
            would otherwise silently decay the position embeddings).
    """
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    hook = getattr(model, "no_weight_decay", None)
    if callable(hook):
        keys = set(hook())
        all_names = [n for n, _ in model.named_parameters()]
        unknown = sorted(k for k in keys if not any(_matches(n, k) for n in all_names))
        if unknown:
            raise ValueError(
                f"{type(model).__name__}.no_weight_decay() names parameters the model does not have: "
                f"{unknown}; parameter names look like {all_names[:5]}"
            )
        excluded = lambda n: any(_matches(n, k) for k in keys)  # noqa: E731
    else:
        excluded = lambda n: n.rsplit(".", 1)[-1] in DEFAULT_NO_DECAY_NAMES  # noqa: E731

    decay: list[str] = []
    no_decay: list[str] = []
    for name, p in named:
        (no_decay if p.ndim <= 1 or excluded(name) else decay).append(name)
    return decay, no_decay


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Optimiser parameter groups with decoupled weight decay on matrices/kernels only.

    Returns up to two groups, ``{"params": [...], "weight_decay": weight_decay}`` and
    ``{"params": [...], "weight_decay": 0.0}`` (see :func:`split_decay` for which parameter goes
    where); an empty group is left out because DeepSpeed ZeRO refuses empty groups. Pass the result
    to ``torch.optim.AdamW`` or ``deepspeed.initialize(model_parameters=...)``. Use AdamW (decoupled
    decay), not Adam with L2, to match the paper's "high weight decay" setting.

    Raises:
        ValueError: ``weight_decay`` is negative or not finite, or the model has no trainable
            parameters.
    """
    wd = number(weight_decay, "weight_decay")
    if wd < 0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
    decay_names, no_decay_names = split_decay(model)
    if not decay_names and not no_decay_names:
        raise ValueError(f"{type(model).__name__} has no trainable parameters (all requires_grad=False)")
    params = dict(model.named_parameters())
    groups = [
        {"params": [params[n] for n in decay_names], "weight_decay": wd},
        {"params": [params[n] for n in no_decay_names], "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


# --------------------------------------------------------------------------------------------
# Batch arithmetic
# --------------------------------------------------------------------------------------------


def steps_for(epochs: float, samples_per_epoch: int, global_batch: int) -> int:

    """Optimiser steps to see ``epochs`` passes over ``samples_per_epoch`` examples at ``global_batch``.

    The example count is rounded to an integer first and the step count rounded *up*, so the run
    sees at least the requested data (7 epochs of 303M JFT images at 4096 → 517,823 steps). Always
    at least 1 step.

    Raises:
        ValueError: ``epochs`` is not a positive finite number, or a count is not a positive integer.
    """
    ep = number(epochs, "epochs")
    if ep <= 0:
        raise ValueError(f"epochs must be > 0, got {epochs}")
    positive_int(samples_per_epoch, "samples_per_epoch")
    positive_int(global_batch, "train.global_batch")
    examples = max(1, round(ep * samples_per_epoch))
    return -(-examples // global_batch)  # ceil division on ints: exact for any size


def schedule_length(split_samples: int, global_batch: int, epochs: float,
                    max_steps: int | None) -> tuple[int, int]:
    """(steps per epoch, total steps) of a run over a split of `split_samples` samples.

    An epoch is the whole global batches the split fills (data/order.py: each rank takes its share of
    every one, whatever the world size), so the count does not depend on the world size; the schedule
    is `max_steps` or `epochs` of such epochs. The loop and the driver (ASHA's horizon) both use this,
    so they agree on the step count.
    """
    steps_per_epoch = split_samples // global_batch
    if steps_per_epoch == 0:
        raise ValueError(f"data.url: {split_samples} samples cannot fill one step of train.global_batch="
                         f"{global_batch}; use a smaller train.global_batch")
    total = max_steps or steps_for(epochs, steps_per_epoch * global_batch, global_batch)
    return steps_per_epoch, total


def epoch_at(step: int, global_batch: int, samples_per_epoch: int) -> float:
    """Fractional epoch reached after ``step`` optimiser steps (examples seen / epoch size)."""
    non_negative_int(step, "step")
    positive_int(global_batch, "train.global_batch")
    positive_int(samples_per_epoch, "samples_per_epoch")
    return step * global_batch / samples_per_epoch


def optimizer_for(train: TrainConfig, groups: list[dict], *, fused: bool = False) -> torch.optim.Optimizer:
    """The torch optimizer `train` names, over `groups` (:func:`param_groups`): AdamW with
    ``(adam_beta1, adam_beta2)`` and decoupled weight decay for pre-training (Sec. 4.1, App. B.1),
    SGD with momentum for fine-tuning (App. B.1.1). Its learning rate is set before every step
    from :func:`lr_at`; ``base_lr`` is only its starting value. ``fused``: torch's one-kernel CUDA
    implementation (the same update; parameters must be on a GPU)."""
    if train.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=train.base_lr, momentum=train.momentum, weight_decay=train.weight_decay,
                               fused=fused or None)
    return torch.optim.AdamW(groups, lr=train.base_lr, betas=(train.adam_beta1, train.adam_beta2), eps=ADAM_EPS,
                             weight_decay=train.weight_decay, fused=fused or None)


ADAM_EPS = 1e-8
"""Adam's epsilon (the paper's optimiser uses the common default)."""
