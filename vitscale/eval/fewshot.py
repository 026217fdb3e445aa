"""Few-shot linear evaluation (ViT paper, Sec. 4.1 "Metrics").

Freeze the model, take representations of ``k`` training images per class (k = 1, 5, 10, 25), fit a
regularised least-squares map from representations to {-1, +1}^K targets **in closed form**, and
report top-1 accuracy on the test set. No SGD, no hyper-parameters beyond the ridge strength, so it
is cheap enough to run during pre-training.

The solve (``A`` = features with a ones column appended, shape (n, p = d + 1); ``Y`` = targets (n, K)):

* primal, when ``n >= p``:  ``W = (AᵀA + λI_p)⁻¹ AᵀY``  — a p x p system;
* dual,   when ``n <  p``:  ``W = Aᵀ(AAᵀ + λI_n)⁻¹ Y``  — an n x n system.

The two are the same matrix for λ > 0 (push-through identity), so the cheaper one is taken: 10-way
5-shot on a ViT-L representation is a 50 x 50 solve instead of 1025 x 1025. The bias (last row of
``W``) is regularised like every other weight, which is what an appended ones column means; with
:func:`fewshot_accuracy`'s default standardisation the features are centred, so this costs nothing.
All linear algebra runs in float64 on the features' device.

Standardising features with the few-shot set's mean and std before the fit (and the test features
with the same statistics) follows big_vision's few-shot evaluator, the successor of the paper's code.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np
import torch
from torch import nn

from vitscale.config.checks import check, positive_int

__all__ = ["extract_features", "fewshot_accuracy", "fit_least_squares", "predict", "sample_shots"]

ArrayLike = torch.Tensor | np.ndarray


def _as_tensor(x: ArrayLike, name: str, ndim: int) -> torch.Tensor:
    t = torch.as_tensor(x)
    if t.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    return t


def _augment(features: torch.Tensor) -> torch.Tensor:
    """(n, d) → (n, d + 1) float64 with a ones column for the bias."""
    x = features.to(torch.float64)
    return torch.cat([x, torch.ones(x.shape[0], 1, dtype=x.dtype, device=x.device)], dim=1)


def fit_least_squares(features: ArrayLike, labels: ArrayLike, num_classes: int, l2: float) -> torch.Tensor:
    """Closed-form ridge regression from ``features`` (n, d) to {-1, +1}^K one-vs-rest targets.

    Minimises ``||A W - Y||² + l2 ||W||²`` with ``A = [features, 1]`` and ``Y = 2·onehot(labels) - 1``;
    see the module docstring for the primal/dual choice.

    Returns:
        ``W`` of shape (d + 1, num_classes), float64, on the features' device; the last row is the
        bias. Use with :func:`predict`.

    Raises:
        ValueError: shapes disagree, a label is outside [0, num_classes), or ``l2`` is not > 0
            (without regularisation the system is singular whenever n < d + 1).
    """
    x = _as_tensor(features, "features", 2)
    y = _as_tensor(labels, "labels", 1)
    if x.shape[0] != y.shape[0]:
        raise ValueError(f"features has {x.shape[0]} rows but labels has {y.shape[0]}")
    if x.shape[0] == 0:
        raise ValueError("features is empty: need at least one example")
    check(positive_int(num_classes, "num_classes") >= 2, "num_classes", f"must be >= 2, got {num_classes!r}")
    if not (math.isfinite(l2) and l2 > 0):
        raise ValueError(f"l2 must be a positive finite number, got {l2}")
    y = y.to(device=x.device, dtype=torch.long)
    if int(y.min()) < 0 or int(y.max()) >= num_classes:
        raise ValueError(f"labels must lie in [0, {num_classes}), got range [{int(y.min())}, {int(y.max())}]")

    a = _augment(x)  # (n, p)
    targets = 2.0 * torch.nn.functional.one_hot(y, num_classes).to(torch.float64) - 1.0  # (n, K)
    n, p = a.shape
    if n >= p:
        gram = a.T @ a + l2 * torch.eye(p, dtype=a.dtype, device=a.device)  # (p, p)
        return torch.linalg.solve(gram, a.T @ targets)  # (p, K)
    gram = a @ a.T + l2 * torch.eye(n, dtype=a.dtype, device=a.device)  # (n, n)
    return a.T @ torch.linalg.solve(gram, targets)  # (p, n) @ (n, K) = (p, K)


def predict(features: ArrayLike, weights: torch.Tensor) -> torch.Tensor:
    """Class ids (n,) int64: argmax over ``[features, 1] @ weights``; weights (d + 1, K) from the fit."""
    x = _as_tensor(features, "features", 2)
    if weights.ndim != 2 or weights.shape[0] != x.shape[1] + 1:
        raise ValueError(
            f"weights must have shape ({x.shape[1] + 1}, K) for {x.shape[1]}-dim features, got {tuple(weights.shape)}"
        )
    scores = _augment(x.to(weights.device)) @ weights.to(torch.float64)  # (n, K)
    return scores.argmax(dim=1)


def sample_shots(labels: ArrayLike, num_classes: int, shots: int, seed: int) -> np.ndarray:
    """Indices of exactly ``shots`` examples of each class 0..num_classes-1, chosen by ``seed``.

    The same (labels, shots, seed) always gives the same indices; the result is sorted.

    Raises:
        ValueError: ``shots`` < 1, or some class has fewer than ``shots`` examples (named).
    """
    y = np.asarray(torch.as_tensor(labels).cpu().numpy()).reshape(-1)
    positive_int(shots, "shots")
    positive_int(num_classes, "num_classes")
    rng = np.random.default_rng(seed)
    chosen = []
    for c in range(num_classes):
        idx = np.flatnonzero(y == c)
        if idx.size < shots:
            raise ValueError(f"class {c} has {idx.size} training examples, fewer than shots={shots}")
        chosen.append(rng.choice(idx, size=shots, replace=False))
    return np.sort(np.concatenate(chosen))


def fewshot_accuracy(
    train_feats: ArrayLike,
    train_labels: ArrayLike,
    test_feats: ArrayLike,
    test_labels: ArrayLike,
    *,
    num_classes: int,
    shots: int,
    l2: float,
    seed: int,
    standardize: bool = True,
) -> float:
    """Top-1 test accuracy of a ``shots``-per-class closed-form least-squares probe.

    Samples ``shots`` training examples per class (:func:`sample_shots`, deterministic by ``seed``),
    standardises features with that subset's per-dimension mean and std (``standardize``; big_vision
    does the same) and fits :func:`fit_least_squares` with ridge strength ``l2``.

    Returns:
        Accuracy in [0, 1] over all test examples.
    """
    xtr = _as_tensor(train_feats, "train_feats", 2)
    xte = _as_tensor(test_feats, "test_feats", 2)
    ytr = _as_tensor(train_labels, "train_labels", 1)
    yte = _as_tensor(test_labels, "test_labels", 1)
    if xtr.shape[1] != xte.shape[1]:
        raise ValueError(f"train_feats has {xtr.shape[1]} dims but test_feats has {xte.shape[1]}")
    if xte.shape[0] != yte.shape[0] or xte.shape[0] == 0:
        raise ValueError(f"test_feats ({xte.shape[0]} rows) and test_labels ({yte.shape[0]}) must match and be non-empty")
    if xtr.shape[0] != ytr.shape[0]:
        raise ValueError(f"train_feats has {xtr.shape[0]} rows but train_labels has {ytr.shape[0]}")

    idx = torch.as_tensor(sample_shots(ytr, num_classes, shots, seed), device=xtr.device)
    x = xtr[idx].to(torch.float64)  # (K * shots, d)
    xt = xte.to(device=xtr.device, dtype=torch.float64)  # (m, d)
    if standardize:
        mean = x.mean(dim=0, keepdim=True)
        # Population std as in big_vision; + 1e-5 keeps dimensions that are constant over the
        # few-shot subset (dead units, tiny subsets) finite instead of dividing by zero.
        std = x.std(dim=0, unbiased=False, keepdim=True) + 1e-5
        x, xt = (x - mean) / std, (xt - mean) / std
    w = fit_least_squares(x, ytr.to(xtr.device)[idx], num_classes, l2)
    pred = predict(xt, w)
    return float((pred.cpu() == yte.cpu().long()).double().mean())


@torch.no_grad()
def extract_features(
    model: nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]], device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Frozen representations of every image in ``batches``: ``model.forward_features`` in eval mode.

    Args:
        model: exposes ``forward_features(images) -> (B, D)``, the image representation (the
            pre-logits output the paper's probe uses). The model's train/eval mode is restored after.
        batches: an iterable of ``(images (B, C, H, W), labels (B,))``.
        device: where to run the model (it must already live there).

    Returns:
        ``(features (N, D) float32, labels (N,) int64)`` on the CPU, in the order of ``batches``.

    Raises:
        ValueError: the model has no ``forward_features``, it returns something other than (B, D),
            or ``batches`` is empty.
    """
    forward = getattr(model, "forward_features", None)
    if not callable(forward):
        raise ValueError(f"{type(model).__name__} has no forward_features(); the few-shot probe needs it")
    was_training = model.training
    model.eval()
    feats, labels = [], []
    try:
        for images, y in batches:
            out = forward(images.to(device, non_blocking=True))
            if out.ndim != 2 or out.shape[0] != images.shape[0]:
                raise ValueError(
                    f"{type(model).__name__}.forward_features must return (B, D) representations, "
                    f"got shape {tuple(out.shape)} for a batch of {images.shape[0]}"
                )
            feats.append(out.float().cpu())
            labels.append(torch.as_tensor(y).long().cpu())
    finally:
        model.train(was_training)
    if not feats:
        raise ValueError("batches is empty: no images to extract features from")
    return torch.cat(feats), torch.cat(labels)
