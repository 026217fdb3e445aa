"""ZeRO 1-3's gradient hooks counting from held gradient accumulators (`train/grad_hooks.py`) against DeepSpeed's
own: the same count in every backward pass (an unused parameter left out), no view made for it, the same steps;
ZeRO 3's partitioned parameters left to DeepSpeed. Real DeepSpeed engines on a one-rank gloo group."""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch

from vitscale.models import create_model
from vitscale.train.batch import derive_batch
from vitscale.train.config import TrainConfig
from vitscale.train.engine import build_engine, deepspeed_config
from vitscale.train.grad_hooks import HELD, count_from_held_accumulators, used_parameters
from vitscale.train.update import apply_update

pytest.importorskip("deepspeed")

TINY = {"img_size": 16, "depth": 2, "width": 32, "mlp_dim": 64, "heads": 2}


class WithUnused(torch.nn.Module):
    """A ViT and a layer its forward pass never calls: a parameter no backward pass reaches."""

    def __init__(self) -> None:
        super().__init__()
        self.vit = create_model("ViT-Ti/8", num_classes=5, **TINY)
        self.unused = torch.nn.Linear(4, 4)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.vit(images)


def _engine(stage: int, monkeypatch: pytest.MonkeyPatch, *, held: bool, unused: bool = False,
            accumulate: int = 1, deepspeed: dict[str, Any] | None = None) -> Any:
    import vitscale.train.engine as engine_module

    if not held:  # DeepSpeed's hooks as it ships them
        monkeypatch.setattr(engine_module, "count_from_held_accumulators", lambda engine: False)
    torch.manual_seed(0)
    model = WithUnused() if unused else create_model("ViT-Ti/8", num_classes=5, **TINY)
    for p in model.parameters():  # the zero-initialised head would leave most gradients zero
        torch.nn.init.normal_(p, std=0.05)
    batch = 4 * accumulate
    train = TrainConfig(global_batch=batch, micro_batch=4, zero_stage=stage, precision="fp32", grad_clip=1e-3,
                        weight_decay=0.1, base_lr=1e-2, deepspeed=deepspeed or {})
    engine = build_engine(model, train, deepspeed_config(train, derive_batch(batch, 4, 1), on_gpu=False),
                          on_gpu=False)
    monkeypatch.undo()
    return engine


def _steps(engine: Any, count: int) -> None:
    for step in range(count):
        torch.manual_seed(step)
        for micro in range(engine.gradient_accumulation_steps()):
            loss = torch.nn.functional.cross_entropy(engine(torch.randn(4, 3, 16, 16)), torch.randint(0, 5, (4,)))
            engine.backward(loss / engine.gradient_accumulation_steps())
            if micro < engine.gradient_accumulation_steps() - 1:
                engine.step()
        assert apply_update(engine, loss=loss.detach()).read()[0]


def _masters(engine: Any) -> list[torch.Tensor]:
    optimizer = engine.optimizer
    flat = getattr(optimizer, "fp32_partitioned_groups_flat", None) or optimizer.single_partition_of_fp32_groups
    return [m.detach().clone() for m in flat]


def _groups(optimizer: Any) -> list[list[torch.Tensor]]:
    return getattr(optimizer, "fp16_groups", None) or optimizer.bit16_groups


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_the_held_count_is_deepspeeds_in_every_backward_pass(process_group: None, monkeypatch: pytest.MonkeyPatch,
                                                              stage: int) -> None:
    """Asked beside DeepSpeed's own count inside each backward pass, three steps running: the same number, the
    unused layer's two parameters left out by both; DeepSpeed's count (a view per parameter) never asked by the
    hooks themselves."""
    from deepspeed.runtime.utils import count_used_parameters_in_backward

    engine = _engine(stage, monkeypatch, held=True, unused=True)
    optimizer = engine.optimizer
    held = vars(optimizer)[HELD]
    params = [p for group in _groups(optimizer) for p in group if p.requires_grad]
    assert len(held) == len(params)
    counts: list[tuple[int, int]] = []
    first = next(p for p in params if p.ndim == 2 and p.shape[0] == 5)  # the head: its hook fires first
    first.register_post_accumulate_grad_hook(
        lambda _: counts.append((used_parameters(held), count_used_parameters_in_backward(params))))
    module = sys.modules[type(optimizer).__module__]
    monkeypatch.setattr(module, "count_used_parameters_in_backward",
                        lambda *_: pytest.fail("a hook made DeepSpeed's count"))
    _steps(engine, 3)
    assert counts == [(len(params) - 2, len(params) - 2)] * 3


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("accumulate", [1, 2])
def test_the_held_hooks_step_as_deepspeeds(process_group: None, monkeypatch: pytest.MonkeyPatch, stage: int,
                                           accumulate: int) -> None:
    """Three steps, one or two micro-batches each: the same masters bit for bit as DeepSpeed's own hooks."""
    ours = _engine(stage, monkeypatch, held=True, accumulate=accumulate)
    theirs = _engine(stage, monkeypatch, held=False, accumulate=accumulate)
    assert HELD in vars(ours.optimizer) and HELD not in vars(theirs.optimizer)
    assert len(ours.optimizer._grad_acc_hooks) == len(theirs.optimizer._grad_acc_hooks)
    _steps(ours, 3)
    _steps(theirs, 3)
    assert all(torch.equal(a, b) for a, b in zip(_masters(ours), _masters(theirs), strict=True))


def test_zero_0_and_partitioned_zero_3_keep_deepspeeds_and_none_is_taken_twice(
        process_group: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """ZeRO 0 has no such hooks; ZeRO 3 whose parameters are partitioned (here on one rank, DeepSpeed's
    persistence threshold set back to 0) keeps DeepSpeed's (an accumulator made for an empty partition would
    refuse the gathered gradient) and steps; an optimizer whose hooks count from held accumulators is left alone."""
    engine = _engine(0, monkeypatch, held=True)
    assert HELD not in vars(engine.optimizer) and not count_from_held_accumulators(engine)
    partitioned = {"zero_optimization": {"stage3_param_persistence_threshold": 0}}
    engine = _engine(3, monkeypatch, held=True, deepspeed=partitioned)
    assert any(p.numel() == 0 for group in _groups(engine.optimizer) for p in group)  # partitioned
    assert HELD not in vars(engine.optimizer) and not count_from_held_accumulators(engine)
    _steps(engine, 2)
    engine = _engine(1, monkeypatch, held=True)
    hooks = list(engine.optimizer._grad_acc_hooks)
    assert not count_from_held_accumulators(engine) and engine.optimizer._grad_acc_hooks == hooks
