"""The worker loop without Ray: one process, gloo, real DeepSpeed ZeRO, exact resume from a checkpoint."""

from __future__ import annotations

import os
import signal
import socket
from pathlib import Path

import pytest
import torch

from helpers.loop_runs import Recorder, steps
from helpers.loop_runs import weights as final_weights
from vitscale.data.tools.write import write_dataset
from vitscale.stages import build_pipeline
from vitscale.stages.pretrain import pretraining_job
from vitscale.train.checkpoint import check_complete
from vitscale.train.job import TrainJob

pytest.importorskip("deepspeed")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tiny_dataset(tmp_path_factory: pytest.TempPathFactory) -> str:
    out = tmp_path_factory.mktemp("data") / "synthetic"
    write_dataset("synthetic", str(out), shard_size=37, max_side=32, seed=0,
                  source_options={"count": 160, "classes": 4, "image_size": 32}, progress=False)
    return str(out)


def tiny_config(url: str, **train: object) -> TrainJob:
    """The pre-training job of a tiny pipeline: what a Ray Train worker is handed."""
    return pretraining_job(build_pipeline({
        "model": {"name": "ViT-Ti/8", "img_size": 16, "depth": 2, "width": 32, "mlp_dim": 64, "heads": 2},
        "data": {"url": url, "num_workers": 0, "shuffle_buffer": 64},
        "train": {"global_batch": 16, "micro_batch": 8, "max_steps": 6, "warmup_steps": 2, "base_lr": 1e-3,
                  "zero_stage": 2, "precision": "fp32", "checkpoint_every": 3, "log_every": 1,
                  "record_samples": True, **train},
        "cluster": {"num_workers": 1, "use_gpu": False},
    }))


@pytest.mark.parametrize(("compiled", "stage"), [(False, 2), (True, 2), (True, 3), (False, 3)],
                         ids=["eager", "compiled", "compiled-zero3", "eager-zero3"])
def test_resume_from_checkpoint_matches_uninterrupted_run(tmp_path: Path, tiny_dataset: str,
                                                          process_group: None, compiled: bool, stage: int) -> None:
    """Compiled (`train.compile`, inductor on the CPU too; at one rank's ZeRO 3 too, the whole model) or not, the
    same checkpoints and exact resume."""
    from torch._dynamo.utils import counters

    from vitscale.train.loop import WorkerContext, train

    config = tiny_config(tiny_dataset, compile=compiled, zero_stage=stage)
    graphs = counters["stats"]["unique_graphs"]
    whole = Recorder(tmp_path / "whole")
    (tmp_path / "whole").mkdir()
    summary = train(config, WorkerContext(rank=0, world_size=1, run_dir=tmp_path / "run-a", report=whole))
    assert summary["steps"] == 6
    assert [m["step"] for m in steps(tmp_path / "run-a")] == [1, 2, 3, 4, 5, 6]
    assert [m["step"] for m in whole.metrics] == [3, 6]  # the launcher hears of checkpoints, not of each step
    assert check_complete(tmp_path / "whole" / "checkpoint_000000003", 1) == []

    # Resume the same run from its step-3 checkpoint: the last three steps must be bit-identical.
    resumed = Recorder(tmp_path / "resumed")
    (tmp_path / "resumed").mkdir()
    train(config, WorkerContext(rank=0, world_size=1, run_dir=tmp_path / "run-b", report=resumed,
                                   resume_from=tmp_path / "whole" / "checkpoint_000000003"))
    assert [m["step"] for m in steps(tmp_path / "run-b")] == [4, 5, 6]
    a = final_weights(tmp_path / "whole" / "checkpoint_000000006")
    b = final_weights(tmp_path / "resumed" / "checkpoint_000000006")
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    for m_whole, m_resumed in zip(steps(tmp_path / "run-a")[3:], steps(tmp_path / "run-b"), strict=True):
        assert m_whole["loss"] == pytest.approx(m_resumed["loss"], abs=0.0)

    # And the resumed run consumed exactly the samples the uninterrupted one did after step 3.
    def keys(run: str) -> list[list[str]]:
        import json

        lines = (tmp_path / run / "samples" / "rank0.jsonl").read_text().splitlines()
        return [json.loads(line)["keys"] for line in lines]

    assert keys("run-a")[3:] == keys("run-b")
    # The model ran through torch.compile's graphs exactly when asked to.
    assert (counters["stats"]["unique_graphs"] > graphs) == compiled


def test_a_preemption_notice_checkpoints_at_once_and_loses_no_step(tmp_path: Path, tiny_dataset: str,
                                                                     process_group: None) -> None:
    """A notice after step 2 (Ray Train's preemption info; checkpoints are every 3 steps): a complete
    checkpoint of step 2 at once, one per notice, and a run resumed from it ends as the uninterrupted one."""
    from vitscale.train.loop import WorkerContext, train

    config = tiny_config(tiny_dataset)
    calls: list[int] = []

    def notice() -> str | None:
        calls.append(1)
        return "node abc (ranks [0]) preempted, 30 s before its deadline" if len(calls) >= 2 else None

    (tmp_path / "noticed").mkdir()
    seen = Recorder(tmp_path / "noticed")
    train(config, WorkerContext(rank=0, world_size=1, run_dir=tmp_path / "run-a", report=seen, preemption=notice,
                                preemption_every_s=0.0))  # asked every step
    assert sorted(p.name for p in (tmp_path / "noticed").iterdir()) == [
        "checkpoint_000000002", "checkpoint_000000003", "checkpoint_000000006"]
    assert len(calls) == 2  # answered once: no second checkpoint for the same notice
    assert check_complete(tmp_path / "noticed" / "checkpoint_000000002", 1) == []

    (tmp_path / "resumed").mkdir()
    train(config, WorkerContext(rank=0, world_size=1, run_dir=tmp_path / "run-b", report=Recorder(tmp_path / "resumed"),
                                resume_from=tmp_path / "noticed" / "checkpoint_000000002"))
    a = final_weights(tmp_path / "noticed" / "checkpoint_000000006")
    b = final_weights(tmp_path / "resumed" / "checkpoint_000000006")
    assert all(torch.equal(a[name], b[name]) for name in a)


def test_sigterm_checkpoints_at_the_next_step_then_the_rank_leaves(tmp_path: Path, tiny_dataset: str,
                                                                     process_group: None) -> None:
    """A real SIGTERM to this process after step 4 (the fault injection sends it), held back as a notice:
    the loop checkpoints step 5 (not a periodic one), reports once more, and raises Terminated; a run
    resumed from that checkpoint ends with the uninterrupted run's weights."""
    from vitscale.train.loop import WorkerContext, train
    from vitscale.train.termination import Terminated, TerminationNotice

    told = tiny_config(tiny_dataset, checkpoint_every=100,
                       fault={"kill_rank": 0, "kill_at_step": 4, "kill_with": "SIGTERM"})
    (tmp_path / "told").mkdir()
    seen = Recorder(tmp_path / "told")
    with TerminationNotice(60) as notice, pytest.raises(Terminated) as stopped:
        train(told, WorkerContext(rank=0, world_size=1, run_dir=tmp_path / "run-a", report=seen,
                                  terminated=notice.notice))
    assert stopped.value.step == 5 and "received SIGTERM" in str(stopped.value)
    assert [p.name for p in (tmp_path / "told").iterdir()] == ["checkpoint_000000005"]
    assert check_complete(tmp_path / "told" / "checkpoint_000000005", 1) == []
    # The checkpoint's report, and one more that waits until the checkpoint's was taken; no step after 5.
    assert [m["step"] for m in seen.metrics] == [5, 5]
    assert [m["step"] for m in steps(tmp_path / "run-a")] == [1, 2, 3, 4, 5]

    (tmp_path / "resumed").mkdir()
    train(told, WorkerContext(rank=0, world_size=1, run_dir=tmp_path / "run-b", report=Recorder(tmp_path / "resumed"),
                              resume_from=tmp_path / "told" / "checkpoint_000000005"))
    (tmp_path / "whole").mkdir()
    train(tiny_config(tiny_dataset), WorkerContext(rank=0, world_size=1, run_dir=tmp_path / "run-c",
                                                   report=Recorder(tmp_path / "whole")))
    a = final_weights(tmp_path / "whole" / "checkpoint_000000006")
    b = final_weights(tmp_path / "resumed" / "checkpoint_000000006")
    assert all(torch.equal(a[name], b[name]) for name in a)


def test_the_drivers_stop_request_checkpoints_the_next_step_and_the_run_returns(
        tmp_path: Path, tiny_dataset: str, process_group: None) -> None:
    """The driver asks the run to stop (Ctrl-C to `vitscale run`) while step 3 runs: rank 0 reads it in its
    votes, the loop checkpoints step 3 (not a periodic one), reports once more and returns; a run resumed from
    that checkpoint ends with the uninterrupted run's weights."""
    from vitscale.train.loop import WorkerContext, train

    job = tiny_config(tiny_dataset, checkpoint_every=100)
    reads = []

    def stop_requested() -> str | None:
        reads.append(len(reads) + 1)  # read once per step, at its votes
        return "the run was asked to stop (SIGINT to the driver)" if len(reads) >= 3 else None

    (tmp_path / "asked").mkdir()
    seen = Recorder(tmp_path / "asked")
    summary = train(job, WorkerContext(rank=0, world_size=1, run_dir=tmp_path / "run-a", report=seen,
                                       stop_requested=stop_requested))
    assert summary["steps"] == 3 and reads == [1, 2, 3]  # read until it answered, then never again
    assert [p.name for p in (tmp_path / "asked").iterdir()] == ["checkpoint_000000003"]
    assert [m["step"] for m in seen.metrics] == [3, 3] and [m["step"] for m in steps(tmp_path / "run-a")] == [1, 2, 3]
    (tmp_path / "resumed").mkdir()
    train(job, WorkerContext(rank=0, world_size=1, run_dir=tmp_path / "run-b", report=Recorder(tmp_path / "resumed"),
                             resume_from=tmp_path / "asked" / "checkpoint_000000003"))
    (tmp_path / "whole").mkdir()
    train(job, WorkerContext(rank=0, world_size=1, run_dir=tmp_path / "run-c", report=Recorder(tmp_path / "whole")))
    a = final_weights(tmp_path / "whole" / "checkpoint_000000006")
    b = final_weights(tmp_path / "resumed" / "checkpoint_000000006")
    assert all(torch.equal(a[name], b[name]) for name in a)


def test_loss_goes_down(tmp_path: Path, tiny_dataset: str, process_group: None) -> None:
    from vitscale.train.loop import WorkerContext, train

    config = tiny_config(tiny_dataset, max_steps=30, base_lr=3e-3, checkpoint_every=30, warmup_steps=3)
    seen = Recorder(tmp_path)
    train(config, WorkerContext(rank=0, world_size=1, run_dir=tmp_path / "run", report=seen))
    losses = [m["loss"] for m in steps(tmp_path / "run")]
    assert len(losses) == 30 and sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5, losses


def test_a_run_that_ends_before_its_warmup_says_so_once_at_its_start(tmp_path: Path, tiny_dataset: str,
                                                                      process_group: None,
                                                                      capsys: pytest.CaptureFixture) -> None:
    """A warm-up as long as the run (the paper's 10k steps kept in a short one): the learning rate never reaches
    `train.base_lr`. Rank 0 says so in one line as the run starts, not again as it resumes or restarts; a warm-up
    that ends within the run is not mentioned."""
    from vitscale.train.loop import WorkerContext, train

    job = tiny_config(tiny_dataset, warmup_steps=6, checkpoint_every=3)  # 6 steps
    (tmp_path / "a").mkdir()
    train(job, WorkerContext(rank=0, world_size=1, run_dir=tmp_path / "run-a", report=Recorder(tmp_path / "a")))
    said = [line for line in capsys.readouterr().out.splitlines() if "warmup_steps" in line]
    assert said == ["[vitscale] train.warmup_steps (6) is not below the run's 6 steps: the whole run is warm-up, its "
                    "learning rate rises to 83.3% of the base LR and never decays (set train.warmup_steps below the "
                    "run's steps for the paper's schedule)"], said
    (tmp_path / "b").mkdir()
    train(job, WorkerContext(rank=0, world_size=1, run_dir=tmp_path / "run-b", report=Recorder(tmp_path / "b"),
                             resume_from=tmp_path / "a" / "checkpoint_000000003"))
    assert "warmup_steps" not in capsys.readouterr().out
    # Restarted before any checkpoint (no resume point): the same run folder holds the first attempt's step lines.
    (tmp_path / "a2").mkdir()
    train(job, WorkerContext(rank=0, world_size=1, run_dir=tmp_path / "run-a", report=Recorder(tmp_path / "a2")))
    assert "warmup_steps" not in capsys.readouterr().out
    (tmp_path / "c").mkdir()
    train(tiny_config(tiny_dataset, warmup_steps=5), WorkerContext(rank=0, world_size=1, run_dir=tmp_path / "run-c",
                                                                   report=Recorder(tmp_path / "c")))
    assert "warmup_steps" not in capsys.readouterr().out


@pytest.mark.parametrize("stage, offload", [(0, False), (1, False), (3, False), (2, True)])
def test_every_zero_stage_trains_and_checkpoints(tmp_path: Path, tiny_dataset: str, process_group: None,
                                                 stage: int, offload: bool) -> None:
    """ZeRO 0-3 (and CPU offload) for real: train, checkpoint, consolidate to one fp32 state dict."""
    from vitscale.train.loop import WorkerContext, train

    config = tiny_config(tiny_dataset, zero_stage=stage, offload=offload, max_steps=3, checkpoint_every=3)
    seen = Recorder(tmp_path)
    summary = train(config, WorkerContext(rank=0, world_size=1, run_dir=tmp_path / "run", report=seen))
    assert summary["steps"] == 3 and all(m["loss"] > 0 for m in steps(tmp_path / "run"))
    weights = final_weights(tmp_path / "checkpoint_000000003")
    assert weights["head.weight"].dtype == torch.float32
    assert weights["head.weight"].abs().sum() > 0  # the zero-initialised head has been trained


def test_a_worker_refuses_to_resume_on_a_dataset_written_again(tmp_path: Path, process_group: None) -> None:
    """The workers' own check (object storage has no driver-side one): every checkpoint records the dataset it was
    trained on, and a resume on the same `data.url` rewritten with other samples stops before loading anything."""
    import yaml

    from vitscale.config.checks import ConfigError
    from vitscale.train.loop import WorkerContext, train

    def write(seed: int) -> str:
        import shutil

        shutil.rmtree(tmp_path / "data", ignore_errors=True)
        write_dataset("synthetic", str(tmp_path / "data"), shard_size=37, max_side=32, seed=seed,
                      source_options={"count": 48, "classes": 4, "image_size": 32}, progress=False)
        return str(tmp_path / "data")

    config = tiny_config(write(0), max_steps=3, record_samples=False)
    kept = Recorder(tmp_path / "kept")
    train(config, WorkerContext(rank=0, world_size=1, run_dir=tmp_path / "run-a", report=kept))
    checkpoint = tmp_path / "kept" / "checkpoint_000000003"
    assert yaml.safe_load((checkpoint / "config.yaml").read_text())["trained"]["dataset"]["samples"] == 48
    write(1)  # the same 48 samples' count, other images
    with pytest.raises(ConfigError, match="not the one it was trained on") as refused:
        train(config, WorkerContext(rank=0, world_size=1, run_dir=tmp_path / "run-b", report=Recorder(tmp_path / "b"),
                                    resume_from=checkpoint))
    assert refused.value.key == "data.url"


_SAVING_RANK = """
import json, os, pickle, signal, sys, tempfile
from pathlib import Path
import torch
from vitscale.train.engine import init_distributed
from vitscale.train.loop import WorkerContext, train

os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": sys.argv[2], "RANK": "0", "WORLD_SIZE": "1",
                   "LOCAL_RANK": "0"})
torch.distributed.init_process_group("gloo", rank=0, world_size=1)
init_distributed(on_gpu=False)
job = pickle.loads(open(sys.argv[1], "rb").read())
killed = sys.argv[4] == "kill"

def report(metrics, checkpoint_dir):  # Ray's copy into the run's storage: cut short by a SIGKILL, or recorded
    if checkpoint_dir is not None:
        if killed:
            os.kill(os.getpid(), signal.SIGKILL)
        print(json.dumps({"saving": str(checkpoint_dir), "there": sorted(os.listdir(tempfile.gettempdir()))}))

train(job, WorkerContext(rank=0, world_size=1, run_dir=Path(sys.argv[3]), report=report))
"""


def test_a_rank_killed_mid_checkpoint_leaves_no_part_the_next_one_keeps(tmp_path: Path, tiny_dataset: str) -> None:
    """A rank SIGKILLed while its checkpoint part waits in the temporary folder for Ray's copy (an OOM kill, a
    lost node's process) runs no cleanup: the part, a checkpoint's size, stayed there for good, one more at
    every such kill until the disk filled. The next rank to save on the machine removes it; a live rank's
    part (locked) is never touched, and a finished save leaves nothing. (Both ranks are processes of their own,
    as Ray's workers are.)"""
    import json
    import pickle
    import subprocess
    import sys

    from vitscale.train.checkpointer import SCRATCH_PREFIX

    spools = tmp_path / "tmp"
    spools.mkdir()
    (tmp_path / "job.pkl").write_bytes(pickle.dumps(tiny_config(tiny_dataset)))

    def rank(mode: str, run: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", _SAVING_RANK, str(tmp_path / "job.pkl"), str(_free_port()),
                               str(tmp_path / run), mode], env={**os.environ, "TMPDIR": str(spools)},
                              capture_output=True, text=True, timeout=300)

    killed = rank("kill", "run-a")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    left = list(spools.glob(f"{SCRATCH_PREFIX}*"))
    assert len(left) == 1 and (left[0] / "deepspeed").is_dir()  # the killed rank's part, whole

    saved = rank("save", "run-b")
    assert saved.returncode == 0, saved.stderr[-3000:]
    saves = [json.loads(line) for line in saved.stdout.splitlines() if line.startswith('{"saving"')]
    assert len(saves) == 2  # steps 3 and 6
    for save in saves:  # during each save: its own part only, the killed rank's gone
        assert [n for n in save["there"] if n.startswith(SCRATCH_PREFIX)] == [Path(save["saving"]).name], save
    assert list(spools.glob(f"{SCRATCH_PREFIX}*")) == []  # and nothing once saved
