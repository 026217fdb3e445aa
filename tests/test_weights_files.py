"""Checkpoint import/export round trips on tiny models (vitscale.models.weights_files)."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from helpers.models import TINY, X32
from helpers.models import randomize as _randomize
from vitscale.models import (
    create_from_weights,
    create_model,
    export_npz,
    export_state_dict,
    load_pretrained,
    timm_state_dict,
)


def randomize(model: nn.Module, seed: int = 0) -> nn.Module:
    """Every parameter non-zero random, in eval mode (no dropout in logit comparisons)."""
    return _randomize(model, seed).eval()


def tiny_vit(seed: int = 0, **kw: object) -> nn.Module:
    torch.manual_seed(seed)
    opts = {"num_classes": 5, "img_size": 32, **TINY, **kw}
    return create_model("ViT-Ti/8", **opts).eval()


VARIANTS = [
    {},
    {"classifier": "gap"},
    {"representation_size": 16},
    {"pos_emb": "learn_2d", "pos_emb_placement": "every_layer"},
    {"pos_emb": "learn_1d", "pos_emb_placement": "every_layer"},
    {"pos_emb": "relative", "classifier": "gap"},
    {"pos_emb": "none"},
]


@pytest.mark.parametrize("kw", VARIANTS, ids=lambda kw: "-".join(map(str, kw.values())) or "default")
def test_npz_round_trip_gives_identical_logits(tmp_path: Path, kw: dict) -> None:
    src = randomize(tiny_vit(**kw))
    export_npz(src, tmp_path / "m.npz")
    dst = tiny_vit(seed=1, **kw)
    report = load_pretrained(dst, tmp_path / "m.npz")
    assert report.source_format == "npz" and not report.kept and not report.resampled
    assert len(report.loaded) == len(src.state_dict())
    with torch.no_grad():
        assert torch.equal(dst(X32), src(X32))


def test_npz_uses_official_names_and_layouts(tmp_path: Path) -> None:
    model = randomize(tiny_vit(representation_size=16))
    export_npz(model, tmp_path / "m.npz")
    w = dict(np.load(tmp_path / "m.npz"))
    d, heads, dh = 32, 2, 16
    assert not any(k.startswith("vitscale/") for k in w)  # default ViT is fully official
    assert w["embedding/kernel"].shape == (8, 8, 3, d)  # HWIO
    assert w["cls"].shape == (1, 1, d) and w["Transformer/posembed_input/pos_embedding"].shape == (1, 17, d)
    mha = "Transformer/encoderblock_0/MultiHeadDotProductAttention_1/"
    assert w[mha + "query/kernel"].shape == (d, heads, dh) and w[mha + "out/kernel"].shape == (heads, dh, d)
    assert w["Transformer/encoderblock_1/MlpBlock_3/Dense_0/kernel"].shape == (d, 64)
    assert {"Transformer/encoderblock_0/LayerNorm_0/scale", "Transformer/encoderblock_0/LayerNorm_2/bias",
            "Transformer/encoder_norm/scale", "pre_logits/kernel", "head/bias"} <= set(w)
    assert w["head/kernel"].shape == (16, 5)
    # Semantics, computed the Flax way from the arrays (not by inverting our own mapping):
    x = torch.randn(d)
    attn = model.blocks[0].attn
    with torch.no_grad():
        q_torch = attn.qkv(x)[:d].reshape(heads, dh).numpy()
        v_torch = attn.qkv(x)[2 * d:].reshape(heads, dh).numpy()
        y = torch.randn(heads, dh)
        out_torch = attn.proj(y.reshape(-1)).numpy()
        patch = torch.randn(1, 3, 8, 8)
        emb_torch = model.patch_embed.proj(patch).reshape(-1).numpy()
    xn = x.numpy()
    np.testing.assert_allclose(np.einsum("d,dhk->hk", xn, w[mha + "query/kernel"]) + w[mha + "query/bias"],
                               q_torch, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.einsum("d,dhk->hk", xn, w[mha + "value/kernel"]) + w[mha + "value/bias"],
                               v_torch, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.einsum("hk,hkd->d", y.numpy(), w[mha + "out/kernel"]) + w[mha + "out/bias"],
                               out_torch, rtol=1e-5, atol=1e-6)
    hwc = patch[0].permute(1, 2, 0).numpy()
    np.testing.assert_allclose(np.einsum("ijc,ijcd->d", hwc, w["embedding/kernel"]) + w["embedding/bias"],
                               emb_torch, rtol=1e-5, atol=1e-5)


def test_hybrid_npz_round_trip_with_official_resnet_names(tmp_path: Path) -> None:
    torch.manual_seed(0)
    kw = {"num_classes": 3, "img_size": 32, "resnet_layers": (1, 2, 1), **TINY}
    src = randomize(create_model("R50x1+ViT-Ti/16", **kw))
    export_npz(src, tmp_path / "h.npz")
    w = dict(np.load(tmp_path / "h.npz"))
    assert w["conv_root/kernel"].shape == (7, 7, 3, 64) and w["gn_root/scale"].shape == (64,)
    assert {"block1/unit1/conv1/kernel", "block1/unit1/gn3/bias", "block2/unit2/conv2/kernel",
            "block3/unit1/conv_proj/kernel", "block3/unit1/gn_proj/scale"} <= set(w)
    assert w["embedding/kernel"].shape == (1, 1, 1024, 32)
    assert not any(k.startswith("vitscale/") for k in w)
    # Files that nest the CNN under "ResNet/" load too.
    np.savez(tmp_path / "nested.npz", **{(k if k.startswith(("Transformer", "embedding", "cls", "head")) else
                                          "ResNet/" + k): v for k, v in w.items()})
    for name in ("h.npz", "nested.npz"):
        dst = create_model("R50x1+ViT-Ti/16", **kw).eval()
        load_pretrained(dst, tmp_path / name)
        with torch.no_grad():
            assert torch.equal(dst(X32), src(X32))


def test_bit_resnet_npz_and_timm_round_trip(tmp_path: Path) -> None:
    torch.manual_seed(0)
    kw = {"num_classes": 4, "img_size": 32, "resnet_layers": (1, 1, 1, 1)}
    src = randomize(create_model("R50x1", **kw))
    export_npz(src, tmp_path / "r.npz")
    w = dict(np.load(tmp_path / "r.npz"))
    assert w["resnet/root_block/standardized_conv2d/kernel"].shape == (7, 7, 3, 64)
    assert {"resnet/block1/unit01/a/group_norm/gamma", "resnet/block4/unit01/a/proj/standardized_conv2d/kernel",
            "resnet/group_norm/beta"} <= set(w)
    assert w["resnet/head/conv2d/kernel"].shape == (1, 1, 2048, 4)
    timm_sd = timm_state_dict(src)
    assert timm_sd["head.fc.weight"].shape == (4, 2048, 1, 1) and "head.weight" not in timm_sd
    torch.save(timm_sd, tmp_path / "r.pth")
    for name in ("r.npz", "r.pth"):
        dst = create_model("R50x1", **kw).eval()
        load_pretrained(dst, tmp_path / name)
        with torch.no_grad():
            assert torch.equal(dst(X32), src(X32))


@pytest.mark.parametrize("suffix", [".pth", ".safetensors"])
def test_vitscale_export_round_trip_and_rebuild(tmp_path: Path, suffix: str) -> None:
    kw = {"pos_emb": "learn_2d", "classifier": "gap", "dropout": 0.1, "head_bias_init": -2.0}
    src = randomize(tiny_vit(**kw))
    path = tmp_path / f"m{suffix}"
    export_state_dict(src, path)
    dst = tiny_vit(seed=3, **kw)
    report = load_pretrained(dst, path)
    assert report.source_format == "vitscale" and report.meta is not None
    assert report.meta["name"] == "ViT-Ti/8" and report.meta["num_classes"] == 5 and report.meta["img_size"] == 32
    with torch.no_grad():
        assert torch.equal(dst(X32), src(X32))
    rebuilt, _ = create_from_weights(path)
    assert rebuilt.cfg == src.cfg
    with torch.no_grad():
        assert torch.equal(rebuilt.eval()(X32), src(X32))


def test_timm_state_dict_with_wrappers_and_prefixes(tmp_path: Path) -> None:
    src = randomize(tiny_vit())
    sd = {f"module.{k}": v for k, v in timm_state_dict(src).items()}
    torch.save({"model": sd, "epoch": 3}, tmp_path / "w.pth")
    dst = tiny_vit(seed=2)
    assert load_pretrained(dst, tmp_path / "w.pth").source_format == "timm"
    with torch.no_grad():
        assert torch.equal(dst(X32), src(X32))


class _Opaque:
    """An object a checkpoint may pickle: loading it would run this module's code."""


@pytest.mark.parametrize("layout", ["timm", "deit"])
def test_a_training_scripts_checkpoint_with_its_args_loads(tmp_path: Path, layout: str) -> None:
    """timm's train.py (model_best.pth.tar) and DeiT's / MAE's main.py save their argparse.Namespace beside the
    weights: every such file was refused as 'not a file of tensors that loads without running code'."""
    src, ema = randomize(tiny_vit()), randomize(tiny_vit(), seed=7)
    args = argparse.Namespace(model="vit_tiny_patch8", lr=5e-4, smoothing=0.1, aa=None, input_size=[3, 32, 32])
    optimizer = torch.optim.AdamW(src.parameters()).state_dict()
    if layout == "timm":
        ckpt = {"epoch": 9, "arch": "vit_tiny_patch8", "state_dict": timm_state_dict(src), "optimizer": optimizer,
                "version": 2, "args": args, "amp_scaler": {"scale": 65536.0, "_growth_tracker": 3}, "metric": 71.5,
                "state_dict_ema": timm_state_dict(ema)}
    else:
        ckpt = {"model": timm_state_dict(src), "optimizer": optimizer, "lr_scheduler": {"last_epoch": 9},
                "epoch": 9, "model_ema": timm_state_dict(ema), "scaler": {"scale": 1024.0}, "args": args}
    torch.save(ckpt, tmp_path / "model_best.pth.tar")
    dst = tiny_vit(seed=2)
    assert load_pretrained(dst, tmp_path / "model_best.pth.tar").source_format == "timm"
    with torch.no_grad():
        assert torch.equal(dst(X32), src(X32))  # the trained weights, as timm's load_checkpoint reads them
    torch.save({**ckpt, "args": argparse.Namespace(hook=_Opaque())}, tmp_path / "opaque.pth")
    with pytest.raises(ValueError, match="not a file of tensors that loads without running code"):
        load_pretrained(dst, tmp_path / "opaque.pth")


@pytest.mark.parametrize("fmt", ["npz", "pth"])
def test_higher_resolution_resamples_position_embeddings(tmp_path: Path, fmt: str) -> None:
    src = randomize(tiny_vit())
    path = tmp_path / f"m.{fmt}"
    export_npz(src, path) if fmt == "npz" else torch.save(timm_state_dict(src), path)
    dst = tiny_vit(seed=1, img_size=64)
    report = load_pretrained(dst, path)
    assert report.resampled == ("pos_embed: 4x4 -> 8x8",)
    assert dst.pos_embed.shape == (1, 65, 32)
    assert torch.equal(dst.pos_embed[:, 0], src.pos_embed[:, 0])  # class token kept
    grid = dst.pos_embed[0, 1:].reshape(8, 8, 32)
    assert torch.equal(grid[0, 0], src.pos_embed[0, 1]) and torch.equal(grid[7, 7], src.pos_embed[0, 16])
    assert torch.equal(dst.blocks[1].mlp.fc2.weight, src.blocks[1].mlp.fc2.weight)


def test_a_timm_no_embed_class_table_loads_as_timm_computes_it(tmp_path: Path) -> None:
    """timm's no_embed_class (FlexiViT, DeiT-III) adds positions to the patches alone, then prepends the class
    token: its table has a square count of rows. Refused as 'cannot infer the source grid of 15 position
    embeddings (not square)'; loaded with a zero class-token row, the model computes what timm's does."""
    src = randomize(tiny_vit())
    with torch.no_grad():
        src.pos_embed[:, 0] = 0  # [cls; patches] + [0; table] == [cls; patches + table]: timm's no_embed_class
    sd = timm_state_dict(src)
    sd["pos_embed"] = sd["pos_embed"][:, 1:].clone()
    torch.save(sd, tmp_path / "no_embed_class.pth")
    dst = tiny_vit(seed=1)
    report = load_pretrained(dst, tmp_path / "no_embed_class.pth")
    assert any("no_embed_class" in note for note in report.notes)
    with torch.no_grad():
        assert torch.equal(dst(X32), src(X32))
    big = tiny_vit(seed=1, img_size=64)
    assert load_pretrained(big, tmp_path / "no_embed_class.pth").resampled == ("pos_embed: 4x4 -> 8x8",)
    assert torch.equal(big.pos_embed[0, 0], torch.zeros(32))


def test_2d_and_relative_tables_resample(tmp_path: Path) -> None:
    for kw in ({"pos_emb": "learn_2d"}, {"pos_emb": "relative"}):
        src = randomize(tiny_vit(**kw))
        export_state_dict(src, tmp_path / "m.pth")
        report = load_pretrained(tiny_vit(img_size=48, **kw), tmp_path / "m.pth")
        assert report.resampled, kw


def test_new_class_count_keeps_zero_head(tmp_path: Path) -> None:
    src = randomize(tiny_vit())
    export_npz(src, tmp_path / "m.npz")
    dst = tiny_vit(seed=1, num_classes=3, head_bias_init=0.5)
    report = load_pretrained(dst, tmp_path / "m.npz")
    assert report.head_kept and report.kept == ("head.bias", "head.weight")
    assert any("zero-init head" in n for n in report.notes)
    assert torch.equal(dst.head.weight, torch.zeros(3, 32))
    with torch.no_grad():
        torch.testing.assert_close(dst.forward_features(X32), src.forward_features(X32), rtol=0, atol=0)


def test_pre_logits_dropped_for_fine_tuning(tmp_path: Path) -> None:
    src = randomize(tiny_vit(representation_size=16))
    torch.save(timm_state_dict(src), tmp_path / "m.pth")
    dst = tiny_vit(seed=1)  # same class count, but no representation layer: the paper's recipe
    report = load_pretrained(dst, tmp_path / "m.pth")
    assert set(report.dropped) == {"pre_logits.fc.weight", "pre_logits.fc.bias", "head.weight", "head.bias"}
    assert report.head_kept and any("pre-logits" in n for n in report.notes)
    assert torch.equal(dst.head.weight, torch.zeros(5, 32))


def test_mismatched_file_lists_missing_unexpected_and_shapes(tmp_path: Path) -> None:
    src = randomize(tiny_vit(depth=3))
    torch.save(timm_state_dict(src), tmp_path / "deep.pth")
    with pytest.raises(ValueError, match=r"unexpected \(12\): blocks\.2\.norm1\.weight"):
        load_pretrained(tiny_vit(), tmp_path / "deep.pth")
    with pytest.raises(ValueError, match=r"missing \(12\): blocks\.3\.norm1\.weight"):
        load_pretrained(tiny_vit(depth=4), tmp_path / "deep.pth")
    wide = randomize(tiny_vit(width=64, mlp_dim=128))
    export_npz(wide, tmp_path / "wide.npz")
    with pytest.raises(ValueError, match=r"shape mismatch .*patch_embed\.proj\.weight file \(64, 3, 8, 8\)"):
        load_pretrained(tiny_vit(), tmp_path / "wide.npz")
    gap = randomize(tiny_vit(classifier="gap"))
    torch.save(timm_state_dict(gap), tmp_path / "gap.pth")
    with pytest.raises(ValueError, match="missing.*cls_token"):
        load_pretrained(tiny_vit(), tmp_path / "gap.pth")
    # A parameter in the file at another shape is a mismatch, not also missing (it was listed as both).
    sd = timm_state_dict(tiny_vit())
    sd["cls_token"] = torch.zeros(3, 3)
    torch.save(sd, tmp_path / "token.pth")
    with pytest.raises(ValueError) as refused:
        load_pretrained(tiny_vit(), tmp_path / "token.pth")
    assert "shape mismatch (1): cls_token file (3, 3)" in str(refused.value) and "missing" not in str(refused.value)


def test_unreadable_files_raise_value_error(tmp_path: Path) -> None:
    model = tiny_vit()
    with pytest.raises(ValueError, match="does not exist"):
        load_pretrained(model, tmp_path / "nope.pth")
    (tmp_path / "junk.pth").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="cannot read"):
        load_pretrained(model, tmp_path / "junk.pth")
    # A plain pickle of protocol 4 (not torch's): the refusal is the one line, without torch's warning about the
    # protocol printed above it.
    import pickle
    import warnings

    (tmp_path / "p4.pth").write_bytes(pickle.dumps({"w": [1.0]}, protocol=4))
    with warnings.catch_warnings(record=True) as seen, pytest.raises(ValueError, match="loads without running code"):
        warnings.simplefilter("always")
        load_pretrained(model, tmp_path / "p4.pth")
    assert [str(w.message) for w in seen] == []
    torch.save({"step": 3}, tmp_path / "nodict.pth")
    with pytest.raises(ValueError, match="not a state dict"):
        load_pretrained(model, tmp_path / "nodict.pth")
    torch.save(timm_state_dict(model), tmp_path / "t.pth")
    with pytest.raises(ValueError, match="without a vitscale header"):
        create_from_weights(tmp_path / "t.pth")


def test_an_npz_of_another_head_count_is_refused(tmp_path: Path) -> None:
    """Its q/k/v kernels reshape to the very matrices the model holds, split into other heads: loaded, the
    model's attention computed something else, without a word."""
    export_npz(randomize(tiny_vit(heads=4)), tmp_path / "4heads.npz")
    with pytest.raises(ValueError, match=rf"checkpoint {tmp_path / '4heads.npz'} \(npz\) does not fit .*"
                                         r"encoderblock_0/MultiHeadDotProductAttention_1/query/kernel.* "
                                         r"\(32, 4, 8\) is not 2 heads"):
        load_pretrained(tiny_vit(), tmp_path / "4heads.npz")


def _safetensors_with_header(path: Path, meta: str) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tiny_vit().state_dict().items()}, str(path),
              metadata={"format": "vitscale", "meta": meta})


def _pt_with_header(path: Path, meta: object) -> None:
    torch.save({"format": "vitscale", "version": 1, "meta": meta, "state_dict": tiny_vit().state_dict()}, path)


@pytest.mark.parametrize(("name", "write", "says"), [
    ("objects.npz", lambda p: np.savez(p, x=np.array([{"a": 1}], dtype=object)), "Object arrays cannot be loaded"),
    ("badjson.safetensors", lambda p: _safetensors_with_header(p, "{not json"), "its vitscale header is not JSON"),
    ("list.safetensors", lambda p: _safetensors_with_header(p, "[1]"), "its vitscale header is a list, not a mapping"),
    ("list.pth", lambda p: _pt_with_header(p, [1, 2]), "its vitscale header is a list, not a mapping"),
    ("partial.pth", lambda p: _pt_with_header(p, {"name": "ViT-Ti/8"}), "its vitscale header needs name .* got {'name'"),
    ("classes.pth", lambda p: _pt_with_header(p, {"name": "ViT-Ti/8", "num_classes": "five", "img_size": 32}),
     "its vitscale header needs name .*'num_classes': 'five'"),
    ("unknown.pth", lambda p: _pt_with_header(p, {"name": "ViT-Zz/3", "num_classes": 5, "img_size": 32}),
     "its vitscale header names no model vitscale builds: unknown model name 'ViT-Zz/3'"),
    # numpy took bytes that are no zip for a pickle, and advised allow_pickle=True (running whatever it holds)
    ("bytes.npz", lambda p: p.write_bytes(bytes(range(256)) * 8), r"not an \.npz archive \(a zip of arrays\)"),
    ("cut.npz", lambda p: (export_npz(tiny_vit(), p), p.write_bytes(p.read_bytes()[:2000])),
     r"not an \.npz archive \(a zip of arrays\); cut short"),
    # torch's zip reader said only "OSError: [Errno 22] Invalid argument"
    ("cut.pth", lambda p: (torch.save(timm_state_dict(tiny_vit()), p), p.write_bytes(p.read_bytes()[:3000])),
     "a damaged or cut-short torch file"),
    # a copy that never wrote a byte: once "EOFError: " and nothing after it
    ("empty.pth", lambda p: p.write_bytes(b""), r"an empty or cut-short file \(it ends before its first object\)"),
])
def test_a_damaged_file_is_a_value_error_naming_it(tmp_path: Path, name: str, write, says: str) -> None:
    """Once a TypeError (a header that is a list), or a ValueError that named no file (numpy's, json's)."""
    path = tmp_path / name
    write(path)
    for read in (lambda: load_pretrained(tiny_vit(), path), lambda: create_from_weights(path)):
        with pytest.raises(ValueError, match=f"cannot read checkpoint {path}: {says}"):
            read()


def test_a_position_table_that_cannot_be_resampled_names_the_file(tmp_path: Path) -> None:
    sd = timm_state_dict(tiny_vit())
    sd["pos_embed"] = torch.zeros(1, 1 + 10, 32)  # 10 patches: no square grid
    torch.save(sd, tmp_path / "odd.pth")
    with pytest.raises(ValueError, match=rf"checkpoint {tmp_path / 'odd.pth'}: pos_embed \(1, 11, 32\) does not fit "
                                         r"the model's \(1, 17, 32\): cannot infer the source grid of 10"):
        load_pretrained(tiny_vit(), tmp_path / "odd.pth")


def test_a_bfloat16_npz_as_jax_writes_it_loads(tmp_path: Path) -> None:
    """numpy has no bfloat16: an npz of JAX's bf16 weights holds 2-byte voids, once a TypeError traceback from
    torch.from_numpy. Widened to float32 exactly: the model holds the bf16-rounded weights."""
    src = randomize(tiny_vit())
    export_npz(src, tmp_path / "m.npz")
    with np.load(tmp_path / "m.npz") as f:
        bf16 = {k: torch.from_numpy(f[k]).bfloat16().view(torch.int16).numpy().view("V2") for k in f.files}
    np.savez(tmp_path / "bf16.npz", **bf16)
    dst = tiny_vit(seed=1)
    assert len(load_pretrained(dst, tmp_path / "bf16.npz").loaded) == len(src.state_dict())
    for name, value in src.state_dict().items():
        assert torch.equal(dst.state_dict()[name], value.bfloat16().float()), name


@pytest.mark.parametrize("bad", [np.array("text"), np.ones((1, 1, 32), np.int32), np.ones((1, 1, 32), np.complex64)],
                         ids=["text", "int32", "complex64"])
def test_an_npz_entry_that_is_no_float_is_refused_by_name(tmp_path: Path, bad: np.ndarray) -> None:
    """Text was a TypeError traceback; integers and complex numbers were cast into the model without a word."""
    export_npz(randomize(tiny_vit()), tmp_path / "m.npz")
    with np.load(tmp_path / "m.npz") as f:
        arrays = {k: f[k] for k in f.files}
    np.savez(tmp_path / "bad.npz", **{**arrays, "cls": bad})
    with pytest.raises(ValueError, match=rf"checkpoint {tmp_path / 'bad.npz'} \(npz\) does not fit .*"
                                         rf"npz entry 'cls' holds {bad.dtype} values, not floating-point weights"):
        load_pretrained(tiny_vit(), tmp_path / "bad.npz")


def _big_vision(arrays: dict[str, np.ndarray], scanned: bool) -> dict[str, np.ndarray]:
    """The official arrays as big_vision's vit.py names them (params/, blocks' modules numbered from 0, the
    position table one row per patch at the model's top), the layers stacked when scanned."""
    out: dict[str, np.ndarray] = {}
    for key, value in arrays.items():
        for old, new in (("MultiHeadDotProductAttention_1/", "MultiHeadDotProductAttention_0/"),
                         ("LayerNorm_2/", "LayerNorm_1/"), ("MlpBlock_3/", "MlpBlock_0/")):
            key = key.replace(old, new)
        if key == "Transformer/posembed_input/pos_embedding":
            key, value = "pos_embedding", value[:, 1:]
        out[key] = value
    if scanned:
        blocks = sorted({k.split("/")[1] for k in out if k.startswith("Transformer/encoderblock_")})
        for rest in sorted({k.split("/", 2)[2] for k in out if k.startswith("Transformer/encoderblock_0/")}):
            out[f"Transformer/encoderblock/{rest}"] = np.stack([out.pop(f"Transformer/{b}/{rest}") for b in blocks])
    return {f"params/{k}": v for k, v in out.items()}


@pytest.mark.parametrize("layout", ["opt/target", "big_vision", "big_vision-scanned"])
def test_training_checkpoint_npz_layouts_load(tmp_path: Path, layout: str) -> None:
    """The vision_transformer repo's training checkpoints (opt/target/ beside the optimizer's state) and
    big_vision's (params/, its own module numbering, a scanned encoder): every entry was 'unexpected' and every
    parameter 'missing'."""
    src = randomize(tiny_vit(representation_size=16))
    with torch.no_grad():
        src.pos_embed[:, 0] = 0  # big_vision adds positions to the patches alone
    export_npz(src, tmp_path / "m.npz")
    with np.load(tmp_path / "m.npz") as f:
        arrays = {k: f[k] for k in f.files}
    if layout == "opt/target":
        arrays = {**{f"opt/target/{k}": v for k, v in arrays.items()}, "opt/state/step": np.array(1000)}
    else:
        arrays = _big_vision(arrays, scanned=layout.endswith("scanned"))
    np.savez(tmp_path / "train.npz", **arrays)
    dst = tiny_vit(seed=1, representation_size=16)
    assert len(load_pretrained(dst, tmp_path / "train.npz").loaded) == len(src.state_dict())
    with torch.no_grad():
        assert torch.equal(dst(X32), src(X32))
    from vitscale.train.weights import load_model

    probed, _ = load_model(tmp_path / "train.npz", model_name="ViT-Ti/8", img_size=32, model_options=TINY)
    with torch.no_grad():  # its head and pre-logits read from the file: the probe's features are the file's
        assert torch.equal(probed.eval()(X32), src(X32))


# -- Hugging Face transformers' ViT layout ---------------------------------------------------------------------------
# The reference below is transformers' ViT written out from its own parameter names (ViTEmbeddings, ViTLayer:
# layernorm_before -> self-attention (query, key, value) -> output.dense -> residual, layernorm_after ->
# intermediate.dense -> GELU -> output.dense -> residual; ViTModel's final layernorm and tanh pooler on the class
# token; ViTForImageClassification's classifier on the class token), with its layer-norm epsilon of 1e-12.


def _transformers_vit(prefix: str, seed: int, classes: int | None, pooler: bool) -> dict[str, torch.Tensor]:
    """Random weights of a transformers ViT of TINY's sizes (patch 8, 32 px), under transformers' names."""
    g = torch.Generator().manual_seed(seed)
    d, m, n = TINY["width"], TINY["mlp_dim"], (32 // 8) ** 2 + 1

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.2

    sd = {"embeddings.cls_token": r(1, 1, d), "embeddings.position_embeddings": r(1, n, d),
          "embeddings.patch_embeddings.projection.weight": r(d, 3, 8, 8),
          "embeddings.patch_embeddings.projection.bias": r(d), "layernorm.weight": 1 + r(d), "layernorm.bias": r(d)}
    for i in range(TINY["depth"]):
        layer = f"encoder.layer.{i}."
        for name, rows, cols in (("attention.attention.query", d, d), ("attention.attention.key", d, d),
                                 ("attention.attention.value", d, d), ("attention.output.dense", d, d),
                                 ("intermediate.dense", m, d), ("output.dense", d, m)):
            sd[f"{layer}{name}.weight"], sd[f"{layer}{name}.bias"] = r(rows, cols), r(rows)
        for norm in ("layernorm_before", "layernorm_after"):
            sd[f"{layer}{norm}.weight"], sd[f"{layer}{norm}.bias"] = 1 + r(d), r(d)
    if pooler:
        sd["pooler.dense.weight"], sd["pooler.dense.bias"] = r(d, d), r(d)
    sd = {prefix + k: v for k, v in sd.items()}
    if classes:
        sd["classifier.weight"], sd["classifier.bias"] = r(classes, d), r(classes)
    return sd


def _transformers_forward(sd: dict[str, torch.Tensor], x: torch.Tensor, prefix: str) -> dict[str, torch.Tensor]:
    """transformers' ViT forward from its state dict: the class token's final state, pooled, and logits."""
    import torch.nn.functional as F

    w = {k.removeprefix(prefix): v for k, v in sd.items()}

    def norm(h: torch.Tensor, name: str) -> torch.Tensor:
        return F.layer_norm(h, h.shape[-1:], w[f"{name}.weight"], w[f"{name}.bias"], eps=1e-12)

    def dense(h: torch.Tensor, name: str) -> torch.Tensor:
        return F.linear(h, w[f"{name}.weight"], w[f"{name}.bias"])

    p = F.conv2d(x, w["embeddings.patch_embeddings.projection.weight"],
                 w["embeddings.patch_embeddings.projection.bias"], stride=8).flatten(2).transpose(1, 2)
    h = torch.cat([w["embeddings.cls_token"].expand(len(x), -1, -1), p], 1) + w["embeddings.position_embeddings"]
    heads = TINY["heads"]
    for i in range(TINY["depth"]):
        layer = f"encoder.layer.{i}."
        a = norm(h, layer + "layernorm_before")
        q, k, v = (dense(a, f"{layer}attention.attention.{n}").unflatten(-1, (heads, -1)).transpose(1, 2)
                   for n in ("query", "key", "value"))
        att = torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, -1) @ v
        h = h + dense(att.transpose(1, 2).flatten(2), layer + "attention.output.dense")
        h = h + dense(F.gelu(dense(norm(h, layer + "layernorm_after"), layer + "intermediate.dense")),
                      layer + "output.dense")
    cls = norm(h, "layernorm")[:, 0]
    out = {"cls": cls}
    if "pooler.dense.weight" in w:
        out["pooled"] = torch.tanh(dense(cls, "pooler.dense"))
    if "classifier.weight" in w:
        out["logits"] = dense(cls, "classifier")
    return out


def test_a_transformers_image_classifier_gives_transformers_logits(tmp_path: Path) -> None:
    """`ViTForImageClassification`'s `pytorch_model.bin` (names under `vit.`, a `classifier`): its logits."""
    sd = _transformers_vit("vit.", seed=1, classes=5, pooler=False)
    torch.save(sd, tmp_path / "pytorch_model.bin")
    model = tiny_vit(seed=9)

    report = load_pretrained(model, tmp_path / "pytorch_model.bin")

    assert report.source_format == "transformers" and len(report.loaded) == len(model.state_dict())
    assert not report.kept and any("transformers" in note for note in report.notes), report
    with torch.no_grad():
        torch.testing.assert_close(model(X32), _transformers_forward(sd, X32, "vit.")["logits"], atol=1e-4, rtol=1e-4)


def test_a_transformers_encoder_with_its_pooler_is_the_paper_s_pre_logits(tmp_path: Path) -> None:
    """`ViTModel` (the in21k checkpoints: no prefix, a tanh `pooler`, no classifier) as `model.safetensors`: the
    pooler is the pre-logits layer, and a model with one gives transformers' pooled features; the head is new."""
    from safetensors.torch import save_file

    sd = _transformers_vit("", seed=2, classes=None, pooler=True)
    save_file(sd, str(tmp_path / "model.safetensors"))
    model = tiny_vit(seed=9, representation_size=TINY["width"])

    report = load_pretrained(model, tmp_path / "model.safetensors")

    assert report.source_format == "transformers" and report.head_kept, report
    with torch.no_grad():
        torch.testing.assert_close(model.forward_features(X32), _transformers_forward(sd, X32, "")["pooled"],
                                   atol=1e-4, rtol=1e-4)


def test_a_transformers_block_without_its_key_matrix_is_refused_by_name(tmp_path: Path) -> None:
    sd = _transformers_vit("vit.", seed=3, classes=5, pooler=False)
    del sd["vit.encoder.layer.1.attention.attention.key.weight"]
    torch.save(sd, tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"(?s)\(transformers\) does not fit.*missing \(1\): blocks\.1\.attn\.qkv\.weight"
                                         r".*unexpected \(2\): encoder\.layer\.1\.attention\.attention\.query\.weight"):
        load_pretrained(tiny_vit(), tmp_path / "pytorch_model.bin")


def test_a_folder_of_weights_that_is_no_run_names_its_file(tmp_path: Path) -> None:
    """A model folder as a hub download leaves it (`config.json` beside `pytorch_model.bin`) given where a run or a
    file goes: it said only "no checkpoint_* directories (is it a vitscale run directory?)"."""
    from vitscale.train.weights import load_model

    folder = tmp_path / "vit-tiny"
    folder.mkdir()
    torch.save(_transformers_vit("vit.", seed=4, classes=5, pooler=False), folder / "pytorch_model.bin")
    (folder / "config.json").write_text('{"model_type": "vit"}')
    with pytest.raises(FileNotFoundError, match=re.escape(f"it holds weights: name the file ({folder / 'pytorch_model.bin'})")):
        load_model(folder)
    model, facts = load_model(folder / "pytorch_model.bin", model_name="ViT-Ti/8", img_size=32,
                              model_options=dict(TINY))
    assert facts["format"] == "transformers" and isinstance(model, nn.Module)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match=r"no checkpoint_\* directories \(is it a vitscale run directory\?\)$"):
        load_model(empty)
