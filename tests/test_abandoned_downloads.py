"""Ray's checkpoint downloads that killed readers left in the temporary folder are removed, and nothing else.

A process SIGKILLed inside Ray's real `Checkpoint.as_directory()` of a checkpoint that is not on the local
filesystem leaves `checkpoint_tmp_<uuid>` (the whole checkpoint) and its reader mark for good; the next
worker that resumes from object storage on that node removes it (`launch/abandoned_downloads.py`). A live
reader's folder, one being downloaded (Ray's lock held), one with no mark and anything else stay.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray")

from vitscale.launch.abandoned_downloads import MARK, PREFIX, remove_abandoned_downloads

KILLED_READER = """
import os, signal, sys
import pyarrow.fs
from ray.train import Checkpoint
# A filesystem that is not pyarrow's LocalFileSystem: as_directory() downloads, as from object storage.
fs = pyarrow.fs.SubTreeFileSystem(sys.argv[1], pyarrow.fs.LocalFileSystem())
with Checkpoint("checkpoint_000000004", filesystem=fs).as_directory() as directory:
    print(directory, os.getpid(), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # the OOM killer, mid-resume
"""


def _dead_pid() -> int:
    done = subprocess.Popen(["true"])
    done.wait()
    return done.pid


def _download(tmp: Path, name: str, *pids: int) -> Path:
    folder = tmp / f"{PREFIX}{name}"
    folder.mkdir()
    (folder / "rank0.pt").write_bytes(b"x" * 1000)
    for pid in pids:
        (tmp / f"{folder.name}{MARK}{pid}").touch()
    return folder


def test_a_reader_killed_inside_rays_download_leaves_it_and_the_next_resume_removes_it(tmp_path: Path) -> None:
    storage, tmp = tmp_path / "bucket", tmp_path / "tmp"
    (storage / "checkpoint_000000004").mkdir(parents=True)
    (storage / "checkpoint_000000004" / "rank0.pt").write_bytes(os.urandom(4096))
    tmp.mkdir()
    killed = subprocess.run([sys.executable, "-c", KILLED_READER, str(storage)], capture_output=True, text=True,
                            timeout=120, env={**os.environ, "TMPDIR": str(tmp)})
    assert killed.returncode == -9, killed.stderr[-3000:]
    printed, pid = killed.stdout.split()
    left = Path(printed)
    assert left.parent == tmp and left.name.startswith(PREFIX) and (left / "rank0.pt").is_file()  # Ray kept it
    assert [p.name for p in tmp.glob(f"{left.name}{MARK}*")] == [f"{left.name}{MARK}{pid}"]  # and its reader's mark

    assert remove_abandoned_downloads(str(tmp)) == [left.name]
    assert not [p.name for p in tmp.iterdir() if p.name.startswith(PREFIX)]  # Ray's own lock folder stays


def test_only_folders_whose_every_reader_is_gone_are_removed(tmp_path: Path) -> None:
    from ray.air._internal.filelock import TempFileLock

    dead, alive = _dead_pid(), os.getpid()
    gone = _download(tmp_path, "gone", dead, _dead_pid())
    live = _download(tmp_path, "live", alive)
    mixed = _download(tmp_path, "mixed", dead, alive)
    kept_by_caller = _download(tmp_path, "unmarked")  # to_directory()'s: its caller keeps it
    downloading = _download(tmp_path, "downloading", dead)
    other = tmp_path / "vitscale-ckpt-x"
    other.mkdir()
    with TempFileLock(str(downloading)):  # a download (or Ray's own removal) of it runs now
        assert remove_abandoned_downloads(str(tmp_path)) == [gone.name]
    assert not gone.exists() and not list(tmp_path.glob(f"{gone.name}{MARK}*"))
    assert all(p.is_dir() for p in (live, mixed, kept_by_caller, downloading, other))
    assert remove_abandoned_downloads(str(tmp_path)) == [downloading.name]  # once nothing holds it
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == sorted(
        [live.name, mixed.name, kept_by_caller.name, other.name])
