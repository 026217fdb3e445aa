"""The models' build options: what `create_model`'s keyword arguments are, validated on construction.

This is the one list of model options. `ViTConfig` and `ResNetConfig` are the configs the
modules are built from; every field that is not structural (dims, patch size, grid, classes,
channels) is an option a pipeline's `model:` section may set, and `OPTIONS` is derived from
them, so adding an option is adding a field here and using it in `vit.py` / `resnet.py`.
Pure dataclasses, no torch: the FLOPs counter checks its arguments against the same list.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from vitscale.config.checks import ConfigError, check, finite, non_negative_int, one_of, positive_int, probability
from vitscale.models.variants import ResNetDims, ViTDims

CLASSIFIERS: tuple[str, ...] = ("token", "gap")
POS_EMBS: tuple[str, ...] = ("learn_1d", "learn_2d", "none", "relative")
POS_EMB_PLACEMENTS: tuple[str, ...] = ("input", "every_layer", "every_layer_shared")


def _bool(value: object, key: str) -> None:
    check(isinstance(value, bool), key, f"must be true or false, got {value!r}")


def _bias(value: object, key: str) -> None:
    check(isinstance(value, (int, float)) and not isinstance(value, bool), key, f"must be a float, got {value!r}")
    finite(value, key)  # type: ignore[arg-type]


@dataclass(frozen=True)
class ViTConfig:
    """Everything a VisionTransformer is built from; validated on construction."""

    dims: ViTDims
    """Encoder depth / width / MLP width / heads."""
    patch_size: int
    """Patch size on the embedding's input (pixels; 1 for hybrids, on the CNN feature map)."""
    grid: tuple[int, int]
    """Patch grid (rows, cols) the position embeddings are built for."""
    num_classes: int
    """Classifier outputs."""
    in_chans: int = 3
    """Input image channels."""
    classifier: str = "token"
    """"token": zero-init class token; "gap": global average pool of patch tokens (App. D.3)."""
    representation_size: int | None = None
    """Width of the pre-logits layer (Linear + tanh) used in pre-training; None = absent."""
    pos_emb: str = "learn_1d"
    """"learn_1d" | "learn_2d" | "none" | "relative" (App. D.4)."""
    pos_emb_placement: str = "input"
    """"input" | "every_layer" (one per layer) | "every_layer_shared" (one, added before every layer)."""
    dropout: float = 0.0
    """Dropout after every dense layer except qkv, and after the position-embedding add."""
    attention_dropout: float = 0.0
    """Dropout on attention probabilities."""
    head_bias_init: float = 0.0
    """Initial classifier bias (e.g. -6.9 for sigmoid multi-label heads)."""
    activation_checkpointing: bool = False
    """Recompute each block in backward (torch.utils.checkpoint, use_reentrant=False)."""

    def __post_init__(self) -> None:
        for key in ("depth", "width", "mlp_dim", "heads"):
            positive_int(getattr(self.dims, key), key)
        check(self.dims.width % self.dims.heads == 0, "width",
              f"width={self.dims.width} must be divisible by heads={self.dims.heads}")
        positive_int(self.patch_size, "patch_size")
        positive_int(self.grid[0], "grid rows")
        positive_int(self.grid[1], "grid cols")
        non_negative_int(self.num_classes, "num_classes")  # 0: no classifier (an encoder)
        positive_int(self.in_chans, "in_chans")
        one_of(self.classifier, CLASSIFIERS, "classifier")
        if self.representation_size is not None:
            positive_int(self.representation_size, "representation_size")
        one_of(self.pos_emb, POS_EMBS, "pos_emb")
        one_of(self.pos_emb_placement, POS_EMB_PLACEMENTS, "pos_emb_placement")
        check(not (self.pos_emb in ("none", "relative") and self.pos_emb_placement != "input"), "pos_emb_placement",
              f"pos_emb_placement={self.pos_emb_placement!r} applies to additive embeddings "
              f"(learn_1d, learn_2d) only, not pos_emb={self.pos_emb!r}; use 'input'")
        check(not (self.pos_emb == "learn_2d" and self.dims.width % 2 != 0), "pos_emb",
              f"pos_emb='learn_2d' needs an even width, got {self.dims.width}")
        probability(self.dropout, "dropout")
        probability(self.attention_dropout, "attention_dropout")
        _bias(self.head_bias_init, "head_bias_init")
        _bool(self.activation_checkpointing, "activation_checkpointing")

    @property
    def num_prefix_tokens(self) -> int:
        """1 with a class token, 0 for GAP."""
        return 1 if self.classifier == "token" else 0

    @property
    def seq_len(self) -> int:
        """Tokens through the encoder: prefix + rows * cols."""
        return self.num_prefix_tokens + self.grid[0] * self.grid[1]


@dataclass(frozen=True)
class ResNetConfig:
    """What a ResNetV2 is built from; validated on construction."""

    dims: ResNetDims
    """Units per stage, width multiplier, unit type."""
    num_classes: int
    """Classifier outputs; 0 = backbone only (no final norm for post-act, no head)."""
    in_chans: int = 3
    """Input image channels."""
    head_bias_init: float = 0.0
    """Initial classifier bias."""
    activation_checkpointing: bool = False
    """Recompute each unit in backward (torch.utils.checkpoint, use_reentrant=False)."""

    def __post_init__(self) -> None:
        check(isinstance(self.num_classes, int) and not isinstance(self.num_classes, bool) and self.num_classes >= 0,
              "num_classes", f"must be an int >= 0, got {self.num_classes!r}")
        check(bool(self.dims.layers) and all(n >= 1 for n in self.dims.layers), "resnet_layers",
              f"resnet layers must be positive unit counts, got {self.dims.layers!r}")
        _bias(self.head_bias_init, "head_bias_init")
        _bool(self.activation_checkpointing, "activation_checkpointing")


_STRUCTURAL = frozenset({"dims", "patch_size", "grid", "num_classes", "in_chans"})
VIT_OPTIONS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(ViTConfig) if f.name not in _STRUCTURAL)
"""Options of ViTs (and of the ViT part of hybrids)."""
RESNET_OPTIONS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(ResNetConfig) if f.name not in _STRUCTURAL)
"""Options of BiT ResNets (and of the CNN part of hybrids)."""
DIM_OPTIONS: tuple[str, ...] = ("depth", "width", "mlp_dim", "heads", "resnet_layers")
"""Overrides of the variant table's dims (`variants.with_overrides`): tiny test and quickstart models."""
OPTIONS: tuple[str, ...] = tuple(dict.fromkeys(VIT_OPTIONS + RESNET_OPTIONS + DIM_OPTIONS))
"""Every keyword `create_model` accepts besides name, num_classes and img_size."""


def check_option_names(options: dict[str, object] | set[str] | tuple[str, ...], family: str, name: str) -> None:
    """Unknown options, or ViT-only options on a ResNet, are a `ConfigError` naming the option."""
    for key in sorted(options):
        if key not in OPTIONS:
            raise ConfigError(key, f"unknown override for model {name}; model options: {', '.join(OPTIONS)}")
        if family == "resnet" and key in VIT_OPTIONS and key not in RESNET_OPTIONS:
            raise ConfigError(key, f"ViT options do not apply to ResNet model {name}")
