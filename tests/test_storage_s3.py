"""Storage against a real S3-protocol server (moto's standalone server on loopback).

Faults are injected by a loopback HTTP proxy in front of moto (tests/helpers/s3_faults.py) that answers a
fraction of requests with 500/503, drops the connection without answering, or cuts a response body
short, so the real botocore/urllib3 error paths and our retry layer are exercised end to end.
"""

from __future__ import annotations

import io
import pickle
import random
import uuid

import boto3
import pytest

from helpers.s3_faults import FaultProxy
from vitscale.data.format import read_index, read_meta
from vitscale.data.storage import RetryPolicy, S3Storage, StorageError, open_storage
from vitscale.data.tools.scan import iter_shard
from vitscale.data.tools.verify import dataset_stats, verify_dataset
from vitscale.data.tools.write import write_dataset

FAST_RETRY = RetryPolicy(max_attempts=10, base_delay_s=0.001, max_delay_s=0.01)


@pytest.fixture
def bucket(moto_s3: str) -> str:
    """A fresh bucket on the moto server."""
    name = f"vitscale-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=moto_s3).create_bucket(Bucket=name)
    return name


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path, moto_s3: str):  # type: ignore[no-untyped-def]
    """The same Storage contract on both back ends."""
    if request.param == "local":
        return open_storage(str(tmp_path / "ds"))
    name = f"vitscale-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=moto_s3).create_bucket(Bucket=name)
    return open_storage(f"s3://{name}/some/prefix", endpoint_url=moto_s3)


def test_storage_contract(store) -> None:  # type: ignore[no-untyped-def]
    data = bytes(range(256)) * 40
    store.write_bytes("a.bin", data)
    store.write_bytes("sub/b.bin", b"bee")
    assert store.read_bytes("a.bin") == data
    assert store.read_range("a.bin", 1000, 77) == data[1000:1077]
    assert store.read_range("a.bin", len(data) - 5, 100) == data[-5:]
    assert store.read_range("a.bin", len(data) + 10, 5) == b""
    assert store.size("a.bin") == len(data)
    assert store.exists("a.bin") and not store.exists("nope.bin")
    assert store.list() == ["a.bin", "sub/b.bin"]
    assert store.list("sub/") == ["sub/b.bin"]
    with store.open_read("a.bin") as f:
        assert f.read(10) == data[:10]
        f.seek(5000)
        assert f.read(20) == data[5000:5020]
        f.seek(-3, io.SEEK_END)
        assert f.read() == data[-3:]
    store.write_bytes("a.bin", b"replaced")
    assert store.read_bytes("a.bin") == b"replaced"
    clone = pickle.loads(pickle.dumps(store))
    assert clone.read_bytes("sub/b.bin") == b"bee"
    with pytest.raises(FileNotFoundError, match="nope.bin"):
        store.read_bytes("nope.bin")
    with pytest.raises(ValueError):
        store.read_bytes("../escape")


def test_missing_object_error_names_it(moto_s3: str, bucket: str) -> None:
    st = open_storage(f"s3://{bucket}/ds", endpoint_url=moto_s3)
    for call in (lambda: st.read_bytes("gone.tar"), lambda: st.read_range("gone.tar", 0, 10), lambda: st.open_read("gone.tar")):
        with pytest.raises(FileNotFoundError, match=f"s3://{bucket}/ds/gone.tar"):
            call()


@pytest.mark.parametrize("var", ["VITSCALE_S3_ENDPOINT_URL", "AWS_ENDPOINT_URL"])
def test_endpoint_from_environment(var: str, moto_s3: str, bucket: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(var, moto_s3)
    st = open_storage(f"s3://{bucket}")
    assert isinstance(st, S3Storage) and st.endpoint_url == moto_s3
    st.write_bytes("x", b"1")
    assert st.url_of("x") == f"s3://{bucket}/x" and st.read_bytes("x") == b"1"


def test_large_upload_is_multipart(moto_s3: str, bucket: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    st = S3Storage(bucket, "big", endpoint_url=moto_s3, multipart_threshold=5 * 2**20, multipart_chunksize=5 * 2**20)
    payload = random.Random(1).randbytes(11 * 2**20 + 123)
    (tmp_path / "shard.tar").write_bytes(payload)
    st.write_file("shard.tar", tmp_path / "shard.tar")
    st.write_bytes("blob.tar", payload)
    for name in ("shard.tar", "blob.tar"):
        etag = st.client.head_object(Bucket=bucket, Key=f"big/{name}")["ETag"]
        assert etag.strip('"').endswith("-3"), etag  # 3 parts of 5 MiB
        assert st.read_bytes(name) == payload


def test_write_digits_to_s3_matches_local(moto_s3: str, bucket: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    kw = {"shard_size": 400, "max_side": 32, "splits": {"train": 0.8, "minival": 0.2}, "progress": False}
    url = f"s3://{bucket}/digits"
    meta_s3 = write_dataset("digits", url, endpoint_url=moto_s3, **kw)
    meta_local = write_dataset("digits", str(tmp_path / "digits"), **kw)
    # Shards are byte-reproducible: the same inputs give the same SHA-256 wherever they land.
    assert meta_s3["splits"] == meta_local["splits"]
    assert verify_dataset(url, endpoint_url=moto_s3) == []
    stats = dataset_stats(url, endpoint_url=moto_s3)
    assert stats["samples"] == 1797 and stats["classes"] == 10
    assert stats["shards"] == len(open_storage(url, endpoint_url=moto_s3).list("train-")) + 1
    assert {s: v["samples"] for s, v in stats["splits"].items()} == {"train": 1438, "minival": 359}
    assert stats == {**dataset_stats(str(tmp_path / "digits")), "url": url}


def test_synthetic_multilabel_on_s3_and_corruption_found(moto_s3: str, bucket: str) -> None:
    url = f"s3://{bucket}/synth"
    opts = {"count": 48, "classes": 5, "image_size": 40, "multi_label": True}
    meta = write_dataset("synthetic", url, shard_size=20, source_options=opts, endpoint_url=moto_s3, progress=False)
    assert meta["multi_label"] and [s["samples"] for s in meta["splits"]["train"]["shards"]] == [20, 20, 8]
    assert verify_dataset(url, endpoint_url=moto_s3) == []
    st = open_storage(url, endpoint_url=moto_s3)
    raw = bytearray(st.read_bytes("train-000001.tar"))
    raw[700] ^= 0xFF  # flip a byte inside the first JPEG
    st.write_bytes("train-000001.tar", bytes(raw))
    st.client.delete_object(Bucket=bucket, Key="synth/train-000002.tar")
    problems = verify_dataset(url, endpoint_url=moto_s3)
    assert any(p.startswith("train-000001.tar: sha256 mismatch") for p in problems), problems
    assert any(p.startswith("train-000002.tar") and f"s3://{bucket}/synth/train-000002.tar" in p for p in problems), problems
    assert not any("train-000000.tar" in p for p in problems)


def test_flaky_server_loses_no_sample(moto_s3: str, bucket: str) -> None:
    url = f"s3://{bucket}/flaky"
    opts = {"count": 240, "classes": 4, "image_size": 24}
    write_dataset("synthetic", url, shard_size=60, source_options=opts, endpoint_url=moto_s3, progress=False)
    direct = open_storage(url, endpoint_url=moto_s3)
    meta, rows = read_meta(url, endpoint_url=moto_s3), read_index(url, endpoint_url=moto_s3).to_pylist()
    blobs = {name: direct.read_bytes(name) for name in meta.shard_names()}
    expected = {r["key"]: blobs[r["shard"]][r["offset"] : r["offset"] + r["size"]] for r in rows}
    port = int(moto_s3.rsplit(":", 1)[1])
    with FaultProxy(port, fault_rate=0.3, methods=("GET", "HEAD", "PUT"), seed=7) as proxy:
        flaky = open_storage(url, endpoint_url=proxy.url, retry=FAST_RETRY)
        # Every sample through ranged reads ...
        got = {r["key"]: flaky.read_range(r["shard"], r["offset"], r["size"]) for r in rows}
        assert got == expected
        # ... and through streamed whole-shard reads, which resume mid-body after a drop.
        streamed = {}
        for name in meta.shard_names("train"):
            with flaky.open_read(name) as f:
                streamed.update({s.key: s.files["jpg"] for s in iter_shard(f)})
        assert len(streamed) == 240
        assert verify_dataset(url, endpoint_url=proxy.url) == []
        # Writes through the proxy are retried as well: a whole dataset, uploads included.
        flaky.write_bytes("note.txt", b"written through faults")
        url2 = f"s3://{bucket}/flaky-write"
        write_dataset("synthetic", url2, shard_size=10, source_options={"count": 60, "classes": 3, "image_size": 16},
                      endpoint_url=proxy.url, progress=False)
    assert proxy.counts["truncate"] > 0 and proxy.counts["drop"] > 0 and proxy.counts["500"] > 0
    assert set(proxy.faulted_methods) == {"GET", "HEAD", "PUT"}, proxy.faulted_methods
    assert direct.read_bytes("note.txt") == b"written through faults"
    assert verify_dataset(url2, endpoint_url=moto_s3) == []
    assert read_index(url2, endpoint_url=moto_s3).num_rows == 60


def test_persistent_failure_names_object(moto_s3: str, bucket: str) -> None:
    open_storage(f"s3://{bucket}/p", endpoint_url=moto_s3).write_bytes("train-000000.tar", b"x" * 100)
    port = int(moto_s3.rsplit(":", 1)[1])
    with FaultProxy(port, fault_rate=1.0) as proxy:
        st = open_storage(f"s3://{bucket}/p", endpoint_url=proxy.url, retry=RetryPolicy(3, 0.001, 0.002))
        with pytest.raises(StorageError, match=f"s3://{bucket}/p/train-000000.tar failed after 3 attempts"):
            st.read_bytes("train-000000.tar")
    assert proxy.counts["ok"] == 0 and proxy.faults == 3


def test_a_stream_never_splices_an_object_written_again_while_it_is_read(moto_s3: str, bucket: str) -> None:
    """A seek or a resumed drop is a new GET: it must read the version the stream opened, or fail saying why
    (was: the rest of the new version at the same size, one file spliced from two writes, no error)."""
    direct = open_storage(f"s3://{bucket}/p", endpoint_url=moto_s3)
    direct.write_bytes("model.pt", b"A" * (3 << 20))
    with direct.open_read("model.pt") as f:
        assert f.read(10) == b"A" * 10
        direct.write_bytes("model.pt", b"B" * (3 << 20))  # an export written again to the same URL
        f.seek(2 << 20)
        with pytest.raises(StorageError, match=f"s3://{bucket}/p/model.pt: the object was written again"):
            f.read(10)
    direct.write_bytes("model.pt", b"A" * (3 << 20))
    with FaultProxy(int(moto_s3.rsplit(":", 1)[1])) as proxy:
        st = open_storage(f"s3://{bucket}/p", endpoint_url=proxy.url, retry=FAST_RETRY)
        with st.open_read("model.pt") as f:
            proxy.schedule("truncate")  # the first GET's body ends half way: the resumed GET meets version B
            direct.write_bytes("model.pt", b"B" * (3 << 20))
            with pytest.raises(StorageError, match="written again while it was being read"):
                f.read()
        assert proxy.counts["truncate"] == 1
        with st.open_read("model.pt") as f:  # a stream opened after the write reads it whole
            assert f.read() == b"B" * (3 << 20)


def test_retry_policy_backoff_is_bounded() -> None:
    p = RetryPolicy(max_attempts=5, base_delay_s=0.1, max_delay_s=0.5)
    rng = random.Random(0)
    for attempt in range(1, 10):
        d = p.delay(attempt, rng)
        assert 0.0 <= d <= min(0.5, 0.1 * 2 ** (attempt - 1))
    with pytest.raises(ValueError):
        RetryPolicy(max_attempts=0)


def test_open_storage_rejects_unknown_scheme() -> None:
    with pytest.raises(ValueError, match="gs://"):
        open_storage("gs://bucket/x")
    with pytest.raises(ValueError, match="bucket"):
        open_storage("s3://")
