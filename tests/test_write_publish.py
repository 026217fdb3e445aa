"""`shards write`: bad source files skipped and listed up to --max-bad; never a half-dataset."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from vitscale.cli import main
from vitscale.data.format import has_dataset, read_index, read_meta
from vitscale.data.loader.stream import ShardStream
from vitscale.data.storage import LocalStorage, open_storage
from vitscale.data.tools.publish import WRITING
from vitscale.data.tools.write import write_dataset

BAD = {"cat/notes.jpg": b"shopping list\n", "cat/empty.png": b"", "dog/cut.jpg": None}


def _jpeg(seed: int, size: int = 24) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 255, (size, size, 3), np.uint8)).save(buf, "JPEG")
    return buf.getvalue()


def _folder(root: Path, good: int = 6, bad: bool = True) -> Path:
    for i in range(good):
        path = root / ("cat" if i % 2 else "dog") / f"img{i}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(_jpeg(i))
    # Three names that clean up to colliding keys: all three are written, under distinct keys.
    (root / "cat" / "a.jpg").write_bytes(_jpeg(90))
    (root / "cat" / "a.png").write_bytes(_jpeg(91))
    (root / "cat" / "a_1.jpg").write_bytes(_jpeg(92))
    if bad:
        for name, data in BAD.items():
            (root / name).write_bytes(_jpeg(7)[:300] if data is None else data)
    return root


def _write(src: Path, out: Path | str, **kw) -> dict:
    return write_dataset(f"folder:{src}", str(out), shard_size=4, progress=False, workers=1, **kw)


def test_bad_files_are_skipped_counted_listed_and_the_rest_trains(tmp_path):
    meta = _write(_folder(tmp_path / "src"), tmp_path / "out", max_bad=3)
    listed = {Path(b["file"]).relative_to(tmp_path / "src").as_posix(): b["error"] for b in meta["bad_files"]}
    assert set(listed) == set(BAD)
    assert "empty" in listed["cat/empty.png"] and "not an image" in listed["cat/notes.jpg"]
    assert read_meta(str(tmp_path / "out")).extra["bad_files"] == meta["bad_files"]
    assert meta["splits"]["train"]["samples"] == 9  # 6 + the three colliding names
    keys = read_index(str(tmp_path / "out")).column("key").to_pylist()
    assert len(set(keys)) == 9
    stream = ShardStream(str(tmp_path / "out"), batch_size=3, resolution=16, train=False, error_budget=0.0)
    assert sum(int(b["valid"].sum()) for b in stream) == 9


def test_past_max_bad_the_write_stops_naming_a_file_and_leaves_nothing(tmp_path, capsys):
    src, out = _folder(tmp_path / "src"), tmp_path / "out"
    code = main(["shards", "write", "--source", f"folder:{src}", "--out", str(out), "--max-bad", "2",
                 "--shard-size", "2"])
    err = capsys.readouterr().err.strip()
    last = err.splitlines()[-1]  # the lines before it are the progress bar's
    assert code == 2 and last.startswith("vitscale: error: ") and "Traceback" not in err
    assert "more than --max-bad 2" in last and str(src) in last
    assert not has_dataset(str(out)) and LocalStorage(out).list() == []  # no shards, index or marker left
    # A re-run to the same destination works.
    assert main(["shards", "write", "--source", f"folder:{src}", "--out", str(out), "--max-bad", "3"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["bad"] == 3 and len(summary["bad_files"]) == 3 and has_dataset(str(out))


class _Interrupt(BaseException):
    pass


def test_an_interrupted_write_is_never_a_dataset_and_a_rerun_works(tmp_path, monkeypatch):
    src, out = _folder(tmp_path / "src", bad=False), tmp_path / "out"
    from vitscale.data.tools import write

    real, calls = write.encode_image, []

    def dies_late(*args, **kw):
        calls.append(1)
        if len(calls) == 7:  # after the first shards are in place
            raise _Interrupt()
        return real(*args, **kw)

    monkeypatch.setattr(write, "encode_image", dies_late)
    with pytest.raises(_Interrupt):
        _write(src, out)
    assert not has_dataset(str(out)) and LocalStorage(out).list() == []
    monkeypatch.setattr(write, "encode_image", real)
    # What a killed write (no cleanup at all) leaves: shards, maybe an index, the marker.
    leftovers = LocalStorage(out)
    leftovers.write_bytes(WRITING, b"{}")
    leftovers.write_bytes("train-000007.tar", b"half a shard")
    (out / ".train-000008.tar.0123456789ab.part").write_bytes(b"a shard being copied in")  # atomic.py's
    (out / ".notes.txt.0123456789ab.part").write_bytes(b"not a write's")
    assert _write(src, out)["splits"]["train"]["samples"] == 9
    assert "train-000007.tar" not in LocalStorage(out).list() and WRITING not in LocalStorage(out).list()
    assert [p.name for p in out.glob(".*.part")] == [".notes.txt.0123456789ab.part"]
    # A finished dataset, or shards no vitscale write left, are never written over.
    with pytest.raises(ValueError, match="already holds a dataset"):
        _write(src, out)
    foreign = tmp_path / "foreign"
    LocalStorage(foreign).write_bytes("train-000000.tar", b"someone's shard")
    with pytest.raises(ValueError, match="no vitscale write left it there"):
        _write(src, foreign)


def test_an_error_while_aborting_never_hides_the_original(tmp_path, monkeypatch):
    src, out = _folder(tmp_path / "src"), tmp_path / "out"

    def broken_delete(self, name):
        raise PermissionError(f"cannot delete {name}")

    monkeypatch.setattr(LocalStorage, "delete", broken_delete)
    with pytest.raises(ValueError, match="more than --max-bad 0") as err:
        _write(src, out, max_bad=0)
    assert any("while cleaning up" in note and "PermissionError" in note for note in err.value.__notes__)
    assert not has_dataset(str(out))


def test_s3_rerun_after_an_interrupted_write(tmp_path, moto_s3):
    storage = open_storage("s3://vitscale-write/ds", endpoint_url=moto_s3)
    storage.client.create_bucket(Bucket="vitscale-write")
    storage.write_bytes(WRITING, b"{}")
    storage.write_bytes("train-000003.tar", b"left by a killed write")
    src = _folder(tmp_path / "src", bad=False)
    meta = write_dataset(f"folder:{src}", "s3://vitscale-write/ds", shard_size=4, progress=False, workers=1,
                         endpoint_url=moto_s3)
    names = storage.list()
    assert meta["splits"]["train"]["samples"] == 9 and "dataset.json" in names
    assert WRITING not in names and sorted(n for n in names if n.endswith(".tar")) == [
        "train-000000.tar", "train-000001.tar", "train-000002.tar"]


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_second_write_to_a_destination_being_written_is_refused(tmp_path, moto_s3, where):
    """One writer per destination: a live write's shards are never cleared as leftovers by another."""
    import os

    from vitscale.data.storage.lease import LeaseHeld
    from vitscale.data.tools import publish

    if where == "local":
        url, endpoint = str(tmp_path / "out"), None
    else:
        open_storage("s3://vitscale-two-writers", endpoint_url=moto_s3).client.create_bucket(Bucket="vitscale-two-writers")
        url, endpoint = "s3://vitscale-two-writers/ds", moto_s3
    first = open_storage(url, endpoint_url=endpoint)
    publish.claim(first)  # a write in progress ...
    first.write_bytes("train-000000.tar", b"a live write's shard")
    src = _folder(tmp_path / "src", bad=False)
    try:
        with pytest.raises(LeaseHeld, match=f"dataset {url} is being written by pid {os.getpid()} .*another --out"):
            write_dataset(f"folder:{src}", url, shard_size=4, progress=False, workers=1, endpoint_url=endpoint)
        assert first.read_bytes("train-000000.tar") == b"a live write's shard"  # untouched
    finally:
        publish.abort(first, RuntimeError("the first write stops"))
    assert write_dataset(f"folder:{src}", url, shard_size=4, progress=False, workers=1,
                         endpoint_url=endpoint)["splits"]["train"]["samples"] == 9
    assert ".vitscale-lease" not in open_storage(url, endpoint_url=endpoint).list()


def test_a_dataset_is_never_written_inside_another(tmp_path, capsys):
    train = tmp_path / "train"
    write_dataset("digits", str(train), progress=False)
    for argv in (["shards", "write", "--source", "digits", "--out", str(train / "more")],
                 ["shards", "dedup", "--train", str(train), "--against", str(train), "--out", str(train / "clean")]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"vitscale: error: {argv[-1]} is inside the dataset {train}") and err.count("\n") == 1
    assert sorted(p.name for p in train.iterdir() if p.is_dir()) == []  # nothing made there
    assert main(["shards", "verify", str(train)]) == 0


def test_a_dataset_is_never_written_inside_another_in_a_bucket(moto_s3, capsys):
    """Was checked on a disk only: `shards write --out s3://b/train/more` was written, and `train` then failed verify."""
    import boto3

    for bucket in ("nested", "nested-root"):
        boto3.client("s3", endpoint_url=moto_s3).create_bucket(Bucket=bucket)
    for train in ("s3://nested/train", "s3://nested-root"):  # a dataset at a bucket's root has every prefix below it
        write_dataset("digits", train, progress=False, endpoint_url=moto_s3)
        for out in (f"{train}/more", f"{train}/a/b/more"):
            assert main(["shards", "write", "--source", "digits", "--out", out, "--endpoint-url", moto_s3]) == 2
            err = capsys.readouterr().err
            assert err.startswith(f"vitscale: error: {out} is inside the dataset {train}") and err.count("\n") == 1
        assert not open_storage(f"{train}/more", endpoint_url=moto_s3).list()  # nothing written there, no lease
        assert main(["shards", "verify", train, "--endpoint-url", moto_s3]) == 0
        capsys.readouterr()


def test_the_spool_of_a_killed_write_is_removed_by_the_next_and_a_live_ones_never(tmp_path, monkeypatch):
    import os
    import signal
    import subprocess
    import sys
    import tempfile
    import time

    from vitscale.data.storage import cleanup

    spools = tmp_path / "tmp"
    spools.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "vitscale", "shards", "write", "--source", "synthetic", "--count",
                             "40000", "--image-size", "32", "--max-side", "32", "--shard-size", "100000", "--out",
                             str(tmp_path / "killed")], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "TMPDIR": str(spools)})
    try:
        deadline = time.monotonic() + 120
        while not list(spools.glob("vitscale-spool-shard-*.tar")):  # mid-shard: its spool there
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)  # no cleanup runs: the spool stays
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    monkeypatch.setattr(tempfile, "tempdir", str(spools))
    monkeypatch.setattr(cleanup, "_SWEPT", set())
    live = cleanup.spool_file("vitscale-spool-shard-", ".tar")  # another write's, still being filled
    live.write(b"half a shard")
    monkeypatch.setattr(cleanup, "_SWEPT", set())
    write_dataset("digits", str(tmp_path / "next"), progress=False)
    assert [p.name for p in spools.iterdir()] == [Path(live.name).name]  # the killed write's is gone
    live.close()
