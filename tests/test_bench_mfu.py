"""benchmarks/mfu.py, host_cost.py and update_pass.py on the CPU: vitscale's training step and the hand-written
peer, side by side, with phases, a profile, the host's reads and the update alone (the GPU figures come from
the same code: benchmarks/gpu_check.sh)."""

from __future__ import annotations

import gzip
import json
import sys
from itertools import pairwise
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("deepspeed")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


def test_mfu_measures_the_training_step_beside_the_peer(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    import mfu

    rows = mfu.main(["--models", "ViT-Ti/16", "--batch", "2", "--steps", "1", "--compile", "off", "--peer",
                     "--zero-stages", "1", "--profile", str(tmp_path), "--out", str(tmp_path / "rows.json")])
    loops = [r["loop"] for r in rows]
    assert loops[-1] == "vitscale" and any(loop.startswith("peer") for loop in loops)
    for r in rows:
        assert r["images_per_s"] > 0 and all(r[k] > 0 for k in ("forward_ms", "backward_ms", "optimizer_ms"))
    table = capsys.readouterr().out
    assert "| ViT-Ti/16 | vitscale | 1 | no | DeepSpeed's | 2 |" in table and "x |" in table  # the ratio to the peer
    with gzip.open(tmp_path / "profile-zero1.trace.json.gz", "rt") as trace:  # the whole trace, beside it
        assert any(e.get("name") == "vitscale.update" for e in json.load(trace)["traceEvents"])
    profile = (tmp_path / "profile-zero1.md").read_text()
    assert "## Host syncs and copies" in profile and "aten::item" in profile and "## Host calls by host time" in profile
    phases = {line.split(" | ")[0].strip("| "): line.split(" | ")[1:] for line in profile.splitlines()
              if line.startswith(("| forward", "| backward", "| update"))}
    assert sorted(phases) == ["backward", "forward", "update"]
    assert all(calls == "3" and float(host) > 0 for calls, host, *_ in phases.values()), phases  # a range a step
    from vitscale.train import step, update

    assert step.apply_update is update.apply_update  # the ranges taken off again
    assert (tmp_path / "rows.json").exists()


def _launch(ts: float, correlation: int, thread: int = 1) -> dict:
    return {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 5, "tid": thread,
            "args": {"correlation": correlation}}


def _work(cat: str, name: str, ts: float, dur: float, correlation: int) -> dict:
    return {"cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"stream": 7, "correlation": correlation}}


def test_a_phases_gpu_span_counts_the_work_inside_it_on_any_stream() -> None:
    from gpu_spans import phase_spans

    # Microseconds, as Kineto writes them. The host's update range 0-50 launches a, b, c and d (b from another
    # thread); they run 90-220 on the GPU, on two streams, overlapping each other, beside e (launched before the
    # range) and a gap 160-190 where nothing ran. The forward's range launched nothing.
    events = [{"cat": "user_annotation", "name": "vitscale.update", "ts": 0, "dur": 50, "tid": 1},
              {"cat": "user_annotation", "name": "vitscale.forward", "ts": 300, "dur": 40, "tid": 1},
              _launch(-10, 9), _work("kernel", "e", 80, 20, 9),
              _launch(10, 1), _work("kernel", "a", 90, 20, 1),
              _launch(12, 2, thread=2), {**_work("kernel", "b", 105, 10, 2), "args": {"stream": 20, "correlation": 2}},
              _launch(20, 3), _work("gpu_memcpy", "c", 150, 10, 3),
              _launch(30, 4), _work("kernel", "d", 190, 30, 4),
              _launch(60, 5), _work("kernel", "f", 400, 10, 5)]  # after the range: not the update's
    spans = phase_spans(events, ["vitscale.update", "vitscale.forward", "vitscale.backward"])
    update = spans["vitscale.update"]
    assert update["calls"] == 1 and update["host_ms"] == pytest.approx(0.05)
    assert update["work_ms"] == pytest.approx(0.07)  # a, b, c and d: 20+10+10+30
    assert update["span_ms"] == pytest.approx(0.13)  # 90 to 220
    assert update["busy_ms"] == pytest.approx(0.065)  # 90-115 (e's 80-100 inside), 150-160, 190-220
    assert spans["vitscale.forward"] == {"calls": 1, "host_ms": pytest.approx(0.04), "work_ms": 0.0,
                                         "span_ms": 0.0, "busy_ms": 0.0}
    assert "vitscale.backward" not in spans


def test_a_backward_pass_launched_by_autograds_thread_is_the_backward_phases() -> None:
    """The ZeRO 2 trace of 2026-12-01: the caller's thread waited inside `backward()` while autograd's device
    thread launched every kernel; Kineto's own GPU range for it was 0.01 ms long."""
    from gpu_spans import phase_spans

    events = [{"cat": "user_annotation", "name": "vitscale.backward", "ts": 0, "dur": 100, "tid": 1},
              {"cat": "gpu_user_annotation", "name": "vitscale.backward", "ts": 500, "dur": 0.01},
              _launch(1, 1), _work("gpu_memset", "Memset (Device)", 500, 0.01, 1)]
    events += [x for i in range(2, 12) for x in (_launch(5 * i, i, thread=2),
                                                   _work("kernel", f"k{i}", 500 + 10 * i, 10, i))]
    backward = phase_spans(events, ["vitscale.backward"])["vitscale.backward"]
    assert backward["span_ms"] == pytest.approx(0.12) and backward["work_ms"] == pytest.approx(0.10001)


def test_the_gpu_work_by_time_counts_each_kernel_once() -> None:
    from gpu_spans import work_by_name

    # The host's operator and the range share a kernel's GPU time in the profiler's averages; here only the work.
    events = [{"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5},
              {"cat": "gpu_user_annotation", "name": "vitscale.forward", "ts": 0, "dur": 100},
              {"cat": "cpu_op", "name": "triton_poi_fused_gelu_0", "ts": 1, "dur": 2},
              _work("kernel", "nvjet_mm", 10, 30, 1), _work("kernel", "nvjet_mm", 50, 30, 2),
              _work("kernel", "triton_poi_fused_gelu_0", 90, 5, 3), _work("gpu_memcpy", "Memcpy DtoD", 96, 4, 4)]
    assert work_by_name(events) == [("nvjet_mm", 2, pytest.approx(0.06)),
                                    ("triton_poi_fused_gelu_0", 1, pytest.approx(0.005)),
                                    ("Memcpy DtoD", 1, pytest.approx(0.004))]
    assert work_by_name([e for e in events if e["cat"] == "cpu_op"]) == []


@given(st.lists(st.tuples(st.floats(0, 1e6), st.floats(0, 1e3)), max_size=30), st.floats(0, 1e6), st.floats(0, 1e3))
def test_the_busy_part_of_a_span_is_the_union_of_the_work_in_it(work: list[tuple[float, float]], start: float,
                                                                  length: float) -> None:
    from gpu_spans import merged, overlap

    union = merged((ts, ts + dur) for ts, dur in work)
    assert all(a[1] < b[0] for a, b in pairwise(union))  # disjoint and sorted
    busy = overlap((start, start + length), union)
    assert -1e-6 <= busy <= length + 1e-6
    assert busy <= sum(max(0.0, min(start + length, ts + dur) - max(start, ts)) for ts, dur in work) + 1e-6


@given(fixed=st.floats(0, 1e11), per_image=st.floats(1e3, 1e9), capacity=st.floats(0, 2e11),
       multiple=st.sampled_from([1, 8, 64]), cap=st.sampled_from([64, 512, 1024]))
def test_an_auto_batch_is_the_largest_multiple_that_fits(fixed: float, per_image: float, capacity: float,
                                                          multiple: int, cap: int) -> None:
    import mfu

    try:
        batch = mfu.largest_batch(fixed, per_image, capacity, multiple=multiple, cap=cap)
    except ValueError as err:
        assert fixed + per_image * multiple > capacity, err  # refused only when one multiple does not fit
        return
    assert batch % multiple == 0 and multiple <= batch <= cap
    assert fixed + per_image * batch <= capacity
    assert batch + multiple > cap or fixed + per_image * (batch + multiple) > capacity  # nothing larger fits


def test_an_auto_batch_needs_a_gpu(capsys: pytest.CaptureFixture) -> None:
    import mfu

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: auto is allowed")
    for argv in (["--batch", "auto"], ["--batch-for", "ViT-B/16=auto"]):
        with pytest.raises(SystemExit):
            mfu.main(["--models", "ViT-Ti/16", *argv])
        assert "chosen by GPU memory: this machine has no GPU" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        mfu.main(["--batch-for", "ViT-B/16=0"])
    assert "expected MODEL=BATCH with a positive batch or auto" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_an_auto_batch_fits_the_gpu_it_was_chosen_for() -> None:
    import mfu

    device = torch.device("cuda", 0)
    at_zero, per_image, parameters = mfu.memory_line("ViT-Ti/16", device)
    # The fp32 weights at least: the probe's peak comes before its last gradients exist (4.9 bytes per
    # parameter on an H200), which `auto_batch` adds back (`PROBE_STATE_BYTES`).
    assert per_image > 0 and at_zero >= 4 * parameters * 0.9
    batch = mfu.auto_batch("ViT-Ti/16", device)
    assert batch % mfu.AUTO_BATCH_MULTIPLE == 0 and batch <= mfu.AUTO_BATCH_CAP


def test_host_cost_counts_the_steps_waits_beside_the_peer(capsys: pytest.CaptureFixture) -> None:
    import host_cost

    rows = host_cost.main(["--zero-stages", "1", "3", "--steps", "2", "--width", "24", "--per-layer-hooks"])
    assert [(r["loop"], r["zero_stage"]) for r in rows[:5]] == [
        ("peer: hand-written", None), ("vitscale", 1), ("vitscale", 3), (host_cost.ONE_PASS_LABEL, 1),
        (host_cost.ONE_PASS_LABEL, 3)]
    # One each: ZeRO 3's own host check of its norm is left to vitscale's verdict on the device (`train/update.py`).
    assert [r["waits_per_step"] for r in rows[:5]] == [0, 1, 1, 1, 1]
    # One rank's ZeRO 3 gathers nothing; gathering every parameter, as on many ranks, waits on each gather.
    assert [r["gathers_per_step"] for r in (rows[2], rows[4], *rows[5:])] == [0, 0, 152, 152]
    assert all(r["waits_per_step"] > 2 for r in rows[5:])
    assert all(r["step_ms"] > 0 and r["optimizer_ms"] > 0 for r in rows)
    # One rank's ZeRO 3 update launches about what ZeRO 1's does: its norm is the fused one, not a cast and a
    # norm per parameter (the layout's 152), and the peer's fused AdamW alone launches least. The one-pass
    # update replaces ZeRO 1's cast, clip, AdamW and copy back with its compiled kernels; at ZeRO 3, whose update
    # was a handful of launches over one flat partition already, it passes over memory less and launches about
    # as many (measured: 58 against 56), none per parameter (the layout's 152).
    ops = [r["update_ops"] for r in rows[:5]]
    assert 0 < ops[0] < ops[3] < ops[1] and ops[2] < ops[1] + 50 and ops[4] < ops[2] + 10, ops
    assert "| vitscale | 1 |" in capsys.readouterr().out


def test_the_update_alone_is_timed_four_ways_and_the_two_masters_agree(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture) -> None:
    import update_pass

    rows = update_pass.main(["--models", "ViT-Ti/16", "--steps", "2", "--out", str(tmp_path / "u.json")])
    assert [r["update"] for r in rows] == ["deepspeed", "one pass", "one pass, flat gradient", "peer"]
    assert rows[0]["parameters"] == sum(s.numel() for s in update_pass.shapes("ViT-Ti/16")) > 5_000_000
    assert all(r["ms"] > 0 and r["gb_per_s"] > 0 for r in rows) and rows[0]["vs_deepspeed"] == 1.0
    # Five steps of the same gradients (three to warm up, two timed): DeepSpeed's sequence and the pass end at
    # the same masters, to fp32 rounding; a lost clip or decay would be ~1e-3 off.
    assert rows[1]["masters_apart"] < 1e-6
    assert "| ViT-Ti/16 | one pass | 32 |" in capsys.readouterr().out


@pytest.mark.parametrize(("argv", "says"), [(["--models", "ViT-X/99"], "--models: unknown model name 'ViT-X/99'"),
                                            (["--steps", "0"], "'0': expected a positive whole number")])
def test_the_update_benchmark_names_a_bad_argument_in_one_line(argv: list[str], says: str,
                                                               capsys: pytest.CaptureFixture) -> None:
    import update_pass

    with pytest.raises(SystemExit) as stopped:
        update_pass.main(argv)
    assert stopped.value.code == 2 and says in capsys.readouterr().err


def test_attention_times_every_backend_that_takes_the_shapes(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    import attention

    rows = attention.main(["--models", "ViT-Ti/16", "--batch", "2", "--steps", "2", "--out", str(tmp_path / "a.json")])
    (row,) = rows
    assert (row["heads"], row["tokens"], row["head_dim"]) == (3, 197, 64)  # 14 x 14 patches and the class token
    assert row["ms"]["math"] > 0 and row["ms"]["default"] > 0  # the plain kernel takes any shape, on any device
    assert row["fastest"] in row["tflops_per_s"] and row["ms"][row["fastest"]] == min(
        ms for name, ms in row["ms"].items() if ms is not None and name != "default")
    assert "| ViT-Ti/16 | 2 x 3 x 197 x 64 |" in capsys.readouterr().out
    with pytest.raises(ValueError, match="not a ViT"):
        attention.shapes("R50x1", 2, 224)


@pytest.mark.parametrize(("variable", "value", "says"), [
    ("GPU_CHECK_SECONDS", "9m", "GPU_CHECK_SECONDS must be a whole number of seconds, got '9m'"),
    ("GPU_CHECK_ONLY", "l16 tset", "GPU_CHECK_ONLY names no part 'tset' (the parts: update b16 l16 data"),
])
def test_gpu_check_refuses_a_bad_setting_before_it_installs_anything(tmp_path: Path, variable: str, value: str,
                                                                     says: str) -> None:
    # GPU minutes are scarce: a typo must cost one line, not a machine's start and a wheel install.
    import os
    import subprocess

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.sh"
    done = subprocess.run(["bash", str(script), str(tmp_path / "out")], capture_output=True, text=True,
                          env={**os.environ, variable: value}, timeout=30)
    assert done.returncode == 2 and done.stdout == "" and done.stderr.count("\n") == 1, done
    assert says in done.stderr and not (tmp_path / "out").exists()
