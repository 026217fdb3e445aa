"""Long work shows progress: a redrawn bar on a terminal, periodic lines in a log, nothing for short
work in a log, and no final line after a failure (the error's own line follows)."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest

from vitscale.data.tools.progress import Progress


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_terminal_gets_the_final_line_a_log_only_after_periodic_ones() -> None:
    tty, log = _Terminal(), io.StringIO()
    for stream in (tty, log):
        with Progress(3, "x", stream=stream, interval_s=10.0) as bar:
            bar.update(3)
    assert "3/3" in tty.getvalue() and log.getvalue() == ""


def test_a_failure_leaves_no_final_line() -> None:
    tty = _Terminal()
    with pytest.raises(RuntimeError), Progress(3, "x", stream=tty, interval_s=0.0) as bar:
        bar.update()
        raise RuntimeError("boom")
    assert tty.getvalue().endswith("\n") and "1/3" in tty.getvalue() and "3/3" not in tty.getvalue()


def _screen(text: str) -> list[str]:
    """What a terminal shows for `text`: a carriage return moves back to the line's start, and what follows
    overwrites only the characters it covers."""
    rows, row, col = [], [], 0
    for ch in text:
        if ch == "\r":
            col = 0
        elif ch == "\n":
            rows, row, col = [*rows, "".join(row)], [], 0
        else:
            row[col:col + 1] = [ch]
            col += 1
    return [*rows, "".join(row)]


def test_a_shorter_redraw_leaves_nothing_of_the_longer_line_before_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import vitscale.data.tools.progress as progress

    clock = [0.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: clock[0])
    tty = _Terminal()
    with Progress(1000, "write x", unit="img", stream=tty, interval_s=0.0) as bar:
        clock[0] = 0.5
        bar.update(600)  # 1200.0 img/s
        clock[0] = 2.0
        bar.update(100)  # 350.0 img/s: one character shorter
        assert _screen(tty.getvalue())[-1].rstrip().endswith("350.0 img/s  ETA 0:00:01")
        clock[0] = 3.0
    assert _screen(tty.getvalue())[-2].rstrip().endswith("233.3 img/s  ETA 0:00:01")  # the final line, ended


@pytest.mark.parametrize("verb", ["index", "fewshot", "inspect"])
def test_the_verbs_show_progress_on_a_terminal(verb: str, tmp_path: Path, small_synthetic: str,
                                               monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    import shutil

    import torch

    from vitscale.cli import main
    from vitscale.models import create_model
    from vitscale.models.factory import model_meta
    from vitscale.models.weights_files import export_state_dict

    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    if verb == "index":
        tars = tmp_path / "tars"
        tars.mkdir()
        for tar in Path(small_synthetic).glob("train-*.tar"):
            shutil.copy(tar, tars / tar.name)
        assert main(["shards", "index", str(tars)]) == 0
        assert f"index {tars}" in terminal.getvalue() and "shard/s" in terminal.getvalue()
        assert json.loads(capsys.readouterr().out)["samples"]["train"] > 0
        return
    torch.manual_seed(0)
    model = create_model("ViT-Ti/16", num_classes=3, img_size=32, depth=1, width=32, mlp_dim=64, heads=2)
    weights = tmp_path / "model.pt"
    export_state_dict(model, weights, meta=model_meta(model))
    if verb == "fewshot":
        from vitscale.data.tools.write import write_dataset

        data = str(tmp_path / "split")
        write_dataset("synthetic", data, max_side=32, progress=False, splits={"train": 0.7, "test": 0.3},
                      source_options={"count": 30, "classes": 3, "image_size": 32})
        assert main(["fewshot", str(weights), "--data", data, "--shots", "1", "--seeds", "1"]) == 0, \
            terminal.getvalue()
        assert f"features of {data} (test)" in terminal.getvalue() and "img/s" in terminal.getvalue()
    else:
        assert main(["inspect", str(weights), "--images", small_synthetic, "--out", str(tmp_path / "out"),
                     "--count", "2"]) == 0
        assert f"inspect {weights}" in terminal.getvalue() and "5/5" in terminal.getvalue()
