"""The study's fits and answers: bounds, bootstrap intervals, identifiability, backtest, frontier,
recommend, stable cell ids and time over attempts (pure functions, with property tests)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vitscale.scaling.study.cells import location_free, settings_hash
from vitscale.scaling.study.fit import WELL_DETERMINED, fit_power_law, saturating
from vitscale.scaling.study.recommend import recommend
from vitscale.scaling.study.state import CellRecord, StudyState
from vitscale.scaling.study.uncertainty import backtest, backtest_split, fit_with_intervals, predict

TRUTH = (2e-4, 0.45, 0.12, 2e-7)


def _noisy(n: int, seed: int = 0, sigma: float = 0.004) -> tuple[np.ndarray, np.ndarray]:
    compute = np.geomspace(1e-6, 1e-3, n)
    return compute, saturating(compute, *TRUTH) + np.random.default_rng(seed).normal(0, sigma, n)


def test_bootstrap_intervals_cover_the_truth_and_predictions() -> None:
    compute, error = _noisy(10)
    fit = fit_with_intervals(compute, error, bootstrap=100, seed=1)
    assert len(fit.intervals) == 4 and len(fit.samples) >= 50
    (b_lo, b_hi), (c_lo, c_hi) = fit.intervals[1], fit.intervals[2]
    assert b_lo <= TRUTH[1] <= b_hi and c_lo <= TRUTH[2] <= c_hi
    mid, lo, hi = predict(fit, 5e-4)
    assert lo is not None and hi is not None and lo <= mid <= hi
    assert lo <= 1 - float(saturating(5e-4, *TRUTH)) <= hi
    far = predict(fit, 1.0)  # 1000x past the data: a wider band
    assert far[2] - far[1] > hi - lo
    assert fit.row()["b_lo"] == b_lo and fit.row()["bootstrap"] == len(fit.samples)


def test_a_prediction_below_the_data_is_an_accuracy() -> None:
    """E = a C^-b grows without bound as C falls: 1e-4 below the data, the law's 1 - E was -9 (interval down to
    -6e8), and recommend ranked that family first at "predicted -7.1236". An accuracy lies in [0, 1]."""
    compute = np.geomspace(1e-6, 1e-4, 9)
    error = saturating(compute, 1e-4, 0.5, 0.2, 0.0) + np.random.default_rng(0).normal(0, 0.003, 9)
    fit = fit_with_intervals(compute, error, bootstrap=50, seed=0)
    assert 1.0 - float(fit.error(1e-10)) < 0  # the law itself, outside an accuracy's range
    for budget in (1e-300, 1e-10, 1e-7):
        mid, lo, hi = predict(fit, budget)
        assert lo is not None and hi is not None and 0.0 <= lo <= mid <= hi <= 1.0, (budget, lo, mid, hi)
    (answer,) = recommend(1e-10, {"ViT": fit}, [])
    assert answer.predicted == 0.0 and answer.extrapolated
    assert float(fit.accuracy(1e-5)) == pytest.approx(1.0 - float(fit.error(1e-5)))  # inside: the law as it is


points = st.lists(st.tuples(st.floats(-6, 3), st.floats(0.0, 1.0)), min_size=5, max_size=9,
                  unique_by=lambda p: round(p[0], 3))


@given(points)
@settings(max_examples=25, deadline=None)
def test_fits_stay_within_their_documented_bounds(pts: list[tuple[float, float]]) -> None:
    compute = np.array([10.0 ** p[0] for p in pts])
    error = np.array([p[1] for p in pts])
    fit = fit_power_law(compute, error)
    assert 0.0 <= fit.c <= error.min() + 1e-9  # never saturates above a measured error
    assert 0.01 - 1e-9 <= fit.b <= 3.0 + 1e-9
    assert 0.0 <= fit.d <= compute.max() * (1 + 1e-6)
    assert fit.min_compute == compute.min() and fit.max_compute == compute.max()
    if fit.points < WELL_DETERMINED:
        assert any("weakly determined" in w for w in fit.warnings)


def test_identifiability_warnings() -> None:
    compute, error = _noisy(12, sigma=0.0005)
    assert fit_power_law(compute, error).warnings == ()  # 12 clean cells of a known law
    few = fit_power_law(compute[:5], error[:5])
    assert any("5 cells" in w for w in few.warnings)
    flat = fit_power_law(np.geomspace(1, 100, 8), [0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5])
    assert flat.on_bound or flat.condition > 1e6
    assert any("bound" in w or "condition number" in w for w in flat.warnings)


@given(st.lists(st.floats(1e-6, 1e3), min_size=1, max_size=20), st.integers(0, 4))
@settings(max_examples=200, deadline=None)
def test_backtest_holds_out_exactly_the_largest_compute(compute: list[float], holdout: int) -> None:
    x = np.array(compute)
    train, held = backtest_split(x, holdout)
    assert np.all(train ^ held)
    top = sorted(set(compute))[-holdout:] if holdout else []
    assert sorted(set(x[held].tolist())) == sorted(top)
    if train.any() and held.any():
        assert x[train].max() < x[held].min()


def test_backtest_predicts_a_known_law_and_refuses_thin_families() -> None:
    from vitscale.scaling.study.fit import FitRefused

    compute, error = _noisy(9, sigma=0.001)
    rows = backtest(compute, 1 - error, holdout=1, bootstrap=60)
    assert len(rows) == 1 and rows[0].compute == compute.max()
    assert abs(rows[0].error) < 0.02
    with pytest.raises(FitRefused, match="backtest needs"):
        backtest(compute[:5], 1 - error[:5])


# -- recommend ------------------------------------------------------------------------------------


def _vit_fit() -> object:
    compute = np.geomspace(1e-7, 1e-5, 6)
    return fit_with_intervals(compute, 1 - (0.43 - 0.02 * np.log10(1e-5 / compute)), bootstrap=40)


def test_recommend_shows_an_unfitted_family_measured_inside_the_budget() -> None:
    """The issue's case: ViT fitted near 0.41-0.43, a ResNet cell at 0.72 inside the budget but too few
    ResNet cells to fit. The ResNet cell is the answer, and it is named."""
    vit = _vit_fit()
    cells = [{"family": "ViT", "model": f"v{i}", "epochs": 2.0, "data_size": 2000, "exaflops": c,
              "accuracy": 0.43 - 0.02 * np.log10(1e-5 / c)} for i, c in enumerate(np.geomspace(1e-7, 1e-5, 6))]
    cells += [{"family": "ResNet", "model": "R-4unit", "epochs": 2.0, "data_size": 6000, "exaflops": 9e-7, "accuracy": 0.72},
              {"family": "ResNet", "model": "R-big", "epochs": 2.0, "data_size": 6000, "exaflops": 5e-6, "accuracy": 0.9}]
    answers = recommend(1e-6, {"ViT": vit}, cells, {"ResNet": "2 finished cell(s): too few"})  # type: ignore[dict-item]
    assert answers[0].family == "ResNet" and answers[0].best_cell is not None
    assert answers[0].best_cell["accuracy"] == 0.72 and answers[0].predicted is None  # R-big is over budget
    vit_answer = answers[1]
    assert vit_answer.family == "ViT" and vit_answer.predicted is not None and not vit_answer.extrapolated
    assert vit_answer.lo is not None and vit_answer.lo <= vit_answer.predicted <= vit_answer.hi
    assert recommend(1e-3, {"ViT": vit}, cells)[1].extrapolated  # past the measured range  # type: ignore[dict-item]


cell = st.fixed_dictionaries({"family": st.sampled_from(["ViT", "ResNet", "Hybrid"]), "exaflops": st.floats(1e-6, 1e3),
                              "accuracy": st.one_of(st.none(), st.floats(0, 1)), "model": st.just("m")})


@given(st.lists(cell, max_size=25), st.floats(1e-6, 1e3))
@settings(max_examples=200, deadline=None)
def test_recommend_never_hides_a_measured_cell(cells: list[dict], budget: float) -> None:
    answers = recommend(budget, {}, cells)
    by_family = {a.family: a for a in answers}
    for family in {c["family"] for c in cells}:
        within = [c["accuracy"] for c in cells if c["family"] == family and c["exaflops"] <= budget
                  and isinstance(c["accuracy"], float)]
        assert family in by_family
        best = by_family[family].best_cell
        assert (best is None) == (not within)
        if within:
            assert best is not None and best["accuracy"] == max(within) and best["exaflops"] <= budget
    scores = [a.score for a in answers]
    assert scores == sorted(scores, reverse=True)


def test_recommend_refuses_a_bad_budget() -> None:
    for budget in (-1.0, 0.0, float("nan"), float("inf")):
        with pytest.raises(ValueError):
            recommend(budget, {}, [])


# -- ids, migration, time over attempts -------------------------------------------------------------


def test_cell_ids_do_not_see_where_the_data_lives() -> None:
    raw = {"model": {"name": "ViT-Ti/16"}, "data": {"url": "/home/a/data/pre", "subset": 60},
           "fewshot": {"datasets": ["/home/a/data/digits"]}, "stages": ["pretrain", "fewshot"]}
    moved = {**raw, "data": {"url": "s3://bucket/elsewhere/pre/", "subset": 60},
             "fewshot": {"datasets": ["/mnt/b/digits"]}}
    assert settings_hash(raw, {}) == settings_hash(moved, {})
    assert settings_hash(raw, {}, locations=True) != settings_hash(moved, {}, locations=True)
    assert settings_hash({**raw, "data": {"url": "/home/a/data/other", "subset": 60}}, {}) != settings_hash(raw, {})
    assert settings_hash({**raw, "data": {"url": "/home/a/data/pre", "subset": 61}}, {}) != settings_hash(raw, {})
    assert location_free({"a": ["ViT-B/16", "/x/y", "rel/path"]}) == {"a": ["ViT-B/16", "y", "rel/path"]}


def test_resolved_cells_are_the_same_from_another_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from vitscale.config.loader import absolute_paths
    from vitscale.scaling.study.cell_pipelines import resolve_cells
    from vitscale.stages import load_pipeline

    pipeline = Path(__file__).resolve().parents[1] / "pipelines" / "scaling-study-local.yaml"
    ids = []
    for where in ("a", "b"):
        (tmp_path / where).mkdir()
        monkeypatch.chdir(tmp_path / where)
        cells = resolve_cells(absolute_paths(load_pipeline(pipeline)))
        ids.append([c.id for c in cells])
        assert all(c.legacy_id not in (None, c.id) for c in cells)  # the old rule hashed the absolute path
    assert ids[0] == ids[1]


def test_a_study_begun_under_legacy_ids_is_found(tmp_path: Path) -> None:
    state = StudyState(str(tmp_path / "study"))
    state.write(CellRecord("vit-e2-all-aaaaaa", status="done", runs=1, wall_s=30.0, accuracies={"d fewshot 5shot": 0.5}))
    state.stage_done("vit-e2-all-aaaaaa", "pretrain", {"checkpoint": "/x/checkpoint_000001"})
    record = state.record_or_migrate("vit-e2-all-bbbbbb", "vit-e2-all-aaaaaa")
    assert record.id == "vit-e2-all-bbbbbb" and record.status == "done" and record.run_name == "vit-e2-all-aaaaaa"
    assert state.record("vit-e2-all-bbbbbb").accuracies == {"d fewshot 5shot": 0.5}
    assert state.stages("vit-e2-all-bbbbbb")["pretrain"]["checkpoint"] == "/x/checkpoint_000001"
    assert state.record_or_migrate("new-cell", None).status == "pending"
    assert state.record_or_migrate("new-cell", "no-such-legacy").status == "pending"


@given(st.lists(st.tuples(st.floats(0, 1e4), st.booleans()), min_size=1, max_size=10), st.floats(0.5, 8))
@settings(max_examples=200, deadline=None)
def test_time_sums_every_attempt_killed_ones_included(attempts: list[tuple[float, bool]], devices: float) -> None:
    """Each attempt either ends (closed by the driver) or is killed (only its last heartbeat is left)."""
    record = CellRecord("c")
    for seconds, killed in attempts:
        record = CellRecord.from_json(record.to_json())  # what a new driver reads back
        record.open_attempt(devices)
        if killed:
            record.open_attempt_s = seconds  # the last heartbeat before the kill
        else:
            record.close_attempt(seconds)
    total = sum(s for s, _ in attempts)
    assert record.total_wall_s() == pytest.approx(total)
    assert record.total_device_hours() == pytest.approx(total / 3600 * devices)
