"""The scaling study's pure parts and its plan: cells, compute, budget, state, fits, report."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vitscale.config.checks import ConfigError
from vitscale.scaling.study.fit import (
    MIN_POINTS,
    FitRefused,
    fit_power_law,
    pareto_frontier,
    saturating,
)
from vitscale.scaling.study.recommend import recommend
from vitscale.scaling.study.state import CellRecord, StudyState, runnable

PIPELINES = Path(__file__).resolve().parents[1] / "pipelines"


# -- fits -----------------------------------------------------------------------------------------


def test_fit_recovers_known_law() -> None:
    compute = np.geomspace(1e-6, 1e-3, 8)
    truth = (2e-4, 0.45, 0.12, 2e-7)  # a, b, c, d in exaFLOPs units
    error = saturating(compute, *truth)
    fit = fit_power_law(compute, error)
    assert fit.b == pytest.approx(truth[1], rel=0.05)
    assert fit.c == pytest.approx(truth[2], abs=0.01)
    assert fit.rmse < 1e-4
    assert np.allclose(fit.error(compute), error, atol=1e-3)
    assert fit.max_compute == pytest.approx(1e-3)


def test_fit_is_the_same_in_any_compute_unit() -> None:
    compute = np.geomspace(10, 5000, 7)
    error = saturating(compute, 3.0, 0.3, 0.2, 5.0) + np.array([0.004, -0.003, 0.002, 0, -0.002, 0.003, -0.001])
    small = fit_power_law(compute * 1e-9, error)
    large = fit_power_law(compute, error)
    assert small.b == pytest.approx(large.b, rel=1e-3) and small.c == pytest.approx(large.c, abs=1e-4)
    assert np.allclose(small.error(compute * 1e-9), large.error(compute), atol=1e-5)
    assert all(math.isfinite(v) for v in (large.a_std, large.b_std, large.c_std, large.d_std))


def test_fit_refuses_too_few_points() -> None:
    with pytest.raises(FitRefused, match=f"at least {MIN_POINTS}"):
        fit_power_law([1, 2, 3, 4], [0.5, 0.4, 0.35, 0.3])
    with pytest.raises(FitRefused, match="distinct"):  # repeated compute values do not count twice
        fit_power_law([1, 1, 2, 2, 3, 3], [0.5, 0.5, 0.4, 0.4, 0.3, 0.3])
    with pytest.raises(FitRefused, match="positive"):
        fit_power_law([0, 1, 2, 3, 4], [0.5, 0.4, 0.35, 0.3, 0.2])


points = st.lists(st.tuples(st.floats(1e-3, 1e3), st.floats(0, 1)), min_size=1, max_size=30)


@given(points)
@settings(max_examples=200, deadline=None)
def test_pareto_frontier_is_exactly_the_undominated_points(pts: list[tuple[float, float]]) -> None:
    front = pareto_frontier(pts)
    assert all(p in pts for p in front)
    assert [c for c, _ in front] == sorted(c for c, _ in front)
    assert all(a2 > a1 for (_, a1), (_, a2) in itertools.pairwise(front))
    for c, a in pts:  # every point is matched or beaten by a frontier point no more expensive
        assert any(fc <= c and fa >= a for fc, fa in front)
    for fc, fa in front:  # and no frontier point is beaten by a point no more expensive
        assert not any((c <= fc and a > fa) or (c < fc and a >= fa) for c, a in pts)


def test_recommend_ranks_families_at_the_budget() -> None:
    compute = np.geomspace(1, 1000, 6)
    vit = fit_power_law(compute, saturating(compute, 0.5, 0.5, 0.10, 0.0))
    resnet = fit_power_law(compute, saturating(compute, 0.3, 0.3, 0.20, 0.0))
    cells = [{"family": "ViT", "exaflops": 10.0, "accuracy": 0.7, "model": "B"},
             {"family": "ViT", "exaflops": 900.0, "accuracy": 0.85, "model": "L"}]
    ranked = recommend(100.0, {"ViT": vit, "ResNet": resnet}, cells)
    assert [r.family for r in ranked] == ["ViT", "ResNet"]
    assert ranked[0].best_cell["model"] == "B"  # L is over the budget
    assert not ranked[0].extrapolated and recommend(1e5, {"ViT": vit}, cells)[0].extrapolated
    with pytest.raises(ValueError):
        recommend(-1.0, {"ViT": vit}, cells)


# -- cells and plan -------------------------------------------------------------------------------


def test_table6_plan_equals_vitscale_flops_cell_by_cell(capsys: pytest.CaptureFixture[str]) -> None:
    from vitscale.cli import main
    from vitscale.scaling.catalog import flops_summary
    from vitscale.scaling.flops import reproduce_table6

    assert main(["study", "plan", str(PIPELINES / "scaling-study.yaml"), "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)
    paper = {(r["model"], r["epochs"]): r for r in reproduce_table6()}
    assert len(planned) == len(paper) == 18
    for cell in planned:
        assert {"model", "epochs", "examples", "exaflops"} <= set(cell)
        assert (cell["examples"], cell["num_classes"], cell["img_size"]) == (303_000_000, 18_291, 224)
        row = paper[(cell["model"], int(cell["epochs"]))]
        assert cell["exaflops"] == pytest.approx(row["exaflops"], rel=1e-12)  # vitscale's own Table 6 figures
        assert abs(cell["exaflops"] / row["paper_exaflops"] - 1) < 0.035
        width = _width(cell["model"])  # the recipes' JFT head: pre-logits of width D on ViTs and hybrids
        again = flops_summary(cell["model"], resolution=224, examples=303_000_000, epochs=cell["epochs"],
                              num_classes=18_291, **({"representation_size": width} if width else {}))
        assert cell["exaflops"] == again["train_exaflops"]


def _width(model: str) -> int | None:
    from vitscale.models.variants import parse_model_name

    spec = parse_model_name(model)
    return spec.vit.width if spec.vit is not None else None


def _study(tmp_path: Path, study: dict, **sections: dict) -> dict:
    from vitscale.data.tools.write import write_dataset

    pre, down = tmp_path / "pre", tmp_path / "down"
    if not pre.exists():
        write_dataset("synthetic", str(pre), shard_size=100, seed=0, source_options={"count": 120, "classes": 4,
                                                                                     "image_size": 32})
        write_dataset("digits", str(down), shard_size=500, seed=0, splits={"train": 0.8, "test": 0.2})
    raw = {"name": "s", "stages": ["study"], "model": {"name": "ViT-Ti/16", "img_size": 32},
           "data": {"url": str(pre), "num_workers": 0},
           "train": {"global_batch": 8, "micro_batch": 8, "epochs": 1, "warmup_steps": 1, "precision": "fp32"},
           "fewshot": {"datasets": [str(down)], "shots": [1], "resolution": 32},
           "cluster": {"num_workers": 1, "use_gpu": False, "cpus_per_worker": 1, "storage_path": str(tmp_path / "runs")},
           "study": study}
    raw.update(sections)
    return raw


TINY = {"name": "ViT-Ti/16", "depth": 1, "width": 32, "mlp_dim": 64, "heads": 2}


def _plan(raw: dict):
    from vitscale.scaling.study.stage import plan
    from vitscale.stages import build_pipeline

    return plan(build_pipeline(raw, "study.yaml"))


def test_grid_cells_ids_and_subsets(tmp_path: Path) -> None:
    from vitscale.scaling.study.cell_pipelines import resolve_cells
    from vitscale.stages import build_pipeline

    raw = _study(tmp_path, {"models": [TINY, {**TINY, "width": 64, "label": "wide"}], "epochs": [1, 2],
                            "data_sizes": [60, None], "cells": [{"model": "R50x1", "epochs": 1, "data_size": 30}]})
    cells = resolve_cells(build_pipeline(raw))
    assert len(cells) == 2 * 2 * 2 + 1
    assert len({c.id for c in cells}) == len(cells)
    assert cells[0].id.startswith("vit-ti16-e1-n60-") and cells[1].id.startswith("vit-ti16-e1-all-")
    assert cells[-1].family == "resnet" and cells[-1].raw["model"] == {"name": "R50x1", "img_size": 32}
    assert [c.raw["data"]["subset"] for c in cells[:2]] == [60, None]
    assert resolve_cells(build_pipeline(raw))[3].id == cells[3].id  # stable
    changed = _study(tmp_path, {**raw["study"]})
    changed["train"] = {**raw["train"], "base_lr": 0.5}
    assert resolve_cells(build_pipeline(changed))[0].id != cells[0].id  # other settings: another cell
    facts, planned = _plan(raw)
    assert facts.examples == 120 and facts.num_classes == 4
    assert [p.examples for p in planned[:2]] == [60, 120] and planned[2].examples_seen == 120  # 2 epochs x 60


@pytest.mark.parametrize("study, key, words", [
    ({"models": [{"name": "ViT-Q/16"}]}, "study.models[0]", "ViT-Q/16"),
    ({"models": [{**TINY, "depth": -1}]}, "study.models[0]", "depth"),
    ({"models": [TINY], "data_sizes": [500]}, "study.models[0]", "larger than the pre-training split"),
    ({"models": [TINY], "max_exaflops": 1e-15}, "study.max_exaflops", "above its budget"),
    ({"models": [TINY], "transfer": ["probe"]}, "study.transfer[0]", "fewshot"),
    ({"models": [{"recipe": "no-such-recipe"}]}, "study.models[0].recipe", "no pipeline file"),
    ({"cells": [{"model": TINY, "epochs": 0}]}, "study.cells[0].epochs", "> 0"),
    ({"cells": [{"model": TINY, "size": 5}]}, "study.cells[0].size", "unknown key"),
    ({"models": [TINY, TINY]}, "study.models[1]", "the same cell as study.models[0]"),
    # the cell id names its run folder: an OSError's traceback (File name too long) from its first record
    ({"models": [{**TINY, "label": "L" * 240}]}, "study.models[0].label", "makes a cell id of 254 bytes"),
    ({"models": [TINY], "epochs": [1e308]}, "study.models[0]", "more compute than a float holds"),  # a traceback
    ({}, "study.models", "needs models"),
    # a column no cell reports: every fit refused, found only after the whole study had run
    ({"models": [TINY], "fit_metric": "down fewshot 5shot"}, "study.fit_metric", "they report: down fewshot 1shot"),
    ({"models": [TINY], "transfer": [], "fit_metric": "down fewshot 1shot"}, "study.fit_metric", "report: none"),
])
def test_bad_studies_fail_at_plan_time_naming_the_key(tmp_path: Path, study: dict, key: str, words: str) -> None:
    with pytest.raises(ConfigError) as info:
        _plan(_study(tmp_path, study))
    assert str(info.value).startswith(key) and words in str(info.value)
    assert "\n" not in str(info.value)


def test_a_fit_metric_the_cells_report_plans(tmp_path: Path) -> None:
    _plan(_study(tmp_path, {"models": [TINY], "fit_metric": "down fewshot 1shot"}))


def test_downstream_without_a_test_split_fails_at_plan_time(tmp_path: Path) -> None:
    from vitscale.data.tools.write import write_dataset

    only_train = tmp_path / "only-train"
    write_dataset("digits", str(only_train), shard_size=500, seed=0, splits={"train": 1.0})
    raw = _study(tmp_path, {"models": [TINY]})
    raw["fewshot"] = {**raw["fewshot"], "datasets": [str(only_train)]}
    with pytest.raises(ConfigError, match="test"):
        _plan(raw)


# -- state and report -----------------------------------------------------------------------------


def test_runnable_cells() -> None:
    assert runnable(CellRecord("a"), retries=1)
    assert runnable(CellRecord("a", status="running", runs=1), retries=0)  # interrupted: resumed
    assert not runnable(CellRecord("a", status="done"), retries=5)
    assert runnable(CellRecord("a", status="failed", failures=1), retries=1)
    assert not runnable(CellRecord("a", status="failed", failures=2), retries=1)  # failed for good


def _fake_study(directory: Path | str, endpoint_url: str | None = None) -> StudyState:
    """A study directory as the runner leaves it: a plan and records (six ViT cells, two ResNets, one running)."""
    state = StudyState(str(directory), endpoint_url)
    cells, rng = [], np.random.default_rng(0)
    for i, (family, c) in enumerate([("vit", c) for c in np.geomspace(1e-6, 1e-4, 6)] + [("resnet", 2e-6), ("resnet", 2e-5),
                                                                                          ("hybrid", 3e-5)]):
        cell_id = f"{family}-{i}"
        cells.append({"id": cell_id, "label": f"{family}{i}", "family": family, "epochs": 2.0,
                      "examples": 1000 if i % 2 else 3000, "exaflops": c})
        if i == 8:
            state.write(CellRecord(cell_id, status="running", runs=1))
            continue
        acc = 1 - float(saturating(c, 1e-4, 0.5, 0.2, 0.0)) + rng.normal(0, 0.002)  # accuracies 0.70-0.79
        state.write(CellRecord(cell_id, status="done", runs=1, exaflops=float(c), examples_seen=6000,
                               device_hours=0.01, accuracies={"digits fewshot 5shot": acc}))
    state.write_plan({"cells": cells, "fit_metric": None})
    return state


def test_report_from_state_marks_partial_rows_and_refuses_thin_families(tmp_path: Path) -> None:
    import pyarrow.parquet as pq

    from vitscale.scaling.study.report import publish_report, recommendation_text

    state = _fake_study(tmp_path / "study")
    report = publish_report(state)
    assert report.metric == "digits fewshot 5shot"
    assert set(report.fits) == {"ViT"} and set(report.refused) == {"ResNet", "Hybrid"}
    assert "2 finished cell(s)" in report.refused["ResNet"]
    assert report.fits["ViT"].c == pytest.approx(0.2, abs=0.05)
    table = pq.read_table(tmp_path / "study" / "results.parquet").to_pylist()
    assert [r["partial"] for r in table] == [False] * 8 + [True]
    for name in ("results.csv", "results.md", "fits.parquet", "compute_vs_accuracy.png", "data_size_vs_accuracy.png"):
        assert (tmp_path / "study" / name).stat().st_size > 0
    text = recommendation_text(report, 5e-5)
    assert text.splitlines()[1].startswith("-> ViT: predicted") and "ResNet: no fit" in text
    # Past the first version: intervals, backtest, frontier, and every measured family in recommend.
    fits = {r["family"]: r for r in pq.read_table(tmp_path / "study" / "fits.parquet").to_pylist()}
    assert fits["ViT"]["b_lo"] <= fits["ViT"]["b_hi"] and fits["ViT"]["bootstrap"] > 0
    assert "weakly determined" in fits["ViT"]["warnings"]  # 6 cells for 4 parameters
    assert "ViT" in report.backtests and isinstance(report.backtests["ResNet"], str)
    front = pq.read_table(tmp_path / "study" / "frontier.parquet").to_pylist()
    accs = [r["digits fewshot 5shot"] for r in front]
    assert accs == sorted(accs) and len(front) >= 2
    for name in ("backtest.csv", "backtest.md", "frontier.csv", "frontier.md"):
        assert (tmp_path / "study" / name).stat().st_size > 0
    assert "best measured cell within budget: resnet6" in text or "best measured cell within budget: resnet7" in text
    assert "warning: 6 cells" in text


def test_cli_study_plan_refusal_and_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import yaml

    from vitscale.cli import main

    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(_study(tmp_path, {"models": [TINY], "max_exaflops": 1e-15})))
    capsys.readouterr()  # the datasets' write progress
    assert main(["study", "plan", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("vitscale: error: study.max_exaflops:") and err.count("\n") == 1
    assert main(["study", "plan", str(path), "--set", "study.max_exaflops=1"]) == 0
    assert "1 cells" in capsys.readouterr().out
    _fake_study(tmp_path / "study")
    assert main(["study", "recommend", str(tmp_path / "study"), "--budget", "1e-4"]) == 0
    assert "-> ViT" in capsys.readouterr().out
    assert main(["study", "report", str(tmp_path / "nowhere")]) == 2
    capsys.readouterr()
    for budget in ("-1", "0", "nan", "inf"):  # was a ValueError traceback, exit 1
        assert main(["study", "recommend", str(tmp_path / "study"), "--budget", budget]) == 2
        err = capsys.readouterr().err
        assert err.startswith("vitscale: error: --budget: must be") and err.count("\n") == 1, err
    # A column no cell reports: every fit would be refused for want of cells; one line naming the columns.
    for verb, extra in (("report", []), ("recommend", ["--budget", "1e-4"])):
        assert main(["study", verb, str(tmp_path / "study"), "--metric", "digits fewshot 50shot", *extra]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "they have: digits fewshot 5shot" in err, err


@pytest.mark.parametrize(("name", "content", "words"), [
    ("plan.json", b"{", "plan.json is unreadable (JSONDecodeError"),
    ("plan.json", b'{"cells": 5}', "a plan is a JSON object with a list of cells"),
    ("plan.json", b'{"cells": [{"id": "vit-0"}]}', "cell 0: label, family, epochs, examples, exaflops missing"),
    ("state/vit-0.json", b"[]", "state/vit-0.json is unreadable (ValueError: a cell's record is a JSON object"),
    ("state/vit-0.json", b'{"id": "vit-0", "status": "finished", "runs": "1"}', "status, runs not of the kind"),
    ("state/vit-0.json", b'{"id": "vit-0", "accuracies": {"digits": "high"}}', "accuracies not of the kind"),
    ("state/vit-0.json", b"\xff\xfe", "state/vit-0.json is unreadable"),
    # JSON as Python writes it holds NaN and Infinity: such a record was fitted (a NaN accuracy refused its
    # whole family's fit yet was backtested as "measured nan"), an accuracy of -0.5 fitted as an error of 1.5.
    ("state/vit-0.json", b'{"id": "vit-0", "status": "done", "exaflops": NaN}', "exaflops not of the kind"),
    ("state/vit-0.json", b'{"id": "vit-0", "status": "done", "exaflops": Infinity}', "exaflops not of the kind"),
    ("state/vit-0.json", b'{"id": "vit-0", "status": "done", "wall_s": -5}', "wall_s not of the kind"),
    ("state/vit-0.json", b'{"id": "vit-0", "status": "done", "accuracies": {"digits fewshot 5shot": NaN}}',
     "accuracies not of the kind a record holds (finite numbers >= 0, accuracies in [0, 1])"),
    ("state/vit-0.json", b'{"id": "vit-0", "status": "done", "accuracies": {"digits fewshot 5shot": -0.5}}',
     "accuracies not of the kind"),
    ("state/vit-0.json", b'{"id": "vit-0", "status": "done", "accuracies": {"digits fewshot 5shot": 1.5}}',
     "accuracies not of the kind"),
])
def test_a_damaged_state_file_is_one_line_naming_it_and_the_way_back(tmp_path: Path, name: str, content: bytes,
                                                                      words: str,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    from vitscale.cli import main

    _fake_study(tmp_path / "study")
    (tmp_path / "study" / name).write_bytes(content)
    for verb in (["study", "report"], ["study", "recommend", "--budget", "1e-4"]):
        assert main([*verb, str(tmp_path / "study")]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"vitscale: error: {tmp_path / 'study' / name} is unreadable") and words in err, err
        assert err.count("\n") == 1 and ("writes it again" in err or "delete it" in err), err


def test_a_cell_records_only_finite_accuracies() -> None:
    """What the runner writes its reader reads back: a stage summary's non-finite accuracy is no value."""
    from vitscale.scaling.study.state import accuracies

    stages = {"fewshot": {"/d/digits": {"5shot": math.nan, "25shot": 0.5}}, "sweep": {"test_accuracy": math.inf}}
    got = accuracies(stages, "/d/digits")
    assert got == {"digits fewshot 25shot": 0.5}
    CellRecord.from_json(CellRecord("a", status="done", accuracies=got).to_json())


def test_a_damaged_record_of_finished_stages_names_the_way_back(tmp_path: Path) -> None:
    from vitscale.scaling.study.state import StudyStateError

    state = _fake_study(tmp_path / "study")
    state.stage_done("vit-0", "pretrain", {"checkpoint": "x"})
    assert set(state.stages("vit-0")) == {"pretrain"}
    (tmp_path / "study" / "state" / "vit-0.stages.json").write_bytes(b'{"pretrain": 3}')
    with pytest.raises(StudyStateError, match=r"vit-0\.stages\.json is unreadable .*delete it and the cell's finished"):
        state.stages("vit-0")


def test_study_state_and_report_on_s3(moto_s3: str) -> None:
    import boto3

    from vitscale.scaling.study.report import publish_report

    boto3.client("s3", endpoint_url=moto_s3).create_bucket(Bucket="studies")
    state = _fake_study("s3://studies/my-study", moto_s3)
    assert state.record("vit-0").status == "done" and state.record("hybrid-8").status == "running"
    assert state.cells_storage() == "s3://studies/my-study/cells"
    state.stage_done("vit-0", "pretrain", {"checkpoint": "s3://studies/my-study/cells/vit-0/checkpoint_000001"})
    assert state.stages("vit-0")["pretrain"]["checkpoint"].endswith("checkpoint_000001")
    report = publish_report(state)
    assert "s3://studies/my-study/results.parquet" in report.files
    assert state.storage.exists("compute_vs_accuracy.png") and state.storage.exists("fits.md")


def test_checkpoint_uri_keeps_the_scheme() -> None:
    import pyarrow.fs as pafs
    from ray.train import Checkpoint

    from vitscale.scaling.study.runner import checkpoint_uri

    local = Checkpoint("/runs/cell/checkpoint_000003")
    remote = Checkpoint("bucket/study/cells/c/checkpoint_000003",
                        filesystem=pafs.S3FileSystem(endpoint_override="http://127.0.0.1:1", anonymous=True))
    assert checkpoint_uri(local) == "/runs/cell/checkpoint_000003"
    assert checkpoint_uri(remote) == "s3://bucket/study/cells/c/checkpoint_000003"


def test_a_cell_may_name_the_masked_patch_objective_and_its_head_is_priced(tmp_path: Path) -> None:
    """A model entry's `train:` names the objective: the cell pre-trains by masked patch prediction (its
    own id), and the plan's compute counts the encoder and the per-patch head, as the worker does."""
    from vitscale.scaling.flops import masked_patch_flops, training_flops

    mpp = {**TINY, "label": "mpp", "train": {"objective": "masked_patch"}}
    raw = _study(tmp_path, {"models": [TINY, mpp], "epochs": [1]})
    _, (supervised, masked) = _plan(raw)
    assert masked.id != supervised.id and masked.label == "mpp"
    dims = {k: v for k, v in TINY.items() if k != "name"}
    # ViT-Ti/16 at 32 px: a 2 x 2 grid, 2 patches corrupted, 512 colours each.
    per_example = sum(masked_patch_flops("ViT-Ti/16", img_size=32, corrupted=2, outputs=512, **dims).values())
    assert masked.exaflops == pytest.approx(training_flops(per_example, 120) / 1e18, rel=1e-12)
    assert masked.exaflops != supervised.exaflops
    assert (supervised.objective, masked.objective) == ("supervised", "masked_patch")


def test_masked_patch_cells_are_fitted_apart_from_the_supervised_ones_of_their_family(tmp_path: Path) -> None:
    """Six supervised ViT cells and six masked patch ViT cells on curves of their own: two fits, one per
    objective (pooled, one fit would have drawn a curve through both and recommended from it)."""
    from vitscale.scaling.study.report import publish_report

    state = StudyState(str(tmp_path / "study"))
    cells = []
    for objective, floor in (("supervised", 0.2), ("masked_patch", 0.6)):
        for i, c in enumerate(np.geomspace(1e-6, 1e-4, 6)):
            cells.append({"id": f"{objective}-{i}", "label": f"v{i}", "family": "vit", "epochs": 2.0,
                          "examples": 1000, "exaflops": float(c), "objective": objective})
            acc = 1 - float(saturating(c, 1e-4, 0.5, floor, 0.0))
            state.write(CellRecord(f"{objective}-{i}", status="done", runs=1, exaflops=float(c), examples_seen=2000,
                                   device_hours=0.01, accuracies={"digits fewshot 5shot": acc}))
    del cells[0]["objective"]  # a plan written before cells recorded their objective: supervised
    state.write_plan({"cells": cells, "fit_metric": None})
    report = publish_report(state)
    assert [r["family"] for r in report.rows] == ["ViT"] * 6 + ["ViT (masked patch)"] * 6
    assert set(report.fits) == {"ViT", "ViT (masked patch)"}
    assert report.fits["ViT"].c == pytest.approx(0.2, abs=0.05)
    assert report.fits["ViT (masked patch)"].c == pytest.approx(0.6, abs=0.05)


def test_a_report_into_a_place_that_takes_no_files_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    import errno

    import vitscale.scaling.study.plots as plots
    from vitscale.cli import main

    _fake_study(tmp_path / "study")

    def full(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "study" / "compute_vs_accuracy.png"))

    monkeypatch.setattr(plots, "plot_compute", full)  # the disk fills on the first figure, after the tables
    assert main(["study", "report", str(tmp_path / "study")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("vitscale: error: study report into ") and err.count("\n") == 1, err  # no traceback
    assert "No space left on device" in err and "compute_vs_accuracy.png" in err
    monkeypatch.setattr("os.access", lambda path, mode: False)  # a read-only mount: refused before the fits
    assert main(["study", "report", str(tmp_path / "study")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"vitscale: error: study_dir: {tmp_path / 'study'}") and err.count("\n") == 1, err


def test_a_cells_progress_line_shows_a_non_finite_loss_instead_of_failing(tmp_path: Path) -> None:
    """A cell whose latest step's loss was NaN (a skipped step, within train.max_skipped_steps) has it as
    null in its metrics line: the study's progress line says nan, not a TypeError that ends the study."""
    from vitscale.launch.run_place import run_place
    from vitscale.scaling.study.cell_pipelines import cell_run, resolve_cells
    from vitscale.scaling.study.runner import _progress
    from vitscale.stages import build_pipeline
    from vitscale.train.metrics import MetricsSink, StepMetrics

    raw = _study(tmp_path, {"models": [TINY], "epochs": [1]})
    config = build_pipeline(raw, "study.yaml")
    [cell], [planned] = resolve_cells(config), _plan(raw)[1]
    run = cell_run(config, cell, str(tmp_path / "cells"))
    with MetricsSink(run_place(run.cluster, run.run_name).local_dir(), run=run.run_name, rank=0) as sink:
        sink.record(StepMetrics(step=3, loss=float("nan"), lr=0.1, grad_norm=float("inf"), images_per_s=12.0,
                                step_time_s=1.0, data_wait_s=0.0, compute_s=1.0, examples_seen=24,
                                cumulative_exaflops=1e-9, mfu=None, skipped_samples=0, epoch=0.2))
    assert _progress(run, planned) == "step 3 (20% of 120 examples) loss nan, 12 img/s"
