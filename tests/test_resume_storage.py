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
from vitscale.launch import ray_train
from vitscale.train import checkpoint as ckpt

BUCKET = "vitscale-resume"


def _upload(local: Path, url: str, endpoint: str) -> None:
    storage = open_storage(url, endpoint_url=endpoint)
    for path in sorted(p for p in local.rglob("*") if p.is_file()):
        storage.write_file(path.relative_to(local).as_posix(), path)


@pytest.fixture
def s3_run(tmp_path: Path, moto_s3: str) -> tuple[pyarrow.fs.S3FileSystem, str]:
    """A run in object storage: complete checkpoints at steps 1 and 2, an incomplete one at step 3."""
    open_storage(f"s3://{BUCKET}", endpoint_url=moto_s3).client.create_bucket(Bucket=BUCKET)
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
        found = ray_train._resume_directory(world_size=2, rank=0, downloads=downloads)
        assert found is not None and ckpt.manifest_info(found) == (2, 2)
        assert not ckpt.check_complete(found, 2)
        assert found == seen[-1] and len(seen) == 2  # step 3 tried, step 2 taken; step 1 never fetched
        assert not seen[0].exists()  # the incomplete download is released at once
        assert found.exists()
    assert not found.exists()  # released when the loop says it has loaded it
    assert "latest checkpoint checkpoint_000000003 is incomplete; resuming from checkpoint_000000002" in capsys.readouterr().out


def test_no_complete_checkpoint_names_every_problem(s3_run, moto_s3, monkeypatch) -> None:
    fs, run = s3_run
    storage = open_storage(f"s3://{run}", endpoint_url=moto_s3)
    for step in (1, 2):
        storage.write_bytes(f"checkpoint_00000000{step}/MANIFEST-rank0.json", json.dumps([step]).encode())
    monkeypatch.setattr(ray.train, "get_checkpoint",
                        lambda: ray.train.Checkpoint(f"{run}/checkpoint_000000003", filesystem=fs))
    with contextlib.ExitStack() as downloads, pytest.raises(RuntimeError, match="no complete checkpoint") as err:
        ray_train._resume_directory(world_size=2, rank=0, downloads=downloads)
    assert all(f"MANIFEST-rank{r}.json" in str(err.value) for r in (0, 1))


def test_no_checkpoint_is_a_fresh_start(monkeypatch) -> None:
    monkeypatch.setattr(ray.train, "get_checkpoint", lambda: None)
    with contextlib.ExitStack() as downloads:
        assert ray_train._resume_directory(world_size=2, rank=0, downloads=downloads) is None


def test_a_checkpoint_ray_never_registered_is_found_in_storage(s3_run, moto_s3, monkeypatch) -> None:
    """A worker that died right after its upload: Ray knows no checkpoint, the storage holds them."""
    monkeypatch.setattr(ray.train, "get_checkpoint", lambda: None)
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_s3)
    with contextlib.ExitStack() as downloads:
        found = ray_train._resume_directory(world_size=2, rank=0, downloads=downloads,
                                            storage=f"s3://{BUCKET}/runs/r1")
        assert found is not None and ckpt.manifest_info(found) == (2, 2)  # step 3 is incomplete: step 2


def test_a_run_with_nothing_in_storage_starts_fresh(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(ray.train, "get_checkpoint", lambda: None)
    with contextlib.ExitStack() as downloads:
        assert ray_train._resume_directory(2, 0, downloads, storage=str(tmp_path / "new-run")) is None
    complete_checkpoint(tmp_path / "run" / "checkpoint_000000004", 4)
    assert ray_train.newest_in_storage(str(tmp_path / "run")).path.endswith("checkpoint_000000004")
