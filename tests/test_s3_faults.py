"""Object storage faults, injected by a proxy in front of moto's S3 server (tests/helpers/s3_faults.py): 503
SlowDown, 500, connections dropped or reset mid-body, a slow server. Shard reads and checkpoint uploads
either succeed after bounded retries with backoff or stop in one line naming the URL and the last
error; a checkpoint whose upload failed is never complete."""

from __future__ import annotations

import contextlib
import errno
import os
import pickle
import shutil
import time
import uuid
from pathlib import Path

import boto3
import pytest

from helpers.s3_faults import FaultProxy
from vitscale.cli import main
from vitscale.data.format import read_index
from vitscale.data.loader.stream import ShardStream
from vitscale.data.storage import RetryPolicy, StorageError, open_storage
from vitscale.data.storage.filesystem import clear_stale, ensure_uploaded, run_filesystem
from vitscale.data.tools.write import write_dataset
from vitscale.launch.failures import DeterministicFailure, StopOnDeterministicFailure, deterministic_cause
from vitscale.train import checkpoint as ckpt

FAST = RetryPolicy(max_attempts=8, base_delay_s=0.001, max_delay_s=0.01)


@pytest.fixture
def bucket(moto_s3: str) -> str:
    name = f"faults-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=moto_s3).create_bucket(Bucket=name)
    return name


@pytest.fixture
def dataset(moto_s3: str, bucket: str) -> str:
    url = f"s3://{bucket}/ds"
    write_dataset("synthetic", url, shard_size=10, endpoint_url=moto_s3, progress=False,
                  source_options={"count": 20, "classes": 2, "image_size": 16})
    return url


def test_each_fault_on_a_shard_read_is_retried_and_nothing_is_lost(moto_s3: str, dataset: str) -> None:
    rows = read_index(dataset, endpoint_url=moto_s3).to_pylist()
    direct = open_storage(dataset, endpoint_url=moto_s3)
    expected = [direct.read_range(r["shard"], r["offset"], r["size"]) for r in rows]
    with FaultProxy(moto_s3, slow_s=1.0) as proxy:
        proxy.schedule("503", "500", "reset", "truncate", "drop", "slow", "503")
        # A read timeout shorter than the slow answer: the slow server is a failed try, then a retry.
        flaky = open_storage(dataset, endpoint_url=proxy.url, retry=FAST)
        flaky.read_timeout_s = 0.4
        got = [flaky.read_range(r["shard"], r["offset"], r["size"]) for r in rows]
    assert got == expected
    assert proxy.pending == 0 and proxy.counts["ok"] == len(rows)  # every fault met, one retry each
    assert all(proxy.counts[f] >= 1 for f in ("503", "500", "reset", "truncate", "drop", "slow"))


def test_the_training_loader_reads_every_sample_through_faults(moto_s3: str, dataset: str) -> None:
    with FaultProxy(moto_s3, fault_rate=0.3, seed=3, random_faults=("503", "500", "reset", "drop")) as proxy:
        stream = ShardStream(dataset, batch_size=4, resolution=16, train=False, endpoint_url=proxy.url,
                             error_budget=0.0)
        keys = {k for b in stream for k, ok in zip(b["key"], b["valid"], strict=True) if ok}
    assert len(keys) == 20 and proxy.faults > 0


def test_a_dead_store_stops_in_one_line_naming_the_url_and_the_last_error(moto_s3: str, dataset: str,
                                                                          capsys: pytest.CaptureFixture,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    with FaultProxy(moto_s3, fault_rate=1.0, methods=("GET", "HEAD"), random_faults=("503",)) as proxy:
        with pytest.raises(StorageError) as err:
            open_storage(dataset, endpoint_url=proxy.url, retry=RetryPolicy(4, 0.001, 0.002)).read_bytes("dataset.json")
        assert f"{dataset}/dataset.json failed after 4 attempts" in str(err.value) and "SlowDown" in str(err.value)
        assert proxy.faults == 4  # bounded: exactly max_attempts tries
        monkeypatch.setenv("VITSCALE_S3_RETRY_S", "2")  # the CLI's policy: bounded by the budget setting
        started = time.monotonic()
        assert main(["shards", "stats", dataset, "--endpoint-url", proxy.url]) == 2
        took = time.monotonic() - started
    out, err_text = capsys.readouterr()
    lines = err_text.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out + err_text, err_text
    assert dataset in lines[0] and "SlowDown" in lines[0] and "VITSCALE_S3_RETRY_S: 2 s" in lines[0], lines[0]
    assert 1.5 < took < 10, took


def test_a_server_slower_than_the_timeout_stops_in_one_line(moto_s3: str, dataset: str) -> None:
    with FaultProxy(moto_s3, slow_s=1.0) as proxy:
        proxy.schedule(*["slow"] * 3)
        slow = open_storage(dataset, endpoint_url=proxy.url, retry=RetryPolicy(3, 0.001, 0.002))
        slow.read_timeout_s = 0.3
        with pytest.raises(StorageError, match=f"{dataset}/dataset.json failed after 3 attempts: .*[Tt]imeout"):
            slow.read_bytes("dataset.json")


# ------------------------------------------------------------------------------------- checkpoints


def _local_checkpoint(directory: Path, step: int) -> Path:
    directory.mkdir(parents=True)
    (directory / "payload.bin").write_bytes(os.urandom(300_000))
    ckpt.write_rank_part(directory, rank=0, stream_state={"epoch": 0, "position": step, "seed": 0},
                         train_state=ckpt.TrainState(step=step, world_size=1), config_yaml="")
    return directory


def _upload(local: Path, fs: object, fs_path: str) -> None:
    """Ray Train's own upload of a reported checkpoint (pyarrow's copy through the run's filesystem)."""
    from ray.train.v2._internal.execution.storage import _upload_to_fs_path

    _upload_to_fs_path(str(local), fs, fs_path)  # type: ignore[arg-type]


def _fetch(fs_path: str, moto_s3: str, dest: Path) -> Path:
    from ray.train.v2._internal.execution.storage import _download_from_fs_path

    fs, _ = run_filesystem("s3://" + fs_path, endpoint_url=moto_s3)
    _download_from_fs_path(fs, fs_path, str(dest))
    return dest


def test_checkpoint_uploads_retry_through_faults(tmp_path: Path, moto_s3: str, bucket: str) -> None:
    local = _local_checkpoint(tmp_path / "local", 2)
    with FaultProxy(moto_s3, methods=("PUT", "POST")) as proxy:
        # Five faults in a row on the first request: more than the SDK's default of 3 tries.
        proxy.schedule("503", "500", "drop", "503", "500", methods=("PUT", "POST"))
        fs, run = run_filesystem(f"s3://{bucket}/runs/r1", endpoint_url=proxy.url, max_attempts=6)
        assert run == f"{bucket}/runs/r1"
        fs = pickle.loads(pickle.dumps(fs))  # as Ray hands it to its controller and workers
        with ckpt.space_for(f"s3://{run}", step=2, copying=local):
            _upload(local, fs, f"{run}/checkpoint_000000002")
    assert proxy.pending == 0 and proxy.faults == 5
    fetched = _fetch(f"{run}/checkpoint_000000002", moto_s3, tmp_path / "fetched")
    assert ckpt.check_complete(fetched, 1) == []


def test_a_failed_checkpoint_upload_is_one_line_and_never_complete(tmp_path: Path, moto_s3: str,
                                                                    bucket: str) -> None:
    previous = _local_checkpoint(tmp_path / "previous", 1)
    fs, run = run_filesystem(f"s3://{bucket}/runs/r2", endpoint_url=moto_s3)
    _upload(previous, fs, f"{run}/checkpoint_000000001")
    local = _local_checkpoint(tmp_path / "local", 2)
    with FaultProxy(moto_s3, methods=("PUT", "POST")) as proxy:
        proxy.schedule(*["503"] * 3, methods=("PUT", "POST"), path="payload.bin")
        flaky, _ = run_filesystem(f"s3://{run}", endpoint_url=proxy.url, max_attempts=3)
        with pytest.raises(ckpt.CheckpointNotWritten) as err, ckpt.space_for(f"s3://{run}", step=2, copying=local):
            _upload(local, flaky, f"{run}/checkpoint_000000002")
    message = str(err.value)
    assert "\n" not in message and f"not written to s3://{run}: " in message and "payload.bin" in message, message
    assert proxy.counts["503"] == 3  # bounded: max_attempts tries of the failing file
    # What did arrive (the other files, the manifest) is not a complete checkpoint; the previous one is.
    fetched = [_fetch(f"{run}/checkpoint_00000000{s}", moto_s3, tmp_path / f"fetched{s}") for s in (1, 2)]
    assert ckpt.check_complete(fetched[1], 1) and ckpt.check_complete(fetched[0], 1) == []
    assert ckpt.latest_complete(fetched, 1) == fetched[0]


def test_a_file_the_upload_lost_without_a_word_is_stored_again(tmp_path: Path, moto_s3: str, bucket: str) -> None:
    """pyarrow's copy (Ray's upload) drops the error of a multipart completion that failed after its
    retries: the run went on with a checkpoint missing a file. The worker checks and stores it again."""
    local = _local_checkpoint(tmp_path / "local", 2)
    target = f"{bucket}/runs/r3/checkpoint_000000002"
    with FaultProxy(moto_s3, methods=("PUT", "POST")) as proxy:
        proxy.schedule("503", "503", "503", methods=("POST",), path="payload.bin?uploadId")  # its completion
        fs, _ = run_filesystem(f"s3://{target}", endpoint_url=proxy.url, max_attempts=3)
        with contextlib.suppress(OSError):  # a pyarrow that reports the failure is as good
            _upload(local, fs, target)
        assert proxy.pending == 0
        copied = ensure_uploaded(local, f"s3://{target}", endpoint_url=proxy.url)
    assert ensure_uploaded(local, f"s3://{target}", endpoint_url=moto_s3) == []  # nothing left to store
    assert ckpt.check_complete(_fetch(target, moto_s3, tmp_path / "fetched"), 1) == []
    assert copied in ([], ["payload.bin"])


def test_a_file_that_cannot_be_stored_is_an_error_naming_it(tmp_path: Path, moto_s3: str, bucket: str) -> None:
    local = _local_checkpoint(tmp_path / "local", 2)
    target = f"{bucket}/runs/r4/checkpoint_000000002"
    with FaultProxy(moto_s3, methods=("PUT", "POST")) as proxy:
        proxy.schedule(*["503"] * 4, methods=("PUT", "POST"), path="payload.bin")
        with pytest.raises(StorageError) as err:
            ensure_uploaded(local, f"s3://{target}", endpoint_url=proxy.url, retry=RetryPolicy(4, 0.001, 0.002))
    assert proxy.pending == 0 and proxy.counts["503"] == 4  # bounded: the policy's tries, no SDK retries inside
    assert f"store s3://{target}/payload.bin failed after 4 attempts: " in str(err.value), err.value
    assert "SLOW_DOWN" in str(err.value)
    assert err.value.final  # the budget is spent: a restart would only wait it out again


def test_a_bucket_without_write_permission_stops_the_run_in_one_line(moto_s3: str, dataset: str, bucket: str,
                                                                     tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture) -> None:
    """Credentials that may read the data but not write the run's storage: S3 answers 403 to every write.
    The run stops before Ray starts, in one line naming the run's storage and the refusal."""
    import yaml

    pipeline = tmp_path / "readonly.yaml"
    with FaultProxy(moto_s3, fault_rate=1.0, methods=("PUT", "POST", "DELETE"), random_faults=("403",)) as proxy:
        pipeline.write_text(yaml.safe_dump({
            "name": "readonly", "stages": ["pretrain"],
            "data": {"url": dataset, "endpoint_url": proxy.url},
            "model": {"name": "ViT-Ti/8", "img_size": 16, "depth": 1, "width": 32, "mlp_dim": 32, "heads": 2},
            "train": {"global_batch": 4, "micro_batch": 4, "max_steps": 1},
            "cluster": {"num_workers": 1, "use_gpu": False, "cpus_per_worker": 1,
                        "storage_path": f"s3://{bucket}/runs"}}))
        started = time.monotonic()
        assert main(["run", str(pipeline)]) == 2
        assert proxy.counts["403"] >= 1 and time.monotonic() - started < 60  # not retried: a refusal stays one
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out + err, err
    assert f"s3://{bucket}/runs/readonly" in lines[0] and "AccessDenied" in lines[0], lines[0]
    assert "started a local Ray" not in out


def test_a_step_saved_again_replaces_every_file_its_torn_save_left(tmp_path: Path, moto_s3: str, bucket: str) -> None:
    """The first save of step 2 failed part-way (its rank0.pt never arrived); the run restarted and saves step 2
    again. A file the new copy loses without a word must not be taken for stored because the torn save left
    one of that name and size: each rank first clears its own names (launch/train_worker.py, `_report`)."""
    target = f"s3://{bucket}/runs/r5/checkpoint_000000002"
    fs, path = run_filesystem(target, endpoint_url=moto_s3)
    torn = _local_checkpoint(tmp_path / "torn", 2)
    (torn / "MANIFEST-rank1.json").write_text("another rank's: not this rank's to remove")
    _upload(torn, fs, path)
    fs.delete_file(f"{path}/rank0.pt")
    fresh = _local_checkpoint(tmp_path / "fresh", 2)  # payload.bin: the same size, other bytes
    assert clear_stale(fresh, target, endpoint_url=moto_s3) == ["MANIFEST-rank0.json", "config.yaml", "payload.bin",
                                                                 "train_state.json"]
    lossy = tmp_path / "lossy"  # Ray's copy, losing payload.bin without a word
    shutil.copytree(fresh, lossy)
    (lossy / "payload.bin").unlink()
    _upload(lossy, fs, path)
    assert ensure_uploaded(fresh, target, endpoint_url=moto_s3) == ["payload.bin"]
    fetched = _fetch(path, moto_s3, tmp_path / "fetched")
    assert ckpt.check_complete(fetched, 1) == []
    assert (fetched / "MANIFEST-rank1.json").exists()  # another rank's name: left to that rank
    assert clear_stale(fresh, f"s3://{bucket}/runs/r5/checkpoint_000000004", endpoint_url=moto_s3) == []


# ------------------------------------------------------------- errors a restart would repeat stop the run


def _stops_the_run(error: BaseException) -> str:
    """The line the run stops with when a worker raised `error` (launch/failures.py), or fail."""
    found = deterministic_cause(error)
    assert found is not None, f"would be restarted: {error!r}"
    with pytest.raises(DeterministicFailure) as stopped:
        StopOnDeterministicFailure().after_exception(None, {0: error})
    line = str(stopped.value)
    assert "\n" not in line and "Traceback" not in line, line
    return line


def _upload_failing_always(tmp_path: Path, moto_s3: str, where: str, status: str
                           ) -> tuple[str, float, dict[str, int], ckpt.CheckpointNotWritten]:
    """Upload step 4's checkpoint to `s3://where` through a proxy answering every write with `status`:
    (the run's path, seconds until it gave up, the proxy's counts, the error `space_for` raised)."""
    local = _local_checkpoint(tmp_path / "local", 4)
    with FaultProxy(moto_s3, fault_rate=1.0, methods=("PUT", "POST"), random_faults=(status,)) as proxy:
        fs, run = run_filesystem(f"s3://{where}", endpoint_url=proxy.url)
        started = time.monotonic()
        with pytest.raises(ckpt.CheckpointNotWritten) as err, ckpt.space_for(f"s3://{run}", step=4, copying=local):
            _upload(local, fs, f"{run}/checkpoint_000000004")
        return run, time.monotonic() - started, dict(proxy.counts), err.value


def test_a_refused_checkpoint_upload_stops_the_run_at_once(tmp_path: Path, moto_s3: str, bucket: str) -> None:
    run, seconds, counts, error = _upload_failing_always(tmp_path, moto_s3, f"{bucket}/runs/r6", "403")
    assert seconds < 10 and counts["403"] >= 1  # a refusal is not retried
    line = _stops_the_run(error)
    assert line.startswith(f"rank 0: CheckpointNotWritten: the checkpoint of step 4 was not written to s3://{run}: ")
    assert "ACCESS_DENIED" in line and "(not retried: waiting does not mend it)" in line, line


def test_a_checkpoint_upload_that_outlasts_the_retry_budget_stops_the_run(tmp_path: Path, moto_s3: str, bucket: str,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Persistent throttling: the upload gives up within the budget, and the run does not wait it out again
    on each of Ray's restarts: the line says the tries and the budget."""
    monkeypatch.setenv("VITSCALE_S3_RETRY_S", "2")  # sdk_attempts(2): 2 tries per request
    _, seconds, counts, error = _upload_failing_always(tmp_path, moto_s3, f"{bucket}/runs/r7", "503")
    assert seconds < 15 and 2 <= counts["503"] <= 8, counts
    line = _stops_the_run(error)
    assert "SLOW_DOWN" in line and "(gave up after 2 tries per request (retry budget $VITSCALE_S3_RETRY_S: 2 s))" \
        in line, line


def test_a_refused_push_of_the_runs_metrics_stops_the_run_named_as_such(tmp_path: Path, moto_s3: str,
                                                                        bucket: str) -> None:
    """The metrics pushed before a checkpoint (inside its guard) fail as the metrics object, not the checkpoint."""
    from vitscale.data.storage.mirror import RunFileNotStored, RunMirror

    cache = tmp_path / "node"
    (cache / "metrics").mkdir(parents=True)
    (cache / "metrics" / "rank0.jsonl").write_text('{"step": 4}\n')
    local = _local_checkpoint(tmp_path / "local", 4)
    with FaultProxy(moto_s3, fault_rate=1.0, methods=("PUT", "POST"), random_faults=("403",)) as proxy:
        mirror = RunMirror(cache, open_storage(f"s3://{bucket}/runs/r8", endpoint_url=proxy.url))
        with pytest.raises(RunFileNotStored) as err, ckpt.space_for(f"s3://{bucket}/runs/r8", step=4, copying=local):
            mirror.push()
    assert proxy.counts["403"] == 1
    line = _stops_the_run(err.value)
    assert line.startswith(f"rank 0: RunFileNotStored: write s3://{bucket}/runs/r8/metrics/rank0.jsonl failed: "
                           "AccessDenied (HTTP 403)"), line
    assert "checkpoint" not in line


def test_storage_errors_that_may_heal_on_a_restart_are_left_to_ray(tmp_path: Path) -> None:
    """A local disk's I/O error (no object store's retries spent) is still a checkpoint not written that Ray may retry."""
    with pytest.raises(ckpt.CheckpointNotWritten) as err, ckpt.space_for(tmp_path, step=4):
        raise OSError(errno.EIO, "Input/output error", str(tmp_path / "checkpoint_000000004" / "rank0.pt"))
    assert not err.value.final and deterministic_cause(err.value) is None
    unfinished = StorageError("read s3://b/k failed: an error the retry loop did not end")
    assert deterministic_cause(unfinished) is None
