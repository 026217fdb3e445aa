"""A command's output place (`data/storage/outputs.py`): a wrong one refused in one line before the work, a
bucket written to as a folder is (`vitscale export --out s3://...`), nothing left behind locally."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import boto3
import pytest

from helpers.loop_runs import Recorder
from test_full_disk import small_disk  # noqa: F401 -- the module's fixture
from test_pretrain_loop import tiny_config, tiny_dataset  # noqa: F401 -- the module's fixture
from vitscale.cli import main
from vitscale.config.checks import ConfigError
from vitscale.data.storage.outputs import check_output, output_file, output_folder


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, tiny_dataset: str,  # noqa: F811
            process_group: None) -> Path:
    """A run directory with a real 3-step checkpoint of the tiny pre-training (one rank, ZeRO 2)."""
    from vitscale.train.loop import WorkerContext, train

    root = tmp_path_factory.mktemp("trained")
    train(tiny_config(tiny_dataset, max_steps=3), WorkerContext(rank=0, world_size=1, run_dir=root / "work",
                                                                 report=Recorder(root / "run")))
    return root / "run"


def _one_line_error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("vitscale: error: ") and err.count("\n") == 1, err  # one line, no traceback
    return err


def test_a_file_goes_where_a_file_fits(tmp_path: Path) -> None:
    (tmp_path / "folder").mkdir()
    (tmp_path / "file").write_text("x")
    assert check_output(str(tmp_path / "new" / "deeper" / "m.pt"), "--out", folder=False) == \
        str(tmp_path / "new" / "deeper" / "m.pt")
    assert check_output(str(tmp_path / "file"), "--out", folder=False) == str(tmp_path / "file")  # overwritten
    with pytest.raises(ConfigError, match=r"^--out: .*folder is a folder; name the file"):
        check_output(str(tmp_path / "folder"), "--out", folder=False)
    with pytest.raises(ConfigError, match=r"^--out: .*file/m\.pt: .*file is a file, not a folder"):
        check_output(str(tmp_path / "file" / "m.pt"), "--out", folder=False)
    with pytest.raises(ConfigError, match=r"^--out: .*file/a/b/m\.pt: .*file is a file, not a folder"):
        check_output(str(tmp_path / "file" / "a" / "b" / "m.pt"), "--out", folder=False)


def test_a_folder_goes_where_a_folder_fits(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    assert check_output(str(tmp_path), "--out", folder=True) == str(tmp_path)
    assert check_output(str(tmp_path / "a" / "b"), "--out", folder=True) == str(tmp_path / "a" / "b")
    with pytest.raises(ConfigError, match=r"^--out: .*file is a file; name a folder"):
        check_output(str(tmp_path / "file"), "--out", folder=True)
    with pytest.raises(ConfigError, match=r"is a file, not a folder"):
        check_output(str(tmp_path / "file" / "sub"), "--out", folder=True)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_a_folder_this_user_cannot_write_is_refused(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    with pytest.raises(ConfigError, match="not writable"):
        check_output(str(locked / "m.pt"), "--out", folder=False)


def test_a_read_only_mount_is_named_as_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    monkeypatch.setattr(os, "access", lambda path, mode: False)  # what access(2) answers on a read-only mount,
    monkeypatch.setattr(os, "statvfs", lambda path: SimpleNamespace(f_flag=os.ST_RDONLY))  # to root as well
    with pytest.raises(ConfigError, match=f"{tmp_path} is on a read-only file system"):
        check_output(str(tmp_path / "figures"), "--out", folder=True)


def test_a_local_file_is_written_whole_or_not_at_all(tmp_path: Path) -> None:
    target = check_output(str(tmp_path / "m.pt"), "--out", folder=False)
    (tmp_path / "m.pt").write_bytes(b"the previous export")
    with pytest.raises(KeyboardInterrupt), output_file(target, "--out") as path:
        path.write_bytes(b"half of a")
        raise KeyboardInterrupt  # Ctrl-C mid-write
    assert (tmp_path / "m.pt").read_bytes() == b"the previous export" and os.listdir(tmp_path) == ["m.pt"]
    with output_file(target, "--out") as path:
        path.write_bytes(b"the new export")
    assert (tmp_path / "m.pt").read_bytes() == b"the new export" and os.listdir(tmp_path) == ["m.pt"]


def test_a_misspelt_or_bucket_only_url_is_refused_naming_the_flag() -> None:
    with pytest.raises(ConfigError, match=r"--out"):
        check_output("s3:/bucket/m.pt", "--out", folder=False)
    with pytest.raises(ConfigError, match=r"^--out: s3://bucket: name the file to write inside the bucket"):
        check_output("s3://bucket", "--out", folder=False)


def test_a_bucket_takes_a_file_and_a_folder_and_nothing_stays_behind(moto_s3: str) -> None:
    boto3.client("s3", endpoint_url=moto_s3).create_bucket(Bucket="outputs")
    spools_before = set(Path(tempfile.gettempdir()).glob("vitscale-out-*"))
    target = check_output("s3://outputs/a/m.npz", "--out", folder=False, endpoint_url=moto_s3)
    with output_file(target, "--out", endpoint_url=moto_s3) as path:
        path.write_bytes(b"weights")
    assert check_output("s3://outputs", "--out", folder=True, endpoint_url=moto_s3) == "s3://outputs"  # its root
    folder = check_output("s3://outputs/figures", "--out", folder=True, endpoint_url=moto_s3)
    with output_folder(folder, "--out", endpoint_url=moto_s3) as path:
        (path / "a.png").write_bytes(b"png")
        (path / "tables").mkdir()
        (path / "tables" / "t.parquet").write_bytes(b"pq")
    with pytest.raises(RuntimeError, match="mid-write"), output_file(target.replace("m.npz", "never.pt"), "--out",
                                                                     endpoint_url=moto_s3) as path:
        path.write_bytes(b"half")
        raise RuntimeError("mid-write")
    s3 = boto3.client("s3", endpoint_url=moto_s3)
    keys = {o["Key"]: s3.get_object(Bucket="outputs", Key=o["Key"])["Body"].read()
            for o in s3.list_objects_v2(Bucket="outputs")["Contents"]}
    assert keys == {"a/m.npz": b"weights", "figures/a.png": b"png", "figures/tables/t.parquet": b"pq"}
    assert set(Path(tempfile.gettempdir()).glob("vitscale-out-*")) == spools_before


def test_a_folder_with_a_marker_loses_the_earlier_set_first_and_gets_the_marker_last(tmp_path: Path, moto_s3: str,
                                                                                      monkeypatch: pytest.MonkeyPatch
                                                                                      ) -> None:
    from vitscale.data.storage.s3 import S3Storage

    local = tmp_path / "figures"
    local.mkdir()
    for name in ("done.json", "a.png", "b.png", "mine.txt"):
        (local / name).write_text("earlier")
    with pytest.raises(KeyboardInterrupt), output_folder(str(local), "--out", marker="done.json",
                                                         replaces=("a.png", "b.png")) as path:
        (path / "a.png").write_text("new")
        raise KeyboardInterrupt  # before b.png and the marker: the half set goes too, the user's file stays
    assert {p.name: p.read_text() for p in local.iterdir()} == {"mine.txt": "earlier"}
    with pytest.raises(OSError), output_folder(str(tmp_path / "new" / "figures"), "--out", marker="done.json",
                                               replaces=("a.png",)) as path:
        (path / "a.png").write_text("new")
        raise OSError(28, "No space left on device")
    assert not (tmp_path / "new").exists()  # nor the folders it made

    s3 = boto3.client("s3", endpoint_url=moto_s3)
    s3.create_bucket(Bucket="marked")
    for name in ("done.json", "a.png", "b.png"):
        s3.put_object(Bucket="marked", Key=f"f/{name}", Body=b"earlier")
    uploaded: list[str] = []
    real = S3Storage.write_file
    monkeypatch.setattr(S3Storage, "write_file", lambda self, name, p: (uploaded.append(name), real(self, name, p)))
    with output_folder("s3://marked/f", "--out", endpoint_url=moto_s3, marker="done.json",
                       replaces=("a.png", "b.png")) as path:
        assert {o["Key"] for o in s3.list_objects_v2(Bucket="marked").get("Contents", [])} == set()
        (path / "done.json").write_text("new")
        (path / "a.png").write_text("new")
    assert uploaded == ["a.png", "done.json"]  # the marker last: an upload cut short leaves no marker


def test_a_bucket_that_does_not_exist_is_refused_before_the_work(moto_s3: str) -> None:
    from vitscale.data.storage import StorageError

    with pytest.raises(StorageError, match="no-such-bucket"):
        check_output("s3://no-such-bucket/m.pt", "--out", folder=False, endpoint_url=moto_s3)
    with pytest.raises(StorageError, match="no-such-bucket"):
        check_output("s3://no-such-bucket", "--out", folder=True, endpoint_url=moto_s3)


def test_a_file_over_a_bucket_folder_and_files_into_a_bucket_file_are_refused_as_on_disk(moto_s3: str) -> None:
    """Was accepted: S3 stores `runs/exp1` beside `runs/exp1/...`, and the object then shadows the folder for every
    reader that asks for one name (`fetch.local_copy` takes the file): a run read as a model file."""
    s3 = boto3.client("s3", endpoint_url=moto_s3)
    s3.create_bucket(Bucket="shadows")
    s3.put_object(Bucket="shadows", Key="runs/exp1/checkpoint_000000001/rank0.pt", Body=b"x")
    s3.put_object(Bucket="shadows", Key="models/m.pt", Body=b"weights")
    with pytest.raises(ConfigError, match=r"^--out: s3://shadows/runs/exp1 is a folder \(objects are stored under"):
        check_output("s3://shadows/runs/exp1/", "--out", folder=False, endpoint_url=moto_s3)
    with pytest.raises(ConfigError, match=r"^--out: s3://shadows/runs is a folder"):
        check_output("s3://shadows/runs", "--out", folder=False, endpoint_url=moto_s3)
    with pytest.raises(ConfigError, match=r"^--out: s3://shadows/models/m.pt is a file; name a folder"):
        check_output("s3://shadows/models/m.pt", "--out", folder=True, endpoint_url=moto_s3)
    # A name that merely begins another's is neither: `runs/exp` beside `runs/exp1/`, `models/m` beside `m.pt`.
    assert check_output("s3://shadows/runs/exp", "--out", folder=False, endpoint_url=moto_s3) == "s3://shadows/runs/exp"
    assert check_output("s3://shadows/models/m", "--out", folder=True, endpoint_url=moto_s3) == "s3://shadows/models/m"
    assert check_output("s3://shadows/runs/exp1", "--out", folder=True, endpoint_url=moto_s3)  # a folder for files
    assert check_output("s3://shadows/models/m.pt", "--out", folder=False, endpoint_url=moto_s3)  # a file replaced


def test_export_writes_into_a_bucket_the_same_file_as_on_disk(trained: Path, tmp_path: Path, moto_s3: str,
                                                              monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("VITSCALE_S3_ENDPOINT_URL", moto_s3)
    boto3.client("s3", endpoint_url=moto_s3).create_bucket(Bucket="exports")
    assert main(["export", str(trained), "--out", str(tmp_path / "local.npz")]) == 0
    assert main(["export", str(trained), "--out", "s3://exports/models/vit.npz"]) == 0
    assert '"out": "s3://exports/models/vit.npz"' in capsys.readouterr().out
    stored = boto3.client("s3", endpoint_url=moto_s3).get_object(Bucket="exports", Key="models/vit.npz")
    assert stored["Body"].read() == (tmp_path / "local.npz").read_bytes()
    assert not Path("s3:").exists() and not (Path.cwd() / "s3:").exists()  # never a local folder named "s3:"


def test_export_to_a_wrong_place_is_one_line_naming_out(trained: Path, tmp_path: Path, moto_s3: str,
                                                        monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("VITSCALE_S3_ENDPOINT_URL", moto_s3)
    (tmp_path / "file").write_text("x")
    assert "is a folder" in _one_line_error(capsys, ["export", str(trained), "--out", str(tmp_path)])
    assert "is a file, not a folder" in _one_line_error(
        capsys, ["export", str(trained), "--out", str(tmp_path / "file" / "m.pt")])
    assert "missing-bucket" in _one_line_error(capsys, ["export", str(trained), "--out", "s3://missing-bucket/m.pt"])
    assert "--out" in _one_line_error(capsys, ["export", str(trained), "--out", "s3:/bucket/m.pt"])


def test_export_into_a_full_disk_is_one_line_and_leaves_nothing(trained: Path, small_disk: Callable[..., Path],  # noqa: F811
                                                                 monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    import vitscale.data.storage.space as space

    disk = small_disk(64 * 1024)  # less than the tiny model's weights
    for fmt in ("pt", "npz"):
        err = _one_line_error(capsys, ["export", str(trained), "--out", str(disk / f"m.{fmt}")])
        assert f"no space left on the device of {disk / f'm.{fmt}'} for the model" in err, err
        assert list(disk.iterdir()) == []
    # Written into (free space misread at first): torch's C++ writer says "unexpected pos", no errno; the
    # line is the same and no part file stays.
    real, calls = space.free_bytes, []
    monkeypatch.setattr(space, "free_bytes", lambda p: real(p) if calls.append(p) or len(calls) > 1 else 1 << 40)
    err = _one_line_error(capsys, ["export", str(trained), "--out", str(disk / "m.pt")])
    assert f"no space left on the device of {disk / 'm.pt'} for the model" in err, err
    assert list(disk.iterdir()) == []


def test_a_bucket_is_asked_for_one_empty_page_not_for_what_the_place_holds(moto_s3: str,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A run's storage path may hold every run's checkpoints: the check must not list them."""
    from vitscale.data.storage.outputs import PROBE
    from vitscale.data.storage.s3 import S3Storage

    s3 = boto3.client("s3", endpoint_url=moto_s3)
    s3.create_bucket(Bucket="runs")
    for i in range(5):
        s3.put_object(Bucket="runs", Key=f"team/run{i}/checkpoint_000000001/rank0.pt", Body=b"x")
    asked: list[tuple[str, str]] = []
    real = S3Storage.list_sizes

    def recorded(self: S3Storage, prefix: str = "") -> dict[str, int]:
        found = real(self, prefix)
        asked.append((self.url_of(prefix), str(len(found))))
        return found

    monkeypatch.setattr(S3Storage, "list_sizes", recorded)
    check_output("s3://runs/team", "cluster.storage_path", folder=True, endpoint_url=moto_s3)
    check_output("s3://runs", "--out", folder=True, endpoint_url=moto_s3)
    assert asked == [(f"s3://runs/team/{PROBE}", "0"), (f"s3://runs/{PROBE}", "0")]


def test_an_upload_that_fails_keeps_the_work_and_says_where(moto_s3: str) -> None:
    import re

    from vitscale.data.storage import StorageError

    s3 = boto3.client("s3", endpoint_url=moto_s3)
    s3.create_bucket(Bucket="gone-soon")
    target = check_output("s3://gone-soon/m.pt", "--out", folder=False, endpoint_url=moto_s3)
    with pytest.raises(StorageError, match=r"kept at .*: copy it to s3://gone-soon/m\.pt") as failed, \
            output_file(target, "--out", endpoint_url=moto_s3) as path:
        path.write_bytes(b"minutes of work")
        s3.delete_bucket(Bucket="gone-soon")  # the storage goes away while the work runs
    kept = Path(re.search(r"kept at (\S+):", str(failed.value)).group(1))  # type: ignore[union-attr]
    assert (kept / "m.pt").read_bytes() == b"minutes of work"
    shutil.rmtree(kept)


def test_a_killed_uploads_spool_is_swept_and_a_kept_one_never(moto_s3: str, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    import subprocess
    import sys

    from vitscale.data.storage import cleanup

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(cleanup, "_SWEPT", set())
    # A process killed outright (SIGKILL, the OOM killer) mid-export to a bucket: its spool, the model's size.
    boto3.client("s3", endpoint_url=moto_s3).create_bucket(Bucket="swept")
    code = ("import os, tempfile; from vitscale.data.storage.outputs import output_file; "
            f"tempfile.tempdir = {str(tmp_path)!r}\n"
            f"with output_file('s3://swept/m.pt', '--out', endpoint_url={moto_s3!r}) as path:\n"
            "    path.write_bytes(b'weights'); os.kill(os.getpid(), 9)")
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == -9
    kept = tmp_path / "vitscale-kept-x"  # what a failed upload keeps and names (not swept)
    kept.mkdir()
    assert len(list(tmp_path.glob("vitscale-out-*"))) == 1
    with output_file("s3://swept/m.pt", "--out", endpoint_url=moto_s3) as path:
        path.write_bytes(b"weights")
        assert [p.parent for p in tmp_path.glob("vitscale-out-*/m.pt")] == [path.parent]  # the live one only
    assert sorted(p.name for p in tmp_path.iterdir()) == ["vitscale-kept-x"]
