"""Models and checkpoints read straight from object storage: copied into the local cache, newest complete first."""

from __future__ import annotations

import os
import re
from pathlib import Path

import boto3
import pytest

from helpers.checkpoints import complete_checkpoint
from vitscale.data.storage import open_storage
from vitscale.data.storage.fetch import local_copy, subfolders
from vitscale.train.export import find_checkpoint


@pytest.fixture()
def bucket(moto_s3: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_s3)
    monkeypatch.setenv("VITSCALE_CACHE", str(tmp_path / "cache"))
    name = f"fetch-{os.urandom(4).hex()}"
    boto3.client("s3", endpoint_url=moto_s3).create_bucket(Bucket=name)
    return name


def _upload(folder: Path, url: str) -> None:
    storage = open_storage(url)
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            storage.write_file(path.relative_to(folder).as_posix(), path)


def test_local_copy_of_a_file_a_folder_and_a_local_path(bucket: str, tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "model.pt").write_bytes(b"weights")
    (src / "sub" / "a.txt").write_text("a")
    _upload(src, f"s3://{bucket}/runs/r")
    one = local_copy(f"s3://{bucket}/runs/r/model.pt")
    assert one.read_bytes() == b"weights" and str(one).startswith(str(tmp_path / "cache"))
    folder = local_copy(f"s3://{bucket}/runs/r")
    assert (folder / "sub" / "a.txt").read_text() == "a" and (folder / "model.pt").is_file()
    assert subfolders(f"s3://{bucket}/runs/r") == [f"s3://{bucket}/runs/r/sub"]
    assert local_copy(str(src)) == src  # a local path is its own copy
    with pytest.raises(FileNotFoundError, match="no such file or folder"):
        local_copy(f"s3://{bucket}/runs/none")


def test_find_checkpoint_in_storage_skips_an_incomplete_newest(bucket: str, tmp_path: Path) -> None:
    run = tmp_path / "run"
    complete_checkpoint(run / "checkpoint_000000004", step=4)
    newest = complete_checkpoint(run / "checkpoint_000000006", step=6)
    (newest / "MANIFEST-rank1.json").unlink()  # rank 1 died before its manifest: incomplete
    _upload(run, f"s3://{bucket}/runs/run")
    found = find_checkpoint(f"s3://{bucket}/runs/run")
    assert found.name == "checkpoint_000000004" and (found / "payload.bin").read_bytes() == b"x" * 10
    # Naming a checkpoint directly works too, and an incomplete one is refused naming why.
    assert find_checkpoint(f"s3://{bucket}/runs/run/checkpoint_000000004") == found
    with pytest.raises(Exception, match="incomplete"):
        find_checkpoint(f"s3://{bucket}/runs/run/checkpoint_000000006")


def test_a_place_that_is_no_run_is_refused_by_its_listing_without_downloading_it(bucket: str, tmp_path: Path) -> None:
    """A dataset's prefix, a file or a bucket's root named as a run: was copied whole into the cache (a dataset's
    terabytes) to end in an error naming the cache; a bucket's root looked for its older-layout sibling in
    another bucket (`s3://b-finetune`: NoSuchBucket)."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "train-000000.tar").write_bytes(b"x" * 1000)
    (data / "dataset.json").write_text("{}")
    _upload(data, f"s3://{bucket}/datasets/d")
    _upload(data, f"s3://{bucket}")
    open_storage(f"s3://{bucket}/models").write_bytes("model.pt", b"weights")
    for url, why in [(f"s3://{bucket}/datasets/d", "no checkpoint_* folders, and no checkpoint itself"),
                     (f"s3://{bucket}/datasets", "no checkpoint_* folders, and no checkpoint itself"),
                     (f"s3://{bucket}", "no checkpoint_* folders, and no checkpoint itself"),
                     (f"s3://{bucket}/models/model.pt", "one file, not a run or checkpoint folder")]:
        with pytest.raises(FileNotFoundError, match="^" + re.escape(f"{url}: {why}")):
            find_checkpoint(url)
    assert not (tmp_path / "cache").exists()  # nothing was copied
    run = tmp_path / "run"  # a pipeline run without checkpoints of its own: its summary.json names them
    complete_checkpoint(tmp_path / "elsewhere" / "checkpoint_000000002", step=2)
    _upload(tmp_path / "elsewhere", f"s3://{bucket}/runs/pre")
    run.mkdir()
    (run / "summary.json").write_text(f'{{"pretrain": {{"checkpoint": "s3://{bucket}/runs/pre"}}}}')
    _upload(run, f"s3://{bucket}/runs/pipe")
    assert find_checkpoint(f"s3://{bucket}/runs/pipe").name == "checkpoint_000000002"


def test_one_bucket_name_on_two_endpoints_has_two_cached_copies(bucket: str, moto_s3: str, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from vitscale.data.storage.fetch import _cached_path

    url = f"s3://{bucket}/runs/r/model.pt"
    here = _cached_path(url)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://minio.internal:9000")
    elsewhere = _cached_path(url)
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    aws = _cached_path(url)
    assert len({here, elsewhere, aws}) == 3 and aws == tmp_path / "cache" / "storage" / "s3" / bucket / "runs/r/model.pt"
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_s3.replace("http://", "HTTP://") + "/")
    assert _cached_path(url) == here  # one endpoint, however it is spelled


def test_a_file_written_again_at_its_size_is_fetched_again(bucket: str, tmp_path: Path) -> None:
    # `vitscale export RUN --out s3://.../vit.pt` again after more training: the same architecture, the same
    # bytes count, other weights; fewshot, inspect and finetune must read the new ones, not the cached copy.
    storage = open_storage(f"s3://{bucket}/models")
    storage.write_bytes("vit.pt", b"step 1000")
    assert local_copy(f"s3://{bucket}/models/vit.pt").read_bytes() == b"step 1000"
    storage.write_bytes("vit.pt", b"step 2000")
    assert local_copy(f"s3://{bucket}/models/vit.pt").read_bytes() == b"step 2000"
    copy = local_copy(f"s3://{bucket}/models/vit.pt")
    before = copy.stat().st_mtime_ns
    assert local_copy(f"s3://{bucket}/models/vit.pt").stat().st_mtime_ns == before  # unchanged: not fetched again


def test_a_killed_fetchs_part_file_is_removed_by_the_next_and_a_live_ones_never(bucket: str) -> None:
    import fcntl

    storage = open_storage(f"s3://{bucket}/models")
    storage.write_bytes("vit.pt", b"weights")
    copy = local_copy(f"s3://{bucket}/models/vit.pt")
    killed = copy.with_name(f".{copy.name}.999999.part")  # a fetch killed outright: a checkpoint file's size
    killed.write_bytes(b"half")
    live = copy.with_name(f".{copy.name}.999998.part")
    live.write_bytes(b"another process's, fetching now")
    with live.open("rb") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)
        storage.write_bytes("vit.pt", b"new weights")
        assert local_copy(f"s3://{bucket}/models/vit.pt").read_bytes() == b"new weights"
        assert not killed.exists() and live.exists()
