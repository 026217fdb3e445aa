"""The study plan's costs: device-hours from FLOPs at peak x MFU, the MFU table, wall time, money."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vitscale.scaling.study.costs import (
    DEFAULT_MFU,
    PEAK_FLOPS,
    MeasuredMFU,
    cell_cost,
    choose_mfu,
    parse_mfu_table,
    peak_flops,
    read_mfu_table,
    study_wall_hours,
)

PIPELINES = Path(__file__).resolve().parents[1] / "pipelines"

positive = st.floats(1e-9, 1e6, allow_nan=False, allow_infinity=False)


@given(exaflops=st.floats(0, 1e5), devices=st.integers(1, 4096), mfu=st.floats(0.01, 1.0), overhead=st.floats(0, 1e4),
       price=st.one_of(st.none(), st.floats(0, 100)), device=st.sampled_from(sorted(PEAK_FLOPS)))
@settings(max_examples=200, deadline=None)
def test_device_hours_are_flops_over_peak_times_mfu(exaflops: float, devices: int, mfu: float, overhead: float,
                                                    price: float | None, device: str) -> None:
    cost = cell_cost(exaflops=exaflops, examples_seen=10, devices=devices, device=device, mfu=mfu, mfu_source="x",
                     throughput=None, overhead_s=overhead, price=price)
    assert cost.device_hours * 3600 * PEAK_FLOPS[device] * mfu == pytest.approx(exaflops * 1e18, rel=1e-9, abs=1e-6)
    assert cost.wall_hours == pytest.approx(cost.device_hours / devices + overhead / 3600, rel=1e-9, abs=1e-12)
    assert cost.cost == (None if price is None else pytest.approx(cost.device_hours * price, rel=1e-9, abs=1e-12))
    assert cost.mfu == mfu and cost.source == "x"


@given(seen=st.integers(1, 10**10), throughput=positive, devices=st.integers(1, 64))
@settings(max_examples=100, deadline=None)
def test_a_measured_throughput_overrides_the_flops(seen: int, throughput: float, devices: int) -> None:
    cost = cell_cost(exaflops=123.0, examples_seen=seen, devices=devices, device="H100", mfu=0.4, mfu_source="x",
                     throughput=throughput, overhead_s=0.0, price=None)
    assert cost.device_hours == pytest.approx(seen / throughput / 3600)
    assert cost.mfu is None and cost.source.startswith("measured throughput")


def test_the_issue_arithmetic_h14_at_40_percent_of_an_h100() -> None:
    """ViT-H/14 for 14 epochs of JFT (4,262 exaFLOPs in the paper) is ~3,000 H100-hours at 40% MFU."""
    cost = cell_cost(exaflops=4262.0, examples_seen=1, devices=8, device="NVIDIA H100 80GB HBM3", mfu=0.40,
                     mfu_source="x", throughput=None, overhead_s=0, price=None)
    assert cost.device_hours == pytest.approx(2992, rel=0.01)
    assert peak_flops("NVIDIA H100 PCIe") == 756e12 and peak_flops("cpu") == PEAK_FLOPS["CPU"]
    with pytest.raises(ValueError, match="no peak"):
        peak_flops("Abacus")
    # A name was matched as a substring: "h100-pcie" was priced as an SXM H100 (989, not 756 TFLOP/s), and "H1000"
    # or an "RTX A1000" (a small workstation GPU) as an H100 or an A100, with no word of it.
    assert peak_flops("h100-pcie") == peak_flops("H100_PCIe") == 756e12
    assert peak_flops("NVIDIA A100-SXM4-80GB") == 312e12 and peak_flops("NVIDIA GH200 480GB") == 989e12
    for unknown in ("H1000", "NVIDIA RTX A1000", "V1000"):
        with pytest.raises(ValueError, match="no peak"):
            peak_flops(unknown)


mfu_text = st.floats(0.001, 1.0).map(lambda v: round(v, 4))


@given(rows=st.lists(st.tuples(st.sampled_from(["ViT-B/16", "ViT-L/16", "R50x1", "R50x1+ViT-B/16"]), mfu_text,
                               st.booleans()), max_size=8))
@settings(max_examples=100, deadline=None)
def test_mfu_table_parses_what_benchmarks_mfu_prints_amid_noise(rows: list[tuple[str, float, bool]]) -> None:
    lines = ["# Results", "", "Some prose | with a pipe.", "",
             "| other | table |", "|---|---|", "| x | y |", "",
             "| model | batch | images/s | model TFLOP/s | vs matmul peer | MFU |", "|---|---:|---:|---:|---:|---:|"]
    for model, mfu, percent in rows:
        lines.append(f"| {model} | 128 | 1.0 | 2.0 | 50% | {mfu * 100:.2f}% |" if percent else
                     f"| {model} | 128 | 1.0 | 2.0 | 50% | {mfu} |")
    lines += ["| ViT-B/16 | 128 | 1 | 2 | 3 | n/a |", "| ViT-B/16 | 128 | 1 | 2 | 3 | 250% |", "", "The end."]
    parsed = parse_mfu_table("\n".join(lines))
    assert [p.model for p in parsed] == [m for m, _, _ in rows]
    for p, (_, mfu, _) in zip(parsed, rows):
        assert p.mfu == pytest.approx(mfu, abs=1e-4) and 0 < p.mfu <= 1


def test_mfu_table_missing_or_unreadable_is_empty(tmp_path: Path) -> None:
    assert read_mfu_table(tmp_path / "nope.md") == []
    (tmp_path / "bin.md").write_bytes(b"\xff\xfe\x00")
    assert read_mfu_table(tmp_path / "bin.md") == []


def test_choose_mfu_prefers_the_model_then_its_family_then_a_labelled_default() -> None:
    table = [MeasuredMFU("ViT-B/16", 0.46, "NVIDIA H200"), MeasuredMFU("ViT-L/16", 0.52, None),
             MeasuredMFU("R50x1", 0.9, "cpu")]
    assert choose_mfu("ViT-B/16", "vit", "H100", table, "R.md") == (0.46, "measured (R.md, ViT-B/16)")
    mfu, source = choose_mfu("ViT-H/14", "vit", "H100", table, "R.md")
    assert mfu == pytest.approx(0.49) and source.startswith("measured, same family")
    mfu, source = choose_mfu("R152x2", "resnet", "H100", table, "R.md")  # the R50x1 row is a CPU's
    assert mfu == DEFAULT_MFU["gpu"]["resnet"] and "estimate" in source
    assert choose_mfu("ViT-B/16", "vit", "A100", table[:1], "R.md")[1].startswith("estimate")  # another peak


@given(walls=st.lists(st.floats(0, 100), min_size=1, max_size=30), at_once=st.integers(1, 8))
@settings(max_examples=200, deadline=None)
def test_study_wall_time_bounds(walls: list[float], at_once: int) -> None:
    total = study_wall_hours(walls, at_once)
    assert max(walls) - 1e-9 <= total <= sum(walls) + 1e-9
    assert total >= sum(walls) / at_once - 1e-9
    assert study_wall_hours(walls, 1) == pytest.approx(sum(walls))


def test_table6_plan_prices_each_model_from_its_flops(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Each cell's device-hours are its own FLOPs at its MFU; with no measured table every MFU is the
    labelled estimate of its family, so hours scale exactly as FLOPs do within a family."""
    import json

    from vitscale.cli import main

    no_table = tmp_path / "RESULTS.md"
    no_table.write_text("nothing measured here\n")
    pinned = ["--set", f"study.mfu_results={no_table}"]
    assert main(["study", "plan", str(PIPELINES / "scaling-study.yaml"), *pinned, "--json"]) == 0
    cells = {(c["model"], c["epochs"]): c for c in json.loads(capsys.readouterr().out)}
    h14, b32 = cells[("ViT-H/14", 14.0)], cells[("ViT-B/32", 7.0)]
    for cell in cells.values():
        if cell["mfu"] is not None:
            assert cell["device_hours"] * 3600 * PEAK_FLOPS["H100"] * cell["mfu"] == pytest.approx(cell["exaflops"] * 1e18)
        assert cell["cost"] == pytest.approx(cell["device_hours"] * 2.5)
    assert h14["device_hours"] / b32["device_hours"] == pytest.approx(h14["exaflops"] / b32["exaflops"])
    assert 2500 < h14["device_hours"] < 3500
    assert main(["study", "plan", str(PIPELINES / "scaling-study.yaml"), *pinned]) == 0
    text = capsys.readouterr().out
    assert "estimate" in text and "measured" not in text
    assert "cost" in text and "wall time" in text and "H100 device-hours" in text


def test_a_measured_table_named_but_absent_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from vitscale.cli import main

    absent = tmp_path / "RESLUTS.md"  # was passed over: every cell priced from the default MFU, exit 0
    assert main(["study", "plan", str(PIPELINES / "scaling-study.yaml"), "--set", f"study.mfu_results={absent}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("vitscale: error: study.mfu_results: no file") and err.count("\n") == 1, err


def test_the_measured_table_prices_a_model_from_its_own_row(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from vitscale.cli import main

    table = tmp_path / "RESULTS.md"
    table.write_text("| model | device | MFU |\n|---|---|---:|\n| ViT-H/14 | H200 | 35.3% |\n| ViT-B/16 | H200 | 25% |\n")
    assert main(["study", "plan", str(PIPELINES / "scaling-study.yaml"), "--set",
                 f"study.mfu_results={table}", "--json"]) == 0
    cells = {(c["model"], c["epochs"]): c for c in json.loads(capsys.readouterr().out)}
    h14, b32, r50 = cells[("ViT-H/14", 14.0)], cells[("ViT-B/32", 7.0)], cells[("R50x1", 7.0)]
    assert h14["mfu"] == pytest.approx(0.353) and "measured" in h14["cost_source"]
    assert b32["mfu"] == pytest.approx((0.353 + 0.25) / 2) and "same family" in b32["cost_source"]
    assert r50["mfu"] == pytest.approx(DEFAULT_MFU["gpu"]["resnet"]) and "estimate" in r50["cost_source"]
    for cell in (h14, b32):
        assert cell["device_hours"] * 3600 * PEAK_FLOPS["H100"] * cell["mfu"] == pytest.approx(cell["exaflops"] * 1e18)


def test_plan_writes_no_dataset_and_prints_first(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from vitscale.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["study", "plan", str(PIPELINES / "scaling-study-local.yaml")]) == 0
    text = capsys.readouterr().out
    assert "9 cells" in text and "CPU device-hours" in text and "cell(s) at once" in text
    assert not (tmp_path / "data_cache").exists()  # planning wrote nothing
    minutes = float(text.split("wall time ")[1].split(" min")[0])
    assert 3 < minutes < 30 and math.isfinite(minutes)
