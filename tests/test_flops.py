"""Analytic FLOPs (vitscale.scaling.flops) and the model catalog (vitscale.scaling.catalog).

Three kinds of evidence: (1) the formula against torch's FlopCounterMode on tiny real models of
each family, with fused attention accounted for explicitly; (2) the paper's Table 6; (3)
algebraic properties (hypothesis).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.overrides import TorchFunctionMode
from torch.utils.flop_counter import FlopCounterMode

from vitscale.models.factory import create_model
from vitscale.models.variants import VIT_SIZES, model_names, parse_model_name
from vitscale.scaling import flops as fl
from vitscale.scaling.catalog import flops_summary, model_rows, models_markdown, summary_markdown

# --------------------------------------------------------------------------------------------
# (1) Formula vs. torch.utils.flop_counter.FlopCounterMode
# --------------------------------------------------------------------------------------------


class _RecordSDPA(TorchFunctionMode):
    """Records the (q, k, v) shapes of every F.scaled_dot_product_attention call."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[torch.Size, torch.Size, torch.Size]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is F.scaled_dot_product_attention:
            q, k, v = args[:3]
            self.calls.append((q.shape, k.shape, v.shape))
        return func(*args, **(kwargs or {}))


def _sdpa_flops(q: torch.Size, k: torch.Size, v: torch.Size) -> int:
    """q·kᵀ and A·v of one SDPA call from its runtime shapes (B, H, T, D_h)."""
    *batch, tq, dk = q
    tk, dv = k[-2], v[-1]
    n = 1
    for b in batch:
        n *= b
    return 2 * n * tq * tk * dk + 2 * n * tq * tk * dv


def _counter_sees_sdpa(device: str = "cpu") -> bool:
    """Does FlopCounterMode count fused attention on this torch build and device?

    torch 2.13 on CPU dispatches SDPA to a fused CPU kernel the counter has no formula for, so it
    reports 0; on CUDA (memory-efficient / flash kernels) it counts it. Anything else is a
    surprise worth failing on.
    """
    q = torch.randn(2, 3, 5, 4, device=device)
    with FlopCounterMode(display=False) as counter:
        F.scaled_dot_product_attention(q, q, q)
    got, full = counter.get_total_flops(), _sdpa_flops(q.shape, q.shape, q.shape)
    if got not in (0, full):
        pytest.fail(f"FlopCounterMode counted {got} FLOPs for SDPA; expected 0 or {full}")
    return got == full


def _measure(
    model: torch.nn.Module, img: int, batch: int = 2, device: str = "cpu"
) -> tuple[int, dict[str, dict[Any, int]], int]:
    """(counter total incl. attention products, counter's per-module counts, SDPA FLOPs added)."""
    x = torch.randn(batch, 3, img, img, device=device)
    rec = _RecordSDPA()
    with torch.no_grad(), FlopCounterMode(display=False) as counter, rec:
        model.to(device).eval()(x)
    added = 0 if _counter_sees_sdpa(device) else sum(_sdpa_flops(*c) for c in rec.calls)
    return counter.get_total_flops() + added, counter.get_flop_counts(), added


def _module_flops(counts: dict[str, dict[Any, int]], name: str) -> int:
    return sum(counts.get(name, {}).values())


def _stage_flops(counts: dict[str, dict[Any, int]], prefix: str, stage: int, units: int) -> int:
    """A ResNet stage's counter figure: the model calls its units directly, not the stage."""
    return sum(_module_flops(counts, f"{prefix}.stages.{stage}.blocks.{j}") for j in range(units))


TINY_VIT = {"depth": 2, "width": 32, "mlp_dim": 48, "heads": 2}


@pytest.mark.parametrize(
    ("name", "img", "over"),
    [
        ("ViT-B/16", 64, TINY_VIT),
        ("ViT-B/8", 48, {**TINY_VIT, "classifier": "gap", "representation_size": 24}),
        ("ViT-S/14", 28, {"depth": 1, "width": 24, "mlp_dim": 40, "heads": 3, "representation_size": 16}),
    ],
)
def test_vit_matches_flop_counter(name: str, img: int, over: dict[str, Any]) -> None:
    batch, k = 2, 7
    model = create_model(name, num_classes=k, img_size=img, **over)
    total, counts, added = _measure(model, img, batch)
    parts = fl.flops_breakdown(name, img_size=img, num_classes=k, count_padding=True, **over)
    assert total == batch * sum(parts.values())
    # Component by component, from the counter's per-module figures (timm module names).
    assert _module_flops(counts, "VisionTransformer.patch_embed") == batch * parts["patch_embed"]
    depth = over["depth"]
    proj = sum(_module_flops(counts, f"VisionTransformer.blocks.{i}.attn") for i in range(depth))
    mlp = sum(_module_flops(counts, f"VisionTransformer.blocks.{i}.mlp") for i in range(depth))
    assert mlp == batch * parts["mlp"]
    # The counter's attn module holds qkv + out-projection, plus the products when it sees SDPA.
    assert proj + added == batch * (parts["attention_projections"] + parts["attention_products"])
    assert added in (0, batch * parts["attention_products"])
    assert _module_flops(counts, "VisionTransformer.pre_logits") == batch * parts["pre_logits"]
    assert _module_flops(counts, "VisionTransformer.head") == batch * parts["head"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_vit_matches_flop_counter_on_cuda_where_sdpa_is_counted() -> None:
    """The other branch: on CUDA the counter sees the fused attention, so nothing is added."""
    model = create_model("ViT-B/16", num_classes=3, img_size=64, **TINY_VIT)
    total, _counts, added = _measure(model, 64, 2, device="cuda")
    parts = fl.flops_breakdown("ViT-B/16", img_size=64, num_classes=3, **TINY_VIT)
    assert _counter_sees_sdpa("cuda") and added == 0
    assert total == 2 * sum(parts.values())


def test_counter_blind_spot_is_exactly_the_attention_products() -> None:
    """Without the SDPA correction the counter is short by precisely our attention-product term."""
    model = create_model("ViT-B/16", num_classes=5, img_size=64, **TINY_VIT)
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model.eval()(x)
    parts = fl.flops_breakdown("ViT-B/16", img_size=64, num_classes=5, **TINY_VIT)
    missing = sum(parts.values()) - counter.get_total_flops()
    assert missing == (0 if _counter_sees_sdpa() else parts["attention_products"])


@pytest.mark.parametrize(
    ("name", "img", "over"),
    [
        ("R50x1", 64, {"resnet_layers": (1, 1, 1, 1)}),
        ("R26x2", 50, {"resnet_layers": (2, 1, 1, 1)}),  # odd feature maps: ceil arithmetic
        ("R50x1", 40, {"resnet_layers": (1, 2)}),
    ],
)
def test_resnet_matches_flop_counter(name: str, img: int, over: dict[str, Any]) -> None:
    batch, k = 2, 3
    model = create_model(name, num_classes=k, **over)
    total, counts, added = _measure(model, img, batch)
    parts = fl.flops_breakdown(name, img_size=img, num_classes=k, count_padding=True, **over)
    assert added == 0
    assert total == batch * sum(parts.values())
    assert _module_flops(counts, "ResNetV2.stem") == batch * parts["stem"]
    for i, units in enumerate(over["resnet_layers"]):
        assert _stage_flops(counts, "ResNetV2", i, units) == batch * parts[f"stage{i + 1}"]
    assert _module_flops(counts, "ResNetV2.head") == batch * parts["head"]


@pytest.mark.parametrize(
    ("name", "img", "over"),
    [
        ("R50x1+ViT-B/16", 64, {**TINY_VIT, "resnet_layers": (1, 1, 1)}),
        ("R50x1+ViT-B/32", 64, {**TINY_VIT, "resnet_layers": (1, 1, 1, 1), "classifier": "gap"}),
    ],
)
def test_hybrid_matches_flop_counter(name: str, img: int, over: dict[str, Any]) -> None:
    batch, k = 2, 4
    model = create_model(name, num_classes=k, img_size=img, **over)
    total, counts, _ = _measure(model, img, batch)
    parts = fl.flops_breakdown(name, img_size=img, num_classes=k, count_padding=True, **over)
    assert total == batch * sum(parts.values())
    backbone = "VisionTransformer.patch_embed.backbone"
    assert _module_flops(counts, f"{backbone}.stem") == batch * parts["stem"]
    for i, units in enumerate(over["resnet_layers"]):
        assert _stage_flops(counts, backbone, i, units) == batch * parts[f"stage{i + 1}"]
    assert _module_flops(counts, "VisionTransformer.patch_embed.proj") == batch * parts["patch_embed"]


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 40), k=st.sampled_from([1, 3, 5, 7]), s=st.integers(1, 3),
    lo=st.integers(0, 3), hi=st.integers(0, 3),
)
def test_valid_tap_count_matches_a_real_convolution(n: int, k: int, s: int, lo: int, hi: int) -> None:
    """Paper/XLA convention: a conv of an all-ones image, zero-padded, with an all-ones kernel
    sums exactly the multiply-adds that touch real pixels."""
    if n + lo + hi < k:
        return
    flops, out = fl.conv2d_flops(n, 1, 1, k, s, (lo, hi))
    ones = F.pad(torch.ones(1, 1, n, n, dtype=torch.float64), (lo, hi, lo, hi))
    real = F.conv2d(ones, torch.ones(1, 1, k, k, dtype=torch.float64), stride=s)
    assert out == real.shape[-1]
    assert flops == 2 * int(real.sum().item())
    dense, _ = fl.conv2d_flops(n, 1, 1, k, s, (lo, hi), count_padding=True)
    assert dense == 2 * real.numel() * k * k >= flops


# --------------------------------------------------------------------------------------------
# (2) The paper's Table 6
# --------------------------------------------------------------------------------------------

TABLE6_TOLERANCE = 0.05
# Tighter bound met by every row but one (R50x1+ViT-L/16 7ep, -3.1%: the paper's own 7ep figure,
# 859, is not half its 14ep figure, 1668, unlike every other 7/14-epoch pair).
TABLE6_TIGHT = 0.025
_TABLE6 = fl.reproduce_table6()


@pytest.mark.parametrize("row", _TABLE6, ids=[f"{r['model']}-{r['epochs']}ep" for r in _TABLE6])
def test_table6_row_within_tolerance(row: dict[str, Any]) -> None:
    assert abs(row["rel_error"]) <= TABLE6_TOLERANCE, row
    if (row["model"], row["epochs"]) != ("R50x1+ViT-L/16", 7):
        assert abs(row["rel_error"]) <= TABLE6_TIGHT, row


def test_table6_has_every_published_row() -> None:
    assert len(fl.PAPER_TABLE6) == 18
    for r in fl.PAPER_TABLE6:  # canonical names of models the zoo builds
        assert parse_model_name(r.model).name == r.model and r.model in model_names()
    by = {(r.model, r.epochs): r.exaflops for r in fl.PAPER_TABLE6}
    # The paper's own 7/14-epoch pairs are 1:2 to rounding, except the hybrid noted above.
    for model in ("ViT-L/16", "R152x2"):
        assert abs(by[(model, 14)] / by[(model, 7)] - 2) < 0.005
    assert abs(by[("R50x1+ViT-L/16", 14)] / by[("R50x1+ViT-L/16", 7)] - 2) > 0.05


def test_table6_resnets_need_the_padding_rule() -> None:
    """Counting multiply-adds on zero padding overshoots every ResNet row by >3%; skipping them
    (XLA's rule) lands every one within 1.5%: evidence for the convention flops.py adopts."""
    dense = {(r["model"], r["epochs"]): r["rel_error"] for r in fl.reproduce_table6(count_padding=True)}
    for row in _TABLE6:
        if row["model"].startswith("R") and "+" not in row["model"]:
            assert dense[(row["model"], row["epochs"])] > 0.03
            assert abs(row["rel_error"]) < 0.015


def test_vit_b16_per_example_and_total() -> None:
    """The brief's sanity check: 35.1 GFLOPs forward x 3 x 7 epochs x 303M images = ~224 exaFLOPs."""
    fwd = fl.forward_flops("ViT-B/16")
    assert 35.0e9 < fwd < 35.2e9
    assert round(fl.exaflops(fl.training_flops(fwd, 7 * fl.JFT300M_EXAMPLES))) == 224


# --------------------------------------------------------------------------------------------
# (3) Properties
# --------------------------------------------------------------------------------------------

_SIZES = st.sampled_from(["Ti", "S", "B", "L", "H"])


@settings(max_examples=40, deadline=None)
@given(size=_SIZES, patch=st.integers(4, 32), a=st.integers(1, 12), b=st.integers(1, 12),
       classifier=st.sampled_from(["token", "gap"]))
def test_vit_flops_grow_with_resolution(size: str, patch: int, a: int, b: int, classifier: str) -> None:
    lo, hi = sorted((a, b))
    f = [fl.forward_flops(f"ViT-{size}/{patch}", img_size=patch * g, classifier=classifier) for g in (lo, hi)]
    assert f[0] < f[1] if lo < hi else f[0] == f[1]


@settings(max_examples=40, deadline=None)
@given(name=st.sampled_from(["R50x1", "R26x2", "R101x1"]), a=st.integers(8, 300), b=st.integers(8, 300),
       dense=st.booleans())
def test_resnet_flops_grow_with_resolution(name: str, a: int, b: int, dense: bool) -> None:
    lo, hi = sorted((a, b))
    f = [fl.forward_flops(name, img_size=s, count_padding=dense) for s in (lo, hi)]
    assert f[0] <= f[1]


@settings(max_examples=40, deadline=None)
@given(size=_SIZES, p1=st.integers(1, 32), p2=st.integers(1, 32), m=st.integers(1, 3))
def test_patch_embedding_flops_independent_of_patch_size(size: str, p1: int, p2: int, m: int) -> None:
    """Eq. 1: N·(P²·C)·D = (H²/P²)·P²·C·D = H²·C·D for any P dividing H."""
    img = p1 * p2 * m
    e1 = fl.flops_breakdown(f"ViT-{size}/{p1}", img_size=img)["patch_embed"]
    e2 = fl.flops_breakdown(f"ViT-{size}/{p2}", img_size=img)["patch_embed"]
    assert e1 == e2 == 2 * img * img * 3 * VIT_SIZES[size].width


@settings(max_examples=40, deadline=None)
@given(size=_SIZES, patch=st.integers(2, 32), g=st.integers(1, 10))
def test_attention_products_quadratic_and_projections_linear_in_tokens(size: str, patch: int, g: int) -> None:
    """GAP model (T = N): doubling the image side multiplies tokens by 4, the attention
    products by 16 and every per-token linear layer by 4."""
    name = f"ViT-{size}/{patch}"
    small = fl.flops_breakdown(name, img_size=patch * g, classifier="gap")
    big = fl.flops_breakdown(name, img_size=2 * patch * g, classifier="gap")
    assert big["attention_products"] == 16 * small["attention_products"]
    for part in ("patch_embed", "attention_projections", "mlp"):
        assert big[part] == 4 * small[part]
    assert big["head"] == small["head"]


@settings(max_examples=30, deadline=None)
@given(w=st.integers(1, 4), img=st.integers(32, 256), depth=st.sampled_from([26, 50, 101]))
def test_resnet_width_multiplier_scales_stages_quadratically(w: int, img: int, depth: int) -> None:
    """Every conv inside the stages has both widths scaled by w; the stem only its output."""
    one = fl.flops_breakdown(f"R{depth}x1", img_size=img)
    wide = fl.flops_breakdown(f"R{depth}x{w}", img_size=img)
    for k in one:
        factor = w if k in ("stem", "head") else w * w
        assert wide[k] == factor * one[k]


@settings(max_examples=30, deadline=None)
@given(name=st.sampled_from(["ViT-B/16", "R50x1+ViT-S/16", "ViT-Ti/32"]), d1=st.integers(1, 8), d2=st.integers(1, 8))
def test_encoder_flops_linear_in_depth(name: str, d1: int, d2: int) -> None:
    a = fl.flops_breakdown(name, depth=d1)
    b = fl.flops_breakdown(name, depth=d2)
    for part in ("attention_projections", "attention_products", "mlp"):
        assert a[part] * d2 == b[part] * d1
    assert a["patch_embed"] == b["patch_embed"]


@pytest.mark.parametrize("name", ["ViT-L/16", "R152x2", "R50x1+ViT-B/16", "R50x1+ViT-L/32"])
def test_padding_rule_only_touches_padded_convs(name: str) -> None:
    xla = fl.flops_breakdown(name)
    dense = fl.flops_breakdown(name, count_padding=True)
    for k in xla:
        if k in ("stem",) or k.startswith("stage"):
            assert xla[k] < dense[k]
        else:
            assert xla[k] == dense[k]


@settings(max_examples=30, deadline=None)
@given(f=st.integers(0, 10**12), n=st.integers(0, 10**10))
def test_training_is_three_forwards_per_example(f: int, n: int) -> None:
    assert fl.training_flops(f, n) == 3 * f * n
    assert fl.exaflops(fl.training_flops(f, n)) == pytest.approx(3 * f * n / 1e18)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: fl.forward_flops("ViT-Q/16"), "unknown model name"),
        (lambda: fl.forward_flops("ViT-B/16", img_size=200), "multiple of 16"),
        (lambda: fl.forward_flops("ViT-B/16", depht=2), "unknown override"),
        (lambda: fl.forward_flops("R50x1", classifier="gap"), "do not apply to ResNet"),
        (lambda: fl.forward_flops("ViT-B/16", classifier="cls"), "classifier"),
        (lambda: fl.forward_flops("ViT-B/16", num_classes=-1), "num_classes"),
        (lambda: fl.training_flops(10, -1), "examples"),
    ],
)
def test_bad_input_is_a_value_error(call: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()


def test_compute_neutral_overrides_are_accepted_and_change_nothing() -> None:
    base = fl.forward_flops("ViT-B/16")
    assert fl.forward_flops("ViT-B/16", pos_emb="relative", dropout=0.1, head_bias_init=-6.9) == base


# --------------------------------------------------------------------------------------------
# Catalog
# --------------------------------------------------------------------------------------------


def test_catalog_rows_cover_every_model_with_meta_params() -> None:
    rows = model_rows()
    names = [r["name"] for r in rows]
    assert names == model_names()
    by = {r["name"]: r for r in rows}
    assert by["ViT-B/16"]["params"] == 86_567_656  # timm vit_base_patch16_224, 1000 classes
    assert by["ViT-B/16"]["gflops_224"] == pytest.approx(fl.forward_flops("ViT-B/16") / 1e9)
    assert by["ViT-B/14"]["gflops_384"] is None and by["ViT-B/16"]["gflops_384"] > by["ViT-B/16"]["gflops_224"]
    assert {r["family"] for r in rows} == {"vit", "resnet", "hybrid"}
    json.dumps(rows)  # the --json output must serialise
    md = models_markdown(rows)
    assert sum(line.startswith("| ") for line in md.splitlines()) == len(rows) + 1  # + header
    assert "| ViT-H/14 | vit | 632.0 |" in md


def test_flops_summary_totals() -> None:
    s = flops_summary("ViT-B/16", epochs=7)
    assert s["params"] == 86_567_656 and s["examples"] == fl.JFT300M_EXAMPLES
    assert s["train_gflops_per_example"] == pytest.approx(3 * s["forward_gflops"])
    assert round(s["train_exaflops"]) == 224
    assert sum(s["breakdown_gflops"].values()) == pytest.approx(s["forward_gflops"])
    s2 = flops_summary("R50+ViT-B/16", resolution=384, examples=1_281_167, epochs=0.5, num_classes=10)
    assert s2["model"] == "R50x1+ViT-B/16" and s2["examples_seen"] == 640_584
    # R50x1+ViT-B/16 has 98,659,112 params at 224px / 1000 classes; at 384px the position table
    # grows by (24² - 14²) rows of 768 and the head shrinks by 990 x (768 + 1).
    assert s2["params"] == 98_659_112 + (24**2 - 14**2) * 768 - 990 * 769
    assert "exaFLOPs" in summary_markdown(s2)
    json.dumps(s2)
    with pytest.raises(ValueError, match="epochs"):
        flops_summary("ViT-B/16", epochs=0)
    with pytest.raises(ValueError, match="multiple of 14"):
        flops_summary("ViT-B/14", resolution=384)


def test_compute_past_a_float_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    """`vitscale flops ViT-B/16 --epochs 1e308 --examples 1000000000` was an OverflowError traceback (round() of
    inf examples seen; at 1e300 epochs, float() of the FLOPs); a study with such epochs the same."""
    from vitscale.cli import main

    with pytest.raises(ValueError, match="more compute than a float holds"):
        flops_summary("ViT-B/16", epochs=1e300)
    for epochs in ("1e308", "1e300"):
        assert main(["flops", "ViT-B/16", "--epochs", epochs, "--examples", "1000000000"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("vitscale: error: --epochs: ") and err.count("\n") == 1, err
    assert flops_summary("ViT-B/16", epochs=1e280)["train_exaflops"] > 1e280  # huge but countable: counted

