"""Rank 0's TensorBoard curves from the real training loop (no Ray): keyed by optimiser step, written
into the run directory, continued (not folded back) by a run resumed from a checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers.loop_runs import Recorder, steps
from test_pretrain_loop import tiny_config, tiny_dataset  # noqa: F401 -- the module's fixture

pytest.importorskip("deepspeed")


def _scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_pretraining_writes_tensorboard_and_a_resume_continues_it(tmp_path: Path, tiny_dataset: str,  # noqa: F811
                                                                   process_group: None) -> None:
    from vitscale.train.loop import WorkerContext, train

    job = tiny_config(tiny_dataset)
    run = tmp_path / "run"
    first = Recorder(tmp_path)
    train(job, WorkerContext(rank=0, world_size=1, run_dir=run, report=first))
    scalars = _scalars(run / "tensorboard")
    assert [s for s, _ in scalars["train/loss"]] == [1, 2, 3, 4, 5, 6]
    first_losses = [m["loss"] for m in steps(run)]  # the run's metrics file: every step of this attempt
    assert [v for _, v in scalars["train/loss"]] == pytest.approx(first_losses) and len(first_losses) == 6
    assert {"train/lr", "train/images_per_s", "train/epoch", "train/exaflops"} <= set(scalars)

    # The same run restarted from its step-3 checkpoint (as Ray Train does after a failure): the
    # curves go 1..6 once, the last three from the second attempt.
    second = Recorder(tmp_path / "again")
    (tmp_path / "again").mkdir()
    train(job, WorkerContext(rank=0, world_size=1, run_dir=run, report=second,
                             resume_from=tmp_path / "checkpoint_000000003"))
    loss = _scalars(run / "tensorboard")["train/loss"]
    assert [s for s, _ in loss] == [1, 2, 3, 4, 5, 6]
    assert [v for _, v in loss[3:]] == pytest.approx([m["loss"] for m in steps(run)[6:]])  # the file goes on


def test_export_shows_progress(tmp_path: Path, tiny_dataset: str, process_group: None,  # noqa: F811
                               monkeypatch: pytest.MonkeyPatch) -> None:
    import io
    import sys

    from vitscale.train.export import export_run
    from vitscale.train.loop import WorkerContext, train

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    train(tiny_config(tiny_dataset, max_steps=3), WorkerContext(rank=0, world_size=1, run_dir=tmp_path / "run",
                                                                 report=Recorder(tmp_path)))
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    info = export_run(tmp_path / "checkpoint_000000003", tmp_path / "model.pt", progress=True)
    assert info["step"] == 3 and (tmp_path / "model.pt").stat().st_size > 0
    assert "export" in terminal.getvalue() and "2/2" in terminal.getvalue()

    # The format follows the file's name: `--out model.npz` is big_vision's layout, not a torch file so named.
    import numpy as np

    from vitscale.config.errors import UserError

    assert export_run(tmp_path / "checkpoint_000000003", tmp_path / "model.npz")["format"] == "npz"
    assert "embedding/kernel" in np.load(tmp_path / "model.npz").files
    from vitscale.models.weights_files import read_weights  # a .safetensors name is that format, not a torch file

    export_run(tmp_path / "checkpoint_000000003", tmp_path / "model.safetensors")
    assert read_weights(tmp_path / "model.safetensors")[0] == "vitscale"
    with pytest.raises(UserError, match=r"--out .*other\.npz.*names the npz format.*--format is pt"):
        export_run(tmp_path / "checkpoint_000000003", tmp_path / "other.npz", fmt="pt")
    assert not (tmp_path / "other.npz").exists()


@pytest.mark.parametrize(("out", "fmt", "chosen"), [
    ("m.npz", None, "npz"), ("m.NPZ", None, "npz"), ("m.pt", None, "pt"), ("m.pth", None, "pt"),
    ("m.bin", None, "pt"), ("m", None, "pt"), ("m.bin", "npz", "npz"), ("m.npz", "npz", "npz")])
def test_the_export_format_is_the_one_the_file_name_says(out: str, fmt: str | None, chosen: str) -> None:
    from vitscale.train.export import export_format

    assert export_format(out, fmt) == chosen


@pytest.mark.parametrize(("out", "fmt"), [("m.npz", "pt"), ("m.pt", "npz"), ("m.pt", "npy")])
def test_an_export_format_its_file_name_contradicts_is_refused(out: str, fmt: str) -> None:
    from vitscale.config.errors import UserError
    from vitscale.train.export import export_format

    with pytest.raises(UserError, match="--format"):
        export_format(out, fmt)


def test_export_of_the_run_directory_a_finetune_prints(tmp_path: Path, tiny_dataset: str,  # noqa: F811
                                                       process_group: None) -> None:
    import json
    import shutil

    from vitscale.train.export import export_run
    from vitscale.train.loop import WorkerContext, train

    # The layout `vitscale finetune` leaves: the pipeline's run directory (what the console prints),
    # and inside it the fine-tuning's own Ray Train run with the checkpoints.
    storage = tmp_path / "runs"
    run_dir = storage / "ft"
    tuned = run_dir / "finetune"
    tuned.mkdir(parents=True)
    train(tiny_config(tiny_dataset, max_steps=3), WorkerContext(rank=0, world_size=1, run_dir=tmp_path / "w",
                                                                 report=Recorder(tuned)))
    assert export_run(run_dir, tmp_path / "a.pt")["step"] == 3  # died before its summary: the run inside it
    for damaged in ("[1, 2]", "{", "\udcff"):  # a summary that is no record of stages: as if there were none
        (run_dir / "summary.json").write_text(damaged, errors="surrogateescape")
        assert export_run(run_dir, tmp_path / "a.pt")["step"] == 3
    (run_dir / "summary.json").unlink()
    beside = storage / "ft-finetune"  # the older layout: the fine-tuning run beside the run
    shutil.move(tuned, beside)
    assert export_run(run_dir, tmp_path / "c.pt")["step"] == 3
    shutil.copytree(beside, storage / "elsewhere")
    shutil.rmtree(beside)
    (run_dir / "summary.json").write_text(json.dumps(
        {"finetune": {"checkpoint": str(storage / "elsewhere" / "checkpoint_000000003")}}))
    assert export_run(run_dir, tmp_path / "b.pt")["step"] == 3  # the checkpoint its summary names


def test_a_resume_in_the_same_second_and_process_continues_the_curve(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Event files sort by name: seconds, host, pid, then a per-process counter as text. An attempt resumed in
    the same second and process whose counter went from 9 to 10 sorted first ("...vm.26417.10" before
    "...vm.26417.9": the suite's order did it), and the curve went 4, 5, 6, 1, 2, 3, ...; it goes 1..6 now."""
    from tensorboard.summary.writer import event_file_writer

    from vitscale.train.metrics import StepMetrics
    from vitscale.train.tensorboard import TensorBoardLog

    monkeypatch.setattr(event_file_writer, "_global_uid", event_file_writer.AtomicCounter(9))

    def record(log: TensorBoardLog, steps_: range, loss: float) -> None:
        for step in steps_:
            log.record(StepMetrics(step=step, loss=loss, lr=0.1, grad_norm=1.0, images_per_s=1.0, step_time_s=1.0,
                                   data_wait_s=0.0, compute_s=1.0, examples_seen=step, cumulative_exaflops=0.0,
                                   mfu=None, skipped_samples=0, epoch=0.0))
        log.close()

    record(TensorBoardLog(tmp_path), range(1, 7), 1.0)  # the first attempt: steps 1-6, its counter 9
    record(TensorBoardLog(tmp_path, resumed_at=3), range(4, 7), 2.0)  # resumed from step 3: counter 10
    assert _scalars(tmp_path)["train/loss"] == [(1, 1.0), (2, 1.0), (3, 1.0), (4, 2.0), (5, 2.0), (6, 2.0)]
