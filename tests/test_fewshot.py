"""Closed-form few-shot probe: exact fits, agreement with numpy / scikit-learn, big_vision's draw, bad rows."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sklearn.linear_model import Ridge
from torch import nn

from helpers.datasets import write_test_dataset
from vitscale.eval.fewshot import (
    BIAS_CONSTANT,
    class_indices,
    extract_features,
    fewshot_accuracy,
    fit_least_squares,
    predict,
    sample_shots,
)


def _targets(labels: np.ndarray, k: int) -> np.ndarray:
    return 2.0 * np.eye(k)[labels] - 1.0  # (n, K) in {-1, +1}


def _reference(x: np.ndarray, labels: np.ndarray, k: int, l2: float, c: float = BIAS_CONSTANT) -> np.ndarray:
    """big_vision's parametrisation via numpy.linalg.lstsq: [A; √λ I] V = [Y; 0] with A = [X, c]; bias = c·V[-1]."""
    a = np.hstack([x, np.full((x.shape[0], 1), c)])
    p = a.shape[1]
    stacked_a = np.vstack([a, np.sqrt(l2) * np.eye(p)])
    stacked_y = np.vstack([_targets(labels, k), np.zeros((p, k))])
    v = np.linalg.lstsq(stacked_a, stacked_y, rcond=None)[0]
    v[-1] *= c
    return v


def _reference_bias_penalty(x: np.ndarray, labels: np.ndarray, k: int, l2: float, c: float) -> np.ndarray:
    """The other parametrisation: scores = [X, 1] W, penalty λ(||w||² + b²/c²), by lstsq on [[X, 1]; √λ diag(1.., 1/c)]."""
    a = np.hstack([x, np.ones((x.shape[0], 1))])
    p = a.shape[1]
    penalty = np.sqrt(l2) * np.diag(np.r_[np.ones(p - 1), 1.0 / c])
    stacked_y = np.vstack([_targets(labels, k), np.zeros((p, k))])
    return np.linalg.lstsq(np.vstack([a, penalty]), stacked_y, rcond=None)[0]


@pytest.mark.parametrize(
    ("n", "d", "path"),
    [(200, 16, "primal"), (30, 100, "dual"), (17, 16, "primal: n == d + 1")],
)
def test_agrees_with_lstsq_and_sklearn_ridge(n: int, d: int, path: str) -> None:
    rng = np.random.default_rng(n * 1000 + d)
    x = rng.normal(size=(n, d)) * rng.uniform(0.1, 3.0, size=d)
    labels = rng.integers(0, 5, size=n)
    for l2 in (1e-3, 1.0, 100.0, 1024.0):
        for c in (1.0, BIAS_CONSTANT):
            w = fit_least_squares(x, labels, 5, l2, bias_constant=c).numpy()
            assert w.shape == (d + 1, 5)
            np.testing.assert_allclose(w, _reference(x, labels, 5, l2, c), rtol=1e-6, atol=1e-9, err_msg=path)
            # scikit-learn: the constant column is an ordinary (regularised) feature, so no fit_intercept
            ridge = Ridge(alpha=l2, fit_intercept=False, solver="svd").fit(
                np.hstack([x, np.full((n, 1), c)]), _targets(labels, 5))
            expected = ridge.coef_.T.copy()
            expected[-1] *= c
            np.testing.assert_allclose(w, expected, rtol=1e-6, atol=1e-9, err_msg=path)
    # the default is big_vision's constant column of 100
    np.testing.assert_allclose(fit_least_squares(x, labels, 5, 1.0).numpy(), _reference(x, labels, 5, 1.0, 100.0),
                               rtol=1e-6, atol=1e-9)


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(2, 40),
    d=st.integers(1, 40),
    k=st.integers(2, 6),
    l2=st.floats(1e-2, 1e4),
    c=st.sampled_from([1.0, 10.0, 100.0]),
    seed=st.integers(0, 2**32 - 1),
)
def test_property_solution_is_the_penalised_least_squares_optimum(n: int, d: int, k: int, l2: float, c: float,
                                                                  seed: int) -> None:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d)) * rng.uniform(0.1, 3.0, size=d) + rng.normal(size=d)  # uncentred
    labels = rng.integers(0, k, size=n)
    w = fit_least_squares(x, labels, k, l2, bias_constant=c).numpy()
    # an independent parametrisation of the same problem (primal or dual path alike)
    np.testing.assert_allclose(w, _reference_bias_penalty(x, labels, k, l2, c), rtol=1e-5, atol=1e-8)
    # first-order optimality: ([X,1]ᵀ[X,1] + λ diag(1.., 1/c²)) W = [X,1]ᵀ Y
    a = np.hstack([x, np.ones((n, 1))])
    lhs = (a.T @ a + l2 * np.diag(np.r_[np.ones(d), 1.0 / c**2])) @ w
    np.testing.assert_allclose(lhs, a.T @ _targets(labels, k), rtol=1e-6, atol=1e-6 * max(1.0, n))
    # the order of the examples does not matter; renaming classes permutes W's columns
    perm, rename = rng.permutation(n), rng.permutation(k)
    np.testing.assert_allclose(fit_least_squares(x[perm], labels[perm], k, l2, bias_constant=c).numpy(), w,
                               rtol=1e-6, atol=1e-9)
    w_renamed = fit_least_squares(x, rename[labels], k, l2, bias_constant=c).numpy()
    np.testing.assert_allclose(w_renamed[:, rename], w, rtol=1e-6, atol=1e-9)


def test_centred_features_match_sklearn_ridge_with_an_unpenalised_intercept() -> None:
    # With centred features the constant column is orthogonal to them: the weights are exactly
    # Ridge(fit_intercept=True)'s and the bias is n c²/(n c² + λ) of its (unpenalised) intercept.
    rng = np.random.default_rng(5)
    n, d, k, l2 = 60, 8, 4, 1024.0
    x = rng.normal(size=(n, d)) * 3
    x -= x.mean(axis=0)
    labels = rng.integers(0, k, size=n)
    w = fit_least_squares(x, labels, k, l2).numpy()
    ridge = Ridge(alpha=l2, fit_intercept=True).fit(x, _targets(labels, k))
    np.testing.assert_allclose(w[:-1], ridge.coef_.T, rtol=1e-8, atol=1e-12)
    shrink = n * BIAS_CONSTANT**2 / (n * BIAS_CONSTANT**2 + l2)
    np.testing.assert_allclose(w[-1], shrink * ridge.intercept_, rtol=1e-10)
    assert shrink > 0.998  # "almost unregularised", as big_vision intends


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


def _big_vision_draw(labels: np.ndarray, num_classes: int, shots: int, seed: int) -> np.ndarray:
    """big_vision/evaluators/fewshot_lsr.py, compute_fewshot_metrics, verbatim in numpy."""
    rng = np.random.default_rng(seed)
    class_indices = [rng.permutation(np.where(labels == cls_i)[0]) for cls_i in range(num_classes)]
    return np.concatenate([indices[:shots] for indices in class_indices], axis=0)


@settings(max_examples=60, deadline=None)
@given(
    counts=st.lists(st.integers(25, 60), min_size=2, max_size=8),
    seed=st.integers(0, 2**32 - 1),
    order_seed=st.integers(0, 1000),
)
def test_property_sample_shots_is_big_visions_draw_and_nested(counts: list[int], seed: int, order_seed: int) -> None:
    k = len(counts)
    labels = np.random.default_rng(order_seed).permutation(np.repeat(np.arange(k), counts))
    previous: set[int] = set()
    for shots in (1, 5, 10, 25):
        idx = sample_shots(labels, k, shots, seed)
        np.testing.assert_array_equal(idx, np.sort(_big_vision_draw(labels, k, shots, seed)))
        assert previous <= set(idx.tolist())  # the 1-shot set lies in the 5-shot set, ...
        previous = set(idx.tolist())


def test_class_indices_are_the_ascending_indices_of_each_class() -> None:
    labels = np.array([2, 0, 2, 5, 1, 0, 2, -1])  # 5 and -1 belong to no class of 3
    groups = class_indices(labels, 3)
    assert [g.tolist() for g in groups] == [[1, 5], [4], [0, 2, 6]]
    assert [g.tolist() for g in class_indices(labels, 4)][3] == []


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
def test_rejects_bad_inputs(call, match: str) -> None:
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


def test_extract_features_drops_rows_not_valid() -> None:
    torch.manual_seed(0)
    model = TinyEncoder()
    images = torch.randn(9, 3, 2, 2)
    labels = torch.arange(9)
    valid = torch.tensor([True, False, True, True, False, False, True, True, True])
    # refilled rows are copies of a surviving row of the same batch, as the stream makes them
    images[1], labels[1] = images[0], labels[0]
    batches = [(images[:3], labels[:3], valid[:3]), (images[3:6], labels[3:6], valid[3:6]),
               (images[4:6], labels[4:6], valid[4:6]),  # a batch with no valid row at all
               (images[6:], labels[6:], valid[6:])]
    feats, ys = extract_features(model, batches, "cpu")
    assert ys.tolist() == [0, 2, 3, 6, 7, 8]
    with torch.no_grad():
        assert torch.allclose(feats, model.proj(images[valid].flatten(1)))
    # two-element batches still work; no valid row anywhere is an error
    assert extract_features(model, [(images, labels)], "cpu")[0].shape == (9, 6)
    with pytest.raises(ValueError, match="no \\(valid\\) images"):
        extract_features(model, [(images[:2], labels[:2], torch.zeros(2, dtype=torch.bool))], "cpu")
    with pytest.raises(ValueError, match="valid has 3 rows"):
        extract_features(model, [(images[:2], labels[:2], torch.ones(3, dtype=torch.bool))], "cpu")


# --------------------------------------------------------------------------- the probe on datasets


class PooledPixels(nn.Module):
    """A deterministic "representation": 2x2 average-pooled pixels, (B, 12)."""

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.adaptive_avg_pool2d(x, 2).flatten(1)


BAD = {"train000003": "jpeg", "train000017": "nolabel", "test000002": "jpeg"}


def _corrupt(key: str, sample: dict[str, bytes]) -> dict[str, bytes]:
    if BAD.get(key) == "jpeg":
        sample["jpg"] = sample["jpg"][:100] + b"\x00" * 50
    elif BAD.get(key) == "nolabel":
        sample.pop("cls")
    return sample


@pytest.fixture(scope="module")
def probe_datasets(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The same 3-class dataset twice (same images): clean, and with 2 bad train and 1 bad test sample."""
    splits = {"train": [13, 11], "test": [12]}
    clean = write_test_dataset(tmp_path_factory.mktemp("clean"), splits, num_classes=3, size=(20, 16))
    damaged = write_test_dataset(tmp_path_factory.mktemp("damaged"), splits, num_classes=3, size=(20, 16),
                                 hook=_corrupt)
    return clean, damaged


def _cfg(*datasets: Path, **kw: object):
    from vitscale.eval.config import FewshotConfig

    kw = {"shots": (1, 5), "resolution": 8, "batch_size": 5, "error_budget": 0.2, "l2": 1.0, **kw}
    cfg = FewshotConfig(datasets=tuple(str(d) for d in datasets), **kw)
    cfg.validate()
    return cfg


def test_rows_refilled_after_a_bad_sample_never_count(probe_datasets: tuple[Path, Path]) -> None:
    from vitscale.eval.probe import _batches, _eval_stream

    clean, damaged = probe_datasets
    cfg = _cfg(clean, damaged)
    for split, total, bad in (("train", 24, [3, 17]), ("test", 12, [2])):
        good = [g for g in range(total) if g not in bad]
        stream = _eval_stream(str(damaged), split, cfg, None)
        feats, labels = extract_features(PooledPixels(), _batches(stream, torch.device("cpu")), "cpu")
        assert labels.tolist() == [g % 3 for g in good]  # no refilled copy among them, nothing lost
        assert sum(stream.skipped().values()) == len(bad)
        reference, _ = extract_features(PooledPixels(), _batches(_eval_stream(str(clean), split, cfg, None),
                                                                 torch.device("cpu")), "cpu")
        torch.testing.assert_close(feats, reference[good])


def test_fewshot_probe_reports_mean_std_and_seeds_without_bad_rows(probe_datasets: tuple[Path, Path]) -> None:
    from vitscale.eval.probe import fewshot_probe
    from vitscale.stages.fewshot import FewshotResult

    clean, damaged = probe_datasets
    cfg = _cfg(clean, damaged, seeds=4, seed=2)
    results = fewshot_probe(PooledPixels(), cfg, device=torch.device("cpu"))
    assert results["seeds"] == [2, 3, 4, 5] and results["l2"] == 1.0
    for url, n_train, n_test, skipped in ((clean, 24, 12, 0), (damaged, 22, 11, 3)):
        r = results[str(url)]
        assert (r["train_examples"], r["test_examples"], r["skipped"]) == (n_train, n_test, skipped)
        assert r["chance"] == pytest.approx(1 / 3)
        for shots in (1, 5):
            per_seed = r[f"{shots}shot_seeds"]
            assert len(per_seed) == 4 and all(0.0 <= a <= 1.0 for a in per_seed)
            # every accuracy is a count of the test rows that are real samples
            assert all(math.isclose(a * n_test, round(a * n_test), abs_tol=1e-9) for a in per_seed)
            assert r[f"{shots}shot"] == pytest.approx(np.mean(per_seed))
            assert r[f"{shots}shot_std"] == pytest.approx(np.std(per_seed, ddof=1))
    assert results["mean_5shot"] == pytest.approx((results[str(clean)]["5shot"] + results[str(damaged)]["5shot"]) / 2)
    # the same seeds give the same numbers; the seed list is the only thing that changes them
    again = fewshot_probe(PooledPixels(), cfg, device=torch.device("cpu"))
    assert again[str(damaged)]["5shot_seeds"] == results[str(damaged)]["5shot_seeds"]
    rows = dict(FewshotResult(results).rows())
    assert set(rows) == {clean.name, damaged.name}
    assert f"5shot {results[str(damaged)]['5shot']:.3f}±" in rows[damaged.name] and "(4 seeds)" in rows[damaged.name]


def test_fewshot_probe_errors_name_the_dataset(probe_datasets: tuple[Path, Path]) -> None:
    from vitscale.eval.probe import fewshot_probe

    _, damaged = probe_datasets
    with pytest.raises(ValueError, match="fewshot.error_budget"):  # 2 of 24 skipped > 1%
        fewshot_probe(PooledPixels(), _cfg(damaged, error_budget=0.01), device=torch.device("cpu"))
    # 8 training examples per class, 7 readable in the damaged set's class 0 and 2
    with pytest.raises(ValueError, match=f"{damaged} \\(train\\): class 0 has 7 .*shots=8"):
        fewshot_probe(PooledPixels(), _cfg(damaged, shots=(8,)), device=torch.device("cpu"))


class DivergedPixels(PooledPixels):
    """A representation with NaN in every image's first dimension (a model whose weights hold NaN)."""

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward_features(x)
        out[:, 0] = math.nan
        return out


def test_a_representation_that_is_not_finite_is_refused(probe_datasets: tuple[Path, Path]) -> None:
    """A model whose weights hold NaN was probed to "0.296±0.000" on 3 classes (NaN scores' argmax is class 0 for
    every image): chance, printed as an accuracy."""
    from vitscale.config.errors import UserError
    from vitscale.eval.probe import fewshot_probe

    clean, _ = probe_datasets
    with pytest.raises(UserError, match=f"{clean} \\(train\\): the model's representations of 24 of 24 images are "
                                        "not finite"):
        fewshot_probe(DivergedPixels(), _cfg(clean), device=torch.device("cpu"))


def test_config_seeds_l2_and_error_budget_are_checked() -> None:
    from vitscale.config.checks import ConfigError
    from vitscale.eval.config import FewshotConfig

    default = FewshotConfig()
    assert (default.seeds, default.l2, default.shots) == (3, 1024.0, (1, 5, 10, 25))  # big_vision's settings
    for bad, key in (({"seeds": 0}, "fewshot.seeds"), ({"seeds": 2.5}, "fewshot.seeds"), ({"l2": 0.0}, "fewshot.l2"),
                     ({"error_budget": 2.0}, "fewshot.error_budget"), ({"shots": (5, 5)}, "fewshot.shots"),
                     ({"datasets": ("a", "a")}, "fewshot.datasets")):
        with pytest.raises(ConfigError) as err:
            FewshotConfig(**bad).validate()
        assert err.value.key == key


def test_the_stage_refuses_on_the_driver_what_the_probe_cannot_use(probe_datasets: tuple[Path, Path],
                                                                     tmp_path: Path) -> None:
    from vitscale.config.checks import ConfigError
    from vitscale.stages import build_pipeline
    from vitscale.stages.fewshot import prepare_fewshot

    clean, _ = probe_datasets
    multi = write_test_dataset(tmp_path / "multi", {"train": [12], "test": [6]}, num_classes=3, multi_label=True)

    def prepare(**fewshot: object) -> None:
        prepare_fewshot(build_pipeline({"stages": ["pretrain", "fewshot"], "model": {"name": "R50x1"},
                                        "fewshot": {"resolution": 8, **fewshot}}))

    prepare(datasets=[str(clean)], shots=[1, 8])
    for fewshot, key, match in (({"datasets": [str(multi)]}, "fewshot.datasets[0]", "multi-label"),
                                ({"datasets": [str(clean)], "test_split": "val"}, "fewshot.test_split", "'val'"),
                                ({"datasets": [str(clean)], "shots": [9]}, "fewshot.shots", "need 27 examples")):
        with pytest.raises(ConfigError, match=match) as err:
            prepare(**fewshot)
        assert err.value.key == key
