"""A run's files pushed from a node's cache to its storage and pulled onto a machine that never saw the run."""

from __future__ import annotations

import os
import time
from pathlib import Path

import boto3
import pytest

from vitscale.data.storage import open_storage
from vitscale.data.storage.mirror import RunMirror


def _fill(folder: Path) -> None:
    (folder / "logs").mkdir(parents=True)
    (folder / "config.yaml").write_text("name: x\n")
    (folder / "logs" / "ray.log").write_text("line 1\n")
    (folder / "checkpoint_000000002").mkdir()
    (folder / "checkpoint_000000002" / "rank0.pt").write_bytes(b"ray train writes these itself")
    (folder / ".vitscale-lease").write_text("held")


@pytest.fixture(params=["local", "s3"])
def storage_url(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "local":
        return str(tmp_path / "storage" / "run")
    endpoint = request.getfixturevalue("moto_s3")
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    bucket = f"mirror-{os.urandom(4).hex()}"
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
    return f"s3://{bucket}/runs/run"


def test_push_copies_what_changed_and_pull_rebuilds_the_run(storage_url: str, tmp_path: Path) -> None:
    cache = tmp_path / "node-a"
    _fill(cache)
    mirror = RunMirror(cache, open_storage(storage_url))
    assert mirror.push() == ["config.yaml", "logs/ray.log"]  # checkpoints and the lease are not the mirror's
    assert mirror.push() == []  # nothing changed: nothing uploaded
    time.sleep(0.01)
    (cache / "logs" / "ray.log").write_text("line 1\nline 2\n")
    (cache / "summary.json").write_text("{}")
    assert mirror.push() == ["logs/ray.log", "summary.json"]

    elsewhere = tmp_path / "node-b"  # a machine that has never seen the run
    pulled = RunMirror(elsewhere, open_storage(storage_url)).pull()
    assert sorted(pulled) == ["config.yaml", "logs/ray.log", "summary.json"]
    assert (elsewhere / "logs" / "ray.log").read_text() == "line 1\nline 2\n"
    assert not (elsewhere / "checkpoint_000000002").exists()
    assert RunMirror(elsewhere, open_storage(storage_url)).pull() == []  # already there


def test_push_limited_to_names_and_close_pushes_the_last_change(storage_url: str, tmp_path: Path) -> None:
    cache = tmp_path / "node-a"
    _fill(cache)
    storage = open_storage(storage_url)
    mirror = RunMirror(cache, storage)
    assert mirror.push(["logs/ray.log"]) == ["logs/ray.log"]
    assert storage.list() == ["logs/ray.log"]
    mirror.push_every(0.05)
    deadline = time.monotonic() + 10
    while "config.yaml" not in storage.list() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "config.yaml" in storage.list()  # the periodic push ran
    (cache / "summary.json").write_text('{"ok": true}')
    mirror.close()
    assert storage.read_bytes("summary.json") == b'{"ok": true}'


def test_a_local_storage_that_is_the_cache_copies_nothing(tmp_path: Path) -> None:
    run = tmp_path / "runs" / "run"
    _fill(run)
    mirror = RunMirror(run, open_storage(str(run)))
    assert mirror.same_place and mirror.push() == [] and mirror.pull() == []


def test_each_writer_pushes_only_its_own_files(storage_url: str, tmp_path: Path) -> None:
    """Two ranks on one node share its folder; each pushes its own file, whoever finishes first."""
    cache = tmp_path / "node"
    (cache / "metrics").mkdir(parents=True)
    for rank in (0, 1):
        (cache / "metrics" / f"rank{rank}.jsonl").write_text(f"{rank}\n")
    storage = open_storage(storage_url)
    assert RunMirror(cache, storage, include=lambda n: "rank1" in n).push() == ["metrics/rank1.jsonl"]
    assert storage.list() == ["metrics/rank1.jsonl"]


def test_a_writer_on_a_new_node_continues_its_predecessors_file(storage_url: str, tmp_path: Path) -> None:
    """Rank 1's node is lost; its successor elsewhere pulls rank 1's records before appending to them."""
    storage = open_storage(storage_url)
    mine = lambda n: "rank1" in n  # noqa: E731
    old = tmp_path / "lost-node"
    (old / "samples").mkdir(parents=True)
    (old / "samples" / "rank1.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    (old / "samples" / "rank0.jsonl").write_text("rank 0's, not rank 1's\n")
    RunMirror(old, storage).push()
    new = tmp_path / "new-node"
    successor = RunMirror(new, storage, include=mine)
    assert successor.pull() == ["samples/rank1.jsonl"]  # its own file only
    with (new / "samples" / "rank1.jsonl").open("a") as f:
        f.write('{"step": 3}\n')
    successor.push()
    assert storage.read_bytes("samples/rank1.jsonl") == b'{"step": 1}\n{"step": 2}\n{"step": 3}\n'


def _bucket_and_prefix(storage_url: str) -> tuple[str, str]:
    bucket, _, prefix = storage_url[len("s3://"):].partition("/")
    return bucket, prefix


def test_folder_markers_are_not_files(moto_s3: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ray Train puts the zero-byte object `runs/run/` when it starts a run (the S3 console's "create folder"
    does the same): a re-run's pull must neither take it for a file named '' nor crash on it."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_s3)
    bucket = f"marker-{os.urandom(4).hex()}"
    s3 = boto3.client("s3", endpoint_url=moto_s3)
    s3.create_bucket(Bucket=bucket)
    for key, body in (("runs/run/", b""), ("runs/run/logs/", b""), ("runs/run/checkpoint_000000002/", b""),
                      ("runs/run/logs/ray.log", b"line 1\n"), ("runs/run/metrics/rank0.jsonl", b"{}\n")):
        s3.put_object(Bucket=bucket, Key=key, Body=body)
    storage = open_storage(f"s3://{bucket}/runs/run")
    assert storage.list_sizes() == {"logs/ray.log": 7, "metrics/rank0.jsonl": 3}
    assert storage.list_sizes("logs/") == {"logs/ray.log": 7}
    assert open_storage(f"s3://{bucket}").list_sizes() == {"runs/run/logs/ray.log": 7, "runs/run/metrics/rank0.jsonl": 3}
    cache = tmp_path / "node"
    # The driver's pull at a re-run (no include filter), then a rank's (its own files).
    assert RunMirror(cache, storage).pull() == ["logs/ray.log", "metrics/rank0.jsonl"]
    assert RunMirror(tmp_path / "other", storage, include=lambda n: "rank0." in n).pull() == ["metrics/rank0.jsonl"]
    assert sorted(p.relative_to(cache).as_posix() for p in cache.rglob("*") if p.is_file()) == [
        "logs/ray.log", "metrics/rank0.jsonl"]


def test_a_pull_makes_the_cache_what_the_storage_holds(storage_url: str, tmp_path: Path) -> None:
    """A run finished, its storage was emptied, a new run starts at the same place: nothing of the old run
    (its metrics lines, its TensorBoard events) may reach the new one from a node's cache."""
    storage = open_storage(storage_url)
    cache = tmp_path / "node"
    _fill(cache)
    (cache / "metrics").mkdir()
    (cache / "metrics" / "rank0.jsonl").write_text('{"step": 1}\n{"step": 12}\n')
    (cache / "tensorboard").mkdir()
    (cache / "tensorboard" / "events.out.tfevents.1").write_bytes(b"old events")
    RunMirror(cache, storage).push()
    for name in storage.list():
        storage.delete(name)  # the run is deleted from its storage
    storage.write_bytes("notes.txt", b"written since")

    driver = RunMirror(cache, storage)
    assert driver.pull() == ["notes.txt"]
    files = sorted(p.relative_to(cache).as_posix() for p in cache.rglob("*") if p.is_file())
    # Ray Train's checkpoint folders and the lease are not the mirror's: left alone.
    assert files == [".vitscale-lease", "checkpoint_000000002/rank0.pt", "notes.txt"], files
    assert not (cache / "metrics").exists() and not (cache / "tensorboard").exists()  # emptied folders go too
    (cache / "metrics").mkdir()
    (cache / "metrics" / "rank0.jsonl").write_text('{"step": 1}\n')  # the new run's first line
    driver.push()
    assert storage.read_bytes("metrics/rank0.jsonl") == b'{"step": 1}\n'
    assert storage.list() == ["metrics/rank0.jsonl", "notes.txt"]  # not the old run's config, log or events


def test_a_writers_pull_removes_only_its_own_files(storage_url: str, tmp_path: Path) -> None:
    """Ranks share a node's folder: rank 1's pull at its start leaves rank 0's files (written, not pushed yet)."""
    storage = open_storage(storage_url)
    cache = tmp_path / "node"
    (cache / "metrics").mkdir(parents=True)
    for rank in (0, 1):
        (cache / "metrics" / f"rank{rank}.jsonl").write_text(f"{rank}, an old run's\n")
    storage.write_bytes("metrics/other.txt", b"x")
    assert RunMirror(cache, storage, include=lambda n: "rank1." in n).pull() == []
    assert sorted(p.name for p in (cache / "metrics").iterdir()) == ["rank0.jsonl"]
