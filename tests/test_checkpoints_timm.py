"""Acceptance: timm-format state dicts of full-size ViTs load and reproduce logits (fp32, 1e-4 rel).

The expected key list below is written from timm's `VisionTransformer` naming, not derived from
our model, so a renamed parameter on either side fails the test.
"""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch
from torch import nn

from vitscale.models import create_model, load_pretrained, parse_model_name, timm_state_dict

_BLOCK_KEYS = ("norm1.weight", "norm1.bias", "attn.qkv.weight", "attn.qkv.bias", "attn.proj.weight",
               "attn.proj.bias", "norm2.weight", "norm2.bias", "mlp.fc1.weight", "mlp.fc1.bias",
               "mlp.fc2.weight", "mlp.fc2.bias")


def timm_vit_shapes(name: str, img_size: int, num_classes: int) -> dict[str, tuple[int, ...]]:
    """timm's vit_*_patch*_* state-dict keys and shapes (class token, learned 1-D pos-emb, no pre-logits)."""
    spec = parse_model_name(name)
    assert spec.vit is not None and spec.patch_size is not None
    d, mlp, p = spec.vit.width, spec.vit.mlp_dim, spec.patch_size
    n = (img_size // p) ** 2
    shapes: dict[str, tuple[int, ...]] = {
        "cls_token": (1, 1, d), "pos_embed": (1, n + 1, d),
        "patch_embed.proj.weight": (d, 3, p, p), "patch_embed.proj.bias": (d,),
        "norm.weight": (d,), "norm.bias": (d,), "head.weight": (num_classes, d), "head.bias": (num_classes,),
    }
    per_block = [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,), (d,), (d,), (mlp, d), (mlp,), (d, mlp), (d,)]
    for i in range(spec.vit.depth):
        shapes.update({f"blocks.{i}.{k}": s for k, s in zip(_BLOCK_KEYS, per_block)})
    return shapes


def randomize_(model: nn.Module) -> None:
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for module in model.modules():
            for name, p in module.named_parameters(recurse=False):
                noise = torch.randn(p.shape, generator=g) * 0.02
                noise = torch.where(noise == 0, 0.01, noise)  # randn can draw an exact 0 among 1e8 values
                p.copy_(noise + 1.0 if isinstance(module, nn.LayerNorm) and name == "weight" else noise)


@pytest.mark.parametrize(
    "name",
    ["ViT-S/16", "ViT-B/16", "ViT-B/32", pytest.param("ViT-L/16", marks=pytest.mark.slow)],
)
def test_timm_state_dict_loads_with_same_logits(tmp_path: Path, name: str) -> None:
    torch.manual_seed(0)
    x = torch.randn(1, 3, 224, 224, generator=torch.Generator().manual_seed(1))
    src = create_model(name, num_classes=1000, img_size=224).eval()
    randomize_(src)
    sd = timm_state_dict(src)
    assert {k: tuple(v.shape) for k, v in sd.items()} == timm_vit_shapes(name, 224, 1000)
    assert all(bool((v != 0).all()) for v in sd.values())  # every parameter matters
    path = tmp_path / "timm.pth"
    torch.save(sd, path)
    with torch.no_grad():
        expected = src(x)
    del src, sd
    gc.collect()
    torch.manual_seed(1)
    dst = create_model(name, num_classes=1000, img_size=224).eval()
    report = load_pretrained(dst, path)
    assert report.source_format == "timm" and not report.kept and not report.resampled
    with torch.no_grad():
        got = dst(x)
    rel = (got - expected).abs().max() / expected.abs().max()
    assert rel <= 1e-4, f"relative logit error {rel:.2e}"
