"""Pre-training on a real local Ray cluster: 2 Train workers, gloo, DeepSpeed ZeRO-2.

The acceptance test of fault tolerance lives here: a worker is SIGKILLed from outside mid-epoch, Ray restarts
the worker group, training resumes from the latest complete checkpoint, and the final weights and the
multiset of consumed samples equal those of the uninterrupted run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
import signal
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from helpers.prometheus_server import metrics_ports
from vitscale.data.tools.write import write_dataset
from vitscale.stages import build_pipeline

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, log_to_driver=True)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> str:
    # 150 samples in shards of uneven size (37): ranks straddle shard boundaries.
    out = tmp_path_factory.mktemp("data") / "synthetic"
    write_dataset("synthetic", str(out), shard_size=37, max_side=32, seed=0,
                  source_options={"count": 150, "classes": 4, "image_size": 32}, progress=False)
    return str(out)


def config(dataset: str, storage: Path, name: str, **train: object):
    return build_pipeline({
        "name": name,
        "stages": ["pretrain"],
        "model": {"name": "ViT-Ti/8", "img_size": 16, "depth": 2, "width": 32, "mlp_dim": 64, "heads": 2},
        "data": {"url": dataset, "num_workers": 0, "shuffle_buffer": 32},
        # 150 samples / 2 ranks = 75 per rank = 4 steps of 16 per epoch: 10 steps cross two epoch ends.
        "train": {"global_batch": 32, "micro_batch": 8, "max_steps": 10, "warmup_steps": 2, "base_lr": 2e-3,
                  "zero_stage": 2, "precision": "fp32", "checkpoint_every": 3, "log_every": 1,
                  "record_samples": True, **train},
        "cluster": {"num_workers": 2, "use_gpu": False, "cpus_per_worker": 1, "storage_path": str(storage),
                    "max_failures": 1},
    })


def effective_samples(run_dir: Path, rank: int) -> list[tuple[int, list[str]]]:
    """(step, keys) whose updates survive: after a resume the last line written for a step wins."""
    by_step: dict[int, list[str]] = {}
    for line in (run_dir / "samples" / f"rank{rank}.jsonl").read_text().splitlines():
        record = json.loads(line)
        by_step[record["step"]] = record["keys"]
    return sorted(by_step.items())


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    from vitscale.train.export import find_checkpoint, model_from_checkpoint

    model, _, facts = model_from_checkpoint(find_checkpoint(run_dir))
    assert facts["step"] == 10
    return model.state_dict()


@pytest.fixture(scope="module")
def clean_run(local_ray: None, dataset: str, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The uninterrupted run the faults are compared with. It also runs the few-shot stage (a Ray task reading
    the final checkpoint) on digits, and serves rank 0's Prometheus endpoint, scraped while it trains (the
    metrics test had a Train run of its own: about 30 s of the suite on 2 cores)."""
    from vitscale.stages.run import run_pipeline

    root = tmp_path_factory.mktemp("runs")
    port = metrics_ports(2)  # a port no Ray process is handed meanwhile (helpers/prometheus_server.py)
    cfg = config(dataset, root, "clean", metrics_port=port)
    cfg = cfg.with_sections(stages=("pretrain", "fewshot"), fewshot=build_pipeline({
        "fewshot": {"datasets": [str(root / "digits")], "shots": [5], "resolution": 16, "batch_size": 256,
                 "create_if_missing": {"kind": "digits", "splits": {"train": 0.8, "test": 0.2}}}}).fewshot)
    with _scraping(port) as scraped:
        result = run_pipeline(cfg)
    return {**result, "scraped": scraped}


@contextlib.contextmanager
def _scraping(port: int) -> Iterator[list[str]]:
    """Rank 0's metrics endpoint read every 0.2 s meanwhile; yields the texts that had a loss in them."""
    scraped: list[str] = []
    done = threading.Event()

    def scrape() -> None:
        while not done.is_set():
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as response:
                    text = response.read().decode()
                if "vitscale_train_loss{" in text:
                    scraped.append(text)
            except OSError:
                pass
            time.sleep(0.2)

    thread = threading.Thread(target=scrape, daemon=True)
    thread.start()
    try:
        yield scraped
    finally:
        done.set()
        thread.join()


def test_fewshot_stage_probes_the_final_checkpoint(clean_run: dict) -> None:
    probe = clean_run["fewshot"]
    assert probe["checkpoint_step"] == 10
    digits = next(v for k, v in probe.items() if k.endswith("digits"))
    assert digits["chance"] == 0.1 and digits["5shot"] > 2 * digits["chance"]


def test_export_round_trips_through_load_pretrained(clean_run: dict, tmp_path: Path) -> None:
    from vitscale.cli import main
    from vitscale.models import load_pretrained
    from vitscale.train.export import find_checkpoint, model_from_checkpoint

    trained, run_config, facts = model_from_checkpoint(find_checkpoint(clean_run["run_dir"]))
    images = torch.randn(3, 3, 16, 16)
    expected = trained.eval()(images)
    for fmt in ("pt", "npz"):
        out = tmp_path / f"model.{fmt}"
        assert main(["export", clean_run["run_dir"], "--out", str(out), "--format", fmt]) == 0
        fresh = run_config.build(facts["num_classes"])
        load_pretrained(fresh, out)
        torch.testing.assert_close(fresh.eval()(images), expected, rtol=1e-5, atol=1e-6)


def _signal_a_worker_at(run_dir: Path, step: int, done: threading.Event, signum: int = signal.SIGKILL) -> list[int]:
    """Send `signum` to one Ray Train worker process from outside once rank 0 has logged `step`; the pids
    signalled."""
    import os

    import psutil

    metrics = run_dir / "metrics" / "rank0.jsonl"
    while not done.is_set():
        lines = metrics.read_text().splitlines() if metrics.exists() else []
        if any(json.loads(x).get("step", 0) >= step for x in lines if x.strip().endswith("}")):
            # This test's own Ray only (its processes descend from this one): another Ray on the
            # machine (a parallel test's) has RayTrainWorkers too.
            workers = [p for p in psutil.Process().children(recursive=True)
                       if any("RayTrainWorker" in part for part in _cmdline(p))]
            if workers:
                victim = workers[-1].pid
                os.kill(victim, signum)
                return [victim]
        time.sleep(0.02)
    return []


def _cmdline(process) -> list[str]:
    import psutil

    try:
        return process.cmdline()
    except psutil.Error:
        return []


def test_a_worker_sigkilled_from_outside_resumes_to_the_same_weights_and_samples(
        clean_run: dict, dataset: str, tmp_path: Path) -> None:
    """No cooperation from the worker: SIGKILL from outside once rank 0 has logged step 4 (past the step-3
    checkpoint, in the middle of epoch 1), landing wherever the run is (mid-step, mid-checkpoint). The restart
    resumes from the newest complete checkpoint to the uninterrupted run's weights, and every sample of an
    epoch is consumed once: the resume neither replays nor skips. (`train.fault`, the drills' kill at a chosen
    step, is run by test_masked_patch_ray.py and test_resume_storage.py.)"""
    from vitscale.stages.run import run_pipeline

    done, killed = threading.Event(), []
    watcher = threading.Thread(target=lambda: killed.extend(_signal_a_worker_at(tmp_path / "killed", 4, done)))
    watcher.start()
    try:
        killed_run = run_pipeline(config(dataset, tmp_path, "killed"))
    finally:
        done.set()
        watcher.join()
    assert killed, "the run ended before a worker could be killed"
    assert killed_run["pretrain"]["restarts"] == 1, killed_run["pretrain"]
    run_dir, clean_dir = Path(killed_run["run_dir"]), Path(clean_run["run_dir"])
    a, b = final_weights(clean_dir), final_weights(run_dir)
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst <= 1e-5, worst

    for rank in (0, 1):
        steps_clean, steps_killed = effective_samples(clean_dir, rank), effective_samples(run_dir, rank)
        assert [s for s, _ in steps_killed] == list(range(1, 11))
        assert Counter(k for _, keys in steps_clean for k in keys) == Counter(k for _, keys in steps_killed for k in keys)
        # Within each epoch (4 steps) no sample repeats: the resume neither replays nor skips.
        for epoch_start in range(0, 10, 4):
            keys = [k for s, ks in steps_killed if epoch_start < s <= epoch_start + 4 for k in ks]
            assert len(keys) == len(set(keys))
    # Ranks never share a sample within an epoch.
    for epoch_start in range(0, 10, 4):
        per_rank = [{k for s, ks in effective_samples(run_dir, r) if epoch_start < s <= epoch_start + 4 for k in ks}
                    for r in (0, 1)]
        assert not per_rank[0] & per_rank[1]


def test_a_worker_sent_sigterm_checkpoints_first_and_no_step_is_trained_twice(
        clean_run: dict, dataset: str, tmp_path: Path) -> None:
    """SIGTERM (a spot VM's shutdown, a pod's deletion) is a notice: every rank checkpoints at the next step,
    the told worker leaves, and the restart goes on from that checkpoint. No periodic checkpoint falls
    inside the run (checkpoint_every 100), so without the notice the restart would start over at step 0."""
    from vitscale.stages.run import run_pipeline

    done, told = threading.Event(), []
    watcher = threading.Thread(target=lambda: told.extend(
        _signal_a_worker_at(tmp_path / "told", 3, done, signal.SIGTERM)))
    watcher.start()
    try:
        told_run = run_pipeline(config(dataset, tmp_path, "told", checkpoint_every=100))
    finally:
        done.set()
        watcher.join()
    assert told, "the run ended before a worker could be sent SIGTERM"
    run_dir = Path(told_run["run_dir"])
    grace = sorted(p.name for p in (tmp_path / "told").glob("checkpoint_*"))
    assert grace and grace[0] < "checkpoint_000000010", grace  # the notice's checkpoint, before the final one
    for rank in (0, 1):
        # Every step once: nothing past the notice's checkpoint was trained and thrown away (the other
        # rank cannot finish a step without the told one), nothing before it trained again.
        for record in ("samples", "metrics"):
            lines = (run_dir / record / f"rank{rank}.jsonl").read_text().splitlines()
            assert [json.loads(x)["step"] for x in lines] == list(range(1, 11)), (record, rank)
    a, b = final_weights(Path(clean_run["run_dir"])), final_weights(run_dir)
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst <= 1e-5, worst
    assert told_run["pretrain"]["restarts"] == 1 and told_run["pretrain"]["relaunches"] == 0, told_run["pretrain"]


def test_metrics_endpoint_serves_prometheus_series_during_a_run(clean_run: dict) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    scraped = clean_run["scraped"]
    assert scraped, "no scrape of rank 0's endpoint succeeded while the run was going"
    families = {f.name: f for f in text_string_to_metric_families(scraped[-1])}
    for name in ("vitscale_train_loss", "vitscale_learning_rate", "vitscale_grad_norm", "vitscale_images_per_second",
                 "vitscale_step_seconds", "vitscale_data_wait_seconds", "vitscale_examples_seen",
                 "vitscale_train_flops"):
        assert name in families, sorted(families)
    loss = families["vitscale_train_loss"].samples[0]
    assert loss.labels == {"run": "clean", "rank": "0"} and loss.value > 0
    examples = [s for s in families["vitscale_examples_seen"].samples if s.name.endswith("_total")]
    assert examples and examples[0].value > 0


def test_worker_error_names_the_rank_and_the_cause(local_ray: None, dataset: str, tmp_path: Path) -> None:
    """A corrupt sample with a zero error budget fails the run at once, though restarts are allowed
    (a restart would meet the same sample); the driver says which rank and why."""
    import shutil

    import pyarrow.parquet as pq

    from vitscale.launch.console import restore_output
    from vitscale.launch.ray_train import PipelineFailed
    from vitscale.stages.run import run_pipeline

    broken = tmp_path / "broken-data"
    shutil.copytree(dataset, broken)
    index = pq.read_table(broken / "_index.parquet").to_pylist()
    first = index[0]
    shard = broken / first["shard"]
    data = bytearray(shard.read_bytes())
    start = first["offset"] + 512 + 64  # inside the first member's data, past its tar header
    data[start:start + 256] = b"\0" * 256
    shard.write_bytes(bytes(data))

    cfg = config(str(broken), tmp_path, "broken", max_steps=4)
    cfg = cfg.with_sections(data=dataclasses.replace(cfg.data, error_budget=0.0),
                            cluster=dataclasses.replace(cfg.cluster, max_failures=2))
    try:  # as the CLI runs it: the workers' output routed to the run's log
        with pytest.raises(PipelineFailed) as err:
            run_pipeline(cfg, verbose=False)
    finally:
        restore_output()
    message = str(err.value)
    assert "not retried" in message  # stopped by launch/failures.py, not after exhausting max_failures
    # Where it was raised is in the run's log whether or not Ray's forwarding of the rank's own lines outran
    # the driver's exit: the driver writes each failed rank's traceback as Ray Train returned it.
    log = (tmp_path / "broken" / "logs" / "ray.log").read_text()
    told = re.search(r"the traceback of rank ([01])(?:, rank [01])?, as Ray Train returned it to the driver:\n"
                     r"Traceback \(most recent call last\):\n(?:.*\n)*?.*ErrorBudgetExceeded", log)
    assert told and f"rank {told[1]}" in message, log[-3000:]
    assert "rank 0" in message or "rank 1" in message
    assert "ErrorBudgetExceeded" in message
    # Named whichever rank's error reached the driver first: the ranks gather their bad shards before raising.
    assert re.search(rf"bad shards: {re.escape(first['shard'])} \(1 on rank [01]\)", message), message
