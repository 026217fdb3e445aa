"""MetricsSink as its consumers see it: JSONL lines, and /metrics scraped over HTTP and parsed by
prometheus_client's own text parser (what a Prometheus-compatible scraper reads)."""

from __future__ import annotations

import json
import math
import socket
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from vitscale.train.metrics import MetricsSink, StepClock, StepMetrics
from vitscale.train.mfu import PEAK_BF16_FLOPS, mfu, peak_flops


def _step(step: int, **over: object) -> StepMetrics:
    base = dict(
        step=step,
        loss=2.5 - 0.1 * step,
        lr=1e-3 * step,
        grad_norm=0.5 + step,
        images_per_s=100.0 * step,
        step_time_s=0.2 * step,
        data_wait_s=0.05 * step,
        compute_s=0.15 * step,
        examples_seen=64 * step,
        cumulative_exaflops=0.25 * step,
        mfu=0.1 * step,
        skipped_samples=step - 1,
        epoch=step / 10,
    )
    base.update(over)
    return StepMetrics(**base)  # type: ignore[arg-type]


def _scrape(port: int) -> dict[str, list]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        assert resp.status == 200
        text = resp.read().decode()
    return {fam.name: fam for fam in text_string_to_metric_families(text)}


def _value(families: dict, sample_name: str, **labels: str) -> float:
    family = sample_name.removesuffix("_total").removesuffix("_sum").removesuffix("_count").removesuffix("_bucket")
    hits = [
        s.value
        for s in families[family].samples
        if s.name == sample_name and all(s.labels.get(k) == v for k, v in labels.items())
    ]
    assert len(hits) == 1, (sample_name, labels, families[family].samples)
    return hits[0]


def test_prometheus_endpoint_after_steps(tmp_path: Path) -> None:
    sink = MetricsSink(tmp_path, run="demo", rank=3, port=0, addr="127.0.0.1")
    try:
        assert isinstance(sink.port, int) and sink.port > 0
        sink.record(_step(1))
        sink.record(_step(2), skipped_by_shard={"shard-000001.tar": 1})
        sink.record(_step(3), skipped_by_shard={"shard-000001.tar": 1, "shard-000007.tar": 1})
        fams = _scrape(sink.port)
    finally:
        sink.close()

    lab = {"run": "demo", "rank": "3"}
    types = {
        "vitscale_step": "gauge",
        "vitscale_epoch": "gauge",
        "vitscale_train_loss": "gauge",
        "vitscale_learning_rate": "gauge",
        "vitscale_grad_norm": "gauge",
        "vitscale_images_per_second": "gauge",
        "vitscale_mfu_ratio": "gauge",
        "vitscale_step_seconds": "histogram",
        "vitscale_data_wait_seconds": "histogram",
        "vitscale_compute_seconds": "histogram",
        "vitscale_examples_seen": "counter",
        "vitscale_train_flops": "counter",
        "vitscale_skipped_samples": "counter",
    }
    for name, kind in types.items():
        assert fams[name].type == kind, name
        for s in fams[name].samples:
            if not s.name.endswith("_created"):
                assert s.labels["run"] == "demo" and s.labels["rank"] == "3", s

    # gauges hold the last step
    assert _value(fams, "vitscale_step", **lab) == 3
    assert _value(fams, "vitscale_epoch", **lab) == pytest.approx(0.3)
    assert _value(fams, "vitscale_train_loss", **lab) == pytest.approx(2.2)
    assert _value(fams, "vitscale_learning_rate", **lab) == pytest.approx(3e-3)
    assert _value(fams, "vitscale_grad_norm", **lab) == pytest.approx(3.5)
    assert _value(fams, "vitscale_images_per_second", **lab) == pytest.approx(300.0)
    assert _value(fams, "vitscale_mfu_ratio", **lab) == pytest.approx(0.3)
    # counters count what this process did (here from the run's start), in base units
    assert _value(fams, "vitscale_examples_seen_total", **lab) == 192
    assert _value(fams, "vitscale_train_flops_total", **lab) == pytest.approx(0.75e18)
    assert _value(fams, "vitscale_skipped_samples_total", **lab, shard="shard-000001.tar") == 1
    assert _value(fams, "vitscale_skipped_samples_total", **lab, shard="shard-000007.tar") == 1
    assert _value(fams, "vitscale_skipped_samples_total", **lab, shard="unknown") == 0
    # histograms saw three observations each
    assert _value(fams, "vitscale_step_seconds_count", **lab) == 3
    assert _value(fams, "vitscale_step_seconds_sum", **lab) == pytest.approx(1.2)
    assert _value(fams, "vitscale_data_wait_seconds_sum", **lab) == pytest.approx(0.3)
    assert _value(fams, "vitscale_compute_seconds_sum", **lab) == pytest.approx(0.9)
    assert _value(fams, "vitscale_step_seconds_bucket", **lab, le="0.5") == 2  # 0.2, 0.4 ≤ 0.5 < 0.6
    assert _value(fams, "vitscale_step_seconds_bucket", **lab, le="+Inf") == 3


def test_close_stops_server_and_frees_port(tmp_path: Path) -> None:
    sink = MetricsSink(tmp_path, run="r", rank=0, port=0, addr="127.0.0.1")
    port = sink.port
    sink.record(_step(1))
    sink.close()
    sink.close()  # idempotent
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)
    # the port can be bound again right away: the listening socket is closed
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
    with pytest.raises(ValueError, match="after close"):
        sink.record(_step(2))


def test_two_sinks_in_one_process_do_not_collide(tmp_path: Path) -> None:
    with MetricsSink(tmp_path, run="a", rank=0, port=0, addr="127.0.0.1") as a, MetricsSink(
        tmp_path, run="a", rank=1, port=0, addr="127.0.0.1"
    ) as b:
        a.record(_step(1))
        b.record(_step(2))
        assert a.port != b.port
        assert _value(_scrape(a.port), "vitscale_step", rank="0") == 1
        assert _value(_scrape(b.port), "vitscale_step", rank="1") == 2


def test_a_port_another_process_holds_is_served_elsewhere_not_a_failed_run(tmp_path: Path) -> None:
    """A peer's run or an exporter on the node holds `train.metrics_port`: the run goes on, its metrics on a
    free port, and says why (a run of days is not stopped, nor restarted to its failure limit, for it)."""
    with socket.socket() as peer:
        peer.bind(("127.0.0.1", 0))
        peer.listen()
        taken = peer.getsockname()[1]
        with MetricsSink(tmp_path, run="r", rank=0, port=taken, addr="127.0.0.1") as sink:
            sink.record(_step(3))
            assert sink.port not in (None, taken) and _value(_scrape(sink.port), "vitscale_step", rank="0") == 3
            assert sink.refused is not None and sink.refused.startswith(f"port {taken} could not be served (")
    with MetricsSink(tmp_path, run="r", rank=1, port=0, addr="127.0.0.1") as free:
        assert free.refused is None


def test_mfu_absent_and_counters_never_go_down(tmp_path: Path) -> None:
    with MetricsSink(tmp_path, run="r", rank=0, port=0, addr="127.0.0.1") as sink:
        sink.record(_step(5, mfu=None))
        sink.record(_step(4, mfu=None))  # restored to an earlier checkpoint in-process
        fams = _scrape(sink.port)
    assert not [s for s in fams["vitscale_mfu_ratio"].samples if s.name == "vitscale_mfu_ratio"]
    assert _value(fams, "vitscale_examples_seen_total", rank="0") == 320
    assert _value(fams, "vitscale_step", rank="0") == 4


def test_a_restarted_process_counts_from_zero_so_rate_reads_its_reset(tmp_path: Path) -> None:
    # The attempt before served up to step 5 (320 examples) and died; the restart resumes from the step-3
    # checkpoint on the same scrape target. Its counters start at 0 and count its own steps: Prometheus
    # reads the drop as a reset and adds 0 + 64, not the checkpoint's 192 examples on top of a fresh one.
    with MetricsSink(tmp_path, run="r", rank=0, port=0, addr="127.0.0.1", resumed_examples=192,
                     resumed_exaflops=0.75) as sink:
        fams = _scrape(sink.port)
        assert _value(fams, "vitscale_examples_seen_total", rank="0") == 0
        assert _value(fams, "vitscale_train_flops_total", rank="0") == 0
        sink.record(_step(4))
        fams = _scrape(sink.port)
    assert _value(fams, "vitscale_examples_seen_total", rank="0") == 64
    assert _value(fams, "vitscale_train_flops_total", rank="0") == pytest.approx(0.25e18)
    assert _value(fams, "vitscale_run_flops", rank="0") == pytest.approx(1.0e18)  # the run's total, a gauge
    assert fams["vitscale_run_flops"].type == "gauge"


def test_the_attempts_start_is_served_for_the_stale_checkpoint_alert(tmp_path: Path) -> None:
    # VitscaleCheckpointStale counts from it while this process has not saved: its steps are all unsaved.
    with MetricsSink(tmp_path, run="r", rank=0, port=0, addr="127.0.0.1") as sink:
        sink.record(_step(1, attempt=1_700_000_000.0))
        fams = _scrape(sink.port)
    assert _value(fams, "vitscale_attempt_start_timestamp_seconds", rank="0") == 1_700_000_000.0
    assert fams["vitscale_last_checkpoint_timestamp_seconds"].samples == []  # no save yet


def test_jsonl_lines(tmp_path: Path) -> None:
    with MetricsSink(tmp_path / "run", run="demo", rank=1) as sink:
        assert sink.port is None
        sink.record(_step(1))
        # flushed per write: readable before close
        path = tmp_path / "run" / "metrics" / "rank1.jsonl"
        assert len(path.read_text().splitlines()) == 1
        sink.record(_step(2, grad_norm=float("nan"), mfu=None), skipped_by_shard={"s0": 1})
    with MetricsSink(tmp_path / "run", run="demo", rank=1) as sink:  # resumed run appends
        sink.record(_step(3))
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    first = rows[0]
    assert first["run"] == "demo" and first["rank"] == 1 and isinstance(first["time"], float)
    assert {k: first[k] for k in ("loss", "lr", "examples_seen", "cumulative_exaflops", "mfu", "epoch")} == {
        "loss": 2.4,
        "lr": 1e-3,
        "examples_seen": 64,
        "cumulative_exaflops": 0.25,
        "mfu": pytest.approx(0.1),
        "epoch": 0.1,
    }
    assert rows[1]["grad_norm"] is None and rows[1]["mfu"] is None  # NaN → null, strict JSON
    assert rows[1]["skipped_by_shard"] == {"s0": 1}
    for line in path.read_text().splitlines():
        json.loads(line, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))


def test_mfu_and_peaks() -> None:
    assert mfu(494.7e12, 989.4e12) == pytest.approx(0.5)
    assert mfu(0.0, 1.0) == 0.0
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="peak_flops_per_s"):
            mfu(1.0, bad)
    with pytest.raises(ValueError, match="model_flops_per_s"):
        mfu(math.nan, 1.0)

    assert PEAK_BF16_FLOPS["H100"] == PEAK_BF16_FLOPS["H200"] == 989e12 and PEAK_BF16_FLOPS["A100"] == 312e12
    # device names as torch.cuda.get_device_name reports them
    assert peak_flops("auto", device_name="NVIDIA H200") == 989e12
    assert peak_flops("auto", device_name="NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops("auto", device_name="NVIDIA H100 PCIe") == 756e12
    assert peak_flops("auto", device_name="NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops("auto", device_name="Tesla T4") is None  # unknown: absent, not guessed
    assert peak_flops("auto", device_name="NVIDIA RTX A1000") is None  # was the A100's 312 TFLOP/s: MFU made up
    assert peak_flops("auto", device_name="NVIDIA GH200 480GB") == 989e12
    assert peak_flops("a100") == 312e12
    assert peak_flops(123e12) == 123e12
    assert peak_flops("989e12") == 989e12
    assert peak_flops(None) is None
    for bad in ("TPUv4", 0, -5.0, "nan", True):
        with pytest.raises(ValueError, match="peak_flops"):
            peak_flops(bad)  # type: ignore[arg-type]


def test_auto_on_this_machine() -> None:
    import torch

    got = peak_flops("auto")
    if not torch.cuda.is_available():
        assert got is None
    else:
        name = torch.cuda.get_device_name()
        assert got == peak_flops("auto", device_name=name)


def test_sink_rejects_bad_args(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="port"):
        MetricsSink(tmp_path, run="r", rank=0, port=70000)
    with pytest.raises(ValueError, match="rank"):
        MetricsSink(tmp_path, run="r", rank=-1)


def test_nonfinite_losses_and_checkpoints_are_counted_for_the_alerts(tmp_path: Path) -> None:
    sink = MetricsSink(tmp_path, run="demo", rank=0, port=0, addr="127.0.0.1")
    try:
        before = _scrape(sink.port)
        # The counter is there at 0 before any step, so an alert's increase() sees the first NaN.
        assert _value(before, "vitscale_nonfinite_loss_total", run="demo", rank="0") == 0
        assert "vitscale_last_checkpoint_timestamp_seconds" not in before or not before[
            "vitscale_last_checkpoint_timestamp_seconds"].samples
        sink.record(_step(1))
        sink.record(_step(2, loss=float("nan")))
        sink.record(_step(3, loss=float("inf")))
        sink.record(_step(4))
        sink.checkpoint_saved(2.5, finished_at=1_700_000_000.0)
        sink.checkpoint_saved(0.5, finished_at=1_700_000_600.0)
        after = _scrape(sink.port)
        with pytest.raises(ValueError, match="finite"):
            sink.checkpoint_saved(float("nan"))
    finally:
        sink.close()
    assert _value(after, "vitscale_nonfinite_loss_total", run="demo", rank="0") == 2
    assert _value(after, "vitscale_checkpoint_seconds_count", run="demo", rank="0") == 2
    assert _value(after, "vitscale_checkpoint_seconds_sum", run="demo", rank="0") == 3.0
    assert _value(after, "vitscale_last_checkpoint_timestamp_seconds", run="demo", rank="0") == 1_700_000_600.0
    with pytest.raises(ValueError, match="after close"):
        sink.checkpoint_saved(1.0)


# -- step lines and TensorBoard ------------------------------------------------------------------


def test_hms() -> None:
    from vitscale.train.progress import hms

    assert hms(0) == "0:00:00" and hms(59.4) == "0:00:59" and hms(3725) == "1:02:05"
    assert hms(100 * 3600 + 1) == "100:00:01"
    assert hms(float("nan")) == "-:--:--" and hms(-1) == "-:--:--"


def test_step_line_has_a_clock_and_an_hms_eta() -> None:
    import time

    from vitscale.train.progress import progress_line

    now = time.mktime((2026, 11, 23, 21, 5, 7, 0, 0, -1))
    line = progress_line(_step(2), total_steps=1002, elapsed_s=20.0, steps_done=2, now=now)
    # 10 s a step, 1000 steps left: 10,000 s.
    assert line.startswith("[vitscale] 21:05:07 step 2/1002 epoch 0.20 loss 2.3000")
    assert line.endswith(" eta 2:46:40")


def _scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_tensorboard_log_is_keyed_by_optimizer_step(tmp_path: Path) -> None:
    from vitscale.train.tensorboard import TensorBoardLog

    board = TensorBoardLog(tmp_path / "tb")
    for step in (1, 2, 3):
        board.record(_step(step))
    board.scores(3, {"dev_accuracy": 0.5})
    board.close()
    scalars = _scalars(tmp_path / "tb")
    assert [s for s, _ in scalars["train/loss"]] == [1, 2, 3]
    assert scalars["train/loss"][2][1] == pytest.approx(2.2)
    assert scalars["train/lr"][0][1] == pytest.approx(1e-3)
    assert scalars["train/images_per_s"][1][1] == pytest.approx(200.0)
    assert scalars["train/mfu"][2][1] == pytest.approx(0.3)
    assert scalars["eval/dev_accuracy"] == [(3, 0.5)]

    # A restart resumed from the checkpoint at step 2: its curve goes on from step 3, no fold-back to 1
    # and no second point at step 3 from the attempt that died.
    board = TensorBoardLog(tmp_path / "tb", resumed_at=2)
    for step in (3, 4):
        board.record(_step(step, loss=9.0 + step))
    board.close()
    loss = _scalars(tmp_path / "tb")["train/loss"]
    assert [s for s, _ in loss] == [1, 2, 3, 4]
    assert loss[2][1] == pytest.approx(12.0) and loss[3][1] == pytest.approx(13.0)


def test_a_restart_before_the_first_checkpoint_does_not_draw_its_steps_twice(tmp_path: Path) -> None:
    from vitscale.train.tensorboard import TensorBoardLog

    board = TensorBoardLog(tmp_path / "tb")
    for step in (1, 2, 3):  # the attempt dies at step 3, before any checkpoint
        board.record(_step(step))
    board.close()
    board = TensorBoardLog(tmp_path / "tb", resumed_at=0)  # Ray Train starts the run again from step 0
    for step in (1, 2):
        board.record(_step(step, loss=7.0 + step))
    board.close()
    loss = _scalars(tmp_path / "tb")["train/loss"]
    assert loss == [(1, pytest.approx(8.0)), (2, pytest.approx(9.0))]


def test_no_mfu_is_no_point(tmp_path: Path) -> None:
    from vitscale.train.tensorboard import TensorBoardLog

    board = TensorBoardLog(tmp_path / "tb")
    board.record(_step(1, mfu=None))
    board.close()
    assert "train/mfu" not in _scalars(tmp_path / "tb") and "train/loss" in _scalars(tmp_path / "tb")


def test_a_steps_time_holds_the_previous_steps_bookkeeping_not_its_checkpoint(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU idles while the loop writes a step's metrics as much as during the step's own host work, so
    the next step's time holds that bookkeeping; an evaluation or a checkpoint between them does not count."""
    import vitscale.train.metrics as metrics

    now = [100.0]
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: now[0])
    clock = StepClock()
    times = []
    for step_s, bookkeeping_s, checkpoint_s in [(0.5, 0.01, 0.0), (0.25, 0.02, 7.0), (0.125, 0.04, 0.0)]:
        clock.start()
        now[0] += step_s
        times.append(clock.lap())
        now[0] += bookkeeping_s
        clock.booked()
        now[0] += checkpoint_s  # evaluation and checkpoint: after `booked`, before the next `start`
    assert times == pytest.approx([0.5, 0.26, 0.145])
