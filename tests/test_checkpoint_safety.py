"""Nothing vitscale loads from a checkpoint can run code; damaged manifests are incomplete checkpoints, never a crash."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from helpers.checkpoints import complete_checkpoint
from vitscale.train import checkpoint as ckpt

pytest.importorskip("deepspeed")

MODEL = {"name": "ViT-Ti/8", "img_size": 16, "depth": 1, "width": 32, "heads": 2, "mlp_dim": 32}


class Payload:
    """Unpickled with full pickle, this creates a file: what a planted checkpoint would do."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _plant(path: Path, marker: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"module": Payload(marker), "buffer_names": []}, path)


def _checkpoint_with(tmp_path: Path, file: str) -> tuple[Path, Path]:
    """A complete-looking checkpoint (manifest and all) whose DeepSpeed file `file` is a payload."""
    directory, marker = tmp_path / "run" / "checkpoint_000000001", tmp_path / "pwned"
    _plant(directory / ckpt.DEEPSPEED_DIR / ckpt.DEEPSPEED_TAG / file, marker)
    ckpt.write_rank_part(directory, rank=0, stream_state={"epoch": 0, "position": 0, "seed": 0},
                         train_state=ckpt.TrainState(step=1), config_yaml=yaml.safe_dump({"model": MODEL}))
    return directory, marker


def test_the_payload_would_run_under_full_pickle(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    _plant(tmp_path / "f.pt", marker)
    torch.load(tmp_path / "f.pt", weights_only=False)
    assert marker.exists()  # so the refusals below are refusals of a working payload


@pytest.mark.parametrize("file", ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"])
def test_export_refuses_a_planted_payload(tmp_path: Path, capsys: pytest.CaptureFixture, file: str) -> None:
    from vitscale.cli import main

    directory, marker = _checkpoint_with(tmp_path, file)
    if "optim" in file:  # the ZeRO path (zero_to_fp32) reads model states first: plant there too
        _plant(directory / ckpt.DEEPSPEED_DIR / ckpt.DEEPSPEED_TAG / "mp_rank_00_model_states.pt", marker)
        ckpt.write_rank_part(directory, rank=0, stream_state={"epoch": 0, "position": 0, "seed": 0},
                             train_state=ckpt.TrainState(step=1), config_yaml=yaml.safe_dump({"model": MODEL}))
    code = main(["export", str(directory.parent), "--out", str(tmp_path / "out.pt")])
    err = capsys.readouterr().err
    assert code == 2 and "refusing to load" in err and "Traceback" not in err
    assert not marker.exists()


def test_probe_refuses_a_planted_payload(tmp_path: Path) -> None:
    from vitscale.train.engine import UnsafeCheckpoint
    from vitscale.train.weights import load_model

    directory, marker = _checkpoint_with(tmp_path, "mp_rank_00_model_states.pt")
    with pytest.raises(UnsafeCheckpoint, match="refusing to load"):
        load_model(directory.parent)
    assert not marker.exists()


def test_resume_refuses_a_planted_payload(tmp_path: Path, process_group: None) -> None:
    from vitscale.train.batch import derive_batch
    from vitscale.train.config import TrainConfig
    from vitscale.train.engine import UnsafeCheckpoint, build_engine, deepspeed_config, load_checkpoint

    model = torch.nn.Linear(4, 2)
    train = TrainConfig(global_batch=2, micro_batch=2, zero_stage=0, precision="fp32")
    engine = build_engine(model, train, deepspeed_config(train, derive_batch(2, 2, 1), on_gpu=False), on_gpu=False)
    engine.save_checkpoint(str(tmp_path / "ds"), tag="state")
    load_checkpoint(engine, tmp_path / "ds", "state")  # DeepSpeed's own files load with weights_only
    marker = tmp_path / "pwned"
    _plant(tmp_path / "ds" / "state" / "mp_rank_00_model_states.pt", marker)
    with pytest.raises(UnsafeCheckpoint, match="mp_rank_00_model_states.pt"):
        load_checkpoint(engine, tmp_path / "ds", "state")
    assert not marker.exists()
    # vitscale's own per-rank file: refused as well.
    torch.save({"stream": Payload(marker)}, tmp_path / "rank0.pt")
    with pytest.raises(ValueError, match="refusing to load"):
        ckpt.read_rank_part(tmp_path, 0)
    assert not marker.exists()


# -- damaged manifests ----------------------------------------------------------------------------------


@pytest.mark.parametrize("damage", [b"", b'{"rank": 0, "step": 2, "wor', b"\xff\xfe not json", b"[1, 2]",
                                    b'{"rank": 0, "step": "2", "world_size": 2, "files": {}}'])
def test_a_damaged_manifest_makes_the_checkpoint_incomplete(tmp_path: Path, damage: bytes) -> None:
    older = complete_checkpoint(tmp_path / "checkpoint_000000001", 1)
    newer = complete_checkpoint(tmp_path / "checkpoint_000000002", 2)
    (newer / "MANIFEST-rank1.json").write_bytes(damage)
    problems = ckpt.check_complete(newer, 2)
    assert problems and any("MANIFEST-rank1.json" in p for p in problems)
    assert ckpt.latest_complete([older, newer], 2) == older
    assert ckpt.latest_complete([older, newer]) == older  # export's way: world size from the manifests
    (newer / "MANIFEST-rank0.json").write_bytes(damage)
    assert ckpt.manifest_info(newer) is None and ckpt.latest_complete([older, newer]) == older


def test_export_falls_back_past_a_truncated_manifest(tmp_path: Path) -> None:
    from vitscale.train.export import find_checkpoint

    older = complete_checkpoint(tmp_path / "checkpoint_000000001", 1)
    newer = complete_checkpoint(tmp_path / "checkpoint_000000002", 2)
    text = (newer / "MANIFEST-rank0.json").read_text()
    (newer / "MANIFEST-rank0.json").write_text(text[: len(text) // 2])
    assert find_checkpoint(tmp_path) == older
    with pytest.raises(ValueError, match="incomplete"):
        find_checkpoint(newer)


def test_manifests_must_agree_on_the_step(tmp_path: Path) -> None:
    directory = complete_checkpoint(tmp_path / "checkpoint_000000002", 2)
    manifest = json.loads((directory / "MANIFEST-rank1.json").read_text())
    manifest["step"] = 3
    (directory / "MANIFEST-rank1.json").write_text(json.dumps(manifest))
    assert any("disagree on the step" in p for p in ckpt.check_complete(directory, 2))


# -- fault markers live in the run's storage ------------------------------------------------------------


def test_fault_marker_lives_in_the_runs_storage(tmp_path: Path) -> None:
    """A rank restarted on another node (another local run directory) sees the fault has fired."""
    from vitscale.train.faults import marker_name

    storage = tmp_path / "storage"
    code = ("import sys; from vitscale.train.config import FaultConfig; from vitscale.train.faults import maybe_die; "
            f"maybe_die(FaultConfig(kill_rank=1, kill_at_step=3), 1, 3, {str(storage)!r}); sys.exit(0)")
    first = subprocess.run([sys.executable, "-c", code], cwd=tmp_path)
    assert first.returncode == 17 and (storage / marker_name(1, 3)).exists()
    again = subprocess.run([sys.executable, "-c", code], cwd=tmp_path / "storage")  # "another node"
    assert again.returncode == 0


# -- a live run's rotation while its checkpoint is read -------------------------------------------------


def test_export_of_a_live_run_reads_on_past_a_checkpoint_rotated_away(tmp_path: Path, process_group: None,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """`vitscale export RUN` while the run trains (`keep_checkpoints: 1`, a checkpoint a step): the run's next
    checkpoint became complete and Ray deleted the one being consolidated, and the export ended in `[Errno 2]
    No such file or directory: .../checkpoint_000000012/deepspeed/state` (seen 2 times in 8 exports of a live
    run). It now reads the run's newest complete checkpoint again; a checkpoint that stays the newest and
    fails keeps its own error."""
    import shutil

    from helpers.loop_runs import Recorder
    from helpers.loop_runs import weights as final_weights
    from vitscale.data.tools.write import write_dataset
    from vitscale.stages import build_pipeline
    from vitscale.stages.pretrain import pretraining_job
    from vitscale.train import engine, export
    from vitscale.train.loop import WorkerContext, train

    data = tmp_path / "data"
    write_dataset("synthetic", str(data), shard_size=20, max_side=16, progress=False,
                  source_options={"count": 40, "classes": 3, "image_size": 16})
    job = pretraining_job(build_pipeline({
        "model": MODEL, "data": {"url": str(data), "num_workers": 0, "shuffle_buffer": 16},
        "train": {"global_batch": 8, "micro_batch": 8, "max_steps": 2, "warmup_steps": 0, "zero_stage": 2,
                  "precision": "fp32", "checkpoint_every": 1},
        "cluster": {"num_workers": 1, "use_gpu": False}}))
    train(job, WorkerContext(rank=0, world_size=1, run_dir=tmp_path / "logs", report=Recorder(tmp_path / "saved")))
    run = tmp_path / "run"
    run.mkdir()
    shutil.copytree(tmp_path / "saved" / "checkpoint_000000001", run / "checkpoint_000000001")

    real = engine.consolidated_state_dict
    rotated: list[str] = []

    def rotating(directory: Path, tag: str) -> dict:
        if not rotated:  # the run registers step 2 and deletes step 1 while step 1 is being read
            rotated.append(str(directory))
            shutil.copytree(tmp_path / "saved" / "checkpoint_000000002", run / "checkpoint_000000002")
            shutil.rmtree(run / "checkpoint_000000001")
        return real(directory, tag)

    monkeypatch.setattr(engine, "consolidated_state_dict", rotating)
    facts = export.export_run(run, tmp_path / "model.pt")
    assert rotated == [str(run / "checkpoint_000000001" / ckpt.DEEPSPEED_DIR)]
    assert facts["step"] == 2 and facts["checkpoint"] == str(run / "checkpoint_000000002")
    exported = torch.load(tmp_path / "model.pt", weights_only=True)
    exported = exported.get("state_dict", exported)
    expected = final_weights(run / "checkpoint_000000002")
    assert all(torch.equal(exported[name], expected[name]) for name in expected)

    # A checkpoint that stays the newest and cannot be read (a disk's EIO) keeps its error, read once.
    reads: list[str] = []

    def failing(directory: Path, tag: str) -> dict:
        reads.append(str(directory))
        raise OSError(5, "Input/output error", str(directory / tag))

    monkeypatch.setattr(engine, "consolidated_state_dict", failing)
    with pytest.raises(OSError, match="Input/output error"):
        export.export_run(run, tmp_path / "again.pt")
    assert reads == [str(run / "checkpoint_000000002" / ckpt.DEEPSPEED_DIR)]
