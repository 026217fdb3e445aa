"""Silent corruption is found: every record's crc32 is in the index and checked when it is read."""

from __future__ import annotations

import logging
import zlib
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from vitscale.data.format import CRC_COLUMN, INDEX_NAME, open_dataset
from vitscale.data.loader.stream import ShardStream
from vitscale.data.tools.write import write_dataset


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("crc") / "ds"
    write_dataset("synthetic", str(out), shard_size=6, progress=False, workers=1,
                  source_options={"count": 12, "image_size": 48, "classes": 3})  # fmt: skip
    return out


def _epoch(url: Path) -> tuple[list[str], ShardStream]:
    s = ShardStream(str(url), batch_size=4, resolution=16, train=False, error_budget=0.5)
    keys = [k for b in s for k, ok in zip(b["key"], b["valid"].tolist()) if ok]
    return keys, s


def test_writer_stores_each_records_crc32(written):
    rows = pq.read_table(written / INDEX_NAME).to_pylist()
    assert len(rows) == 12
    for r in rows:
        with open(written / r["shard"], "rb") as f:
            f.seek(r["offset"])
            assert zlib.crc32(f.read(r["size"])) == r[CRC_COLUMN]
    assert open_dataset(str(written), "train").has_crc


def _flip_inside_jpeg(root: Path) -> tuple[str, str]:
    """Flip one bit in the middle of the first sample's JPEG data: it still decodes, silently wrong."""
    row = pq.read_table(root / INDEX_NAME).to_pylist()[0]
    with open(root / row["shard"], "r+b") as f:
        at = row["offset"] + 512 + 600  # past the jpg member's header, inside its entropy-coded data
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x01]))
    return row["shard"], row["key"]


def test_flipped_bit_is_a_skipped_sample_naming_the_shard(written, tmp_path, caplog):
    import shutil

    damaged = Path(shutil.copytree(written, tmp_path / "damaged"))
    shard, key = _flip_inside_jpeg(damaged)
    # Without the checksum column (a dataset written before it existed) the damage goes unseen:
    # the stream still reads such datasets, and the damaged sample decodes.
    legacy = Path(shutil.copytree(damaged, tmp_path / "legacy"))
    table = pq.read_table(legacy / INDEX_NAME)
    pq.write_table(table.drop_columns([CRC_COLUMN]), legacy / INDEX_NAME)
    keys, s = _epoch(legacy)
    assert key in keys and s.skipped() == {} and not s.dataset.has_crc
    # With it, the sample is skipped, counted against its shard and logged with the shard's path.
    caplog.set_level(logging.WARNING, logger="vitscale.data.loader.stream")
    keys, s = _epoch(damaged)
    assert key not in keys and len(keys) == 11
    assert s.skipped() == {shard: 1}
    assert any("checksum mismatch" in r.getMessage() and shard in r.getMessage() for r in caplog.records)
