"""Model zoo: ViT (Ti/S/B/L/H, any patch size), BiT ResNet-v2, hybrids; weights files in and out.

    from vitscale.models import create_model, load_pretrained
    model = create_model("ViT-B/16", num_classes=1000, img_size=224)
    model = create_model("vit_base_patch16_384", num_classes=10)  # timm's names too (img_size 384)

Names are imported lazily (PEP 562) so `vitscale.models.variants` -- pure data, no torch --
can be imported by the FLOPs counter and config validation without loading torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS: dict[str, str] = {
    "LoadReport": "weights_files",
    "create_from_weights": "weights_files",
    "export_npz": "weights_files",
    "export_state_dict": "weights_files",
    "load_pretrained": "weights_files",
    "read_weights": "weights_files",
    "timm_state_dict": "weights_files",
    "create_from_meta": "factory",
    "create_model": "factory",
    "OPTIONS": "options",
    "REPEATED_UNITS": "factory",
    "ModelConfig": "config",
    "model_meta": "factory",
    "resample_posemb": "posemb",
    "ResNetConfig": "options",
    "ResNetV2": "resnet",
    "ModelSpec": "variants",
    "ResNetDims": "variants",
    "ViTDims": "variants",
    "model_names": "variants",
    "parse_model_name": "variants",
    "timm_alias": "variants",
    "ViTConfig": "options",
    "VisionTransformer": "vit",
}
__all__ = [
    "OPTIONS",
    "REPEATED_UNITS",
    "LoadReport",
    "ModelConfig",
    "ModelSpec",
    "ResNetConfig",
    "ResNetDims",
    "ResNetV2",
    "ViTConfig",
    "ViTDims",
    "VisionTransformer",
    "create_from_meta",
    "create_from_weights",
    "create_model",
    "export_npz",
    "export_state_dict",
    "load_pretrained",
    "model_meta",
    "model_names",
    "parse_model_name",
    "read_weights",
    "resample_posemb",
    "timm_alias",
    "timm_state_dict",
]

if TYPE_CHECKING:
    from vitscale.models.config import ModelConfig
    from vitscale.models.factory import REPEATED_UNITS, create_from_meta, create_model, model_meta
    from vitscale.models.options import OPTIONS, ResNetConfig, ViTConfig
    from vitscale.models.posemb import resample_posemb
    from vitscale.models.resnet import ResNetV2
    from vitscale.models.variants import (
        ModelSpec,
        ResNetDims,
        ViTDims,
        model_names,
        parse_model_name,
        timm_alias,
    )
    from vitscale.models.vit import VisionTransformer
    from vitscale.models.weights_files import (
        LoadReport,
        create_from_weights,
        export_npz,
        export_state_dict,
        load_pretrained,
        read_weights,
        timm_state_dict,
    )


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'vitscale.models' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"vitscale.models.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
