"""Classification losses for pre-training and fine-tuning.

Two kinds, chosen per run by ``kind``:

* ``"softmax"`` — softmax cross-entropy, mean over the batch. The usual single-label loss
  (ImageNet pre-training, every fine-tuning run).
* ``"sigmoid"`` — independent per-class sigmoid binary cross-entropy, **summed over classes and
  averaged over the batch**. JFT-300M is multi-label (an image has several of 18k labels), and the
  official ViT code pre-trains with ``sigmoid_xent``: ``-sum(y log σ(z) + (1-y) log(1-σ(z)), axis=-1)``
  then ``mean`` over examples. Summing (not averaging) over classes keeps the gradient scale
  independent of the number of classes, which is why the paper's learning rates transfer between
  JFT (18k classes) and ImageNet-21k (21k classes).

Label smoothing ε, the same rule for both kinds: targets become ``(1 - ε) * y + ε / K`` where ``y``
is the one-hot (or multi-hot) target and ``K`` the number of classes. For softmax this is exactly
``torch.nn.functional.cross_entropy(label_smoothing=ε)``; for sigmoid it is timm's
``BinaryCrossEntropy(smoothing=ε)`` convention (off-value ε/K, on-value 1 - ε + ε/K).

Losses are computed in float32 even when the logits are bf16/fp16 (mixed precision under
DeepSpeed): the sum over 18k classes loses too much precision in bf16.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F

__all__ = ["LossKind", "classification_loss", "smooth_targets"]

LossKind = Literal["softmax", "sigmoid"]
_KINDS: tuple[str, ...] = ("softmax", "sigmoid")


def smooth_targets(labels: torch.Tensor, num_classes: int, label_smoothing: float) -> torch.Tensor:
    """Dense float32 targets (B, K) from int labels (B,) or dense targets (B, K), with smoothing.

    ``(1 - ε) * y + ε / K``; with ε = 0 the targets are the one-/multi-hot vectors themselves.

    Raises:
        ValueError: labels are neither (B,) integers nor (B, K) values, or ε is out of [0, 1).
    """
    if not 0.0 <= label_smoothing < 1.0 or not math.isfinite(label_smoothing):
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
    if labels.ndim == 1 and not labels.is_floating_point():
        # F.one_hot raises (with the offending value) on labels outside [0, K).
        y = F.one_hot(labels.long(), num_classes).float()  # (B, K)
    elif labels.ndim == 2 and labels.shape[1] == num_classes:
        y = labels.float()  # (B, K) one-hot, multi-hot or probabilities
    else:
        raise ValueError(
            f"labels must be integer class ids of shape (B,) or targets of shape (B, {num_classes}); "
            f"got dtype {labels.dtype}, shape {tuple(labels.shape)}"
        )
    if label_smoothing > 0:
        y = y * (1.0 - label_smoothing) + label_smoothing / num_classes
    return y


def classification_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    kind: LossKind,
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """Scalar training loss for ``logits`` (B, K) against ``labels``.

    Args:
        logits: (B, K) raw scores, any float dtype; the loss is computed in float32.
        labels: (B,) integer class ids, or (B, K) float targets. For ``"sigmoid"`` (B, K) is a
            multi-hot vector per example; for ``"softmax"`` each (B, K) row is a probability
            distribution (e.g. a normalised multi-hot vector, or mixup targets).
        kind: ``"softmax"`` (cross-entropy, mean over batch) or ``"sigmoid"`` (binary cross-entropy
            summed over classes, mean over batch); see the module docstring.
        label_smoothing: ε in [0, 1); targets become ``(1 - ε) y + ε / K`` for both kinds.

    Returns:
        A 0-dim float32 tensor.

    Raises:
        ValueError: unknown ``kind``, ``label_smoothing`` out of range, or shapes that do not match.
    """
    if kind not in _KINDS:
        raise ValueError(f"kind must be one of {_KINDS}, got {kind!r}")
    if logits.ndim != 2:
        raise ValueError(f"logits must have shape (B, K), got {tuple(logits.shape)}")
    if labels.shape[0] != logits.shape[0]:
        raise ValueError(f"labels batch size {labels.shape[0]} != logits batch size {logits.shape[0]}")
    num_classes = logits.shape[1]
    z = logits.float()  # (B, K)
    targets = smooth_targets(labels, num_classes, label_smoothing)  # (B, K) float32
    if kind == "softmax":
        # -sum_k t_k log softmax(z)_k, averaged over the batch.
        return -(targets * F.log_softmax(z, dim=-1)).sum(dim=-1).mean()
    # Numerically stable BCE on logits, (B, K) → sum over classes → mean over batch.
    per_class = F.binary_cross_entropy_with_logits(z, targets, reduction="none")
    return per_class.sum(dim=-1).mean()
