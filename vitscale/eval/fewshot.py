"""Few-shot linear evaluation (ViT paper, Sec. 4.1 "Metrics"), as big_vision's evaluator does it.

Freeze the model, take representations of ``k`` training images per class (k = 1, 5, 10, 25), fit a
regularised least-squares map from representations to {-1, +1}^K targets **in closed form**, and
report top-1 accuracy on the test set. No SGD, no hyper-parameters beyond the ridge strength, so it
is cheap enough to run during pre-training.

The reference is big_vision's ``big_vision/evaluators/fewshot_lsr.py`` (the successor of the
paper's code) with its standard settings from ``big_vision/configs/common_fewshot.py``. Choice by
choice, what big_vision does → what vitscale does:

- **Representation**: the model's ``pre_logits`` → the same, ``model.forward_features`` (after the
  pre-logits layer when the model has one).
- **Rows that are not data**: batch padding (``_mask == 0``) is dropped before the fit → rows the
  training stream refilled after a bad sample (``valid == False``, copies of another row) are
  dropped from the few-shot *and* the test set (:func:`extract_features`), so they never count.
- **Feature normalisation**: per-dimension mean and population std (+ 1e-5) of the few-shot subset,
  applied to the test features too → the same (:func:`fewshot_accuracy`, ``standardize=True``).
- **Bias**: a constant column of ``BIAS_CONSTANT = 100`` appended to the features, so the bias is
  "almost unregularised" (penalty ``l2 / 100²``) → the same (:data:`BIAS_CONSTANT`); the returned
  weight matrix has the bias row already multiplied back, so it is used with a ones column.
- **Targets**: ``2 * one_hot(y, K) - 1``, i.e. {-1, 1}^K → the same.
- **L2 strength**: one fixed ``l2_reg = 2**10 = 1024``; its eigendecomposition cache could serve a
  sweep, but none is done → the same: one fixed ``fewshot.l2`` (default 1024), no sweep.
- **Solve**: primal ``(XᵀX + λI)⁻¹XᵀY`` when n >= p, dual ``Xᵀ(XXᵀ + λI)⁻¹Y`` otherwise, through
  ``eigh`` of the Gram matrix in float32 on the host → the same primal/dual choice (p counts the
  bias column), solved directly (``torch.linalg.solve``) in float64 on the features' device.
- **Shots**: 1, 5, 10, 25 → the same default (``fewshot.shots``).
- **Seeds**: ``num_seeds = 3``, seeds 0, 1, 2 → the same default: ``fewshot.seeds = 3`` draws, seeds
  ``fewshot.seed`` (0) to ``fewshot.seed + 2``.
- **Draw per seed**: ``rng = default_rng(seed)``; per class in order, ``rng.permutation`` of its
  indices; the k-shot set is the first k of each (so nested across k) → the same draw, the same
  indices (:func:`sample_shots`, returned sorted).
- **A class with fewer than k examples**: silently uses fewer → refused, the class named.
- **Reporting**: one number per (dataset, shots, seed) → the mean, the spread (std over seeds,
  ddof=1) and the per-seed values (``eval/probe.py``).

The solve (``A = [X, c·1]`` with ``c`` = :data:`BIAS_CONSTANT`, shape (n, p = d + 1); ``Y`` the
targets (n, K)):

* primal, when ``n >= p``:  ``W = (AᵀA + λI_p)⁻¹ AᵀY``  — a p x p system;
* dual,   when ``n <  p``:  ``W = Aᵀ(AAᵀ + λI_n)⁻¹ Y``  — an n x n system.

The two are the same matrix for λ > 0 (push-through identity), so the cheaper one is taken: 10-way
5-shot on a ViT-L representation is a 50 x 50 solve instead of 1025 x 1025. In terms of weights and
bias (``scores = X w + b``) this minimises ``||Xw + b - Y||² + λ(||w||² + ||b||² / c²)``. With the
few-shot subset standardised (so centred) and exactly ``k`` examples per class, the bias comes out
the same for every class whatever ``c`` is and never changes a prediction; ``c`` matters only when
:func:`fit_least_squares` is used on its own, on uncentred features.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import numpy as np
import torch
from torch import nn

from vitscale.config.checks import check, positive_int

__all__ = ["BIAS_CONSTANT", "class_indices", "extract_features", "fewshot_accuracy", "fit_least_squares", "predict",
           "sample_shots"]

ArrayLike = torch.Tensor | np.ndarray

BIAS_CONSTANT = 100.0
"""Value of the constant feature the bias is fitted on (big_vision's ``BIAS_CONSTANT``): large, so the
bias is almost unregularised (its penalty is ``l2 / BIAS_CONSTANT²``)."""


def _as_tensor(x: ArrayLike, name: str, ndim: int) -> torch.Tensor:
    t = torch.as_tensor(x)
    if t.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    return t


def _augment(features: torch.Tensor, constant: float = 1.0) -> torch.Tensor:
    """(n, d) → (n, d + 1) float64 with a constant column (the bias's feature)."""
    x = features.to(torch.float64)
    return torch.cat([x, torch.full((x.shape[0], 1), constant, dtype=x.dtype, device=x.device)], dim=1)


def fit_least_squares(features: ArrayLike, labels: ArrayLike, num_classes: int, l2: float, *,
                      bias_constant: float = BIAS_CONSTANT) -> torch.Tensor:
    """Closed-form ridge regression from ``features`` (n, d) to {-1, +1}^K one-vs-rest targets.

    Minimises ``||A V - Y||² + l2 ||V||²`` with ``A = [features, bias_constant]`` and
    ``Y = 2·onehot(labels) - 1`` (big_vision's parametrisation; see the module docstring for the
    primal/dual choice), then returns ``W = V`` with its last row multiplied by ``bias_constant``, so
    that ``[features, 1] @ W`` are the scores. Equivalently: ``scores = features @ w + b`` minimising
    ``||features w + b - Y||² + l2 (||w||² + ||b||² / bias_constant²)``.

    Returns:
        ``W`` of shape (d + 1, num_classes), float64, on the features' device; the last row is the
        bias. Use with :func:`predict`.

    Raises:
        ValueError: shapes disagree, a label is outside [0, num_classes), ``l2`` is not > 0
            (without regularisation the system is singular whenever n < d + 1), or
            ``bias_constant`` is not > 0.
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
    if not (math.isfinite(bias_constant) and bias_constant > 0):
        raise ValueError(f"bias_constant must be a positive finite number, got {bias_constant}")
    y = y.to(device=x.device, dtype=torch.long)
    if int(y.min()) < 0 or int(y.max()) >= num_classes:
        raise ValueError(f"labels must lie in [0, {num_classes}), got range [{int(y.min())}, {int(y.max())}]")

    a = _augment(x, bias_constant)  # (n, p)
    targets = 2.0 * torch.nn.functional.one_hot(y, num_classes).to(torch.float64) - 1.0  # (n, K)
    n, p = a.shape
    if n >= p:
        gram = a.T @ a + l2 * torch.eye(p, dtype=a.dtype, device=a.device)  # (p, p)
        w = torch.linalg.solve(gram, a.T @ targets)  # (p, K)
    else:
        gram = a @ a.T + l2 * torch.eye(n, dtype=a.dtype, device=a.device)  # (n, n)
        w = a.T @ torch.linalg.solve(gram, targets)  # (p, n) @ (n, K) = (p, K)
    w[-1] *= bias_constant  # weight of the constant column → the bias itself
    return w


def predict(features: ArrayLike, weights: torch.Tensor) -> torch.Tensor:
    """Class ids (n,) int64: argmax over ``[features, 1] @ weights``; weights (d + 1, K) from the fit."""
    x = _as_tensor(features, "features", 2)
    if weights.ndim != 2 or weights.shape[0] != x.shape[1] + 1:
        raise ValueError(
            f"weights must have shape ({x.shape[1] + 1}, K) for {x.shape[1]}-dim features, got {tuple(weights.shape)}"
        )
    scores = _augment(x.to(weights.device)) @ weights.to(torch.float64)  # (n, K)
    return scores.argmax(dim=1)


def class_indices(labels: ArrayLike, num_classes: int) -> list[np.ndarray]:
    """For each class 0..num_classes-1, the ascending indices of its examples (``np.where(labels == c)[0]``).

    One stable sort instead of ``num_classes`` scans (ImageNet: 1000 classes x 1.28M labels).
    Labels outside [0, num_classes) belong to no class.
    """
    y = np.asarray(torch.as_tensor(labels).cpu().numpy()).reshape(-1)
    positive_int(num_classes, "num_classes")
    order = np.argsort(y, kind="stable")
    bounds = np.searchsorted(y[order], np.arange(num_classes + 1), side="left")
    return [order[bounds[c]:bounds[c + 1]] for c in range(num_classes)]


def sample_shots(labels: ArrayLike, num_classes: int, shots: int, seed: int) -> np.ndarray:
    """Indices of exactly ``shots`` examples of each class 0..num_classes-1, drawn as big_vision draws them.

    ``rng = numpy.random.default_rng(seed)``; for each class in order, ``rng.permutation`` of its
    ascending indices; the first ``shots`` of each. So the draw of a class does not depend on
    ``shots``: for one seed the 1-shot set lies in the 5-shot set, which lies in the 10-shot set.
    The same (labels, seed) always gives the same indices; the result is sorted.

    Raises:
        ValueError: ``shots`` < 1, or some class has fewer than ``shots`` examples (the first such
            class named; big_vision would silently use fewer).
    """
    positive_int(shots, "shots")
    groups = class_indices(labels, num_classes)
    short = [c for c, g in enumerate(groups) if g.size < shots]
    if short:
        more = f" (and {len(short) - 1} more classes)" if len(short) > 1 else ""
        raise ValueError(f"class {short[0]} has {groups[short[0]].size} training examples, fewer than "
                         f"shots={shots}{more}")
    rng = np.random.default_rng(seed)
    return np.sort(np.concatenate([rng.permutation(g)[:shots] for g in groups]))


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
    bias_constant: float = BIAS_CONSTANT,
) -> float:
    """Top-1 test accuracy of a ``shots``-per-class closed-form least-squares probe (one seed).

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
        raise ValueError(f"test_feats ({xte.shape[0]} rows) and test_labels ({yte.shape[0]}) must match and be "
                         "non-empty")
    if xtr.shape[0] != ytr.shape[0]:
        raise ValueError(f"train_feats has {xtr.shape[0]} rows but train_labels has {ytr.shape[0]}")

    idx = torch.as_tensor(sample_shots(ytr, num_classes, shots, seed), device=xtr.device)
    x = xtr[idx].to(torch.float64)  # (K * shots, d)
    xt = xte.to(device=xtr.device, dtype=torch.float64)  # (m, d)
    if standardize:
        mean = x.mean(dim=0, keepdim=True)
        # Population std + 1e-5 as in big_vision: dimensions constant over the few-shot subset
        # (dead units, 1-shot of a 2-class set) stay finite instead of dividing by zero.
        std = x.std(dim=0, unbiased=False, keepdim=True) + 1e-5
        x, xt = (x - mean) / std, (xt - mean) / std
    w = fit_least_squares(x, ytr.to(xtr.device)[idx], num_classes, l2, bias_constant=bias_constant)
    pred = predict(xt, w)
    return float((pred.cpu() == yte.cpu().long()).double().mean())


@torch.no_grad()
def extract_features(
    model: nn.Module, batches: Iterable[Sequence[torch.Tensor]], device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Frozen representations of every valid image in ``batches``: ``model.forward_features`` in eval mode.

    Args:
        model: exposes ``forward_features(images) -> (B, D)``, the image representation (the
            pre-logits output the paper's probe uses). The model's train/eval mode is restored after.
        batches: an iterable of ``(images (B, C, H, W), labels (B,))`` or
            ``(images, labels, valid (B,) bool)``. Rows with ``valid == False`` (the training
            stream's refills after a bad sample: copies of another row) are dropped before the
            forward pass, so they never count, in the few-shot set or in the test set.
        device: where to run the model (it must already live there).

    Returns:
        ``(features (N, D) float32, labels (N,) int64)`` on the CPU, in the order of ``batches``,
        N = the number of valid rows.

    Raises:
        ValueError: the model has no ``forward_features``, it returns something other than (B, D),
            a ``valid`` mask has the wrong shape, or there is no valid row at all.
    """
    forward = getattr(model, "forward_features", None)
    if not callable(forward):
        raise ValueError(f"{type(model).__name__} has no forward_features(); the few-shot probe needs it")
    was_training = model.training
    model.eval()
    feats, labels = [], []
    try:
        for images, y, *rest in batches:
            y = torch.as_tensor(y)
            if rest:
                keep = torch.as_tensor(rest[0]).to(torch.bool).reshape(-1)
                if keep.shape[0] != images.shape[0]:
                    raise ValueError(f"valid has {keep.shape[0]} rows but the batch has {images.shape[0]} images")
                if not bool(keep.all()):
                    images, y = images[keep.to(images.device)], y[keep.to(y.device)]
                if images.shape[0] == 0:
                    continue
            out = forward(images.to(device, non_blocking=True))
            if out.ndim != 2 or out.shape[0] != images.shape[0]:
                raise ValueError(
                    f"{type(model).__name__}.forward_features must return (B, D) representations, "
                    f"got shape {tuple(out.shape)} for a batch of {images.shape[0]}"
                )
            feats.append(out.float().cpu())
            labels.append(y.long().cpu())
    finally:
        model.train(was_training)
    if not feats:
        raise ValueError("batches is empty: no (valid) images to extract features from")
    return torch.cat(feats), torch.cat(labels)
