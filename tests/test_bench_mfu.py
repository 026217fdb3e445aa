"""benchmarks/mfu.py on the CPU: vitscale's training step and the hand-written peer, side by side, with phases
and a profile (the GPU figures come from the same code: benchmarks/gpu_check.sh)."""

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
