"""Properties of the LR schedule, weight-decay groups and batch arithmetic (vitscale.train.optim)."""

from __future__ import annotations

import dataclasses
import itertools
import math
import re

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch import nn

from vitscale.train.batch import BatchPlan, derive_batch, nearest_valid_global_batch
from vitscale.train.optim import epoch_at, lr_at, param_groups, split_decay, steps_for, warmup_outlasts

# ------------------------------------------------------------------------------------ lr_at

schedules = st.fixed_dictionaries(
    {
        "base_lr": st.floats(1e-6, 10.0),
        "total_steps": st.integers(1, 200_000),
        "warmup_frac": st.floats(0.0, 0.99),
        "decay": st.sampled_from(["linear", "cosine"]),
        "end_frac": st.floats(0.0, 1.0),
    }
)


def _args(s: dict) -> dict:
    warmup = int(s["total_steps"] * s["warmup_frac"])
    return dict(
        base_lr=s["base_lr"],
        total_steps=s["total_steps"],
        warmup_steps=warmup,
        decay=s["decay"],
        end_lr=s["base_lr"] * s["end_frac"],
    )


@settings(max_examples=300, deadline=None)
@given(schedules, st.data())
def test_schedule_properties(s: dict, data: st.DataObject) -> None:
    a = _args(s)
    base, total, warm, end = a["base_lr"], a["total_steps"], a["warmup_steps"], a["end_lr"]
    # equals base_lr at the end of warm-up, end_lr at (and after) total_steps
    assert lr_at(warm, **a) == pytest.approx(base, rel=1e-12)
    assert lr_at(total, **a) == pytest.approx(end, rel=1e-9, abs=1e-15)
    assert lr_at(total + 7, **a) == lr_at(total, **a)
    # continuous at the warm-up boundary: the last warm-up step is one ramp increment below base
    if warm > 0:
        assert lr_at(0, **a) == 0.0
        assert base - lr_at(warm - 1, **a) == pytest.approx(base / warm, rel=1e-9)
        # ... and the first decay step is within one decay increment of base
        assert base - lr_at(warm + 1, **a) <= (base - end) / (total - warm) * (math.pi / 2) + 1e-12
    # monotone non-increasing after warm-up, increasing during it, never negative, never above base
    i = data.draw(st.integers(0, total))
    j = data.draw(st.integers(i, total + 3))
    li, lj = lr_at(i, **a), lr_at(j, **a)
    assert 0.0 <= li <= base and 0.0 <= lj <= base
    if i >= warm:
        assert lj <= li
        assert li >= end
    elif j <= warm:
        assert lj >= li


def test_known_values() -> None:
    kw = dict(base_lr=1.0, total_steps=110, warmup_steps=10)
    assert lr_at(5, **kw) == 0.5
    assert lr_at(60, decay="linear", **kw) == 0.5
    assert lr_at(60, decay="cosine", **kw) == pytest.approx(0.5)
    assert lr_at(35, decay="cosine", **kw) == pytest.approx(0.5 * (1 + math.cos(math.pi / 4)))
    assert lr_at(110, decay="linear", end_lr=0.1, **kw) == pytest.approx(0.1)
    assert lr_at(60, decay="linear", end_lr=0.1, **kw) == pytest.approx(0.55)
    # no warm-up: starts at base
    assert lr_at(0, base_lr=3e-3, total_steps=10, warmup_steps=0, decay="cosine") == 3e-3


@given(st.integers(1, 1000), st.integers(0, 5000), st.sampled_from(["linear", "cosine"]))
def test_warmup_longer_than_run_is_a_truncated_ramp(total: int, extra: int, decay: str) -> None:
    warm = total + extra
    a = dict(base_lr=1e-3, total_steps=total, warmup_steps=warm, decay=decay)
    values = [lr_at(s, **a) for s in range(0, total + 2, max(1, total // 50))] + [lr_at(total, **a)]
    assert all(v2 >= v1 for v1, v2 in itertools.pairwise(values))
    assert lr_at(total, **a) == pytest.approx(1e-3 * total / warm)
    assert lr_at(total + 100, **a) == lr_at(total, **a)


@given(st.integers(1, 100_000), st.integers(0, 200_000))
def test_a_run_that_ends_before_its_warmup_is_said_with_the_lr_it_reaches(total: int, warm: int) -> None:
    line = warmup_outlasts(total, warm, "train.warmup_steps")
    # Said exactly when no step of the run trains at the base LR (the 0-based steps 0 .. total - 1).
    # The LR only rises during warm-up and only falls after it: its highest is at the step warm-up ends.
    reaches_base = lr_at(min(warm, total - 1), base_lr=1.0, total_steps=total, warmup_steps=warm) == 1.0
    assert (line is None) == (warm == 0 or reaches_base)
    if line is not None:
        reached = lr_at(total - 1, base_lr=1.0, total_steps=total, warmup_steps=warm)
        assert line.startswith(f"train.warmup_steps ({warm:,}) is not below the run's {total:,} steps")
        assert f"rises to {100 * reached:.3g}% of the base LR" in line and "\n" not in line


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        (dict(step=-1), "step"),
        (dict(step=1.5), "step"),
        (dict(base_lr=0.0), "base_lr"),
        (dict(base_lr=float("nan")), "base_lr"),
        (dict(total_steps=0), "total_steps"),
        (dict(warmup_steps=-1), "warmup_steps"),
        (dict(warmup_steps=True), "warmup_steps"),
        (dict(decay="exponential"), "decay"),
        (dict(end_lr=2.0), "end_lr"),
        (dict(end_lr=-0.1), "end_lr"),
    ],
)
def test_lr_at_rejects_bad_arguments(kwargs: dict, name: str) -> None:
    args = dict(step=0, base_lr=1.0, total_steps=100, warmup_steps=10, decay="linear", end_lr=0.0) | kwargs
    step = args.pop("step")
    with pytest.raises(ValueError, match=rf"^{name}\b"):
        lr_at(step, **args)


# ------------------------------------------------------------------------------------ param groups


class TinyViTish(nn.Module):
    """Has every kind of parameter the grouping must tell apart."""

    def __init__(self) -> None:
        super().__init__()
        self.cls_token = nn.Parameter(torch.zeros(1, 1, 8))  # 3-D: ndim rule would decay it
        self.pos_embed = nn.Parameter(torch.zeros(1, 5, 8))
        self.patch = nn.Conv2d(3, 8, kernel_size=4, stride=4)  # weight 4-D, bias 1-D
        self.norm = nn.LayerNorm(8)  # weight and bias 1-D
        self.blocks = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
        self.head = nn.Linear(8, 3)
        self.frozen = nn.Parameter(torch.zeros(4, 4), requires_grad=False)

    def no_weight_decay(self) -> set[str]:
        return {"cls_token", "pos_embed"}


EXPECT_DECAY = {"patch.weight", "blocks.0.weight", "blocks.2.weight", "head.weight"}
EXPECT_NO_DECAY = {
    "cls_token",
    "pos_embed",
    "patch.bias",
    "norm.weight",
    "norm.bias",
    "blocks.0.bias",
    "blocks.2.bias",
    "head.bias",
}


def test_split_decay_on_a_small_module() -> None:
    decay, no_decay = split_decay(TinyViTish())
    assert set(decay) == EXPECT_DECAY
    assert set(no_decay) == EXPECT_NO_DECAY  # frozen is in neither


def test_param_groups_feed_adamw_and_decay_only_matrices() -> None:
    model = TinyViTish()
    groups = param_groups(model, weight_decay=0.1)
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    ids = {id(p): n for n, p in model.named_parameters()}
    assert {ids[id(p)] for p in groups[0]["params"]} == EXPECT_DECAY
    assert {ids[id(p)] for p in groups[1]["params"]} == EXPECT_NO_DECAY
    # One AdamW step with zero gradients: only decayed tensors shrink.
    for p in model.parameters():
        p.data.fill_(1.0)
        p.grad = torch.zeros_like(p) if p.requires_grad else None
    torch.optim.AdamW(groups, lr=0.5).step()
    for n, p in model.named_parameters():
        if n in EXPECT_DECAY:
            assert torch.allclose(p, torch.full_like(p, 1 - 0.5 * 0.1)), n
        else:
            assert torch.equal(p, torch.ones_like(p)), n


def test_default_names_without_hook_and_wrapper_prefixes() -> None:
    class NoHook(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = TinyViTish()
            self.pos_embed = nn.Parameter(torch.zeros(1, 2, 2))
            self.proj = nn.Parameter(torch.zeros(2, 2))

    decay, no_decay = split_decay(NoHook())
    assert "inner.cls_token" in no_decay and "inner.pos_embed" in no_decay and "pos_embed" in no_decay
    assert "proj" in decay


def test_no_weight_decay_typo_is_an_error() -> None:
    class Typo(TinyViTish):
        def no_weight_decay(self) -> set[str]:
            return {"cls_tokn"}

    with pytest.raises(ValueError, match="cls_tokn"):
        split_decay(Typo())


def test_param_groups_bad_args() -> None:
    with pytest.raises(ValueError, match="weight_decay"):
        param_groups(TinyViTish(), weight_decay=-0.1)
    frozen = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable"):
        param_groups(frozen, weight_decay=0.1)


def test_param_groups_on_project_vit() -> None:
    models = pytest.importorskip("vitscale.models")
    create_model = getattr(models, "create_model", None) or getattr(
        pytest.importorskip("vitscale.models.factory"), "create_model", None
    )
    if create_model is None:
        pytest.skip("vitscale.models.create_model is not written yet")
    model = create_model("ViT-Ti/16", num_classes=10, img_size=32, depth=1)
    decay, no_decay = split_decay(model)
    named = dict(model.named_parameters())
    assert all(named[n].ndim >= 2 for n in decay)
    assert all(named[n].ndim <= 1 or "token" in n or "pos" in n for n in no_decay)
    assert any("pos" in n for n in no_decay), "position embeddings must not be decayed"
    assert any("cls" in n or "token" in n for n in no_decay), "class token must not be decayed"
    groups = param_groups(model, 0.1)
    assert sum(p.numel() for g in groups for p in g["params"]) == sum(
        p.numel() for p in model.parameters() if p.requires_grad
    )


# ------------------------------------------------------------------------------------ batches


@given(st.integers(1, 512), st.integers(1, 64), st.integers(1, 64))
def test_derive_batch_valid(micro: int, accum: int, world: int) -> None:
    plan = derive_batch(micro * accum * world, micro, world)
    assert plan == BatchPlan(micro_batch=micro, grad_accum_steps=accum, world_size=world, global_batch=micro * accum * world)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.micro_batch = 1  # type: ignore[misc]


@given(st.integers(1, 100_000), st.integers(1, 512), st.integers(1, 64))
def test_derive_batch_invalid_names_keys_and_suggests_a_working_batch(g: int, micro: int, world: int) -> None:
    assume(g % (micro * world) != 0 and not (g % world == 0 and g // world < micro))  # (a share below it: one pass)
    with pytest.raises(ValueError) as err:
        derive_batch(g, micro, world)
    msg = str(err.value)
    assert "train.global_batch" in msg and ("train.micro_batch" in msg) == (g >= micro * world or micro == 1)
    suggested = int(re.search(r"set train.global_batch to (\d+)", msg).group(1))
    assert derive_batch(suggested, micro, world).global_batch == suggested  # the suggestion works
    m = re.search(r"set train.micro_batch to (\d+)", msg)
    if m:
        assert derive_batch(g, int(m.group(1)), world).global_batch == g
        assert int(m.group(1)) <= micro


@given(st.integers(1, 100_000), st.integers(1, 512), st.integers(1, 64))
def test_nearest_valid_global_batch_is_nearest(g: int, micro: int, world: int) -> None:
    unit = micro * world
    n = nearest_valid_global_batch(g, micro, world)
    assert n % unit == 0 and n >= unit
    # no positive multiple of unit is strictly closer
    for k in (g // unit, g // unit + 1):
        if k >= 1:
            assert abs(n - g) <= abs(k * unit - g)


def test_derive_batch_paper_and_messages() -> None:
    assert derive_batch(4096, 32, 8).grad_accum_steps == 16
    # 4000 over 8 workers x 24: nearest multiple of 192 is 4032; 500 per worker = 20 x 25.
    with pytest.raises(ValueError, match=r"train.global_batch to 4032 .*train.micro_batch to 20"):
        derive_batch(4000, 24, 8)
    with pytest.raises(ValueError, match="world_size"):
        derive_batch(64, 8, 0)
    with pytest.raises(ValueError, match="train.micro_batch"):
        derive_batch(64, 0, 1)


# ------------------------------------------------------------------------------------ steps


def test_steps_for_paper_numbers() -> None:
    assert steps_for(7, 303_000_000, 4096) == 517_823
    assert steps_for(0.1, 30, 1) == 3  # no float fuzz (0.1 * 30 = 3.0000000000000004)
    assert steps_for(1e-9, 10, 4096) == 1


@given(st.floats(0.01, 100), st.integers(1, 10**8), st.integers(1, 65536))
def test_steps_for_covers_the_data(epochs: float, n: int, g: int) -> None:
    steps = steps_for(epochs, n, g)
    examples = max(1, round(epochs * n))
    assert steps * g >= examples > (steps - 1) * g
    assert epoch_at(steps, g, n) * n == pytest.approx(steps * g)


@pytest.mark.parametrize(("args", "name"), [((0, 10, 1), "epochs"), ((1, 0, 1), "samples_per_epoch"), ((1, 10, 0), "global_batch")])
def test_steps_for_bad_args(args: tuple, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        steps_for(*args)


@given(st.integers(1, 10**6), st.integers(1, 16), st.integers(1, 64), st.integers(0, 15), st.floats(0.1, 20))
def test_schedule_length_fills_whole_global_batches(samples: int, world: int, per_rank: int, extra: int,
                                                    epochs: float) -> None:
    from vitscale.train.optim import schedule_length

    global_batch = per_rank * world + extra % world  # any size, the world dividing it or not
    if samples < global_batch:
        with pytest.raises(ValueError, match="cannot fill one step"):
            schedule_length(samples, global_batch, epochs, None)
        return
    per_epoch, total = schedule_length(samples, global_batch, epochs, None)
    assert per_epoch == samples // global_batch  # whole global batches: the same at every world size
    if extra % world == 0:  # an even split: what each rank's whole steps of its share give
        assert per_epoch == (samples // world) // per_rank
    assert total == steps_for(epochs, per_epoch * global_batch, global_batch)
    assert schedule_length(samples, global_batch, epochs, 7) == (per_epoch, 7)
