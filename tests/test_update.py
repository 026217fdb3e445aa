"""The accumulation boundary's update (`train/update.py`): decided on the device where the engine allows
(ZeRO 1/2, torch's fused optimizer: a GPU's path, run here with the fused CPU kernel), on the host
elsewhere, the same verdict and the same weights either way; and a step whose only host read is the last.
Real DeepSpeed engines on a one-rank gloo group."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

import vitscale.train.engine as engine_module
import vitscale.train.update as update_module
from vitscale.models import create_model
from vitscale.train.batch import derive_batch
from vitscale.train.config import TrainConfig
from vitscale.train.engine import build_engine, deepspeed_config
from vitscale.train.optim import optimizer_for
from vitscale.train.step import Stepper
from vitscale.train.update import apply_update

pytest.importorskip("deepspeed")

TINY = {"img_size": 16, "depth": 2, "width": 32, "mlp_dim": 64, "heads": 2}
READS = {"item", "tolist", "__bool__", "__float__", "__int__", "__index__"}


class HostReads(TorchFunctionMode):
    """Counts the tensor-to-host reads made inside it (each one a device sync on a GPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if getattr(func, "__name__", "") in READS:
            self.reads.append(func.__name__)
        return func(*args, **(kwargs or {}))


def _engine(monkeypatch: pytest.MonkeyPatch, stage: int, *, fused: bool = True, grad_clip: float | None = 1e-2) -> Any:
    """A ZeRO engine whose inner optimizer is torch's fused AdamW, as on a GPU (`fused`), on CPU."""
    monkeypatch.setattr(engine_module, "optimizer_for",
                        lambda train, groups, fused=False, _f=fused: optimizer_for(train, groups, fused=_f))
    torch.manual_seed(0)
    model = create_model("ViT-Ti/8", num_classes=5, **TINY)
    for p in model.parameters():  # the zero-initialised head would leave most gradients zero
        torch.nn.init.normal_(p, std=0.05)
    # bf16 as on a GPU: DeepSpeed's own overflow check (with its host read) is off, vitscale's is the only one.
    train = TrainConfig(global_batch=4, micro_batch=4, zero_stage=stage, precision="bf16", grad_clip=grad_clip,
                        weight_decay=0.1, base_lr=1e-2)
    return build_engine(model, train, deepspeed_config(train, derive_batch(4, 4, 1), on_gpu=False), on_gpu=False)


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


@pytest.mark.parametrize("stage", [1, 2])
def test_device_and_host_verdicts_agree_step_for_step(process_group: None, monkeypatch: pytest.MonkeyPatch,
                                                      stage: int) -> None:
    device, host = _engine(monkeypatch, stage), _engine(monkeypatch, stage)
    seen: dict[str, list[bool]] = {"device": [], "host": []}
    for name, engine in (("device", device), ("host", host)):
        if name == "host":
            monkeypatch.setattr(update_module, "_decides_on_device", lambda engine, inner: False)
        for seed, poison in enumerate(["", "gradient", "loss", "", ""]):
            update = apply_update(engine, loss=_backward(engine, seed, poison))
            assert isinstance(update.refused, torch.Tensor) == (name == "device")
            seen[name].append(update.read()[0])
    assert seen["device"] == seen["host"] == [True, False, False, True, True]
    for (name, p), q in zip(device.module.named_parameters(), host.module.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)
    a, b = device.basic_optimizer.state, host.basic_optimizer.state
    for pa, pb in zip(a.values(), b.values()):  # the refused steps counted in neither optimizer
        assert float(pa["step"]) == float(pb["step"]) == 3
        torch.testing.assert_close(pa["exp_avg_sq"], pb["exp_avg_sq"], rtol=0, atol=0)


def test_a_plain_optimizer_is_decided_on_the_host(process_group: None, monkeypatch: pytest.MonkeyPatch) -> None:
    for stage, fused in ((1, False), (0, True), (3, True)):
        engine = _engine(monkeypatch, stage, fused=fused)
        update = apply_update(engine, loss=_backward(engine, 0))
        assert update.refused is False and update.read()[0], (stage, fused)


@pytest.mark.parametrize("stage", [1, 2])
def test_sync_free_clipping_is_deepspeeds_bit_for_bit(process_group: None, monkeypatch: pytest.MonkeyPatch,
                                                      stage: int) -> None:
    ours, theirs = _engine(monkeypatch, stage), _engine(monkeypatch, stage)
    assert "unscale_and_clip_grads" in ours.optimizer.__dict__
    del theirs.optimizer.unscale_and_clip_grads  # DeepSpeed's own, with its host read of the norm
    for engine in (ours, theirs):
        for seed in range(3):
            applied, norm, _ = apply_update(engine, loss=_backward(engine, seed)).read()
            assert applied and norm > 1e-2  # the clip acts on every step
    for (name, p), q in zip(ours.module.named_parameters(), theirs.module.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)


def _fixed(batch: int) -> Iterator[dict[str, Any]]:
    torch.manual_seed(0)
    micro = {"image": torch.randint(0, 256, (batch, 3, 16, 16), dtype=torch.uint8),
             "label": torch.randint(0, 5, (batch,)), "key": [str(i) for i in range(batch)]}
    while True:
        yield micro


@pytest.mark.parametrize(("stage", "on_device", "reads"), [(1, True, 1), (2, True, 1), (1, False, 3)])
def test_a_step_reads_the_device_once_where_the_update_is_decided_there(
        process_group: None, monkeypatch: pytest.MonkeyPatch, stage: int, on_device: bool, reads: int) -> None:
    """Each read is a host sync on a GPU: the GPU's ZeRO 1/2 step has one, at its end (the loss, votes,
    verdict and norm together); a host-decided update adds the loss before it and the verdict's."""
    engine = _engine(monkeypatch, stage)
    if not on_device:
        monkeypatch.setattr(update_module, "_decides_on_device", lambda engine, inner: False)
    train = TrainConfig(global_batch=4, micro_batch=4, zero_stage=stage, precision="bf16")
    stepper = Stepper(engine, train, derive_batch(4, 4, 1), torch.device("cpu"), world_size=1)
    batches = _fixed(4)
    stepper.step(batches, 1e-3)  # the first step creates optimizer state
    with HostReads() as counted:
        outcome = stepper.step(batches, 1e-3, votes=lambda: [1.0, 2.0])
    assert outcome.applied and outcome.votes == (1.0, 2.0) and outcome.grad_norm > 0
    assert len(counted.reads) == reads, counted.reads
