"""Hybrid ResNet + ViT (Sec. 3.1): patches of size 1x1 taken from a CNN feature map.

The CNN is the official vision_transformer hybrid's ResNet (post-activation GN + weight-std
units, TF "SAME" padding): R50 stages (3, 4, 6, 3) for total stride 32, or (3, 4, 9) with
stage 4 folded into stage 3 for stride 16. Names match timm's hybrid ViT:
``patch_embed.backbone.{stem,stages}...`` and ``patch_embed.proj`` (the 1x1 "embedding" conv).
"""

from __future__ import annotations

from torch import Tensor, nn

from vitscale.models.options import ResNetConfig, ViTConfig
from vitscale.models.resnet import ResNetV2
from vitscale.models.variants import ModelSpec
from vitscale.models.vit import VisionTransformer, lecun_normal_


class HybridEmbed(nn.Module):
    """ResNet feature map (B, C', H/s, W/s) -> 1x1 conv -> tokens (B, N, D)."""

    def __init__(self, backbone: ResNetV2, dim: int, patch_size: int = 1) -> None:
        super().__init__()
        self.backbone = backbone
        self.proj = nn.Conv2d(backbone.num_features, dim, kernel_size=patch_size, stride=patch_size)
        self.stride = backbone.stride * patch_size

    def init_weights(self) -> None:
        """LeCun-normal embedding kernel, zero bias (the backbone inits itself)."""
        lecun_normal_(self.proj.weight)
        if self.proj.bias is not None:
            nn.init.zeros_(self.proj.bias)

    def forward(self, x: Tensor) -> Tensor:
        x = self.backbone.forward_feature_map(x)  # (B, C', h, w)
        return self.proj(x).flatten(2).transpose(1, 2)  # (B, h*w, D)


def build_hybrid(spec: ModelSpec, cfg: ViTConfig) -> VisionTransformer:
    """A VisionTransformer whose patch embedding is `spec`'s ResNet backbone + 1x1 conv."""
    if spec.family != "hybrid" or spec.resnet is None:
        raise ValueError(f"{spec.name} is not a hybrid model")
    backbone = ResNetV2(
        ResNetConfig(
            dims=spec.resnet,
            num_classes=0,
            in_chans=cfg.in_chans,
            activation_checkpointing=cfg.activation_checkpointing,
        )
    )
    embed = HybridEmbed(backbone, cfg.dims.width, patch_size=cfg.patch_size)
    return VisionTransformer(cfg, patch_embed=embed)
