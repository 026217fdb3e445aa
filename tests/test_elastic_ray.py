"""An elastic run for real: Ray Train on a local Ray of worker nodes, `cluster.num_workers: [2, 4]`.

Four CPU workers start on two nodes of 2 CPUs; mid-epoch one node is SIGKILLed (its 2 workers die and
their resources go with it): Ray Train restarts the run on the 2 left, from the latest checkpoint,
resharded from 4 to 2 workers, its first step within `LOSS_TO_STEP_LIMIT_S` of the loss. The node is
added back and the run grows to 4 again (resharded from 2 to 4). At the end: each step's samples are those of an uninterrupted 4-worker run (so every sample of
each epoch is consumed exactly once), the global batch never changed, and the final weights equal
the uninterrupted run's within float reduction error.

Tolerance (the attention key bias aside: see the assertion): the resized steps sum the same per-sample gradients in another grouping (2 ranks x 2 micro
batches of 3 instead of 4 ranks x 1), fp32, ~1e-7 relative per addition; AdamW's update is a
ratio of moments, so such differences stay at ~1e-7 per step on weights of order 1e-2..1; over 12
steps that is far below 1e-5 (atol) -- a wrong sample or a lost optimizer moment moves weights by
~1e-3 (the learning rate), two orders above it.

Gated with the other multi-node runs (`make test-cluster`): minutes on a 2-core machine.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from vitscale.data.tools.write import write_dataset
from vitscale.stages import build_pipeline

ray = pytest.importorskip("ray")
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not os.environ.get("VITSCALE_CLUSTER_E2E"),
                                 reason="an elastic run on a local multi-node Ray (minutes): make test-cluster runs it")]

GLOBAL_BATCH, STEPS, LR, WIDTH = 14, 24, 1e-3, 32
"""14 does not divide over 4 workers (shares of 3 and 4, loss-weighted) and does over 2 (7 each): a
resize moves between uneven and even shares, and the run must still match the uninterrupted one."""

LOSS_TO_STEP_LIMIT_S = 45.0
"""A node SIGKILLed -> the first step at 2 workers: the target is 30 s (docs/elastic.md, "A lost node"; about
27 s measured), with margin for a loaded 2-core machine. Before launch/node_loss.py it was 76 s: a group of
4 tried first from a stale view, waiting out Ray Train's 60 s start timeout."""


@pytest.fixture(autouse=True)
def _paced_by_rays_own_poll(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ray's own 2-s controller poll, as a user may set it (launch/poll.py keeps a user's value), and a
    checkpoint every step (`_config`): each step's report waits up to a poll, which keeps the 2-worker phase
    running (about 30 s) until the node added back has started and Ray's 5-s resize check has seen it. At
    vitscale's 0.25 s for a run this small the 2-worker phase took 2 s, and with a checkpoint every 2 steps
    13 s, and the run ended before it could grow."""
    from vitscale.launch import poll

    monkeypatch.setenv(poll.POLL_ENV, "2")
    monkeypatch.setattr(poll, "_USERS", "2")


@pytest.fixture(scope="module")
def nodes():
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    workers = [cluster.add_node(num_cpus=2) for _ in range(2)]
    ray.init(address=cluster.address)
    yield cluster, workers
    ray.shutdown()
    cluster.shutdown()


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> str:
    out = tmp_path_factory.mktemp("data") / "synthetic"
    # 60 samples in uneven shards: 4 global batches of 14 an epoch; 24 steps cross five epoch ends (and
    # leave the run at 2 workers time to grow back before it ends).
    write_dataset("synthetic", str(out), shard_size=23, max_side=32, seed=0,
                  source_options={"count": 60, "classes": 4, "image_size": 32}, progress=False)
    return str(out)


def _config(dataset: str, storage: Path, name: str, num_workers: object, zero: int):
    return build_pipeline({
        "name": name, "stages": ["pretrain"],
        "model": {"name": "ViT-Ti/8", "img_size": 16, "depth": 1, "width": WIDTH, "mlp_dim": 64, "heads": 2,
                  "dropout": 0.0},
        "data": {"url": dataset, "num_workers": 0, "shuffle_buffer": 16},
        "train": {"global_batch": GLOBAL_BATCH, "micro_batch": 3, "max_steps": STEPS, "warmup_steps": 2,
                  "base_lr": LR, "zero_stage": zero, "precision": "fp32", "checkpoint_every": 1, "log_every": 1,
                  "record_samples": True, "keep_checkpoints": STEPS + 1},
        "cluster": {"num_workers": num_workers, "use_gpu": False, "cpus_per_worker": 1, "storage_path": str(storage),
                    "max_failures": 3, "elastic_resize_s": 5.0},
    })


def surviving_steps(run_dir: Path) -> dict[int, tuple[int, list[str]]]:
    """step -> (world size, the step's keys in rank order) of the attempt whose update survived: the
    last one written for the step (later attempts redo the steps after the checkpoint they resume)."""
    lines: dict[int, list[dict]] = defaultdict(list)
    for path in sorted((run_dir / "samples").glob("rank*.jsonl")):
        rank = int(path.stem.removeprefix("rank"))
        for text in path.read_text().splitlines():
            lines[json.loads(text)["step"]].append({**json.loads(text), "rank": rank})
    out = {}
    for step, records in lines.items():
        last = max(records, key=lambda r: r["time"])
        world = last["world_size"]
        # each rank's latest line for the step, from that world size's attempt
        latest = {}
        for r in sorted(records, key=lambda r: r["time"]):
            if r["world_size"] == world:
                latest[r["rank"]] = r["keys"]
        assert sorted(latest) == list(range(world)), (step, sorted(latest), world)
        out[step] = (world, [k for rank in range(world) for k in latest[rank]])
    return out


def seconds_to_step(run_dir: Path, since: float, world: int) -> float:
    """Seconds from `since` (Unix time) to the end of the first step rank 0 made at `world` workers after it."""
    from vitscale.train.restarts import read_rows

    ends = [float(r["time"]) for r in read_rows(run_dir / "metrics" / "rank0.jsonl")  # type: ignore[arg-type]
            if r.get("world_size") == world and float(r["time"]) > since]  # type: ignore[arg-type]
    assert ends, f"no step at {world} workers after the loss"
    return min(ends) - since


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    from vitscale.train.export import find_checkpoint, model_from_checkpoint

    model, _, facts = model_from_checkpoint(find_checkpoint(run_dir))
    assert facts["step"] == STEPS
    return model.state_dict()


@pytest.mark.parametrize("zero", [0, 2])
def test_a_run_that_shrinks_and_grows_matches_the_uninterrupted_one(nodes, dataset: str, tmp_path: Path,
                                                                    zero: int) -> None:
    from vitscale.stages.run import run_pipeline

    cluster, workers = nodes
    run_dir = tmp_path / "elastic"
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["summary"] = run_pipeline(_config(dataset, tmp_path, "elastic", [2, 4], zero), verbose=False)
        except Exception as exc:  # noqa: BLE001 -- surfaced by the main thread
            outcome["error"] = exc

    driver = threading.Thread(target=run)
    driver.start()

    def wait_for(what: str, ready, timeout: float = 600.0) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            assert driver.is_alive() or ready(), f"the run ended before {what}: {outcome}"
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.5)

    def checkpoints() -> list[int]:
        return sorted(int(p.name.removeprefix("checkpoint_")) for p in run_dir.glob("checkpoint_*")
                      if (p / "MANIFEST-rank0.json").exists())

    wait_for("step 4 at 4 workers", lambda: any(s >= 4 for s in checkpoints()))
    lost_at = time.time()
    # SIGKILL, as a crashed or cut-off machine: no goodbye to the GCS, which learns of the loss only when its
    # health checks fail (a graceful removal tells it at once, and hid the stale view this run once paid for).
    cluster.remove_node(workers[1], allow_graceful=False)  # two workers and their CPUs gone: the run goes on with 2
    wait_for("a checkpoint at 2 workers",
             lambda: any(json.loads((run_dir / f"checkpoint_{s:09d}" / "train_state.json").read_text())
                         ["world_size"] == 2 for s in checkpoints()))
    workers[1] = cluster.add_node(num_cpus=2)  # capacity back: the run grows to 4
    driver.join(timeout=900)
    assert not driver.is_alive() and "error" not in outcome, outcome
    pretrained = outcome["summary"]["pretrain"]
    # Two restarts at least (the loss, the growth), each costing the seconds between two steps.
    assert pretrained["world_size"] == 4 and pretrained["restarts"] >= 2 and pretrained["restart_lost_s"] > 0, pretrained

    log = (run_dir / "logs" / "ray.log").read_text() if (run_dir / "logs" / "ray.log").exists() else ""
    steps = surviving_steps(run_dir)
    assert sorted(steps) == list(range(1, STEPS + 1))
    worlds = [w for _, (w, _) in sorted(steps.items())]
    assert 2 in worlds and worlds[-1] == 4, (worlds, log[-3000:])  # it shrank, and grew back
    # The restart after the loss starts at the size the live nodes hold (2), not at a stale 4 whose placement
    # would wait out Ray Train's worker-group start timeout (docs/elastic.md, "A lost node").
    recovered = seconds_to_step(run_dir, lost_at, world=2)
    print(f"\nnode lost -> first step at 2 workers: {recovered:.1f} s (ZeRO {zero})")
    assert recovered <= LOSS_TO_STEP_LIMIT_S, (recovered, log[-3000:])
    assert all(len(keys) == GLOBAL_BATCH for _, keys in steps.values())  # the global batch never changed

    # The uninterrupted 4-worker run, on the same nodes. A fixed 4 keeps the classic batch rule (14 is no
    # multiple of micro x 4), so it is a range whose MAX the free nodes hold from the start.
    clean = run_pipeline(_config(dataset, tmp_path, "clean", [3, 4], zero), verbose=False)
    assert clean is not None
    reference = surviving_steps(tmp_path / "clean")
    assert {w for w, _ in reference.values()} == {4}, "the reference run must not have resized"
    for step in steps:  # each step consumed the same samples (so each epoch's, exactly once)
        assert sorted(steps[step][1]) == sorted(reference[step][1]), step
    a, b = final_weights(run_dir), final_weights(tmp_path / "clean")
    worst = {}
    for name in a:
        diff = (a[name] - b[name]).abs()
        if name.endswith("attn.qkv.bias"):
            # The key bias's gradient is exactly zero in exact arithmetic (softmax ignores a shift shared by
            # all keys): in floats it is rounding noise, which Adam divides by its own root mean square, so
            # it moves by up to about the learning rate per step whichever way the noise falls, and the
            # noise differs with the world size. Bounded by the learning rates summed over the run.
            key = slice(WIDTH, 2 * WIDTH)
            assert diff[key].max() <= STEPS * LR, name
            diff[key] = 0
        worst[name] = diff.max().item()
    assert max(worst.values()) <= 1e-5, worst


def test_a_preemption_notice_is_answered_with_a_checkpoint_and_no_step_is_lost(nodes, dataset: str,
                                                                              tmp_path: Path) -> None:
    """A node is drained for preemption (what a spot reclaim does, by Ray's own CLI) in a run with no periodic
    checkpoint before its end: the run checkpoints at once, and once the deadline passes and the node is
    gone, goes on on the other node from that checkpoint (without it, from step 0)."""
    import subprocess
    import sys

    from vitscale.stages.run import run_pipeline
    from vitscale.train.restarts import read_rows, restarts

    cluster, workers = nodes
    run_dir = tmp_path / "preempted"
    config = _config(dataset, tmp_path, "preempted", [2, 4], 2)
    # Long enough that the deadline (10 s) and the next preemption ask (every 5 s) pass mid-run: a step takes
    # about 0.1 s here, and no report holds it (checkpoints only on the notice and at the end).
    steps = 600
    config = config.with_sections(train=dataclasses.replace(config.train, checkpoint_every=1000, max_steps=steps))
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["summary"] = run_pipeline(config, verbose=False)
        except Exception as exc:  # noqa: BLE001 -- surfaced by the main thread
            outcome["error"] = exc

    driver = threading.Thread(target=run)
    driver.start()
    metrics = run_dir / "metrics" / "rank0.jsonl"
    deadline = time.monotonic() + 600
    while not (metrics.exists() and any(r.get("step", 0) >= 5 and r.get("world_size") == 4
                                        for r in read_rows(metrics))):
        assert driver.is_alive(), outcome
        assert time.monotonic() < deadline, "the run never reached step 5 at 4 workers"
        time.sleep(0.2)
    victim = workers[1]
    drained = subprocess.run(
        [str(Path(sys.executable).parent / "ray"), "drain-node", "--address", cluster.address,
         "--node-id", victim.node_id, "--reason", "DRAIN_NODE_REASON_PREEMPTION", "--reason-message", "spot reclaim",
         "--deadline-remaining-seconds", "10"], capture_output=True, text=True, timeout=60)
    assert drained.returncode == 0, drained.stderr
    time.sleep(10)  # the deadline: the node goes
    cluster.remove_node(victim)
    workers[1] = cluster.add_node(num_cpus=2)  # capacity back for the other tests
    driver.join(timeout=900)
    assert not driver.is_alive() and "error" not in outcome, outcome

    log = (run_dir / "logs" / "ray.log").read_text()
    noticed = [line for line in log.splitlines() if "preempted" in line and "checkpointing now" in line]
    assert noticed, log[-4000:]
    grace = int(noticed[0].split("step ")[1].split(":")[0])
    assert 5 <= grace < steps, grace
    assert (run_dir / f"checkpoint_{grace:09d}" / "MANIFEST-rank3.json").exists()  # all 4 ranks' parts
    assert sorted(p.name for p in run_dir.glob("checkpoint_*") if p.is_dir()) == [f"checkpoint_{grace:09d}",
                                                                    f"checkpoint_{steps:09d}"]
    history = restarts(read_rows(metrics))
    assert history and history[0].step == grace, history  # resumed from the notice's checkpoint
    assert outcome["summary"]["pretrain"]["step"] == steps


def test_a_refresh_drops_a_dead_node_from_the_resource_view_at_once(nodes) -> None:
    """The refresh `launch/node_loss.py` makes before a recovery's size decision: once the GCS holds a SIGKILLed
    node dead, Ray's AutoscalingCoordinator (whose view Ray Train sizes an elastic run from) reserves nothing on
    it, without waiting for its own 20 s tick."""
    from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import (
        get_or_create_autoscaling_coordinator,
    )

    from vitscale.launch.node_loss import refresh_reserved_resources

    cluster, workers = nodes
    coordinator, requester = get_or_create_autoscaling_coordinator(), "train-refresh-probe"

    def reserved_cpus() -> float:
        reserved = ray.get(coordinator.get_reserved_resources.remote(requester), timeout=10)
        return sum(node.get("CPU", 0.0) for node in reserved.values())

    ray.get(coordinator.request_resources.remote(requester_id=requester, resources=[{"CPU": 1.0}] * 4,
                                                 expire_after_s=300), timeout=10)
    try:
        refresh_reserved_resources(requester)
        assert reserved_cpus() == 4.0
        victim = workers[1]
        cluster.remove_node(victim, allow_graceful=False)
        deadline = time.monotonic() + 120
        while any(n["NodeID"] == victim.node_id and n["Alive"] for n in ray.nodes()):  # the GCS's verdict
            assert time.monotonic() < deadline, "the GCS never declared the killed node dead"
            time.sleep(0.2)
        print(f"\nreserved CPUs once the GCS held the node dead: {reserved_cpus():g} before the refresh")
        refresh_reserved_resources(requester)
        assert reserved_cpus() == 2.0
    finally:
        ray.get(coordinator.cancel_request.remote(requester_id=requester), timeout=10)
        workers[1] = cluster.add_node(num_cpus=2)  # capacity back for the other tests
