"""The `vitscale shards` verbs end to end, as a user runs them (in-process `main`, real files)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vitscale.cli import main


def cli_json(capsys: pytest.CaptureFixture, *argv: str) -> object:
    assert main(list(argv)) == 0
    return json.loads(capsys.readouterr().out)


@pytest.fixture(scope="module")
def digits(tmp_path_factory: pytest.TempPathFactory) -> str:
    out = str(tmp_path_factory.mktemp("ds") / "digits")
    assert main(["shards", "write", "--source", "digits", "--out", out, "--shard-size", "400",
                 "--split", "train=0.8,test=0.2", "--seed", "3"]) == 0
    return out


def test_write_stats_verify_agree(digits: str, capsys: pytest.CaptureFixture) -> None:
    capsys.readouterr()
    stats = cli_json(capsys, "shards", "stats", digits, "--json")
    assert stats["samples"] == 1797 and stats["classes"] == 10
    assert stats["shards"] == len(list(Path(digits).glob("*.tar")))
    assert main(["shards", "verify", digits]) == 0


def test_verify_names_a_corrupted_shard(digits: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(digits, copy)
    shard = sorted(copy.glob("train-*.tar"))[1]
    data = bytearray(shard.read_bytes())
    data[5000] ^= 0xFF
    shard.write_bytes(bytes(data))
    capsys.readouterr()
    assert main(["shards", "verify", str(copy)]) == 1
    assert shard.name in capsys.readouterr().err


def test_order_covers_each_split_once_across_ranks(digits: str, capsys: pytest.CaptureFixture) -> None:
    capsys.readouterr()
    world = 3
    orders = [cli_json(capsys, "shards", "order", digits, "--rank", str(r), "--world-size", str(world),
                       "--epoch", "1", "--json") for r in range(world)]
    keys = [k for order in orders for k in order]
    assert len({len(o) for o in orders}) == 1               # every rank the same number of samples
    assert len(keys) == len(set(keys))                      # no sample twice
    train = cli_json(capsys, "shards", "stats", digits, "--json")["splits"]["train"]["samples"]
    assert train - len(keys) < world                        # at most world - 1 left out
    tail = cli_json(capsys, "shards", "order", digits, "--rank", "1", "--world-size", str(world),
                    "--epoch", "1", "--start", "17", "--json")
    assert tail == orders[1][17:]                           # resume = the tail of the same order
    other = cli_json(capsys, "shards", "order", digits, "--rank", "1", "--world-size", str(world),
                     "--epoch", "2", "--json")
    assert other != orders[1]                               # a new epoch, a new order


def test_bench_reports_throughput(digits: str, capsys: pytest.CaptureFixture) -> None:
    capsys.readouterr()
    result = cli_json(capsys, "shards", "bench", digits, "--resolution", "32", "--seconds", "1",
                      "--workers", "1", "--batch-size", "32", "--json")
    assert result["images_per_s"] > 0 and result["workers"] == 1


def test_dedup_drops_test_images_planted_in_train(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    # The same digits written twice with different split seeds: every test image of one copy is in
    # the other's training split, re-encoded, so dedup must find them.
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    assert main(["shards", "write", "--source", "digits", "--out", a, "--split", "train=0.9,test=0.1",
                 "--seed", "1", "--image-size", "64"]) == 0
    assert main(["shards", "write", "--source", "digits", "--out", b, "--split", "train=0.9,test=0.1",
                 "--seed", "2", "--image-size", "64", "--quality", "75"]) == 0
    capsys.readouterr()
    summary = cli_json(capsys, "shards", "dedup", "--train", a, "--against", b, "--out", str(tmp_path / "clean"),
                       "--threshold", "4")
    stats = cli_json(capsys, "shards", "stats", str(tmp_path / "clean"), "--json")
    removed = 1797 - stats["samples"]
    assert removed >= 150, summary   # ~180 test images of b sit in a's splits (re-encoded at q75)
    assert main(["shards", "verify", str(tmp_path / "clean")]) == 0


def test_bad_source_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["shards", "write", "--source", "pictures", "--out", str(tmp_path / "x")]) == 2
    assert "unknown source" in capsys.readouterr().err


@pytest.mark.parametrize(("chroma", "sampling"), [("4:2:0", 2), ("4:4:4", 0)])
def test_write_offers_full_chroma_for_small_images(tmp_path: Path, chroma: str, sampling: int) -> None:
    import io
    import tarfile

    from PIL import Image, JpegImagePlugin

    from vitscale.data.format import read_meta

    out = tmp_path / chroma.replace(":", "")
    assert main(["shards", "write", "--source", "synthetic", "--out", str(out), "--count", "4", "--classes", "2",
                 "--image-size", "32", "--chroma", chroma]) == 0
    assert read_meta(str(out)).extra["chroma"] == chroma
    with tarfile.open(next(out.glob("train-*.tar"))) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith(".jpg"))
        image = Image.open(io.BytesIO(tar.extractfile(member).read()))  # type: ignore[union-attr]
        assert JpegImagePlugin.get_sampling(image) == sampling  # PIL: 0 = 4:4:4, 2 = 4:2:0


def test_a_damaged_index_is_one_line_naming_it(digits: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(digits, copy)
    index = copy / "_index.parquet"
    index.write_bytes(index.read_bytes()[:100])  # cut short: no parquet footer
    capsys.readouterr()
    assert main(["shards", "stats", str(copy)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"vitscale: error: cannot read {index}: ") and err.count("\n") == 1, err


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads in /proc (Linux)")
def test_reading_a_whole_index_starts_no_thread_and_the_interpreter_exits_cleanly(digits: str) -> None:
    """pyarrow's pool threads, alive as the interpreter exits, aborted a third of the processes that had read
    an index with threads (exit 134, "terminate called without an active exception"), and one in ten under
    load after reads on one thread: pyarrow's dataset scanner starts two pool threads even then. An index is
    now read with no Arrow thread at all (`read_parquet`), counted in a fresh process, which exits 0."""
    import subprocess
    import sys

    code = ("import os; from vitscale.data.format import read_index; n = lambda: len(os.listdir('/proc/self/task'))\n"
            f"before = n(); rows = read_index({digits!r}).num_rows; print(before, n(), rows)")
    results = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True) for _ in range(3)]
    assert [(r.returncode, r.stderr) for r in results] == [(0, "")] * 3
    before, after, rows = map(int, results[0].stdout.split())
    assert rows > 0 and after == before, f"{after - before} thread(s) started by reading the index"


def test_an_out_that_is_a_file_is_refused_before_the_work(digits: str, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "file").write_text("x")
    for argv in (["shards", "write", "--source", "synthetic", "--out", str(tmp_path / "file")],
                 ["shards", "dedup", "--train", digits, "--against", digits, "--out", str(tmp_path / "file")],
                 ["shards", "write", "--source", "synthetic", "--out", str(tmp_path / "file" / "inside")]):
        capsys.readouterr()
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"vitscale: error: --out: {argv[-1]}") and "is a file" in err, err
    assert (tmp_path / "file").read_text() == "x"


def test_a_bad_resolution_is_named_as_the_user_passed_it(digits: str, capsys: pytest.CaptureFixture) -> None:
    capsys.readouterr()
    assert main(["shards", "bench", digits, "--resolution", "0", "--seconds", "1"]) == 2
    assert capsys.readouterr().err.startswith("vitscale: error: --resolution: must be a positive int, got 0")


@pytest.mark.parametrize(("source", "side", "says"), [
    ("synthetic", "100000", "--image-size: must be in [8, 4096] px"),  # was a 112-GiB array's MemoryError
    ("fractal", "8", "--image-size: must be in [16, 4096] px"), ("digits", "4097", "--image-size")])
def test_a_side_no_source_can_draw_is_refused_before_anything_is_written(source: str, side: str, says: str,
                                                                        tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture) -> None:
    capsys.readouterr()
    count = [] if source == "digits" else ["--count", "10"]  # digits are the 1,797 they are
    assert main(["shards", "write", "--source", source, *count, "--image-size", side, "--out", str(tmp_path / "ds")]) == 2
    assert capsys.readouterr().err.startswith(f"vitscale: error: {says}")
    assert not (tmp_path / "ds").exists()


@pytest.mark.parametrize(("workers", "says"), [("0", "must be a positive int, got 0"), ("100000", "at most 64, got 100000")])
def test_a_loader_count_that_cannot_run_is_refused_before_any_fork(workers: str, says: str, digits: str,
                                                                   capsys: pytest.CaptureFixture) -> None:
    capsys.readouterr()
    assert main(["shards", "bench", digits, "--workers", workers, "--seconds", "1"]) == 2
    assert capsys.readouterr().err.startswith(f"vitscale: error: --workers: {says}")


def _rewrite_index(root: Path, change) -> None:
    import pyarrow.parquet as pq

    index = root / "_index.parquet"
    pq.write_table(change(pq.read_table(index)), index)


def _rewrite_meta(root: Path, change) -> None:
    meta = json.loads((root / "dataset.json").read_text())
    change(meta)
    (root / "dataset.json").write_text(json.dumps(meta))


def _set_column(name: str, values) -> object:
    import pyarrow as pa

    def change(t: pa.Table) -> pa.Table:
        return t.set_column(t.column_names.index(name), name, pa.array(values(t.column(name).to_pylist())))

    return lambda root: _rewrite_index(root, change)


def _first(value: object):
    return lambda v: [value, *v[1:]]


@pytest.mark.parametrize(("damage", "names", "says"), [
    # Another tool's rewrite of the index: a contract column gone, or of another kind.
    (lambda r: _rewrite_index(r, lambda t: t.drop(["key"])), "_index.parquet", r"lacks columns \['key'\]"),
    (_set_column("offset", lambda v: [str(x) for x in v]), "_index.parquet", "column 'offset' is string"),
    (_set_column("labels", lambda v: [str(x) for x in v]), "_index.parquet", "column 'labels' is string"),
    # A label outside dataset.json's classes was an IndexError (or -1, null counted against another class).
    (_set_column("labels", _first([10])), "_index.parquet", r"has labels \[10\], outside \[0, 10\)"),
    (_set_column("labels", _first([-1])), "_index.parquet", r"has labels \[-1\], outside"),
    (_set_column("labels", _first(None)), "_index.parquet", "has labels None, outside"),
    # dataset.json's shard names are files under the dataset, each once.
    (lambda r: _rewrite_meta(r, lambda m: m["splits"]["train"]["shards"][0].update(name="../x.tar")),
     "dataset.json", "shard '../x.tar' is not a file name inside the dataset"),
    (lambda r: _rewrite_meta(r, lambda m: m["splits"]["test"]["shards"].append(m["splits"]["train"]["shards"][0])),
     "dataset.json", "shard 'train-000000.tar' is listed twice"),
    # A later layout is refused, not misread; names for classes are one per class.
    (lambda r: _rewrite_meta(r, lambda m: m.update(format=99)), "dataset.json", "format 99 is not one this vitscale reads"),
    (lambda r: _rewrite_meta(r, lambda m: m.update(format="1")), "dataset.json", "format '1' is not one"),
    (lambda r: _rewrite_meta(r, lambda m: m.update(classes=m["classes"][:3])), "dataset.json",
     "classes names 3 classes but num_classes is 10"),
])
def test_a_damaged_index_or_metadata_is_one_line_naming_it(digits: str, tmp_path: Path, capsys: pytest.CaptureFixture,
                                                           damage, names: str, says: str) -> None:
    import re
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(digits, copy)
    damage(copy)
    capsys.readouterr()
    assert main(["shards", "stats", str(copy)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"vitscale: error: {copy / names}") and err.count("\n") == 1, err
    assert re.search(says, err), err
    if "outside" not in says:  # verify checks labels against the tars, sample by sample: its own test
        assert main(["shards", "verify", str(copy)]) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"BAD {copy}: ") and err.count("\n") == 1 and re.search(says, err), err


def test_stats_and_verify_read_an_index_without_labels(digits: str, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture) -> None:
    """Third-party writers may leave the labels column out (INDEX_COLUMNS): per-class counts are unknown,
    not a KeyError."""
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(digits, copy)
    _rewrite_index(copy, lambda t: t.drop(["labels"]))
    capsys.readouterr()
    stats = cli_json(capsys, "shards", "stats", str(copy), "--json")
    assert stats["samples"] == 1797 and stats["splits"]["train"]["classes_present"] is None
    assert main(["shards", "stats", str(copy)]) == 0 and "-" in capsys.readouterr().out
    assert main(["shards", "verify", str(copy)]) == 0
