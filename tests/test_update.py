"""The accumulation boundary's update (`train/update.py`): decided on the device where the engine allows
(ZeRO 0-3 with torch's fused optimizer: a GPU's path, run here with the fused CPU kernel), on the host
elsewhere, the same verdict and the same weights either way; and a step whose only wait for the device is
its last read (counted with `benchmarks/host_cost.py`'s `HostWaits`). Real DeepSpeed engines on gloo."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import vitscale.train.update as update_module
from helpers.gloo_ranks import launch_ranks
from vitscale.models import create_model
from vitscale.train.batch import derive_batch
from vitscale.train.config import TrainConfig
from vitscale.train.engine import build_engine, deepspeed_config, whole_weights
from vitscale.train.step import Stepper
from vitscale.train.update import apply_update

pytest.importorskip("deepspeed")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from host_cost import HostWaits  # the benchmark's counter of where a GPU would be waited on

STAGES = [0, 1, 2, 3]
TINY = {"img_size": 16, "depth": 2, "width": 32, "mlp_dim": 64, "heads": 2}
def _engine(stage: int, *, fused: bool = True, grad_clip: float | None = 1e-2, world: int = 1,
            optimizer: str = "adamw") -> Any:
    """A ZeRO engine whose inner optimizer is torch's fused AdamW, as on a GPU (`fused`), on CPU."""
    torch.manual_seed(0)
    model = create_model("ViT-Ti/8", num_classes=5, **TINY)
    for p in model.parameters():  # the zero-initialised head would leave most gradients zero
        torch.nn.init.normal_(p, std=0.05)
    # bf16 as on a GPU: DeepSpeed's own overflow check (with its host read) is off, vitscale's is the only one.
    train = TrainConfig(global_batch=4 * world, micro_batch=4, zero_stage=stage, precision="bf16",
                        grad_clip=grad_clip, weight_decay=0.1, base_lr=1e-2, optimizer=optimizer)
    plan = derive_batch(4 * world, 4, world)
    parameters = sum(p.numel() for p in model.parameters())
    return build_engine(model, train, deepspeed_config(train, plan, on_gpu=False, parameters=parameters), on_gpu=False,
                        fused=fused)


def _backward(engine: Any, seed: int, poison: str = "") -> torch.Tensor:
    torch.manual_seed(seed)
    dtype = next(engine.module.parameters()).dtype
    images, labels = torch.randn(4, 3, 16, 16, dtype=dtype), torch.randint(0, 5, (4,))
    loss = torch.nn.functional.cross_entropy(engine(images), labels)
    handle = None
    if poison == "gradient":  # one bias's gradient NaN: the loss stays finite
        handle = engine.module.blocks[0].mlp.fc1.bias.register_hook(lambda g: g * float("nan"))
    engine.backward(loss)
    if handle is not None:
        handle.remove()
    return torch.tensor(float("nan")) if poison == "loss" else loss.detach()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_device_and_host_verdicts_agree_step_for_step(process_group: None, monkeypatch: pytest.MonkeyPatch,
                                                      stage: int) -> None:
    device, host = _engine(stage), _engine(stage)
    seen: dict[str, list[bool]] = {"device": [], "host": []}
    for name, engine in (("device", device), ("host", host)):
        if name == "host":
            monkeypatch.setattr(update_module, "_decides_on_device", lambda engine, inner: False)
        for seed, poison in enumerate(["", "gradient", "loss", "", ""]):
            update = apply_update(engine, loss=_backward(engine, seed, poison))
            # The inner step ran at every stage (a fused inner optimizer: ZeRO 3's own skip of a non-finite norm
            # is left to vitscale's verdict, `_no_norm_read`), and refused on the device or on the host.
            assert isinstance(update.refused, torch.Tensor) == (name == "device") and update.deepspeed_applied
            seen[name].append(update.read()[0])
    assert seen["device"] == seen["host"] == [True, False, False, True, True]
    with whole_weights(device) as a, whole_weights(host) as b:
        for (name, p), q in zip(a.named_parameters(), b.parameters()):
            torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)
    a, b = device.basic_optimizer.state, host.basic_optimizer.state
    for pa, pb in zip(a.values(), b.values()):  # the refused steps counted in neither optimizer
        assert float(pa["step"]) == float(pb["step"]) == 3
        torch.testing.assert_close(pa["exp_avg_sq"], pb["exp_avg_sq"], rtol=0, atol=0)


def test_zero_3_refuses_a_non_finite_step_as_its_own_skip_did(process_group: None,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """ZeRO 3 without its host read of the norm (`_no_norm_read`): the non-finite step goes through DeepSpeed's
    step, refused by the fused kernel, and the weights and moments after it are those of DeepSpeed's own skip."""
    import contextlib

    ours, theirs = _engine(3), _engine(3)
    for name, engine in (("ours", ours), ("theirs", theirs)):
        if name == "theirs":
            monkeypatch.setattr(update_module, "_no_norm_read", lambda engine, inner: contextlib.nullcontext())
        applied = [apply_update(engine, loss=_backward(engine, seed, poison)).read()[0]
                   for seed, poison in enumerate(["", "gradient", "", ""])]
        assert applied == [True, False, True, True], name
    assert (ours.skipped_steps, theirs.skipped_steps) == (0, 1)  # DeepSpeed's own count: its skip, or none
    with whole_weights(ours) as a, whole_weights(theirs) as b:
        for (name, p), q in zip(a.named_parameters(), b.parameters()):
            torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)
    for pa, pb in zip(ours.basic_optimizer.state.values(), theirs.basic_optimizer.state.values()):
        assert float(pa["step"]) == float(pb["step"]) == 3
        torch.testing.assert_close(pa["exp_avg"], pb["exp_avg"], rtol=0, atol=0)
        torch.testing.assert_close(pa["exp_avg_sq"], pb["exp_avg_sq"], rtol=0, atol=0)


def test_a_plain_optimizer_is_decided_on_the_host(process_group: None) -> None:
    for stage, fused in ((0, False), (1, False), (3, False)):
        engine = _engine(stage, fused=fused)
        update = apply_update(engine, loss=_backward(engine, 0))
        assert update.refused is False and update.read()[0], (stage, fused)


@pytest.mark.parametrize("stage", [1, 2])
def test_sync_free_clipping_is_deepspeeds_bit_for_bit(process_group: None, stage: int) -> None:
    ours, theirs = _engine(stage), _engine(stage)
    assert "unscale_and_clip_grads" in ours.optimizer.__dict__
    del theirs.optimizer.unscale_and_clip_grads  # DeepSpeed's own, with its host read of the norm
    for engine in (ours, theirs):
        for seed in range(3):
            applied, norm, _ = apply_update(engine, loss=_backward(engine, seed)).read()
            assert applied and norm > 1e-2  # the clip acts on every step
    for (name, p), q in zip(ours.module.named_parameters(), theirs.module.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])  # pre-training's and fine-tuning's (ZeRO 0 by default)
def test_zero_0_in_bf16_steps_as_deepspeeds_own_without_its_reads(process_group: None,
                                                                   optimizer: str) -> None:
    """DeepSpeed's bf16 wrapper at ZeRO 0 reads every gradient on the host for overflow; vitscale's step
    (`fused.fuse_bf16_step`) makes the same update (its norm in fp32 on the device, DeepSpeed's summed on
    the host in double: the clip coefficients agree to rounding) with none, and refuses a non-finite one."""
    from vitscale.train.fused import fuse_clipping

    ours, theirs = _engine(0, optimizer=optimizer), _engine(0, optimizer=optimizer)
    assert type(theirs.optimizer).__name__ == "FP16_UnfusedOptimizer" and "step" in ours.optimizer.__dict__
    assert not fuse_clipping(ours) and "unscale_and_clip_grads" not in ours.optimizer.__dict__  # ZeRO 1/2's only
    del theirs.optimizer.step
    theirs.optimizer.optimizer.state.clear()  # from the same start: without the step DeepSpeed takes at build
    for group16, group32 in zip(theirs.optimizer.fp16_groups, theirs.optimizer.fp32_groups):
        for p16, p32 in zip(group16, group32):
            p32.data.copy_(p16.data)
    for engine in (ours, theirs):
        for seed, poison in enumerate(["", "", "gradient", ""]):
            with HostWaits() as counted:
                applied, norm, _ = apply_update(engine, loss=_backward(engine, seed, poison)).read()
            assert applied == (poison == ""), (seed, poison)
            assert (norm > 1e-2) if applied else norm == float("inf")
            if engine is ours:
                assert counted.waits == ["tolist"]
    for (name, p), q in zip(ours.module.named_parameters(), theirs.module.parameters()):
        torch.testing.assert_close(p.float(), q.float(), rtol=0, atol=1e-6, msg=name)
    for a, b in zip(ours.optimizer.fp32_groups, theirs.optimizer.fp32_groups):
        for p, q in zip(a, b):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)


def test_zero_0_makes_the_same_first_updates_as_zero_1(process_group: None) -> None:
    """DeepSpeed's bf16 wrapper at ZeRO 0 stepped Adam once with zero gradients when built: its first real
    update was 0.74x ZeRO 1's. With that step undone (`fuse_bf16_step`) the stages train alike."""
    zero0, zero1 = _engine(0), _engine(1)
    start = [p.detach().float().clone() for p in zero0.module.parameters()]
    for seed in range(3):
        for engine in (zero0, zero1):
            assert apply_update(engine, loss=_backward(engine, seed)).read()[0]
    # How far each weight moved, compared in size (the bf16 weights round the same fp32 masters alike,
    # but a rounding boundary between them would make an elementwise comparison brittle).
    for (name, p), q, w in zip(zero0.module.named_parameters(), zero1.module.parameters(), start):
        moved0, moved1 = float((p.float() - w).norm()), float((q.float() - w).norm())
        assert moved0 == pytest.approx(moved1, rel=0.02), (name, moved0, moved1)
    masters = [p for group in zero0.optimizer.fp32_groups for p in group]
    assert all(float(zero0.basic_optimizer.state[p]["step"]) == 3 for p in masters)


def _fixed(batch: int) -> Iterator[dict[str, Any]]:
    torch.manual_seed(0)
    micro = {"image": torch.randint(0, 256, (batch, 3, 16, 16), dtype=torch.uint8),
             "label": torch.randint(0, 5, (batch,)), "key": [str(i) for i in range(batch)]}
    while True:
        yield micro


@pytest.mark.parametrize(("stage", "on_device", "reads"),
                         [(0, True, 1), (1, True, 1), (2, True, 1), (3, True, 1), (3, False, 3), (1, False, 3)])
def test_a_step_reads_the_device_once_where_the_update_is_decided_there(
        process_group: None, monkeypatch: pytest.MonkeyPatch, stage: int, on_device: bool, reads: int) -> None:
    """Each read is a host sync on a GPU: the GPU's ZeRO 0-3 step has one, at its end (the loss, votes,
    verdict and norm together; ZeRO 3's own finite check of its norm, a second, is left to the verdict); a
    host-decided update adds the loss before it and the verdict's."""
    engine = _engine(stage)
    if not on_device:
        monkeypatch.setattr(update_module, "_decides_on_device", lambda engine, inner: False)
    train = TrainConfig(global_batch=4, micro_batch=4, zero_stage=stage, precision="bf16")
    stepper = Stepper(engine, train, derive_batch(4, 4, 1), torch.device("cpu"), world_size=1)
    batches = _fixed(4)
    for _ in range(2):  # the first step creates optimizer state, the second checks ZeRO 3's trace on all ranks
        stepper.step(batches, 1e-3)
    with HostWaits() as counted:
        outcome = stepper.step(batches, 1e-3, votes=lambda: [1.0, 2.0])
    assert outcome.applied and outcome.votes == (1.0, 2.0) and outcome.grad_norm > 0
    assert len(counted.waits) == reads, counted.waits


def ranks(out: Path, stages: list[int]) -> None:
    """One rank of `two_ranks` (run as a script): each ZeRO stage in turn, with an engine of its own."""
    from vitscale.train.engine import init_distributed

    torch.distributed.init_process_group("gloo")
    init_distributed(on_gpu=False)
    rank = torch.distributed.get_rank()
    for stage in stages:
        engine = _engine(stage, world=torch.distributed.get_world_size())
        applied, kinds = [], []
        for step, poison in enumerate(["", "gradient", ""]):
            # Each rank its own data (so the gradients differ before averaging); rank 1 alone poisoned.
            update = apply_update(engine, loss=_backward(engine, 10 * step + rank, poison if rank == 1 else ""))
            kinds.append(type(update.refused).__name__)
            applied.append(update.read()[0])
        with whole_weights(engine) as model:
            weights = [float(p.double().sum()) for p in model.parameters()]
        record = {"applied": applied, "kinds": kinds, "weights": weights}
        (out / f"rank{rank}-zero{stage}.json").write_text(json.dumps(record))
        torch.distributed.barrier()  # both ranks done with this engine before either builds the next
    # Leave together, the group torn down: gloo's threads still running at exit abort the process.
    torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two gloo ranks that go through ZeRO 0, 1, 2 and 3 in turn (one launch: the processes' start-up is most
    of the cost), each stage's record in `rank{r}-zero{s}.json`."""
    out = tmp_path_factory.mktemp("two-ranks")
    launch_ranks(__file__, out, 2, str(out), ",".join(map(str, STAGES)), timeout_s=300)
    return out


@pytest.mark.parametrize("stage", STAGES)
def test_one_ranks_bad_gradient_refuses_the_update_on_every_rank(two_ranks: Path, stage: int) -> None:
    """Two gloo ranks on the device path: a NaN in one rank's gradient reaches the other through the averaged
    gradients and the global norm, so both refuse that step with no collective of their own, and both
    apply the others; the ranks' weights stay identical."""
    seen = [json.loads((two_ranks / f"rank{r}-zero{stage}.json").read_text()) for r in (0, 1)]
    assert seen[0]["applied"] == seen[1]["applied"] == [True, False, True]
    if stage != 3:  # ZeRO 3 skips the non-finite step itself, before the inner step
        assert seen[0]["kinds"] == seen[1]["kinds"] == ["Tensor"] * 3
    assert seen[0]["weights"] == seen[1]["weights"]


def test_zero_0_in_bf16_resumes_to_the_uninterrupted_weights(process_group: None, tmp_path: Path) -> None:
    """`fuse_bf16_step` clears the state DeepSpeed's wrapper made at build; a checkpoint's state loaded into a
    fresh engine afterwards is the state training continues from."""
    from vitscale.train.engine import load_checkpoint

    whole = _engine(0)
    for seed in range(4):
        if seed == 2:
            whole.save_checkpoint(str(tmp_path), tag="two")
        assert apply_update(whole, loss=_backward(whole, seed)).read()[0]
    resumed = _engine(0)
    load_checkpoint(resumed, tmp_path, "two")
    for seed in (2, 3):
        assert apply_update(resumed, loss=_backward(resumed, seed)).read()[0]
    for a, b in zip(whole.optimizer.fp32_groups, resumed.optimizer.fp32_groups):
        for p, q in zip(a, b):
            torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_deepspeed_syncs_the_device_only_where_it_overlaps_communication() -> None:
    """A GPU's config: DeepSpeed's throughput timer (a device sync per forward and per step) off; the
    reduction overlapped with the backward pass (a device sync per gradient bucket) only with ranks to
    reduce with."""
    for world, overlapped in ((1, False), (2, True)):
        train = TrainConfig(global_batch=8, micro_batch=4, zero_stage=1)
        config = deepspeed_config(train, derive_batch(8, 4, world), on_gpu=True)
        assert config["zero_optimization"]["overlap_comm"] is overlapped
        assert config["timers"] == {"throughput": {"enabled": False}}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_step_never_asks_deepspeed_to_sync_the_device(process_group: None, stage: int) -> None:
    """The engine's `get_accelerator().synchronize()` calls (a no-op on CPU, a full device sync on a GPU),
    counted over steps past DeepSpeed's timer warm-up, with the config a GPU gets at world size 1."""
    train = TrainConfig(global_batch=4, micro_batch=2, zero_stage=stage, precision="bf16", grad_clip=1.0)
    torch.manual_seed(0)
    model = create_model("ViT-Ti/8", num_classes=5, **TINY)
    plan = derive_batch(4, 2, 1)  # two micro-batches: DeepSpeed's timer starts at every forward
    config = deepspeed_config(train, plan, on_gpu=True)
    engine = build_engine(model, train, config, on_gpu=False, fused=True)
    stepper = Stepper(engine, train, plan, torch.device("cpu"), world_size=1)
    batches = _fixed(2)
    with HostWaits() as counted:
        for _ in range(5):
            assert stepper.step(batches, 1e-3).applied
    syncs = [wait for wait in counted.waits if wait == "synchronize"]
    assert syncs == []


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    ranks(Path(sys.argv[1]), [int(stage) for stage in sys.argv[2].split(",")])
    # The rank's record is written and its group torn down. Past that, the interpreter's own teardown of
    # the libraries' threads aborted a ZeRO 3 rank once on a loaded machine ("terminate called without an
    # active exception", exit -6), failing a test whose every check had passed: leave without it.
    sys.stdout.flush()
    os._exit(0)
