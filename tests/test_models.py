"""Model zoo: names, shapes, gradients, parameter counts, variants (vitscale.models)."""

from __future__ import annotations

import itertools
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from helpers.models import TINY, X32, randomize
from vitscale.models import create_model, model_meta, model_names, parse_model_name
from vitscale.models.layers import Attention
from vitscale.models.resnet import StdConv2d, same_pad_amounts


def check_grads(model: nn.Module, x: torch.Tensor, num_classes: int) -> None:
    model.train()
    out = model(x)
    assert out.shape == (x.shape[0], num_classes)
    out.square().mean().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, f"no gradient reaches {name}"


# --- names and specs -------------------------------------------------------------------------


def test_model_names_cover_paper_grid() -> None:
    names = model_names()
    for size, patch in itertools.product(["Ti", "S", "B", "L", "H"], [32, 16, 14, 8]):
        assert f"ViT-{size}/{patch}" in names
    for r in ["R50x1", "R50x2", "R101x1", "R152x1", "R152x2", "R200x3", "R152x4"]:
        assert r in names
    assert "R50x1+ViT-B/32" in names and "R50x1+ViT-B/16" in names
    assert len(names) == len(set(names)) == 20 + 7 + 10
    for name in names:
        assert parse_model_name(name).name == name  # canonical names round-trip


def test_variants_module_imports_no_torch() -> None:
    import subprocess

    code = "import sys, vitscale.models.variants as v; v.parse_model_name('ViT-B/16'); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize(
    ("name", "dims"),
    [("ViT-Ti/16", (12, 192, 768, 3)), ("ViT-S/16", (12, 384, 1536, 6)), ("ViT-B/32", (12, 768, 3072, 12)),
     ("ViT-L/14", (24, 1024, 4096, 16)), ("ViT-H/14", (32, 1280, 5120, 16))],
)
def test_parse_vit_dims(name: str, dims: tuple[int, int, int, int]) -> None:
    spec = parse_model_name(name)
    assert spec.family == "vit" and spec.vit is not None
    assert (spec.vit.depth, spec.vit.width, spec.vit.mlp_dim, spec.vit.heads) == dims
    assert spec.patch_size == spec.stride == int(name.split("/")[1])


def test_parse_aliases_resnets_and_hybrids() -> None:
    assert parse_model_name("ViT-B_16").name == "ViT-B/16"
    assert parse_model_name("B/16").name == "ViT-B/16"
    assert parse_model_name("ViT-L/7").patch_size == 7
    r = parse_model_name("R152x4")
    assert r.family == "resnet" and r.resnet is not None and r.resnet.layers == (3, 8, 36, 3)
    assert r.resnet.width_factor == 4 and r.resnet.preact and r.stride == 32
    h16 = parse_model_name("R50+ViT-B/16")
    assert h16.name == "R50x1+ViT-B/16" and h16.resnet is not None
    assert h16.resnet.layers == (3, 4, 9) and h16.stride == 16 and h16.patch_size == 1 and not h16.resnet.preact
    h32 = parse_model_name("R50x1+ViT-L/32")
    assert h32.resnet is not None and h32.resnet.layers == (3, 4, 6, 3) and h32.stride == 32
    assert h16.num_patches(224) == 196 and h32.num_patches(384) == 144


@pytest.mark.parametrize("bad", ["ViT-B16", "ViT-X/16", "R51x1", "R50x1+ViT-B/8", "vit"])
def test_unknown_name_lists_close_matches(bad: str) -> None:
    with pytest.raises(ValueError, match="unknown model name") as err:
        parse_model_name(bad)
    if bad == "ViT-B16":
        assert "ViT-B/16" in str(err.value)


@pytest.mark.parametrize(
    ("name", "kwargs", "match"),
    [
        ("ViT-Ti/8", {"colour": 1}, "colour"),
        ("ViT-Ti/8", {"classifier": "cls"}, "classifier"),
        ("ViT-Ti/8", {"pos_emb": "sincos"}, "pos_emb"),
        ("ViT-Ti/8", {"pos_emb_placement": "each"}, "pos_emb_placement"),
        ("ViT-Ti/8", {"pos_emb": "relative", "pos_emb_placement": "every_layer"}, "pos_emb_placement"),
        ("ViT-Ti/8", {"dropout": 1.5}, "dropout"),
        ("ViT-Ti/8", {"attention_dropout": -0.1}, "attention_dropout"),
        ("ViT-Ti/8", {"representation_size": 0}, "representation_size"),
        ("ViT-Ti/8", {"activation_checkpointing": "yes"}, "activation_checkpointing"),
        ("ViT-Ti/8", {"depth": 0}, "depth"),
        ("ViT-Ti/8", {"width": 30, "heads": 4}, "divisible"),
        ("ViT-Ti/8", {"pos_emb": "learn_2d", "width": 33, "heads": 3}, "even"),
        ("R50x1", {"pos_emb": "none"}, "pos_emb"),
        ("R50x1", {"depth": 3}, "depth"),
        ("ViT-Ti/8", {"resnet_layers": (1,)}, "resnet_layers"),
        ("R50x1", {"resnet_layers": (0, 1)}, "resnet_layers"),
        ("ViT-Ti/8", {"depth": 1025}, "depth"),  # MAX_LAYERS: a slip such as 1e9 is refused before it is built
        ("R50x1", {"resnet_layers": (1, 1025)}, "resnet_layers"),
    ],
)
def test_bad_overrides_raise_value_error_naming_them(name: str, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match), torch.device("meta"):
        create_model(name, num_classes=10, img_size=32, **kwargs)


def test_bad_sizes_raise() -> None:
    with pytest.raises(ValueError, match="img_size"), torch.device("meta"):
        create_model("ViT-B/16", num_classes=10, img_size=100)
    with pytest.raises(ValueError, match="num_classes"), torch.device("meta"):
        create_model("ViT-B/16", num_classes=-1)


def test_no_classes_is_an_encoder() -> None:
    """num_classes 0: no classifier (masked patch prediction's encoder); its features are the model's."""
    model = create_model("ViT-Ti/8", num_classes=0, img_size=16, depth=1, width=32, mlp_dim=64, heads=2)
    x = torch.randn(2, 3, 16, 16)
    assert model(x).shape == (2, 0) and model.forward_features(x).shape == (2, 32)
    assert model.head.weight.numel() == 0


# --- parameter counts on the meta device ------------------------------------------------------


def n_params(name: str, **kw: object) -> int:
    with torch.device("meta"):
        model = create_model(name, num_classes=1000, **kw)
    assert all(p.is_meta for p in model.parameters())
    return sum(p.numel() for p in model.parameters())


def test_param_counts_match_paper() -> None:
    assert n_params("ViT-B/16") == 86_567_656
    assert n_params("ViT-L/16") == 304_326_632
    assert abs(n_params("ViT-H/14") - 632.0e6) < 0.1e6
    assert abs(n_params("R50x1") - 25.5e6) < 0.06e6  # BiT R50x1 with a 1000-class head
    assert abs(n_params("R152x4") - 936.5e6) < 0.1e6  # BiT-L: 928M body + 8.2M head
    assert abs(n_params("ViT-Ti/16") - 5.7e6) < 0.05e6
    assert abs(n_params("ViT-S/16") - 22.05e6) < 0.05e6


def test_every_listed_model_builds_on_meta() -> None:
    for name in model_names():
        assert n_params(name) > 1e6, name


def test_a_shape_only_model_skips_the_initialisation_that_would_import_the_compiler() -> None:
    # Every `vitscale run` and `vitscale config` builds its model on meta to check the config. Initialising
    # meta tensors imported torch._dynamo (about a second of the CLI's start, each time): not any more.
    import subprocess

    code = ("import sys, torch\n"
            "from vitscale.models import create_model, model_names\n"
            "from vitscale.models.masked_patch import MaskedPatchPredictor, PatchTarget\n"
            "with torch.device('meta'):\n"
            "    for name in model_names(): create_model(name, num_classes=1000)\n"
            "    MaskedPatchPredictor(create_model('ViT-Ti/16', num_classes=0), PatchTarget('mean_colour', 16, 3), 5)\n"
            "print('torch._dynamo' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
    torch.manual_seed(0)  # and a model with values is initialised as before: random, not the zeros it was made with
    model = create_model("ViT-Ti/8", num_classes=5, img_size=32, **TINY)
    assert model.pos_embed.std() > 0.01 and model.blocks[0].attn.qkv.weight.abs().max() > 0


# --- ViT variants: shapes and gradients -------------------------------------------------------

VIT_VARIANTS = [
    (pe, pl, cl)
    for pe in ["learn_1d", "learn_2d", "none", "relative"]
    for pl in (["input", "every_layer", "every_layer_shared"] if pe.startswith("learn") else ["input"])
    for cl in ["token", "gap"]
]


@pytest.mark.parametrize(("pos_emb", "placement", "classifier"), VIT_VARIANTS)
def test_vit_variant_shapes_and_gradients(pos_emb: str, placement: str, classifier: str) -> None:
    torch.manual_seed(0)
    model = create_model("ViT-Ti/8", num_classes=5, img_size=32, pos_emb=pos_emb, pos_emb_placement=placement,
                         classifier=classifier, **TINY)
    assert model.forward_features(X32).shape == (2, 32)
    check_grads(randomize(model), X32, 5)


def test_vit_initialisation() -> None:
    torch.manual_seed(0)
    model = create_model("ViT-S/16", num_classes=7, img_size=64, head_bias_init=-6.9, representation_size=48)
    assert torch.equal(model.cls_token, torch.zeros(1, 1, 384))
    assert model.pos_embed.shape == (1, 17, 384)
    assert abs(model.pos_embed.std().item() - 0.02) < 0.002
    assert torch.equal(model.head.weight, torch.zeros(7, 48))
    assert torch.equal(model.head.bias, torch.full((7,), -6.9))
    x = torch.randn(3, 3, 64, 64)
    torch.testing.assert_close(model(x), torch.full((3, 7), -6.9))
    assert model.forward_features(x).shape == (3, 48)
    assert model.forward_features(x).abs().max() <= 1.0  # tanh pre-logits
    assert model.no_weight_decay() == {"cls_token", "pos_embed"}


def test_no_weight_decay_names_position_tables() -> None:
    with torch.device("meta"):
        m2d = create_model("ViT-Ti/8", num_classes=2, img_size=32, pos_emb="learn_2d", classifier="gap", **TINY)
        rel = create_model("ViT-Ti/8", num_classes=2, img_size=32, pos_emb="relative", **TINY)
        per = create_model("ViT-Ti/8", num_classes=2, img_size=32, pos_emb_placement="every_layer", **TINY)
    assert m2d.no_weight_decay() == {"pos_embed_row", "pos_embed_col"}
    assert rel.no_weight_decay() == {"cls_token", "blocks.0.attn.rel_bias", "blocks.1.attn.rel_bias"}
    assert per.pos_embed.shape == (2, 17, 32) and per.no_weight_decay() == {"cls_token", "pos_embed"}


def test_placement_every_layer_shared_adds_before_each_block() -> None:
    torch.manual_seed(1)
    one = create_model("ViT-Ti/8", num_classes=3, img_size=32, **{**TINY, "depth": 1})
    shared = create_model("ViT-Ti/8", num_classes=3, img_size=32, pos_emb_placement="every_layer_shared",
                          **{**TINY, "depth": 1})
    randomize(one)
    shared.load_state_dict(one.state_dict())
    torch.testing.assert_close(shared(X32), one(X32))  # one layer: identical to "input"
    two = create_model("ViT-Ti/8", num_classes=3, img_size=32, **TINY)
    two_shared = create_model("ViT-Ti/8", num_classes=3, img_size=32, pos_emb_placement="every_layer_shared", **TINY)
    randomize(two)
    two_shared.load_state_dict(two.state_dict())
    assert not torch.allclose(two_shared(X32), two(X32))
    # ... and equals adding the same table by hand before block 1.
    with torch.no_grad():
        tokens = torch.cat([two.cls_token.expand(2, -1, -1), two.patch_embed(X32)], 1) + two.pos_embed
        tokens = two.blocks[1](two.blocks[0](tokens) + two.pos_embed)
        torch.testing.assert_close(two_shared.head(two.norm(tokens)[:, 0]), two_shared(X32))


def test_relative_bias_is_toeplitz_and_zero_table_equals_no_posemb() -> None:
    attn = Attention(8, 2, rel_pos_len=5)
    nn.init.normal_(attn.rel_bias)
    bias = attn.logit_bias(5)[0]
    for i, j in itertools.product(range(5), repeat=2):
        assert torch.equal(bias[:, i, j], attn.rel_bias[:, i - j + 4])
    torch.manual_seed(2)
    rel = randomize(create_model("ViT-Ti/8", num_classes=3, img_size=32, pos_emb="relative", **TINY))
    plain = create_model("ViT-Ti/8", num_classes=3, img_size=32, pos_emb="none", **TINY)
    missing, unexpected = plain.load_state_dict(rel.state_dict(), strict=False)
    assert not missing and sorted(unexpected) == ["blocks.0.attn.rel_bias", "blocks.1.attn.rel_bias"]
    assert not torch.allclose(rel(X32), plain(X32))
    with torch.no_grad():
        for blk in rel.blocks:
            blk.attn.rel_bias.zero_()
    torch.testing.assert_close(rel(X32), plain(X32))


def test_gap_pools_patch_tokens_and_token_reads_class_token() -> None:
    torch.manual_seed(3)
    gap = randomize(create_model("ViT-Ti/8", num_classes=3, img_size=32, classifier="gap", **TINY))
    with torch.no_grad():
        tokens = gap.forward_encoder(X32)
        assert tokens.shape == (2, 16, 32)
        torch.testing.assert_close(gap.forward_features(X32), gap.fc_norm(tokens.mean(1)))


def test_reset_head_drops_pre_logits_and_updates_meta() -> None:
    model = randomize(create_model("ViT-Ti/8", num_classes=9, img_size=32, representation_size=16, **TINY))
    model.reset_head(4, bias_init=0.5)
    assert isinstance(model.pre_logits, nn.Identity)
    assert model.head.weight.shape == (4, 32) and torch.equal(model.head.weight, torch.zeros(4, 32))
    torch.testing.assert_close(model(X32), torch.full((2, 4), 0.5))
    meta = model_meta(model)
    assert meta["num_classes"] == 4 and meta["overrides"]["representation_size"] is None
    assert meta["overrides"]["depth"] == 2 and meta["name"] == "ViT-Ti/8"


def test_activation_checkpointing_matches_plain_forward_backward() -> None:
    torch.manual_seed(4)
    plain = randomize(create_model("ViT-Ti/8", num_classes=3, img_size=32, **TINY))
    ckpt = create_model("ViT-Ti/8", num_classes=3, img_size=32, activation_checkpointing=True, **TINY)
    ckpt.load_state_dict(plain.state_dict())
    for m in (plain, ckpt):
        m.train()
        m(X32).square().sum().backward()
    for (name, a), b in zip(plain.named_parameters(), ckpt.parameters()):
        torch.testing.assert_close(a.grad, b.grad, msg=name)


def test_dropout_active_in_train_only() -> None:
    model = randomize(create_model("ViT-Ti/8", num_classes=3, img_size=32, dropout=0.5, attention_dropout=0.5, **TINY))
    model.eval()
    assert torch.equal(model(X32), model(X32))
    model.train()
    assert not torch.equal(model(X32), model(X32))


def test_wrong_image_size_is_a_value_error() -> None:
    model = create_model("ViT-Ti/8", num_classes=3, img_size=32, **TINY)
    with pytest.raises(ValueError, match="grid"):
        model(torch.randn(1, 3, 40, 40))
    with pytest.raises(ValueError, match="multiple"):
        model(torch.randn(1, 3, 36, 36))
    with pytest.raises(ValueError, match="expected input"):
        model(torch.randn(1, 1, 32, 32))
    free = create_model("ViT-Ti/8", num_classes=3, img_size=32, pos_emb="none", **TINY)
    assert free(torch.randn(1, 3, 48, 48)).shape == (1, 3)  # no position table: any grid works


# --- ResNet and hybrids ---------------------------------------------------------------------


def test_resnet_tiny_shapes_and_gradients() -> None:
    torch.manual_seed(5)
    model = create_model("R50x1", num_classes=6, img_size=32, resnet_layers=(1, 1, 1, 1), head_bias_init=0.25)
    torch.testing.assert_close(model(X32), torch.full((2, 6), 0.25))  # zero-init head
    assert model.forward_features(X32).shape == (2, 2048)
    assert model.forward_feature_map(torch.randn(1, 3, 64, 64)).shape == (1, 2048, 2, 2)
    check_grads(randomize(model), X32, 6)
    model.reset_head(3)
    assert model(X32).shape == (2, 3)


def test_resnet_structure_matches_bit() -> None:
    with torch.device("meta"):
        model = create_model("R101x1", num_classes=10)
    assert [len(s.blocks) for s in model.stages] == [3, 4, 23, 3]
    assert model.stem.conv.weight.shape == (64, 3, 7, 7)
    assert model.stages[3].blocks[0].conv3.weight.shape == (2048, 512, 1, 1)
    assert model.stages[1].blocks[0].conv2.stride == (2, 2)  # BiT: stride in the 3x3 conv


@pytest.mark.parametrize(("name", "img", "units"), [("R50x1+ViT-Ti/16", 32, [3, 4, 9]),
                                                     ("R50x1+ViT-Ti/32", 64, [3, 4, 6, 3])])
def test_hybrid_shapes_and_gradients(name: str, img: int, units: list[int]) -> None:
    with torch.device("meta"):
        full = create_model(name, num_classes=4, img_size=img, **TINY)
    assert [len(s.blocks) for s in full.patch_embed.backbone.stages] == units
    assert full.patch_embed.proj.kernel_size == (1, 1)
    assert full.pos_embed.shape == (1, 1 + 2 * 2, 32)  # 2x2 grid: total stride 16 resp. 32
    torch.manual_seed(6)
    # Gradients on a one-unit-per-stage backbone keep the test fast; same code path.
    model = create_model(name, num_classes=4, img_size=img, resnet_layers=(1,) * len(units), **TINY)
    x = torch.randn(2, 3, img, img)
    assert model.forward_features(x).shape == (2, 32)
    check_grads(randomize(model), x, 4)


def test_hybrid_b16_full_size_on_meta() -> None:
    with torch.device("meta"):
        model = create_model("R50x1+ViT-B/16", num_classes=1000, img_size=384)
    assert model.pos_embed.shape == (1, 1 + 24 * 24, 768)
    assert model.patch_embed.proj.weight.shape == (768, 1024, 1, 1)  # stage-3 output, 1024 channels


# --- small pure pieces ------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(size=st.integers(1, 300), kernel=st.integers(1, 7), stride=st.integers(1, 4))
def test_same_padding_gives_ceil_output(size: int, kernel: int, stride: int) -> None:
    before, after = same_pad_amounts(size, kernel, stride)
    assert 0 <= before <= after <= before + 1
    assert (size + before + after - kernel) // stride + 1 == -(-size // stride)


def test_weight_standardisation_ignores_filter_scale_and_shift() -> None:
    conv = StdConv2d(4, 6, 3)
    x = torch.randn(2, 4, 9, 9)
    y = conv(x)
    with torch.no_grad():
        conv.weight.mul_(torch.rand(6, 1, 1, 1) * 5 + 0.1).add_(torch.randn(6, 1, 1, 1))
    torch.testing.assert_close(conv(x), y, rtol=1e-4, atol=1e-4)
    w = conv.weight.detach()
    assert y.shape == (2, 6, 9, 9) and not torch.allclose(w.mean((1, 2, 3)), torch.zeros(6))
