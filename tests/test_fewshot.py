"""Closed-form few-shot probe: exact fits, agreement with numpy / scikit-learn, shot sampling."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sklearn.linear_model import Ridge
from torch import nn

from vitscale.eval.fewshot import extract_features, fewshot_accuracy, fit_least_squares, predict, sample_shots


def _targets(labels: np.ndarray, k: int) -> np.ndarray:
    return 2.0 * np.eye(k)[labels] - 1.0  # (n, K) in {-1, +1}


def _reference(x: np.ndarray, labels: np.ndarray, k: int, l2: float) -> np.ndarray:
    """Ridge via numpy.linalg.lstsq on the stacked system [A; √λ I] W = [Y; 0]."""
    a = np.hstack([x, np.ones((x.shape[0], 1))])
    p = a.shape[1]
    stacked_a = np.vstack([a, np.sqrt(l2) * np.eye(p)])
    stacked_y = np.vstack([_targets(labels, k), np.zeros((p, k))])
    return np.linalg.lstsq(stacked_a, stacked_y, rcond=None)[0]


@pytest.mark.parametrize(
    ("n", "d", "path"),
    [(200, 16, "primal"), (30, 100, "dual"), (17, 16, "primal: n == d + 1")],
)
def test_agrees_with_lstsq_and_sklearn_ridge(n: int, d: int, path: str) -> None:
    rng = np.random.default_rng(n * 1000 + d)
    x = rng.normal(size=(n, d)) * rng.uniform(0.1, 3.0, size=d)
    labels = rng.integers(0, 5, size=n)
    for l2 in (1e-3, 1.0, 100.0):
        w = fit_least_squares(x, labels, 5, l2).numpy()
        assert w.shape == (d + 1, 5)
        np.testing.assert_allclose(w, _reference(x, labels, 5, l2), rtol=1e-6, atol=1e-9, err_msg=path)
        # scikit-learn: the ones column is an ordinary (regularised) feature, so no fit_intercept
        ridge = Ridge(alpha=l2, fit_intercept=False, solver="svd").fit(np.hstack([x, np.ones((n, 1))]), _targets(labels, 5))
        np.testing.assert_allclose(w, ridge.coef_.T, rtol=1e-6, atol=1e-9, err_msg=path)


def test_primal_and_dual_agree_on_the_same_problem() -> None:
    # Same data seen as n >= p (primal) and, with zero-padded extra features, as n < p (dual):
    # zero columns get zero weight, so the real rows must match.
    rng = np.random.default_rng(7)
    x = rng.normal(size=(40, 10))
    labels = rng.integers(0, 4, size=40)
    w_primal = fit_least_squares(x, labels, 4, 0.5)
    w_dual = fit_least_squares(np.hstack([x, np.zeros((40, 60))]), labels, 4, 0.5)
    assert torch.allclose(w_dual[:10], w_primal[:10], atol=1e-10)
    assert torch.allclose(w_dual[-1], w_primal[-1], atol=1e-10)  # bias row
    assert torch.count_nonzero(w_dual[10:-1]) == 0


@pytest.mark.parametrize("n_per_class", [2, 40])  # dual and primal paths
def test_exact_recovery_when_targets_are_linear_in_features(n_per_class: int) -> None:
    k, d = 4, 12
    rng = np.random.default_rng(3)
    labels = np.repeat(np.arange(k), n_per_class)
    mix = rng.normal(size=(k, d))  # full row rank: Y = F M⁺ exactly
    feats = _targets(labels, k) @ mix
    w = fit_least_squares(torch.from_numpy(feats), torch.from_numpy(labels), k, l2=1e-9)
    scores = np.hstack([feats, np.ones((len(labels), 1))]) @ w.numpy()
    np.testing.assert_allclose(scores, _targets(labels, k), atol=1e-5)
    assert torch.equal(predict(feats, w), torch.from_numpy(labels))


def test_separable_clusters_give_full_accuracy_and_noise_gives_chance() -> None:
    rng = np.random.default_rng(0)
    k, d = 10, 32
    centers = rng.normal(size=(k, d)) * 10

    def draw(n: int) -> tuple[np.ndarray, np.ndarray]:
        y = rng.integers(0, k, size=n)
        return centers[y] + rng.normal(size=(n, d)), y

    (xtr, ytr), (xte, yte) = draw(500), draw(300)
    for shots in (1, 5, 25):
        acc = fewshot_accuracy(xtr, ytr, xte, yte, num_classes=k, shots=shots, l2=1.0, seed=0)
        assert acc == 1.0, shots
    # features that carry no label information: near chance (0.1), certainly not near 1
    noise_tr, noise_te = rng.normal(size=(500, d)), rng.normal(size=(2000, d))
    acc = fewshot_accuracy(noise_tr, ytr, noise_te, yte.repeat(7)[:2000], num_classes=k, shots=25, l2=1.0, seed=0)
    assert acc < 0.2


def test_fewshot_accuracy_is_deterministic_by_seed_and_accepts_tensors() -> None:
    rng = np.random.default_rng(1)
    xtr, ytr = rng.normal(size=(300, 8)), np.arange(300) % 3
    xte, yte = rng.normal(size=(50, 8)), np.arange(50) % 3
    a = fewshot_accuracy(xtr, ytr, xte, yte, num_classes=3, shots=5, l2=0.1, seed=4)
    b = fewshot_accuracy(
        torch.from_numpy(xtr).float(), torch.from_numpy(ytr), torch.from_numpy(xte).float(), torch.from_numpy(yte),
        num_classes=3, shots=5, l2=0.1, seed=4,
    )
    assert a == pytest.approx(b)
    assert 0.0 <= a <= 1.0


@settings(max_examples=100, deadline=None)
@given(
    counts=st.lists(st.integers(1, 30), min_size=1, max_size=12),
    shots=st.integers(1, 30),
    seed=st.integers(0, 2**32 - 1),
    order_seed=st.integers(0, 1000),
)
def test_sample_shots_exactly_k_per_class_and_deterministic(counts: list[int], shots: int, seed: int, order_seed: int) -> None:
    labels = np.random.default_rng(order_seed).permutation(np.repeat(np.arange(len(counts)), counts))
    if min(counts) < shots:
        with pytest.raises(ValueError, match=f"class {int(np.argmin(np.array(counts) >= shots))} .*shots={shots}"):
            sample_shots(labels, len(counts), shots, seed)
        return
    idx = sample_shots(labels, len(counts), shots, seed)
    assert len(np.unique(idx)) == len(idx) == shots * len(counts)
    assert np.bincount(labels[idx], minlength=len(counts)).tolist() == [shots] * len(counts)
    np.testing.assert_array_equal(idx, sample_shots(torch.from_numpy(labels), len(counts), shots, seed))


def test_sample_shots_seed_changes_the_choice() -> None:
    labels = np.arange(1000) % 10
    picks = {tuple(sample_shots(labels, 10, 5, seed)) for seed in range(5)}
    assert len(picks) == 5


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: fit_least_squares(np.zeros((4, 2)), np.array([0, 1, 0, 1]), 2, 0.0), "l2"),
        (lambda: fit_least_squares(np.zeros((4, 2)), np.array([0, 1, 0, 2]), 2, 1.0), r"\[0, 2\)"),
        (lambda: fit_least_squares(np.zeros((4, 2)), np.array([0, 1, 0]), 2, 1.0), "rows"),
        (lambda: fit_least_squares(np.zeros(4), np.array([0, 1, 0, 1]), 2, 1.0), "features"),
        (lambda: predict(np.zeros((3, 2)), torch.zeros(2, 4)), "weights"),
        (lambda: sample_shots(np.array([0, 1]), 2, 0, 0), "shots"),
    ],
)
def test_rejects_bad_inputs(call, match: str) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match=match):
        call()


class TinyEncoder(nn.Module):
    """forward_features returns (B, D); dropout makes train and eval mode distinguishable."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(12, 6)
        self.drop = nn.Dropout(0.9)
        self.seen_training: list[bool] = []
        self.seen_grad: list[bool] = []

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        self.seen_training.append(self.training)
        self.seen_grad.append(torch.is_grad_enabled())
        return self.drop(self.proj(x.flatten(1)))  # (B, 3*2*2) → (B, 6)


def test_extract_features_eval_mode_no_grad_and_order() -> None:
    torch.manual_seed(0)
    model = TinyEncoder().train()
    images = torch.randn(10, 3, 2, 2)
    labels = torch.arange(10) % 3
    batches = [(images[:4], labels[:4]), (images[4:], labels[4:])]
    feats, ys = extract_features(model, batches, "cpu")
    assert feats.shape == (10, 6) and feats.dtype == torch.float32 and not feats.requires_grad
    assert torch.equal(ys, labels)
    assert model.seen_training == [False, False] and model.seen_grad == [False, False]
    assert model.training  # restored
    with torch.no_grad():
        assert torch.allclose(feats, model.proj(images.flatten(1)))  # no dropout applied


def test_extract_features_rejects_token_outputs_and_empty_input() -> None:
    class Tokens(nn.Module):
        def forward_features(self, x: torch.Tensor) -> torch.Tensor:
            return torch.zeros(x.shape[0], 5, 4)  # (B, T, D): the pooling is the model's job

    with pytest.raises(ValueError, match=r"\(B, D\)"):
        extract_features(Tokens(), [(torch.zeros(2, 3, 4, 4), torch.zeros(2))], "cpu")
    with pytest.raises(ValueError, match="empty"):
        extract_features(TinyEncoder(), [], "cpu")
    with pytest.raises(ValueError, match="forward_features"):
        extract_features(nn.Linear(2, 2), [], "cpu")


def test_extract_features_on_project_vit() -> None:
    models = pytest.importorskip("vitscale.models")
    create_model = getattr(models, "create_model", None) or getattr(
        pytest.importorskip("vitscale.models.factory"), "create_model", None
    )
    if create_model is None:
        pytest.skip("vitscale.models.create_model is not written yet")
    torch.manual_seed(0)
    model = create_model("ViT-Ti/16", num_classes=10, img_size=32, depth=1)
    images = torch.randn(6, 3, 32, 32)
    feats, ys = extract_features(model, [(images[:4], torch.arange(4)), (images[4:], torch.arange(4, 6))], "cpu")
    assert feats.shape[0] == 6 and feats.ndim == 2 and torch.isfinite(feats).all()
    assert torch.equal(ys, torch.arange(6))
    # Features feed the probe end to end (the tiny random model is not expected to be accurate).
    acc = fewshot_accuracy(feats, ys % 2, feats, ys % 2, num_classes=2, shots=2, l2=1.0, seed=0)
    assert 0.0 <= acc <= 1.0
