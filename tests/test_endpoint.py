"""One object-storage endpoint per run: the pipeline's data.endpoint_url steers boto3 and pyarrow alike."""

from __future__ import annotations

import os

import pytest

from vitscale.config.checks import ConfigError
from vitscale.data.storage import open_storage
from vitscale.data.storage.endpoint import endpoint_env, run_endpoint
from vitscale.data.storage.filesystem import run_filesystem


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("VITSCALE_S3_ENDPOINT_URL", "AWS_ENDPOINT_URL", "AWS_REGION", "AWS_DEFAULT_REGION"):
        monkeypatch.setenv(name, "")  # recorded, so that teardown restores whatever was there
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "key")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")


def test_the_pipeline_endpoint_reaches_datasets_checkpoints_and_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", "https://s3.amazonaws.example")  # another tool's choice
    monkeypatch.setenv("AWS_REGION", "eu-west-1")
    with run_endpoint("http://minio.lan:9000") as endpoint:
        assert endpoint == "http://minio.lan:9000"
        _check_minio()
    assert "VITSCALE_S3_ENDPOINT_URL" not in os.environ  # restored: the next run chooses afresh


def _check_minio() -> None:
    assert open_storage("s3://bucket/data").endpoint_url == "http://minio.lan:9000"  # boto3: datasets, run files
    filesystem, path = run_filesystem("s3://bucket/runs")  # pyarrow: Ray Train's checkpoints
    assert path == "bucket/runs" and "minio.lan:9000" in repr(filesystem.__reduce__())
    env = endpoint_env()  # what every worker gets: endpoint and region, never credentials
    assert env["VITSCALE_S3_ENDPOINT_URL"] == "http://minio.lan:9000" and env["AWS_REGION"] == "eu-west-1"
    assert not any("KEY" in name for name in env)


def test_no_pipeline_endpoint_keeps_the_environments(monkeypatch: pytest.MonkeyPatch) -> None:
    with run_endpoint(None) as endpoint:
        assert endpoint is None and endpoint_env() == {}
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://ceph.lan:7480")
    with run_endpoint(None) as endpoint:
        assert endpoint == "http://ceph.lan:7480"
    assert open_storage("s3://bucket/data").endpoint_url == "http://ceph.lan:7480"


def test_two_endpoints_for_one_run_are_refused_naming_both(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VITSCALE_S3_ENDPOINT_URL", "http://minio-a:9000")
    with run_endpoint("http://minio-a:9000/"):  # the same store, spelt with a slash
        pass
    with pytest.raises(ConfigError, match=r"data\.endpoint_url.*minio-b.*minio-a"), run_endpoint("http://minio-b:9000"):
        pass
    assert os.environ["VITSCALE_S3_ENDPOINT_URL"] == "http://minio-a:9000"
