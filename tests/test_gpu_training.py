"""The worker loop on a CUDA GPU in bf16 (NCCL, real DeepSpeed ZeRO 0-3): what the CPU suite cannot show.

One process, one GPU, the loop exactly as a Ray Train worker runs it (`train.loop.train`), fed by
vitscale's own shard stream. Each stage trains, reports an MFU from the device's peak table,
checkpoints, and a run resumed from the middle checkpoint consumes the same samples and ends at
the uninterrupted run's weights. Skipped without a GPU.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def nccl_group() -> None:
    """A one-rank NCCL group, as Ray Train sets up for a GPU worker."""
    if not torch.distributed.is_initialized():
        os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "RANK": "0",
                           "WORLD_SIZE": "1", "LOCAL_RANK": "0"})
        torch.cuda.set_device(0)
        torch.distributed.init_process_group("nccl", rank=0, world_size=1)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> str:
    from vitscale.data.tools.write import write_dataset

    out = tmp_path_factory.mktemp("data") / "synthetic"
    write_dataset("synthetic", str(out), shard_size=37, max_side=32, seed=0,
                  source_options={"count": 160, "classes": 4, "image_size": 32}, progress=False)
    return str(out)


def _job(url: str, stage: int):  # type: ignore[no-untyped-def]
    from vitscale.stages import build_pipeline
    from vitscale.stages.pretrain import pretraining_job

    return pretraining_job(build_pipeline({
        "model": {"name": "ViT-Ti/8", "img_size": 32, "depth": 2, "width": 64, "mlp_dim": 128, "heads": 2},
        "data": {"url": url, "num_workers": 0, "shuffle_buffer": 64},
        "train": {"global_batch": 16, "micro_batch": 8, "max_steps": 6, "warmup_steps": 2, "base_lr": 1e-3,
                  "zero_stage": stage, "precision": "bf16", "checkpoint_every": 3, "log_every": 1,
                  "record_samples": True},
        "cluster": {"num_workers": 1, "use_gpu": True},
    }))


class _Recorder:
    def __init__(self, keep: Path):
        self.keep, self.metrics = keep, []  # type: ignore[var-annotated]
        keep.mkdir(parents=True)

    def __call__(self, metrics: dict, checkpoint_dir: Path | None) -> None:
        import shutil

        self.metrics.append(metrics)
        if checkpoint_dir is not None:
            shutil.copytree(checkpoint_dir, self.keep / f"checkpoint_{metrics['step']:09d}")


def _step_metrics(run_dir: Path) -> list[dict]:
    """Every step's metrics line (the loop reports to Ray Train only at checkpoints and evaluations)."""
    return [json.loads(line) for line in (run_dir / "metrics" / "rank0.jsonl").read_text().splitlines()]


def _keys(run_dir: Path) -> list[list[str]]:
    lines = (run_dir / "samples" / "rank0.jsonl").read_text().splitlines()
    return [json.loads(line)["keys"] for line in lines]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_bf16_training_on_cuda_checkpoints_and_resumes(tmp_path: Path, dataset: str, nccl_group: None,
                                                       stage: int) -> None:
    from vitscale.train.engine import consolidated_state_dict
    from vitscale.train.loop import WorkerContext, train

    job = _job(dataset, stage)
    whole = _Recorder(tmp_path / "whole")
    summary = train(job, WorkerContext(rank=0, world_size=1, run_dir=tmp_path / "run-a", report=whole))
    assert summary["steps"] == 6
    steps = _step_metrics(tmp_path / "run-a")
    assert [m["step"] for m in steps] == [1, 2, 3, 4, 5, 6]
    losses = [m["loss"] for m in steps]
    assert all(torch.isfinite(torch.tensor(losses))), losses
    # The device's peak is in the table (H100/H200/A100), so every step line carries an MFU.
    assert all(m.get("mfu") is not None and 0 < m["mfu"] < 1 for m in steps), steps[-1]
    assert [m["step"] for m in whole.metrics] == [3, 6]  # Ray Train hears of the checkpoints (train/loop.py)

    resumed = _Recorder(tmp_path / "resumed")
    train(job, WorkerContext(rank=0, world_size=1, run_dir=tmp_path / "run-b", report=resumed,
                             resume_from=tmp_path / "whole" / "checkpoint_000000003"))
    assert [m["step"] for m in _step_metrics(tmp_path / "run-b")] == [4, 5, 6]
    assert _keys(tmp_path / "run-a")[3:] == _keys(tmp_path / "run-b")
    a = consolidated_state_dict(tmp_path / "whole" / "checkpoint_000000006" / "deepspeed", "state")
    b = consolidated_state_dict(tmp_path / "resumed" / "checkpoint_000000006" / "deepspeed", "state")
    assert a.keys() == b.keys()
    # The fp32 master weights after the same three steps from the same state. CUDA's attention and
    # reduction kernels may pick another order between processes; three Adam steps of lr <= 1e-3 move
    # a weight by at most ~3e-3, so a bound of 1e-4 still catches a wrong batch, LR or moment.
    worst = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
    print(f"ZeRO {stage}: largest weight difference resumed vs uninterrupted {worst:.3g}")
    assert worst <= 1e-4, worst


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_the_update_is_queued_without_waiting_for_the_gpu(nccl_group: None, stage: int,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """At ZeRO 0-2 the update (norm, clip, verdict, fused AdamW, copies back) makes no host sync: CUDA's sync
    debug mode raises on any. The verdict is read afterwards, once, with the norm. Nor does DeepSpeed call
    its accelerator's `synchronize` anywhere in the step (its throughput timer, overlapped reduction)."""
    from vitscale.models import create_model
    from vitscale.train.batch import derive_batch
    from vitscale.train.config import TrainConfig
    from vitscale.train.engine import build_engine, deepspeed_config
    from vitscale.train.update import apply_update

    # Eager: compiling changes the forward's kernels, not the update this checks (and costs test time).
    train = TrainConfig(global_batch=8, micro_batch=8, zero_stage=stage, precision="bf16", grad_clip=1.0,
                        compile=False)
    torch.manual_seed(0)
    model = create_model("ViT-Ti/8", num_classes=5, img_size=32, depth=2, width=64, mlp_dim=128, heads=2)
    engine = build_engine(model, train, deepspeed_config(train, derive_batch(8, 8, 1), on_gpu=True), on_gpu=True)
    device = torch.device("cuda", torch.cuda.current_device())
    from deepspeed.accelerator import get_accelerator

    accelerator, syncs = get_accelerator(), []
    real = accelerator.synchronize

    def counted(*args: object, **kwargs: object) -> object:  # DeepSpeed's explicit device syncs
        syncs.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(accelerator, "synchronize", counted)
    for poison in ("", "", "gradient", ""):
        images = torch.randn(8, 3, 32, 32, device=device, dtype=torch.bfloat16)
        loss = torch.nn.functional.cross_entropy(engine(images).float(), torch.randint(0, 5, (8,), device=device))
        if poison:
            loss = loss * float("inf")
        engine.backward(loss)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            update = apply_update(engine, loss=loss.detach())
        finally:
            torch.cuda.set_sync_debug_mode(0)
        applied, norm, _ = update.read()
        assert applied == (not poison) and (norm > 0 if applied else True), (poison, applied, norm)
    assert syncs == []  # nor did the engine drain the device through its accelerator (forward to update)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_a_loop_step_waits_for_the_gpu_once(nccl_group: None, stage: int) -> None:
    """`Stepper.step` as the loop calls it (a pinned batch from the loader read ahead, the loop's four votes)
    makes one host sync at ZeRO 0-2, its final read. The votes' copy to the device had made a second (torch
    synchronises the stream after a copy from pageable memory), after the backward pass was queued: the GPU
    idled while the host queued the update, and the loop ran at 0.94x the benchmark's fixed batch, which
    passed no votes."""
    import warnings

    from vitscale.models import create_model
    from vitscale.train.batch import derive_batch
    from vitscale.train.config import TrainConfig
    from vitscale.train.engine import build_engine, deepspeed_config
    from vitscale.train.step import Stepper

    train = TrainConfig(global_batch=8, micro_batch=8, zero_stage=stage, precision="bf16", compile=False)
    torch.manual_seed(0)
    model = create_model("ViT-Ti/8", num_classes=5, img_size=32, depth=2, width=64, mlp_dim=128, heads=2)
    plan = derive_batch(8, 8, 1)
    engine = build_engine(model, train, deepspeed_config(train, plan, on_gpu=True), on_gpu=True)
    device = torch.device("cuda", torch.cuda.current_device())
    stepper = Stepper(engine, train, plan, device, world_size=1)

    def loader():  # what the DataLoader hands the loop on a GPU: pinned uint8 images and labels
        while True:
            yield {"image": torch.randint(0, 256, (8, 3, 32, 32), dtype=torch.uint8).pin_memory(),
                   "label": torch.randint(0, 5, (8,)).pin_memory(), "key": [f"k{i}" for i in range(8)]}

    batches = loader()
    for _ in range(2):  # warm-up: DeepSpeed's first step allocates and may synchronise
        stepper.step(batches, 1e-4, votes=lambda: [0.0, 0.0, 3.0, 0.0], ahead=True)
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:  # its images read ahead by the step before, on a side stream (`train/feed.py`), and the next's
            outcome = stepper.step(batches, 1e-4, votes=lambda: [0.0, 0.0, 3.0, 0.0], ahead=True)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    # Each sync warns "called a synchronizing CUDA operation"; the mode's first use also warns that it is a
    # prototype, which is no sync.
    syncs = [str(w.message) for w in caught if "called a synchronizing" in str(w.message)]
    assert outcome.votes == (0.0, 0.0, 3.0, 0.0) and outcome.applied
    assert len(syncs) == 1, syncs


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_the_one_pass_update_steps_as_deepspeed_without_waiting(nccl_group: None, stage: int) -> None:
    """`train/one_pass.py` on the GPU, its kernel compiled by Triton: from the same weights, one step lands where
    DeepSpeed's own step does (fp32 rounding apart); then, under CUDA's sync debug mode, a poisoned update is
    refused and the next applied, with no host sync in either."""
    from vitscale.models import create_model
    from vitscale.train.batch import derive_batch
    from vitscale.train.config import TrainConfig
    from vitscale.train.engine import build_engine, deepspeed_config
    from vitscale.train.one_pass import one_pass_installed, one_pass_update
    from vitscale.train.update import apply_update

    train = TrainConfig(global_batch=8, micro_batch=8, zero_stage=stage, precision="bf16", grad_clip=1e-3,
                        compile=False)  # the model eager; the update's kernel compiled below
    engines = []
    for one_pass in (True, False):
        torch.manual_seed(0)
        model = create_model("ViT-Ti/8", num_classes=5, img_size=32, depth=2, width=64, mlp_dim=128, heads=2)
        engine = build_engine(model, train, deepspeed_config(train, derive_batch(8, 8, 1), on_gpu=True), on_gpu=True)
        assert not one_pass_installed(engine)  # `compile: false`: DeepSpeed's own step
        if one_pass:
            assert one_pass_update(engine)
        engines.append(engine)
    device = torch.device("cuda", torch.cuda.current_device())

    def step(engine, seed: int, poison: bool = False, debug: bool = False):  # type: ignore[no-untyped-def]
        torch.manual_seed(seed)
        images = torch.randn(8, 3, 32, 32, device=device, dtype=torch.bfloat16)
        loss = torch.nn.functional.cross_entropy(engine(images).float(), torch.randint(0, 5, (8,), device=device))
        engine.backward(loss * float("inf") if poison else loss)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error" if debug else 0)
        try:
            update = apply_update(engine, loss=loss.detach() * (float("inf") if poison else 1.0))
        finally:
            torch.cuda.set_sync_debug_mode(0)
        return update.read()[0]

    def masters(engine):  # type: ignore[no-untyped-def]
        optimizer = engine.optimizer
        return getattr(optimizer, "fp32_partitioned_groups_flat", None) or optimizer.single_partition_of_fp32_groups

    assert step(engines[0], 0) and step(engines[1], 0)
    for ours, theirs in zip(masters(engines[0]), masters(engines[1]), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
        a, b = engines[0].basic_optimizer.state[ours], engines[1].basic_optimizer.state[theirs]
        assert float(a["step"]) == float(b["step"]) == 1.0
        torch.testing.assert_close(a["exp_avg"], b["exp_avg"], rtol=1e-5, atol=1e-11)
    kept = [p.detach().clone() for p in masters(engines[0])]
    assert not step(engines[0], 1, poison=True, debug=True)
    assert all(torch.equal(a, b) for a, b in zip(kept, masters(engines[0])))
    assert step(engines[0], 2, debug=True)


def test_one_ranks_zero_3_never_waits_for_the_gpu(nccl_group: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """ZeRO 3 on one GPU (`train/one_rank.py`, `train/update.py`): from the forward pass to the queued update
    the host never waits for the GPU (CUDA's sync debug mode raises on any sync, and no stream or event is
    synchronised): the forward's hooks gather nothing (each gather had synchronised a stream), the backward's
    end waits for the reduction stream on the GPU (the host had), and the update's verdict is made on the
    device (DeepSpeed had read the norm). The step's one read is `Update.read`. The MLP's weights (256 x
    1,024) are above DeepSpeed's default persistence threshold: without `ONE_RANK_ZERO_3` they are gathered."""
    from vitscale.models import create_model
    from vitscale.train.batch import derive_batch
    from vitscale.train.config import TrainConfig
    from vitscale.train.engine import build_engine, deepspeed_config
    from vitscale.train.update import apply_update

    train = TrainConfig(global_batch=8, micro_batch=8, zero_stage=3, precision="bf16", grad_clip=1.0, compile=False)
    torch.manual_seed(0)
    model = create_model("ViT-Ti/8", num_classes=5, img_size=32, depth=2, width=256, mlp_dim=1024, heads=4)
    engine = build_engine(model, train, deepspeed_config(train, derive_batch(8, 8, 1), on_gpu=True), on_gpu=True)
    device = torch.device("cuda", torch.cuda.current_device())
    waits: list[str] = []
    for cls in (torch.cuda.Stream, torch.cuda.Event):
        real = cls.synchronize

        def counted(self: object, *args: object, _real: object = real, _name: str = cls.__name__) -> object:
            waits.append(_name)
            return _real(self, *args)  # type: ignore[operator]

        monkeypatch.setattr(cls, "synchronize", counted)
    for step in range(4):
        checked = step >= 2  # the first step records DeepSpeed's trace of the modules (and gathers once)
        images = torch.randn(8, 3, 32, 32, device=device, dtype=torch.bfloat16)
        labels = torch.randint(0, 5, (8,), device=device)
        torch.cuda.synchronize()
        waits.clear()
        if checked:
            torch.cuda.set_sync_debug_mode("error")
        try:
            loss = torch.nn.functional.cross_entropy(engine(images).float(), labels)
            engine.backward(loss)
            update = apply_update(engine, loss=loss.detach())
        finally:
            torch.cuda.set_sync_debug_mode(0)
        applied, norm, _ = update.read()
        assert applied and norm > 0
        if checked:
            assert waits == [], (step, waits)


def test_one_ranks_zero_3_with_offload_keeps_the_hosts_wait_for_its_gradients(nccl_group: None) -> None:
    """With `train.offload` ZeRO 3 copies the gradients into host memory on its reduction stream (non-blocking)
    and the host's optimizer reads them there: the host's own wait for that stream is what makes the copies
    complete first, so `order_on_the_gpu` leaves it. The offloaded steps (SGD on the host: nothing for DeepSpeed
    to build) end where the same steps on the GPU end, up to rounding (the two paths cast and reduce the
    gradients in another order: 0.2% of the weights' movement on a CPU); a step on gradients still being copied
    would miss part of a step's movement (a third of it for a whole gradient)."""
    from vitscale.models import create_model
    from vitscale.train.batch import derive_batch
    from vitscale.train.config import TrainConfig
    from vitscale.train.engine import build_engine, deepspeed_config
    from vitscale.train.one_rank import _OrderedOnTheGpu, order_on_the_gpu
    from vitscale.train.update import apply_update

    device = torch.device("cuda", torch.cuda.current_device())
    generator = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 3, 32, 32, generator=generator), torch.randint(0, 5, (8,), generator=generator))
               for _ in range(3)]
    start: dict[int, torch.Tensor] = {}
    ends = {}
    for offload in (False, True):
        train = TrainConfig(global_batch=8, micro_batch=8, zero_stage=3, precision="bf16", optimizer="sgd",
                            base_lr=0.1, offload=offload, compile=False)
        torch.manual_seed(0)
        model = create_model("ViT-Ti/8", num_classes=5, img_size=32, depth=2, width=256, mlp_dim=1024, heads=4)
        engine = build_engine(model, train, deepspeed_config(train, derive_batch(8, 8, 1), on_gpu=True), on_gpu=True)
        stream = engine.optimizer.reduce_and_partition_stream
        assert isinstance(stream, _OrderedOnTheGpu) != offload, (offload, type(stream))
        assert not order_on_the_gpu(engine)  # installed once (no offload) or never (offload)
        start = start or _master_weights(engine)
        for images, labels in batches:  # at the optimizer's starting learning rate, 0.1
            loss = torch.nn.functional.cross_entropy(engine(images.to(device, torch.bfloat16)).float(),
                                                     labels.to(device))
            engine.backward(loss)
            applied, _, _ = apply_update(engine, loss=loss.detach()).read()
            assert applied
        ends[offload] = _master_weights(engine)
    moved = _distance(ends[False], start)
    apart = _distance(ends[True], ends[False])
    print(f"ZeRO 3 one rank: offloaded vs on the GPU {apart:.3g} apart after moving {moved:.3g}")
    assert moved > 0 and apart <= 0.02 * moved, (apart, moved)


def _master_weights(engine) -> dict[int, torch.Tensor]:  # type: ignore[no-untyped-def]
    """ZeRO 3's flat fp32 master partitions by sub-group, on the host (one rank: each is the whole group)."""
    return {i: flat.detach().float().cpu().clone()
            for i, flat in enumerate(engine.optimizer.fp32_partitioned_groups_flat)}


def _distance(a: dict[int, torch.Tensor], b: dict[int, torch.Tensor]) -> float:
    """The L2 distance between two sets of master weights."""
    assert a.keys() == b.keys()
    return float(sum(float(((a[k] - b[k]) ** 2).sum()) for k in a)) ** 0.5
