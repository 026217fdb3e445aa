"""benchmarks/mfu.py and host_cost.py on the CPU: vitscale's training step and the hand-written peer, side by
side, with phases, a profile and the host's reads (the GPU figures come from the same code:
benchmarks/gpu_check.sh)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

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
    assert "| ViT-Ti/16 | vitscale | 1 | no | 2 |" in table and "x |" in table  # the ratio to the peer
    profile = (tmp_path / "profile.md").read_text()
    assert "## Host syncs and copies" in profile and "aten::item" in profile
    assert (tmp_path / "rows.json").exists()


def test_host_cost_counts_the_steps_waits_beside_the_peer(capsys: pytest.CaptureFixture) -> None:
    import host_cost

    rows = host_cost.main(["--zero-stages", "1", "3", "--steps", "2", "--width", "24", "--per-layer-hooks"])
    assert [(r["loop"], r["zero_stage"]) for r in rows[:3]] == [("peer: hand-written", None), ("vitscale", 1),
                                                                ("vitscale", 3)]
    assert [r["waits_per_step"] for r in rows[:3]] == [0, 1, 2]  # ZeRO 3 adds DeepSpeed's own norm check
    # One rank's ZeRO 3 gathers nothing; gathering every parameter, as on many ranks, waits on each gather.
    assert [r["gathers_per_step"] for r in rows[2:]] == [0, 152, 152]
    assert all(r["waits_per_step"] > 2 for r in rows[3:])
    assert all(r["step_ms"] > 0 and r["optimizer_ms"] > 0 for r in rows)
    assert "| vitscale | 1 |" in capsys.readouterr().out


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
