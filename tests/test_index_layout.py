"""_index.parquet with one row group per shard: open reads the footer only, a rank reads only the row
groups of the shards it touches (counted at the storage layer, locally and on S3), and what it reads
equals the eager (legacy) path's."""

from __future__ import annotations

import io
import json
import logging
import pickle
import shutil
import uuid
from pathlib import Path

import boto3
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from helpers.datasets import write_test_dataset
from vitscale.cli import main
from vitscale.data.carve import Carve
from vitscale.data.format import (
    INDEX_NAME,
    META_NAME,
    DatasetMeta,
    IndexWriter,
    ShardMeta,
    SplitMeta,
    open_dataset,
    read_index,
    shard_name,
)
from vitscale.data.format.index import LAYOUT_KEY, reindex
from vitscale.data.loader.stream import ShardStream
from vitscale.data.storage import LocalStorage, S3Storage, Storage, open_storage

SHARDS, ROWS = 24, 300  # ~230 kB of index: well past the 64 kB pyarrow reads first for a footer


def _metadata_dataset(storage: Storage, shards: int = SHARDS, rows: int = ROWS, *, legacy: bool = False) -> None:
    """Index rows, 1-byte records and dataset.json: a dataset whose index is the thing being read."""
    rng = np.random.default_rng(0)
    tables, metas = [], []
    for s in range(shards):
        n = rows - s % 3  # uneven shards
        keys = [f"{s:04d}-{i:05d}-{rng.integers(1 << 62):x}" for i in range(n)]
        tables.append(pa.table({"split": ["train"] * n, "shard": [shard_name("train", s)] * n, "key": keys,
                                "labels": [[i % 7] for i in range(n)], "offset": np.arange(n, dtype=np.int64),
                                "size": np.ones(n, dtype=np.int64), "width": np.full(n, 8, np.int32),
                                "height": np.full(n, 8, np.int32),
                                "crc32": rng.integers(0, 1 << 32, n, dtype=np.int64)}))
        metas.append(ShardMeta(shard_name("train", s), n, None, n))
        storage.write_bytes(shard_name("train", s), b"\0" * n)
    buf = io.BytesIO()
    if legacy:
        pq.write_table(pa.concat_tables(tables), buf)
    else:
        writer = IndexWriter(buf)
        for s, t in enumerate(tables):
            writer.write_shard("train", shard_name("train", s), t)
        writer.close()
    storage.write_bytes(INDEX_NAME, buf.getvalue())
    meta = DatasetMeta(name="meta-only", num_classes=7, multi_label=False,
                       splits={"train": SplitMeta(sum(m.samples for m in metas), tuple(metas))})
    storage.write_bytes(META_NAME, json.dumps(meta.to_json()).encode())


class Reads:
    """Every read of the index through the storage layer: (how, start, length)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, kind: type[Storage]) -> None:
        self.calls: list[tuple[str, int, int]] = []
        for how in ("read_range", "read_bytes", "open_read"):
            original = getattr(kind, how)

            def spy(storage, name, *args, _how=how, _original=original):  # type: ignore[no-untyped-def]
                if name == INDEX_NAME:
                    start, length = (args[0], args[1]) if _how == "read_range" else (0, -1)
                    self.calls.append((_how, start, length))
                return _original(storage, name, *args)

            monkeypatch.setattr(kind, how, spy)

    def take(self) -> list[tuple[str, int, int]]:
        out, self.calls = self.calls, []
        return out


def _extents(data: bytes) -> tuple[list[tuple[int, int]], int]:
    """Byte extent [start, end) of each row group, and where the footer starts."""
    md = pq.ParquetFile(io.BytesIO(data)).metadata
    out = []
    for g in range(md.num_row_groups):
        cols = [md.row_group(g).column(c) for c in range(md.num_columns)]
        starts = [c.dictionary_page_offset if c.has_dictionary_page else c.data_page_offset for c in cols]
        out.append((min(starts), max(s + c.total_compressed_size for s, c in zip(starts, cols))))
    footer = len(data) - 8 - int.from_bytes(data[-8:-4], "little")
    return out, footer


def _groups_read(calls: list[tuple[str, int, int]], data: bytes) -> set[int]:
    """Row groups whose bytes the ranged reads cover, leaving out pyarrow's first footer read (the last
    64 kB of the file, which may overlap the last groups); fails on a read that is not ranged."""
    extents, _ = _extents(data)
    assert all(how == "read_range" for how, _, _ in calls), calls
    groups = set()
    for _, start, length in calls:
        if start + length >= len(data) and length <= 64 << 10:
            continue  # the footer read
        hit = {g for g, (lo, hi) in enumerate(extents) if start < hi and lo < start + length}
        assert hit, f"read [{start}, {start + length}) outside every row group"
        groups |= hit
    return groups


@pytest.fixture(params=["local", "s3"])
def where(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, str | None, type[Storage]]:
    if request.param == "local":
        return str(tmp_path / "ds"), None, LocalStorage
    endpoint = request.getfixturevalue("moto_s3")
    bucket = f"vitscale-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
    return f"s3://{bucket}/ds", endpoint, S3Storage


def test_open_reads_the_footer_and_a_shard_only_its_row_group(where, monkeypatch) -> None:
    url, endpoint, kind = where
    storage = open_storage(url, endpoint_url=endpoint)
    _metadata_dataset(storage)
    data = storage.read_bytes(INDEX_NAME)
    reads = Reads(monkeypatch, kind)

    ds = open_dataset(url, "train", endpoint_url=endpoint)
    assert ds.lazy
    opened = reads.take()
    assert _groups_read(opened, data) == set()  # the footer only
    assert sum(n for _, _, n in opened) <= (64 << 10) + len(data) - _extents(data)[1]
    assert sum(n for _, _, n in opened) < len(data) / 2

    index = ds.load_index([3, 17])
    calls = reads.take()
    assert _groups_read(calls, data) == {3, 17} and len(calls) == 2  # one request per shard

    whole = read_index(storage)  # the eager path's rows, shard by shard
    for s in (3, 17):
        rows = whole.filter(pa.compute.equal(whole["shard"], shard_name("train", s)))
        assert index[s].keys.to_pylist() == rows["key"].to_pylist()
        assert index[s].offsets.tolist() == rows["offset"].to_pylist()
        assert index[s].sizes.tolist() == rows["size"].to_pylist()
        assert index[s].crcs is not None and index[s].crcs.tolist() == rows["crc32"].to_pylist()


def test_a_ranks_first_batch_reads_only_the_row_groups_it_touches(tmp_path, monkeypatch) -> None:
    url = str(tmp_path / "ds")
    _metadata_dataset(open_storage(url))
    data = (tmp_path / "ds" / INDEX_NAME).read_bytes()
    reads = Reads(monkeypatch, LocalStorage)
    stream = ShardStream(url, "train", rank=2, world_size=4, batch_size=16, resolution=8, shuffle_buffer=64)
    assert _groups_read(reads.take(), data) == set()
    order = stream.epoch_order()
    shards = set(order.locate(order.global_indices(0, 16))[0].tolist())
    batch = next(iter(stream.epoch_batches()))  # records of one byte: all skipped, which is fine here
    assert batch["_count"] == 16
    assert _groups_read(reads.take(), data) == shards
    assert len(shards) < SHARDS // 4  # fewer than the rank's span: the rows are read as batches reach them


def test_lazy_rows_equal_the_legacy_eager_rows(tmp_path) -> None:
    lazy, eager = str(tmp_path / "lazy"), str(tmp_path / "eager")
    _metadata_dataset(open_storage(lazy))
    _metadata_dataset(open_storage(eager), legacy=True)
    a, b = open_dataset(lazy, "train"), open_dataset(eager, "train")
    assert a.lazy and not b.lazy and a.counts == b.counts and a.has_crc and b.has_crc
    left, right = a.load_index(range(SHARDS)), b.load_index(range(SHARDS))
    assert sorted(left) == sorted(right) == list(range(SHARDS))
    again = pickle.loads(pickle.dumps(a)).load_index(range(SHARDS))  # a spawned loader worker's copy
    for s in range(SHARDS):
        x, y = left[s], right[s]
        assert x.keys.equals(y.keys) and (x.offsets == y.offsets).all() and (x.sizes == y.sizes).all()
        assert x.crcs is not None and y.crcs is not None and (x.crcs == y.crcs).all()
        assert again[s].keys.equals(x.keys) and (again[s].offsets == x.offsets).all()


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A dataset with real JPEGs in the legacy layout (the test writer's), and a reindexed copy."""
    root = tmp_path_factory.mktemp("images")
    legacy = write_test_dataset(root / "legacy", {"train": [7, 5, 9, 3, 6, 8], "val": [4, 3]})
    shutil.copytree(legacy, root / "new")
    assert reindex(str(root / "new"))["rewritten"]
    return legacy, root / "new"


@pytest.mark.parametrize("kw", [
    dict(rank=1, world_size=2, seed=3),
    dict(rank=0, world_size=1, seed=1, num_workers=2, shuffle_buffer=5),
    dict(rank=0, world_size=1, split="val", train=False),
    dict(rank=0, world_size=1, carve=Carve(0.3, seed=2, part="rest")),
])
def test_the_stream_reads_the_same_batches_from_either_layout(images, kw) -> None:
    legacy, new = images

    def epoch(url: Path, resume: bool = False) -> list[tuple[list[str], list[int], bytes]]:
        args = dict(kw)
        stream = ShardStream(str(url), args.pop("split", "train"), batch_size=4, resolution=16, **args)
        assert stream.dataset.lazy == (url == new)
        if resume:
            stream.load_state_dict({"epoch": 0, "position": 4, "seed": stream.seed})
        return [(b["key"], b["label"].tolist(), b["image"].numpy().tobytes()) for b in stream]

    assert epoch(new) == epoch(legacy)
    assert epoch(new, resume=True) == epoch(legacy, resume=True)


def test_reindex_keeps_every_row_and_says_so_once(images, capsys) -> None:
    legacy, new = images
    assert sorted(read_index(str(new)).to_pylist(), key=lambda r: r["key"]) == \
        sorted(read_index(str(legacy)).to_pylist(), key=lambda r: r["key"])
    md = pq.ParquetFile(new / INDEX_NAME).metadata
    assert md.num_row_groups == 6 + 2  # one per shard, train's then val's
    assert main(["shards", "reindex", str(new)]) == 0
    assert json.loads(capsys.readouterr().out)["rewritten"] is False


def test_reindex_of_an_index_another_tool_rewrote_names_it_once(images, tmp_path, capsys) -> None:
    """The check's own line, not wrapped again in 'cannot read <index>: <index>: ...'."""
    legacy = shutil.copytree(images[0], tmp_path / "legacy")
    table = pq.read_table(legacy / INDEX_NAME)
    pq.write_table(table.set_column(table.column_names.index("offset"), "offset",
                                    table.column("offset").cast(pa.string())), legacy / INDEX_NAME)
    capsys.readouterr()
    assert main(["shards", "reindex", str(legacy)]) == 2
    assert capsys.readouterr().err == (f"vitscale: error: {legacy / INDEX_NAME}: column 'offset' is string, the "
                                       "contract has integers: a damaged index, or one another tool rewrote\n")


def test_a_legacy_index_is_read_and_names_the_command_that_rewrites_it(images, tmp_path, caplog) -> None:
    legacy = shutil.copytree(images[0], tmp_path / "legacy")  # said once per index and process: a new one
    caplog.set_level(logging.WARNING, logger="vitscale.data.format.split")
    assert not open_dataset(str(legacy), "train").lazy
    assert [r.getMessage().count(f"vitscale shards reindex {legacy}") for r in caplog.records] == [1]
    open_dataset(str(legacy), "val")
    assert len(caplog.records) == 1


def test_a_layout_record_that_no_longer_matches_the_row_groups_is_ignored(images, tmp_path) -> None:
    _, new = images
    copy = Path(shutil.copytree(new, tmp_path / "copy"))
    record = pq.ParquetFile(copy / INDEX_NAME).metadata.metadata[LAYOUT_KEY.encode()]
    table = pq.read_table(copy / INDEX_NAME)
    with pq.ParquetWriter(copy / INDEX_NAME, table.schema) as w:  # rewritten whole by another tool
        w.write_table(table)
        w.add_key_value_metadata({LAYOUT_KEY: record.decode()})
    ds = open_dataset(str(copy), "train")
    assert not ds.lazy and sum(len(e.offsets) for e in ds.load_index(range(6)).values()) == 38


def test_writers_write_the_per_shard_layout(tmp_path) -> None:
    from vitscale.data import DatasetWriter

    with DatasetWriter(str(tmp_path / "w"), name="w", classes=["a", "b"], shard_size=3) as w:
        for i in range(8):
            w.add(np.full((8, 8, 3), i * 20, np.uint8), i % 2)
    ds = open_dataset(str(tmp_path / "w"), "train")
    assert ds.lazy and ds.counts == (3, 3, 2)
    assert pq.ParquetFile(tmp_path / "w" / INDEX_NAME).metadata.num_row_groups == 3
