"""Resume from object storage: a newer incomplete checkpoint falls back to an older complete one found
in the run's storage (never beside a temporary download), and downloads are released.

Real parts: moto's S3 server on loopback, pyarrow's S3 filesystem (what Ray Train stores
checkpoints through) and `ray.train.Checkpoint`'s own download; only `ray.train.get_checkpoint`,
which needs a live Train worker, is replaced by the checkpoint Ray would hand back.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from urllib.parse import urlparse

import pyarrow.fs
import pytest
import ray.train

from helpers.checkpoints import complete_checkpoint
from vitscale.data.storage import open_storage
from vitscale.data.storage.filesystem import run_filesystem
from vitscale.launch import resume_point
from vitscale.train import checkpoint as ckpt

BUCKET = "vitscale-resume"


def _upload(local: Path, url: str, endpoint: str) -> None:
    storage = open_storage(url, endpoint_url=endpoint)
    for path in sorted(p for p in local.rglob("*") if p.is_file()):
        storage.write_file(path.relative_to(local).as_posix(), path)


@pytest.fixture
def s3_run(tmp_path: Path, moto_s3: str) -> tuple[pyarrow.fs.S3FileSystem, str]:
    """A run in object storage: complete checkpoints at steps 1 and 2, an incomplete one at step 3."""
    client = open_storage(f"s3://{BUCKET}", endpoint_url=moto_s3).client
    client.create_bucket(Bucket=BUCKET)
    for marker in ("runs/r1/", "runs/r1/checkpoint_000000002/"):  # folder markers, as Ray Train and consoles put
        client.put_object(Bucket=BUCKET, Key=marker, Body=b"")
    local = tmp_path / "written"
    complete_checkpoint(local / "checkpoint_000000001", 1)
    complete_checkpoint(local / "checkpoint_000000002", 2)
    broken = complete_checkpoint(local / "checkpoint_000000003", 3)
    (broken / "MANIFEST-rank1.json").write_bytes(b'{"rank": 1, "st')  # a rank died mid-upload
    _upload(local, f"s3://{BUCKET}/runs/r1", moto_s3)
    endpoint = urlparse(moto_s3)
    fs = pyarrow.fs.S3FileSystem(access_key="testing", secret_key="testing", session_token="testing",
                                 region="us-east-1", scheme=endpoint.scheme, endpoint_override=endpoint.netloc)
    return fs, f"{BUCKET}/runs/r1"


def _downloads(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Every local folder `Checkpoint.as_directory` hands out (the real download, observed)."""
    seen: list[Path] = []
    real = ray.train.Checkpoint.as_directory

    @contextlib.contextmanager
    def observed(self):  # type: ignore[no-untyped-def]
        with real(self) as d:
            seen.append(Path(d))
            yield d

    monkeypatch.setattr(ray.train.Checkpoint, "as_directory", observed)
    return seen


def test_an_incomplete_latest_falls_back_to_the_newest_complete_in_storage(s3_run, monkeypatch, capsys) -> None:
    fs, run = s3_run
    latest = ray.train.Checkpoint(f"{run}/checkpoint_000000003", filesystem=fs)
    monkeypatch.setattr(ray.train, "get_checkpoint", lambda: latest)
    seen = _downloads(monkeypatch)
    with contextlib.ExitStack() as downloads:
        found = resume_point.resume_directory(world_size=2, rank=0, downloads=downloads)
        assert found is not None and ckpt.manifest_info(found) == (2, 2)
        assert not ckpt.check_complete(found, 2)
        assert found == seen[-1] and len(seen) == 2  # step 3 tried, step 2 taken; step 1 never fetched
        assert not seen[0].exists()  # the incomplete download is released at once
        assert found.exists()
    assert not found.exists()  # released when the loop says it has loaded it
    assert "latest checkpoint checkpoint_000000003 is incomplete; resuming from checkpoint_000000002" in capsys.readouterr().out


def test_no_complete_checkpoint_starts_from_step_1_naming_what_it_ignores(s3_run, moto_s3, monkeypatch,
                                                                         capsys) -> None:
    """The storage says every checkpoint is incomplete (each first upload failed part-way): the run starts
    over, in one line naming each checkpoint it ignores and why, rather than failing every restart."""
    fs, run = s3_run
    storage = open_storage(f"s3://{run}", endpoint_url=moto_s3)
    for step in (1, 2):
        storage.write_bytes(f"checkpoint_00000000{step}/MANIFEST-rank0.json", json.dumps([step]).encode())
    monkeypatch.setattr(ray.train, "get_checkpoint",
                        lambda: ray.train.Checkpoint(f"{run}/checkpoint_000000003", filesystem=fs))
    with contextlib.ExitStack() as downloads:
        assert resume_point.resume_directory(world_size=2, rank=0, downloads=downloads) is None
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("[vitscale] no complete checkpoint to resume from: starting from step 1, ignoring 3 "
                               "incomplete: checkpoint_000000003 (MANIFEST-rank1.json: unreadable"), lines[0]
    assert "checkpoint_000000002 (MANIFEST-rank0.json" in lines[0] and "checkpoint_000000001 (" in lines[0]
    assert "/tmp" not in lines[0]  # names in the checkpoint, not a temporary download's path


def test_no_checkpoint_is_a_fresh_start(monkeypatch) -> None:
    monkeypatch.setattr(ray.train, "get_checkpoint", lambda: None)
    with contextlib.ExitStack() as downloads:
        assert resume_point.resume_directory(world_size=2, rank=0, downloads=downloads) is None


def test_a_checkpoint_ray_never_registered_is_found_in_storage(s3_run, moto_s3, monkeypatch) -> None:
    """A worker that died right after its upload: Ray knows no checkpoint, the storage holds them."""
    monkeypatch.setattr(ray.train, "get_checkpoint", lambda: None)
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_s3)
    with contextlib.ExitStack() as downloads:
        found = resume_point.resume_directory(world_size=2, rank=0, downloads=downloads,
                                            storage=f"s3://{BUCKET}/runs/r1")
        assert found is not None and ckpt.manifest_info(found) == (2, 2)  # step 3 is incomplete: step 2


def test_a_run_with_nothing_in_storage_starts_fresh(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(ray.train, "get_checkpoint", lambda: None)
    with contextlib.ExitStack() as downloads:
        assert resume_point.resume_directory(2, 0, downloads, storage=str(tmp_path / "new-run")) is None
    complete_checkpoint(tmp_path / "run" / "checkpoint_000000004", 4)
    assert resume_point.newest_in_storage(str(tmp_path / "run")).path.endswith("checkpoint_000000004")


def _torn_first_checkpoint(run: Path) -> Path:
    """What a first upload that failed part-way leaves: the manifest and DeepSpeed's files, no rank0.pt."""
    torn = complete_checkpoint(run / "checkpoint_000000002", 2, world_size=1)
    (torn / "deepspeed").mkdir()
    (torn / "deepspeed" / "mp_rank_00_model_states.pt").write_bytes(b"m" * 64)
    (torn / "rank0.pt").unlink()
    return torn


def _save_again(run_fs: pyarrow.fs.FileSystem, run: str, tmp_path: Path) -> None:
    """The restarted run reaches step 2 and saves it: Ray Train's own upload into the same folder."""
    from ray.train.v2._internal.execution.storage import _upload_to_fs_path

    fresh = complete_checkpoint(tmp_path / "fresh" / "checkpoint_000000002", 2, world_size=1)
    _upload_to_fs_path(str(fresh), run_fs, f"{run}/checkpoint_000000002")


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_torn_first_checkpoint_starts_over_and_its_step_is_saved_again(where, tmp_path: Path, moto_s3: str,
                                                                         monkeypatch, capsys) -> None:
    monkeypatch.setattr(ray.train, "get_checkpoint", lambda: None)  # Ray never registered it
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_s3)
    written = tmp_path / "written"
    _torn_first_checkpoint(written)
    if where == "local":
        storage, run_fs, run = str(written), pyarrow.fs.LocalFileSystem(), str(written)
    else:
        open_storage(f"s3://{BUCKET}", endpoint_url=moto_s3).client.create_bucket(Bucket=BUCKET)
        storage = f"s3://{BUCKET}/runs/torn-{tmp_path.name}"
        _upload(written, storage, moto_s3)
        run_fs, run = run_filesystem(storage)
    with contextlib.ExitStack() as downloads:
        assert resume_point.resume_directory(1, 0, downloads, storage=storage) is None
    line = capsys.readouterr().out.strip()
    assert "\n" not in line and "starting from step 1, ignoring 1 incomplete: checkpoint_000000002 (rank0.pt: " \
        "listed by rank 0 but missing)" in line, line

    _save_again(run_fs, run, tmp_path)
    with contextlib.ExitStack() as downloads:
        found = resume_point.resume_directory(1, 0, downloads, storage=storage)
        assert found is not None and ckpt.check_complete(found, 1) == [] and ckpt.manifest_info(found) == (2, 1)


def test_a_torn_newer_checkpoint_is_passed_over_then_replaced(tmp_path: Path, monkeypatch) -> None:
    """The newest complete stays the one resumed from while a newer one is torn, and after its step is saved
    again the new save is (a local torn checkpoint: its manifest removed, rank0.pt cut short)."""
    monkeypatch.setattr(ray.train, "get_checkpoint", lambda: None)
    run = tmp_path / "run"
    complete_checkpoint(run / "checkpoint_000000001", 1, world_size=1)
    torn = complete_checkpoint(run / "checkpoint_000000002", 2, world_size=1)
    (torn / "MANIFEST-rank0.json").unlink()
    (torn / "rank0.pt").write_bytes((torn / "rank0.pt").read_bytes()[:10])
    with contextlib.ExitStack() as downloads:
        found = resume_point.resume_directory(1, 0, downloads, storage=str(run))
        assert found == run / "checkpoint_000000001"
    _save_again(pyarrow.fs.LocalFileSystem(), str(run), tmp_path)
    with contextlib.ExitStack() as downloads:
        assert resume_point.resume_directory(1, 0, downloads, storage=str(run)) == run / "checkpoint_000000002"


def test_storage_that_cannot_be_read_is_never_a_fresh_start(s3_run, moto_s3, monkeypatch) -> None:
    """A refused listing or download is not "no checkpoints": the worker fails in one line naming the place
    (and, the error being final, the run stops: launch/failures.py) instead of training from step 1."""
    from helpers.s3_faults import FaultProxy
    from vitscale.data.storage import StorageError
    from vitscale.launch.failures import deterministic_cause

    monkeypatch.setattr(ray.train, "get_checkpoint", lambda: None)
    with FaultProxy(moto_s3, fault_rate=1.0, methods=("GET",), random_faults=("403",)) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        with contextlib.ExitStack() as downloads, pytest.raises(StorageError) as err:
            resume_point.resume_directory(2, 0, downloads, storage=f"s3://{BUCKET}/runs/r1")
    message = str(err.value)
    assert proxy.counts["403"] >= 1 and "\n" not in message
    assert message.startswith(f"cannot list the checkpoints of s3://{BUCKET}/runs/r1: "), message
    assert "not retried" in message and deterministic_cause(err.value) is err.value


def test_a_download_that_fails_is_never_a_fresh_start(s3_run, moto_s3, monkeypatch) -> None:
    from helpers.s3_faults import FaultProxy
    from vitscale.data.storage import StorageError

    _, run = s3_run
    with FaultProxy(moto_s3, methods=("GET",)) as proxy:
        proxy.schedule("403", path="MANIFEST-rank0.json")
        fs, _ = run_filesystem(f"s3://{run}", endpoint_url=proxy.url)
        monkeypatch.setattr(ray.train, "get_checkpoint",
                            lambda: ray.train.Checkpoint(f"{run}/checkpoint_000000003", filesystem=fs))
        with contextlib.ExitStack() as downloads, pytest.raises(StorageError) as err:
            resume_point.resume_directory(2, 0, downloads)
    assert proxy.pending == 0
    assert str(err.value).startswith(f"cannot read checkpoint s3://{run}/checkpoint_000000003: "), err.value


@pytest.mark.slow
def test_ranks_that_disagree_on_the_newest_complete_checkpoint_fail_in_one_line(tmp_path: Path,
                                                                               small_synthetic: str) -> None:
    """Each rank hashes only the files it reads: rank 1's own part of the newest checkpoint damaged (same size)
    makes rank 1 choose an older one while rank 0 takes the newest. They must not train from different steps."""
    import yaml

    from helpers.ray_runs import finished

    raw = {"name": "agree", "stages": ["pretrain"], "data": {"url": small_synthetic},
           "model": {"name": "ViT-Ti/8", "img_size": 16, "depth": 1, "width": 32, "heads": 2, "mlp_dim": 32},
           "train": {"global_batch": 8, "micro_batch": 4, "max_steps": 6, "warmup_steps": 0, "checkpoint_every": 2,
                     "fault": {"kill_rank": 0, "kill_at_step": 5}},
           "cluster": {"num_workers": 2, "use_gpu": False, "cpus_per_worker": 1, "max_failures": 0,
                       "storage_path": str(tmp_path / "runs"), "run_name": "agree"}}
    pipeline = tmp_path / "agree.yaml"
    pipeline.write_text(yaml.safe_dump(raw))
    code, output = finished(pipeline, tmp_path / "first.log")  # killed after step 4's checkpoint, not restarted
    part = tmp_path / "runs" / "agree" / "checkpoint_000000004" / "rank1.pt"
    assert code != 0 and part.is_file(), output[-4000:]
    data = bytearray(part.read_bytes())
    data[-1] ^= 0xFF
    part.write_bytes(bytes(data))
    del raw["train"]["fault"]
    pipeline.write_text(yaml.safe_dump(raw))
    code, output = finished(pipeline, tmp_path / "again.log")
    assert code != 0, output[-4000:]
    last = output.strip().splitlines()[-1]
    assert "rank 1: RuntimeError: rank 1 found no complete checkpoint at step 4, from which rank 0 resumes" in last, last
    assert "it would resume from step 2" in last, last
