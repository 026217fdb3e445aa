"""The one table of model sizes, and the parser that decodes a model name into a spec.

Pure data + parsing: this module imports no torch, so the analytic FLOPs counter
(`vitscale.scaling.flops`) and config validation can read it cheaply.

Names (big_vision style, the paper's spelling):

- ``"ViT-B/16"``: ViT size (Ti, S, B, L, H; Table 1) and patch size in pixels (any positive int).
  ``"ViT-B_16"`` (the official checkpoint spelling) and ``"B/16"`` are accepted as aliases.
- ``"R50x1"``: BiT ResNet-v2 of depth 50, width multiplier 1 (depths 26, 50, 101, 152, 200).
- ``"R50x1+ViT-B/16"``: hybrid; the number after the slash is the ResNet's total stride
  (16: stage 4 folded into stage 3, 32: the full 4-stage ResNet); ViT patch size is 1 on the
  feature map. ``"R50+ViT-B/16"`` is an alias for ``R50x1``.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from dataclasses import dataclass
from typing import Literal

from vitscale.config.checks import check, positive_int

Family = Literal["vit", "resnet", "hybrid"]

MAX_LAYERS = 1024
"""Most encoder blocks (`depth`) or units in one ResNet stage (`resnet_layers`) an override may ask for. The
deepest published ViTs have 48-64 blocks and BiT's R152 36 units in a stage; 1,024 leaves room for research, while
a slip (`depth: 1e9`) is refused here before anything builds it: every block is a Python object even on the meta
device, so such a model would fill the host's memory during the config's own check."""


@dataclass(frozen=True)
class ViTDims:
    """Transformer encoder dimensions."""

    depth: int
    """Number of encoder blocks (L)."""
    width: int
    """Hidden size D."""
    mlp_dim: int
    """Hidden size of the MLP inside each block."""
    heads: int
    """Number of attention heads; D must divide evenly."""

    @property
    def head_dim(self) -> int:
        """Per-head dimension D_h = D / heads."""
        return self.width // self.heads


@dataclass(frozen=True)
class ResNetDims:
    """BiT ResNet dimensions (the units actually built, after any hybrid stage folding)."""

    depth: int
    """Nominal depth from the name (50 in R50x1)."""
    width_factor: int
    """Width multiplier (1 in R50x1)."""
    layers: tuple[int, ...]
    """Bottleneck units per stage, e.g. (3, 4, 6, 3); (3, 4, 9) for the stride-16 hybrid."""
    preact: bool
    """True: BiT pre-activation units (standalone ResNets). False: post-activation units with
    TF-"SAME" padding, as in the official vision_transformer hybrid."""

    @property
    def stem_width(self) -> int:
        """Channels of the 7x7 root convolution."""
        return 64 * self.width_factor

    @property
    def stage_widths(self) -> tuple[int, ...]:
        """Output channels of each stage (4x the bottleneck's middle width)."""
        return tuple(256 * self.width_factor * 2**i for i in range(len(self.layers)))

    @property
    def out_channels(self) -> int:
        """Channels of the last stage's output."""
        return self.stage_widths[-1]

    @property
    def stride(self) -> int:
        """Total down-sampling: 4 from the root (conv + max-pool), then 2 per stage after the first."""
        return 4 * 2 ** (len(self.layers) - 1)


@dataclass(frozen=True)
class ModelSpec:
    """A decoded model name. Frozen; `dataclasses.replace` derives variants."""

    name: str
    """Canonical name, e.g. "ViT-B/16", "R50x1", "R50x1+ViT-B/16"."""
    family: Family
    vit: ViTDims | None
    """Encoder dims (vit and hybrid), else None."""
    resnet: ResNetDims | None
    """ResNet dims (resnet and hybrid), else None."""
    patch_size: int | None
    """ViT patch size on its input: pixels for vit, 1 (on the CNN feature map) for hybrid."""
    stride: int
    """Pixels per output token (vit, hybrid) or per final feature-map cell (resnet)."""

    def grid(self, img_size: int) -> tuple[int, int]:
        """Token grid (rows, cols) for a square image; ValueError if the size does not divide."""
        if img_size <= 0 or img_size % self.stride != 0:
            raise ValueError(
                f"img_size={img_size} must be a positive multiple of {self.stride} for {self.name}"
            )
        return (img_size // self.stride, img_size // self.stride)

    def num_patches(self, img_size: int) -> int:
        """Number of patch tokens N (class token not counted)."""
        rows, cols = self.grid(img_size)
        return rows * cols


VIT_SIZES: dict[str, ViTDims] = {
    "Ti": ViTDims(depth=12, width=192, mlp_dim=768, heads=3),
    "S": ViTDims(depth=12, width=384, mlp_dim=1536, heads=6),
    "B": ViTDims(depth=12, width=768, mlp_dim=3072, heads=12),
    "L": ViTDims(depth=24, width=1024, mlp_dim=4096, heads=16),
    "H": ViTDims(depth=32, width=1280, mlp_dim=5120, heads=16),
}
PAPER_PATCH_SIZES: tuple[int, ...] = (32, 16, 14, 8)
RESNET_LAYERS: dict[int, tuple[int, ...]] = {
    26: (2, 2, 2, 2),
    50: (3, 4, 6, 3),
    101: (3, 4, 23, 3),
    152: (3, 8, 36, 3),
    200: (3, 24, 36, 3),
}
# The paper's scaling-study ResNets plus BiT-L (R152x4).
PAPER_RESNETS: tuple[str, ...] = ("R50x1", "R50x2", "R101x1", "R152x1", "R152x2", "R200x3", "R152x4")
HYBRID_STRIDES: tuple[int, ...] = (32, 16)

_VIT_RE = re.compile(r"^(?:vit-)?(ti|s|b|l|h)[/_](\d+)$", re.IGNORECASE)
_RESNET_RE = re.compile(r"^r(\d+)(?:x(\d+))?$", re.IGNORECASE)
_SIZE_BY_LOWER = {k.lower(): k for k in VIT_SIZES}


def model_names() -> list[str]:
    """Every canonical name: ViT sizes x paper patch sizes, the paper's ResNets, R50x1 hybrids."""
    names = [f"ViT-{size}/{p}" for size in VIT_SIZES for p in PAPER_PATCH_SIZES]
    names += list(PAPER_RESNETS)
    names += [f"R50x1+ViT-{size}/{s}" for size in VIT_SIZES for s in HYBRID_STRIDES]
    return names


# timm's names for the same models (`vit_base_patch16_224`, `vit_base_r50_s16_384`,
# `resnetv2_50x1_bit`), accepted as aliases: size word -> the table's size.
TIMM_SIZES: dict[str, str] = {"tiny": "Ti", "small": "S", "base": "B", "large": "L", "huge": "H"}
_TIMM_VIT_RE = re.compile(r"^vit_(tiny|small|base|large|huge)_patch(\d+)(?:_(\d+))?(?:_[a-z]\w*)?$")
_TIMM_HYBRID_RE = re.compile(r"^vit_(tiny|small|base|large|huge)_r(\d+)_s(\d+)(?:_(\d+))?(?:_[a-z]\w*)?$")
_TIMM_BIT_RE = re.compile(r"^resnetv2_(\d+)x(\d+)_bit\w*$")


def timm_alias(name: str) -> tuple[str, int | None] | None:
    """timm's name -> (vitscale's name, the resolution the name states or None); None if not one.

    ``vit_base_patch16_224`` -> ("ViT-B/16", 224); ``vit_large_r50_s32_384`` -> ("R50x1+ViT-L/32", 384);
    ``resnetv2_50x1_bit.goog_in21k`` -> ("R50x1", None). A pretrained tag after a dot and suffixes
    such as ``_in21k`` name weights, not the architecture, and are ignored.
    """
    base = name.strip().lower().split(".", 1)[0]
    m = _TIMM_VIT_RE.match(base)
    if m:
        return f"ViT-{TIMM_SIZES[m.group(1)]}/{m.group(2)}", int(m.group(3)) if m.group(3) else None
    m = _TIMM_HYBRID_RE.match(base)
    if m:
        return (f"R{m.group(2)}x1+ViT-{TIMM_SIZES[m.group(1)]}/{m.group(3)}",
                int(m.group(4)) if m.group(4) else None)
    m = _TIMM_BIT_RE.match(base)
    if m:
        return f"R{m.group(1)}x{m.group(2)}", None
    return None


def timm_names() -> list[str]:
    """timm's spellings of the canonical models (for "did you mean"; any resolution suffix parses)."""
    words = {v: k for k, v in TIMM_SIZES.items()}
    names = [f"vit_{words[size]}_patch{p}_{res}" for size in VIT_SIZES for p in PAPER_PATCH_SIZES for res in (224, 384)]
    names += [f"vit_{words[size]}_r50_s{s}_{res}" for size in VIT_SIZES for s in HYBRID_STRIDES for res in (224, 384)]
    names += [f"resnetv2_{r[1:].lower()}_bit" for r in PAPER_RESNETS]
    return names


def _unknown(name: str, why: str) -> ValueError:
    candidates = model_names() + (timm_names() if "_" in name else [])
    close = difflib.get_close_matches(name, candidates, n=3, cutoff=0.5)
    hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    return ValueError(f"unknown model name {name!r} ({why}){hint} See vitscale.models.model_names().")


def _parse_vit(name: str) -> tuple[str, ViTDims, int] | None:
    m = _VIT_RE.match(name)
    if m is None:
        return None
    size = _SIZE_BY_LOWER[m.group(1).lower()]
    return size, VIT_SIZES[size], int(m.group(2))


def _parse_resnet(name: str, *, preact: bool) -> ResNetDims | None:
    m = _RESNET_RE.match(name)
    if m is None:
        return None
    depth = int(m.group(1))
    if depth not in RESNET_LAYERS:
        raise _unknown(name, f"ResNet depth {depth} not in {sorted(RESNET_LAYERS)}")
    width = int(m.group(2)) if m.group(2) is not None else 1
    if width < 1:
        raise _unknown(name, "ResNet width multiplier must be >= 1")
    return ResNetDims(depth=depth, width_factor=width, layers=RESNET_LAYERS[depth], preact=preact)


def parse_model_name(name: str) -> ModelSpec:
    """Decode a model name into a frozen `ModelSpec`; ValueError listing close matches if unknown."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"model name must be a non-empty string, got {name!r}")
    name = name.strip()
    alias = timm_alias(name)
    if alias is not None:
        name = alias[0]
    if "+" in name:
        cnn_part, vit_part = name.split("+", 1)
        resnet = _parse_resnet(cnn_part, preact=False)
        vit = _parse_vit(vit_part)
        if resnet is None or vit is None:
            raise _unknown(name, "hybrids are spelled like 'R50x1+ViT-B/16'")
        size, dims, stride = vit
        if stride not in HYBRID_STRIDES:
            raise _unknown(name, f"hybrid ResNet stride must be one of {HYBRID_STRIDES}, got {stride}")
        if stride == 16:
            # Official hybrid: drop stage 4 and move its units into stage 3 -> (3, 4, 6+3).
            *head, third, fourth = resnet.layers
            resnet = dataclasses.replace(resnet, layers=(*head, third + fourth))
        canonical = f"R{resnet.depth}x{resnet.width_factor}+ViT-{size}/{stride}"
        return ModelSpec(canonical, "hybrid", dims, resnet, patch_size=1, stride=resnet.stride)
    vit = _parse_vit(name)
    if vit is not None:
        size, dims, patch = vit
        if patch < 1:
            raise _unknown(name, "patch size must be >= 1")
        return ModelSpec(f"ViT-{size}/{patch}", "vit", dims, None, patch_size=patch, stride=patch)
    resnet = _parse_resnet(name, preact=True)
    if resnet is not None:
        canonical = f"R{resnet.depth}x{resnet.width_factor}"
        return ModelSpec(canonical, "resnet", None, resnet, patch_size=None, stride=resnet.stride)
    raise _unknown(name, "not a ViT, ResNet or hybrid name")


def with_overrides(
    spec: ModelSpec,
    *,
    depth: int | None = None,
    width: int | None = None,
    mlp_dim: int | None = None,
    heads: int | None = None,
    resnet_layers: tuple[int, ...] | None = None,
) -> ModelSpec:
    """Spec with some dims replaced (tiny test/quickstart models); None keeps the table's value.

    A `ConfigError` names an override that does not apply to the family or has a bad value.
    """
    vit_over = {"depth": depth, "width": width, "mlp_dim": mlp_dim, "heads": heads}
    for key, value in [*vit_over.items(), ("resnet_layers", resnet_layers)]:
        if value is None:
            continue
        if key == "resnet_layers":
            check(spec.resnet is not None, key, f"does not apply to {spec.family} model {spec.name}")
            ok = isinstance(value, (tuple, list)) and 1 <= len(value) <= MAX_LAYERS and all(
                isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= MAX_LAYERS for v in value
            )
            check(ok, key, f"must be a list of 1 to {MAX_LAYERS} unit counts, each in [1, {MAX_LAYERS}], got {value!r}")
            continue
        check(spec.vit is not None, key, f"does not apply to {spec.family} model {spec.name}")
        size = positive_int(value, key)
        check(key != "depth" or size <= MAX_LAYERS, key, f"must be at most {MAX_LAYERS} blocks, got {size}")
    vit = spec.vit
    if vit is not None:
        vit = dataclasses.replace(vit, **{k: v for k, v in vit_over.items() if v is not None})
        check(vit.width % vit.heads == 0, "width", f"width={vit.width} must be divisible by heads={vit.heads}")
    resnet = spec.resnet
    if resnet is not None and resnet_layers is not None:
        resnet = dataclasses.replace(resnet, layers=tuple(resnet_layers))
    stride = resnet.stride if resnet is not None else spec.stride  # hybrids: patch size 1 on the map
    return dataclasses.replace(spec, vit=vit, resnet=resnet, stride=stride)
