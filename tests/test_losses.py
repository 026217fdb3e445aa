"""classification_loss against values worked out by hand (math module, not torch)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from vitscale.train.losses import classification_loss, smooth_targets


def _bce(z: float, t: float) -> float:
    # -(t log σ(z) + (1 - t) log(1 - σ(z))) = log(1 + e^z) - t z
    return math.log1p(math.exp(z)) - t * z


def test_softmax_by_hand() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]])
    labels = torch.tensor([2, 0])
    lse = math.log(math.e + math.e**2 + math.e**3)
    per_example = [lse - 3.0, math.log(3.0)]
    assert classification_loss(logits, labels, kind="softmax").item() == pytest.approx(sum(per_example) / 2, rel=1e-6)
    # ε = 0.3, K = 3: targets (0.1, 0.1, 0.8) for the first example, (0.8, 0.1, 0.1) for the second.
    first = 0.1 * (lse - 1) + 0.1 * (lse - 2) + 0.8 * (lse - 3)
    second = math.log(3.0)  # uniform prediction: every target mix gives log 3
    got = classification_loss(logits, labels, kind="softmax", label_smoothing=0.3).item()
    assert got == pytest.approx((first + second) / 2, rel=1e-6)


def test_sigmoid_by_hand_multi_hot_sum_over_classes_mean_over_batch() -> None:
    logits = torch.tensor([[0.0, 2.0], [-1.0, 0.0]])
    multi_hot = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    ex1 = _bce(0.0, 1) + _bce(2.0, 0)  # log 2 + log(1 + e²)
    ex2 = _bce(-1.0, 1) + _bce(0.0, 1)
    assert classification_loss(logits, multi_hot, kind="sigmoid").item() == pytest.approx((ex1 + ex2) / 2, rel=1e-6)
    # ε = 0.2, K = 2: 1 → 0.9, 0 → 0.1
    ex1 = _bce(0.0, 0.9) + _bce(2.0, 0.1)
    ex2 = _bce(-1.0, 0.9) + _bce(0.0, 0.9)
    got = classification_loss(logits, multi_hot, kind="sigmoid", label_smoothing=0.2).item()
    assert got == pytest.approx((ex1 + ex2) / 2, rel=1e-6)


def test_sigmoid_int_labels_mean_one_hot() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 5, generator=g)
    labels = torch.tensor([0, 4, 2, 2, 1, 3])
    dense = F.one_hot(labels, 5).float()
    a = classification_loss(logits, labels, kind="sigmoid", label_smoothing=0.1)
    b = classification_loss(logits, dense, kind="sigmoid", label_smoothing=0.1)
    assert torch.allclose(a, b)
    # sum over classes: 5x the per-element mean torch reports by default
    assert a.item() == pytest.approx(
        5 * F.binary_cross_entropy_with_logits(logits, dense * 0.9 + 0.02).item(), rel=1e-6
    )


@pytest.mark.parametrize("eps", [0.0, 0.1, 0.5])
def test_softmax_matches_torch_cross_entropy(eps: float) -> None:
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(16, 10, generator=g) * 3
    labels = torch.randint(0, 10, (16,), generator=g)
    ours = classification_loss(logits, labels, kind="softmax", label_smoothing=eps)
    ref = F.cross_entropy(logits, labels, label_smoothing=eps)
    assert torch.allclose(ours, ref, atol=1e-6)
    # probability-row targets: a one-hot row gives the same loss as the int label
    probs = F.one_hot(labels, 10).float()
    assert torch.allclose(classification_loss(logits, probs, kind="softmax", label_smoothing=eps), ref, atol=1e-6)


def test_gradients_flow_and_bf16_logits_give_float32_loss() -> None:
    logits = torch.randn(4, 7, dtype=torch.bfloat16, requires_grad=True)
    loss = classification_loss(logits, torch.tensor([0, 1, 2, 6]), kind="sigmoid", label_smoothing=0.1)
    assert loss.dtype == torch.float32 and loss.ndim == 0
    loss.backward()
    assert logits.grad is not None and logits.grad.dtype == torch.bfloat16


def test_smooth_targets_rows() -> None:
    t = smooth_targets(torch.tensor([1, 0]), 4, 0.2)
    assert torch.allclose(t, torch.tensor([[0.05, 0.85, 0.05, 0.05], [0.85, 0.05, 0.05, 0.05]]))
    assert torch.allclose(t.sum(dim=1), torch.ones(2))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(kind="hinge"), "kind"),
        (dict(label_smoothing=1.0), "label_smoothing"),
        (dict(label_smoothing=-0.1), "label_smoothing"),
        (dict(labels=torch.zeros(4, 3)), r"\(B, 5\)"),
        (dict(labels=torch.zeros(3, dtype=torch.long)), "batch size"),
        (dict(logits=torch.zeros(4)), "logits"),
    ],
)
def test_rejects_bad_inputs(kwargs: dict, match: str) -> None:
    args = dict(logits=torch.zeros(4, 5), labels=torch.zeros(4, dtype=torch.long), kind="softmax", label_smoothing=0.0)
    args |= kwargs
    with pytest.raises(ValueError, match=match):
        classification_loss(args.pop("logits"), args.pop("labels"), **args)
