"""Build any model of the zoo from its name: `create_model("ViT-B/16", num_classes=1000)`.

Works under `with torch.device("meta"):` too, so parameter counts of ViT-H or R152x4 are instant.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from vitscale.config.checks import image_side, non_negative_int
from vitscale.models.hybrid import build_hybrid
from vitscale.models.layers import Block
from vitscale.models.options import (
    DIM_OPTIONS,
    OPTIONS,
    VIT_OPTIONS,
    ResNetConfig,
    ViTConfig,
    check_option_names,
)
from vitscale.models.resnet import Bottleneck, PreActBottleneck, ResNetV2
from vitscale.models.variants import (
    ModelSpec,
    model_names,
    parse_model_name,
    timm_alias,
    with_overrides,
)
from vitscale.models.vit import VisionTransformer

__all__ = ["OPTIONS", "REPEATED_UNITS", "create_from_meta", "create_model", "model_meta", "model_names",
           "parse_model_name"]

REPEATED_UNITS: tuple[str, ...] = tuple(f"{unit.__module__}.{unit.__qualname__}"
                                        for unit in (Block, PreActBottleneck, Bottleneck))
"""Qualified class names of the modules every model of the zoo repeats: the transformer block and the two
ResNet units. ZeRO-3 gathers each one's parameters at once (`train/engine.py`)."""


def create_model(name: str, *, num_classes: int, img_size: int | None = None, **overrides: Any) -> nn.Module:
    """Build a ViT, BiT ResNet or hybrid from its name (see `model_names()`).

    Args:
        name: e.g. "ViT-B/16", "ViT-L/14", "R50x1", "R50x1+ViT-B/16", or timm's name for one of
            them: "vit_base_patch16_224", "vit_large_patch16_384", "vit_base_r50_s16_384",
            "resnetv2_50x1_bit" (`variants.timm_alias`; the architecture only, no weights).
        num_classes: classifier outputs (the head is zero-initialised); 0 for a ViT without a classifier
            (masked patch prediction's encoder: `models/masked_patch.py`).
        img_size: square input resolution the position embeddings are built for (default: the
            resolution a timm name states, else 224).
        **overrides: any of `OPTIONS` (the fields of `ViTConfig` / `ResNetConfig` in
            `options.py`, and dims depth / width / mlp_dim / heads / resnet_layers; None = the
            table's value).

    Raises:
        ValueError: unknown name (with close matches), unknown override, a bad value, or an
            override that does not apply to the model family.
    """
    spec = parse_model_name(name)
    if img_size is None:
        alias = timm_alias(name)
        img_size = alias[1] if alias is not None and alias[1] is not None else 224
    check_option_names(overrides, spec.family, spec.name)
    non_negative_int(num_classes, "num_classes")
    image_side(img_size, "img_size")
    spec = with_overrides(spec, **{k: overrides.pop(k) for k in DIM_OPTIONS if k in overrides})
    if spec.family == "resnet":
        if spec.resnet is None:  # narrows the type; parse_model_name always sets it for resnets
            raise ValueError(f"{spec.name} has no ResNet dims")
        model: nn.Module = ResNetV2(ResNetConfig(dims=spec.resnet, num_classes=num_classes, **overrides))
    else:
        if spec.vit is None or spec.patch_size is None:
            raise ValueError(f"{spec.name} has no ViT dims")
        cfg = ViTConfig(
            dims=spec.vit, patch_size=spec.patch_size, grid=spec.grid(img_size), num_classes=num_classes, **overrides
        )
        model = build_hybrid(spec, cfg) if spec.family == "hybrid" else VisionTransformer(cfg)
    # Plain attributes (not state): what the model was built as, for checkpoint headers.
    setattr(model, "spec", spec)  # noqa: B010 - nn.Module's typed __setattr__ takes tensors and modules only
    setattr(model, "img_size", img_size)  # noqa: B010
    return model


def model_meta(model: nn.Module) -> dict[str, Any]:
    """The header `create_from_meta` rebuilds `model` from: name, num_classes, img_size, overrides.

    Reflects `reset_head` (num_classes, dropped pre-logits). Only models from `create_model`.
    """
    spec: ModelSpec | None = getattr(model, "spec", None)
    cfg = getattr(model, "cfg", None)
    if spec is None or cfg is None:
        raise ValueError("model was not built by vitscale.models.create_model; pass meta explicitly")
    base = parse_model_name(spec.name)
    over: dict[str, Any] = {}
    if isinstance(cfg, ViTConfig):
        over = {k: getattr(cfg, k) for k in VIT_OPTIONS}
        for k in ("depth", "width", "mlp_dim", "heads"):
            if base.vit is not None and getattr(cfg.dims, k) != getattr(base.vit, k):
                over[k] = getattr(cfg.dims, k)
    if spec.resnet is not None and base.resnet is not None and spec.resnet.layers != base.resnet.layers:
        over["resnet_layers"] = list(spec.resnet.layers)
    over["head_bias_init"] = float(cfg.head_bias_init)
    over["activation_checkpointing"] = bool(cfg.activation_checkpointing)
    img_size = int(vars(model)["img_size"])  # set by create_model (a plain attribute, not state)
    return {"name": spec.name, "num_classes": int(cfg.num_classes), "img_size": img_size, "overrides": over}


def create_from_meta(meta: Mapping[str, Any]) -> nn.Module:
    """Rebuild a model from a `model_meta` header (e.g. read from a vitscale export)."""
    missing = [k for k in ("name", "num_classes", "img_size") if k not in meta]
    if missing:
        raise ValueError(f"model metadata lacks {missing}; got keys {sorted(meta)}")
    over = dict(meta.get("overrides") or {})
    if isinstance(over.get("resnet_layers"), list):
        over["resnet_layers"] = tuple(over["resnet_layers"])
    return create_model(str(meta["name"]), num_classes=int(meta["num_classes"]), img_size=int(meta["img_size"]), **over)
