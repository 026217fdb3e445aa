"""A full disk: checkpoints, `shards write` and `shards index --out` into a real small filesystem (a tmpfs
mounted by the test: it runs as root) end in one line naming the path and the space needed; the previous
complete checkpoint stays intact and the run resumes once space is freed; nothing half-written is left
taken for complete."""

from __future__ import annotations

import io
import os
import re
import subprocess
import tarfile
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pyarrow.fs
import pytest
import torch
from PIL import Image

from checkpoint_helpers import complete_checkpoint
from vitscale.cli import main
from vitscale.data.storage.space import free_bytes, is_no_space, size_text
from vitscale.train import checkpoint as ckpt


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Callable[[int], Path]]:
    """A factory of tmpfs filesystems of a given size in bytes, unmounted at teardown."""
    mounted: list[Path] = []

    def make(size: int) -> Path:
        where = tmp_path / f"disk{len(mounted)}"
        where.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], check=False,
                              capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a small tmpfs here (needs root and mount permission): {done.stderr.strip()}")
        mounted.append(where)
        return where

    yield make
    for where in reversed(mounted):
        subprocess.run(["umount", "-l", str(where)], check=False)


@pytest.fixture(autouse=True)
def _no_last_checkpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ckpt, "_LAST_PART_BYTES", {})


def _local_checkpoint(directory: Path, step: int, payload: int) -> Path:
    directory.mkdir(parents=True)
    (directory / "payload.bin").write_bytes(os.urandom(payload))
    ckpt.write_rank_part(directory, rank=0, stream_state={"epoch": 0, "position": step, "seed": 0},
                         train_state=ckpt.TrainState(step=step, world_size=1), config_yaml="")
    return directory


def _upload(local: Path, dest: Path) -> None:
    """Ray Train's own upload of a reported checkpoint into the run's storage (pyarrow's copy)."""
    from ray.train.v2._internal.execution.storage import _upload_to_fs_path

    _upload_to_fs_path(str(local), pyarrow.fs.LocalFileSystem(), str(dest))


def test_a_checkpoint_into_a_full_disk_is_one_line_and_the_run_resumes_once_space_is_freed(
        tmp_path: Path, small_disk: Callable[[int], Path]) -> None:
    disk = small_disk(1_500_000)
    run = disk / "run"
    complete_checkpoint(run / "checkpoint_000000001", 1, world_size=1)
    filler = disk / "someone-elses-file"
    filler.write_bytes(b"\0" * 1_000_000)
    local = _local_checkpoint(tmp_path / "local", 2, payload=800_000)

    # The size of what is being copied is known: nothing is written when it cannot fit.
    with pytest.raises(ckpt.DiskFull) as err, ckpt.space_for(run, step=2, copying=local):
        _upload(local, run / "checkpoint_000000002")
    message = str(err.value)
    assert "\n" not in message and f"in {run}:" in message and re.search(r"needs about 8\d\d\.\d kB", message), message
    assert "free" in message and "resumes from the last complete checkpoint" in message
    assert not (run / "checkpoint_000000002").exists()

    # Without a size to check first, the disk's own ENOSPC mid-copy becomes the same line.
    with pytest.raises(ckpt.DiskFull, match=f"no space for the checkpoint of step 2 in {run}"), \
            ckpt.space_for(run, step=2):
        _upload(local, run / "checkpoint_000000002")
    candidates = sorted(run.glob("checkpoint_*"))
    assert all(ckpt.check_complete(c, 1) for c in candidates[1:])  # whatever was half-copied: not complete
    assert ckpt.check_complete(run / "checkpoint_000000001", 1) == []  # the previous one is intact
    assert ckpt.latest_complete(candidates, 1) == run / "checkpoint_000000001"

    filler.unlink()  # space freed: the same save goes through and becomes the one to resume from
    with ckpt.space_for(run, step=2, copying=local):
        _upload(local, run / "checkpoint_000000002")
    assert ckpt.latest_complete(sorted(run.glob("checkpoint_*")), 1) == run / "checkpoint_000000002"


def test_saving_a_rank_part_into_a_full_disk_is_one_line(tmp_path: Path, small_disk: Callable[[int], Path]) -> None:
    disk = small_disk(200_000)
    (disk / "filler").write_bytes(b"\0" * 150_000)
    directory = disk / "ckpt"
    directory.mkdir()
    with pytest.raises(ckpt.DiskFull, match=f"no space for the checkpoint of step 7 in {disk}"), \
            ckpt.space_for(disk, step=7):
        torch.save({"w": torch.zeros(100_000)}, directory / "big.pt")  # torch says only "file write failed"
    # The next save knows the last one's size and checks before writing.
    ok = _local_checkpoint(tmp_path / "ok", 1, payload=100_000)
    assert ckpt.record_part(ok) == ckpt.tree_bytes(ok) > 100_000
    with pytest.raises(ckpt.DiskFull, match=r"needs about 2\d\d\.\d kB \(2 ranks' parts\)"), \
            ckpt.space_for(disk, step=8, parts=2):
        raise AssertionError("not reached: the check comes first")


def test_a_full_disk_is_a_failure_a_restart_repeats() -> None:
    from vitscale.launch.failures import deterministic_cause

    error = ckpt.DiskFull("no space")
    wrapped = RuntimeError("rank 0 failed")
    wrapped.__cause__ = error
    assert deterministic_cause(wrapped) is error
    assert deterministic_cause(OSError(28, "No space left on device")) is not None  # metrics, logs: any write
    assert deterministic_cause(OSError(5, "Input/output error")) is None
    line = ckpt.one_line(OSError(28, "No space left on device"), "/data/runs/r1")
    assert line.startswith("DiskFull: no space left on the device of /data/runs/r1 (") and "run again" in line
    assert ckpt.one_line(ValueError("bad"), "/x") == "ValueError: bad"
    assert is_no_space(OSError("[Errno 28] Error writing bytes to file. Detail: [errno 28] No space left on device"))
    assert not is_no_space(OSError(13, "Permission denied"))
    assert free_bytes("s3://bucket/run") is None


def test_sizes_in_messages_are_in_the_unit_that_shows_them() -> None:
    assert [size_text(n) for n in (None, 0, 1, 999, 1000, 12_345, 999_949, 1_000_000, 1_234_500_000)] == [
        "an unknown amount", "0 bytes", "1 byte", "999 bytes", "1.0 kB", "12.3 kB", "999.9 kB", "1.0 MB",
        "1,234.5 MB"]


def _one_line_error(capsys: pytest.CaptureFixture, argv: list[str]) -> str:
    assert main(argv) == 2
    out, err = capsys.readouterr()
    lines = [line for line in err.strip().splitlines() if "error" in line]  # progress lines aside
    assert len(lines) == 1 and lines[0].startswith("vitscale: error: ") and "Traceback" not in out + err, err
    return lines[0]


def test_shards_write_into_a_full_disk_is_one_line_and_leaves_nothing(small_disk: Callable[[int], Path],
                                                                       capsys: pytest.CaptureFixture) -> None:
    disk = small_disk(256_000)
    argv = ["shards", "write", "--source", "synthetic", "--count", "300", "--classes", "3", "--image-size", "64",
            "--shard-size", "50", "--out", str(disk / "ds")]
    line = _one_line_error(capsys, argv)
    assert f"no space left on the device of {disk / 'ds'}" in line and "it needs more than" in line, line
    # No shard, no index, no marker, and not the folder the write created: nothing taken for a dataset.
    assert sorted(os.listdir(disk)) == []
    # A smaller dataset fits in the same place afterwards.
    assert main([*argv[:5], "30", *argv[6:]]) == 0
    assert (disk / "ds" / "dataset.json").exists()


def _wds_tar(path: Path, n: int) -> None:
    buf = io.BytesIO()
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(buf, "JPEG")
    with tarfile.open(path, "w") as tar:
        for i in range(n):
            for ext, data in (("jpg", buf.getvalue()), ("cls", str(i % 3).encode())):
                info = tarfile.TarInfo(f"{i:06d}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


def test_shards_index_out_into_a_full_disk_is_one_line(tmp_path: Path, small_disk: Callable[[int], Path],
                                                      capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "wds").mkdir()
    _wds_tar(tmp_path / "wds" / "train-000000.tar", 400)
    disk = small_disk(64_000)
    (disk / "filler").write_bytes(b"\0" * (free_bytes(disk) or 0))  # nothing left
    line = _one_line_error(capsys, ["shards", "index", str(tmp_path / "wds"), "--out", str(disk / "idx")])
    assert f"no space left on the device of {disk / 'idx'}" in line, line
    # A few kilobytes of index say so, not "0.0 MB" (the one size format: space.size_text).
    assert re.search(r"they need about \d+\.\d kB, \d+(\.\d kB)?( bytes)? free", line), line
    assert not (disk / "idx" / "dataset.json").exists()
    (disk / "filler").unlink()
    assert main(["shards", "index", str(tmp_path / "wds"), "--out", str(disk / "idx")]) == 0


@pytest.mark.slow
def test_a_run_whose_disk_fills_stops_in_one_line_and_resumes_once_space_is_freed(
        tmp_path: Path, small_disk: Callable[[int], Path], small_synthetic: str) -> None:
    """A real `vitscale run` on a tmpfs that fills once checkpoint 20 is written: the save at step 40 ends
    the run at once in one line (not retried), checkpoint 20 intact; with space freed, the same command
    resumes from it and ends."""
    import time

    import yaml

    from ray_runs import kill_tree, start

    disk = small_disk(64 * 2**20)
    raw = {"name": "full", "stages": ["pretrain"], "data": {"url": small_synthetic},
           "model": {"name": "ViT-Ti/8", "img_size": 16, "depth": 1, "width": 32, "heads": 2, "mlp_dim": 32},
           "train": {"global_batch": 8, "micro_batch": 8, "max_steps": 40, "warmup_steps": 0, "checkpoint_every": 20,
                     "log_every": 1},
           "cluster": {"num_workers": 1, "use_gpu": False, "cpus_per_worker": 1, "storage_path": str(disk),
                       "run_name": "full"}}
    pipeline = tmp_path / "pipeline.yaml"
    pipeline.write_text(yaml.safe_dump(raw))
    run = disk / "full"
    first = run / "checkpoint_000000020"

    proc = start(pipeline, tmp_path / "full.log")
    try:
        deadline = time.monotonic() + 600
        while proc.poll() is None and time.monotonic() < deadline and not (first.exists() and not ckpt.check_complete(first, 1)):
            time.sleep(0.05)
        assert proc.poll() is None, (tmp_path / "full.log").read_text()[-3000:]
        # The disk fills: half a checkpoint's room is left (logs and metrics still fit, checkpoint 40 does not).
        (disk / "filler").write_bytes(b"\0" * ((free_bytes(disk) or 0) - ckpt.tree_bytes(first) // 2))
        proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            kill_tree(proc)
    out = (tmp_path / "full.log").read_text()
    errors = [line for line in out.splitlines() if line.startswith("vitscale: error:")]
    assert proc.returncode == 1 and len(errors) == 1, out[-3000:]
    assert f"DiskFull: no space for the checkpoint of step 40 in {run}: it needs about" in errors[0], errors[0]
    assert "not retried" in errors[0] and "Traceback" not in "\n".join(out.splitlines()[-3:]), out[-3000:]
    assert out.count("DiskFull") <= 3, out[-3000:]  # one attempt: no restart ran into it again
    assert ckpt.latest_complete(sorted(run.glob("checkpoint_*")), 1) == first  # intact, still the one to resume

    (disk / "filler").unlink()
    proc = start(pipeline, tmp_path / "resumed.log")
    proc.wait(timeout=900)
    out = (tmp_path / "resumed.log").read_text()
    assert proc.returncode == 0, out[-3000:]
    assert "step 21/40" in out and "step 1/40" not in out, out[-3000:]  # resumed after checkpoint 20
    assert ckpt.latest_complete(sorted(run.glob("checkpoint_*")), 1) == run / "checkpoint_000000040"
