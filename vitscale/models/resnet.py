"""BiT ResNet-v2 (GroupNorm + weight-standardised convs), timm `resnetv2` parameter names.

Two unit types share this file:

- pre-activation bottlenecks (BiT, the paper's ResNet baselines): GN+ReLU before each conv,
  the projection shortcut taken from the first pre-activation; BiT stem = 7x7/2 conv (pad 3),
  zero pad 1, 3x3/2 max-pool; head = GN+ReLU, global average pool, zero-init linear.
- post-activation bottlenecks with TF "SAME" padding and GN+ReLU in the stem (the official
  vision_transformer hybrid's ResNet, `models_resnet.py`), used as the hybrid's backbone.

Names: ``stem.conv``, ``stem.norm`` (post-act only), ``stages.{i}.blocks.{j}.{conv1,norm1,conv2,
norm2,conv3,norm3}``, ``stages.{i}.blocks.{j}.downsample.conv`` (+ ``.norm`` post-act),
``norm`` (pre-act final GN), ``head`` (a Linear; timm's 1x1-conv ``head.fc`` maps onto it).
"""

from __future__ import annotations

import dataclasses
from typing import cast

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import Tensor, nn

from vitscale.config.checks import positive_int
from vitscale.models.layers import has_values
from vitscale.models.options import ResNetConfig
from vitscale.models.vit import zero_head

GN_GROUPS = 32


def same_pad_amounts(size: int, kernel: int, stride: int, dilation: int = 1) -> tuple[int, int]:
    """TF "SAME" padding (before, after) for one axis: output = ceil(size / stride)."""
    out = -(-size // stride)
    total = max((out - 1) * stride + (kernel - 1) * dilation + 1 - size, 0)
    return total // 2, total - total // 2


class StdConv2d(nn.Conv2d):
    """Conv2d with weight standardisation (per output filter: zero mean, unit variance).

    Args:
        same_pad: TF "SAME" padding computed from the input size (extra pixel after, like
            the Flax/TF originals); False = symmetric PyTorch padding of kernel // 2.
    """

    def __init__(
        self, in_ch: int, out_ch: int, kernel: int, stride: int = 1, same_pad: bool = False, eps: float = 1e-8
    ) -> None:
        super().__init__(in_ch, out_ch, kernel, stride=stride, padding=0 if same_pad else kernel // 2, bias=False)
        self.same_pad = same_pad
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        w = self.weight
        var, mean = torch.var_mean(w, dim=(1, 2, 3), keepdim=True, unbiased=False)
        w = (w - mean) / torch.sqrt(var + self.eps)
        if self.same_pad:
            ph = same_pad_amounts(x.shape[-2], self.kernel_size[0], self.stride[0])
            pw = same_pad_amounts(x.shape[-1], self.kernel_size[1], self.stride[1])
            x = F.pad(x, (*pw, *ph))
        return F.conv2d(x, w, None, self.stride, self.padding)


class GroupNormAct(nn.GroupNorm):
    """GroupNorm(32) optionally followed by ReLU (timm's GroupNormAct; params weight/bias)."""

    def __init__(self, channels: int, eps: float, act: bool = True) -> None:
        super().__init__(GN_GROUPS, channels, eps=eps)
        self.act = act

    def forward(self, x: Tensor) -> Tensor:
        x = super().forward(x)
        return F.relu(x) if self.act else x


class DownsampleConv(nn.Module):
    """Projection shortcut: 1x1 strided conv (+ GN without activation in post-act units)."""

    def __init__(self, in_ch: int, out_ch: int, stride: int, preact: bool, eps: float) -> None:
        super().__init__()
        self.conv = StdConv2d(in_ch, out_ch, 1, stride=stride, same_pad=not preact)
        self.norm = nn.Identity() if preact else GroupNormAct(out_ch, eps, act=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.norm(self.conv(x))


class PreActBottleneck(nn.Module):
    """BiT unit: x + conv3(GN(conv2(GN(conv1(GN(x)))))) with the stride in the 3x3 conv."""

    def __init__(self, in_ch: int, out_ch: int, stride: int, eps: float) -> None:
        super().__init__()
        mid = out_ch // 4
        self.norm1 = GroupNormAct(in_ch, eps)
        self.conv1 = StdConv2d(in_ch, mid, 1)
        self.norm2 = GroupNormAct(mid, eps)
        self.conv2 = StdConv2d(mid, mid, 3, stride=stride)
        self.norm3 = GroupNormAct(mid, eps)
        self.conv3 = StdConv2d(mid, out_ch, 1)
        needs_proj = stride != 1 or in_ch != out_ch
        self.downsample = DownsampleConv(in_ch, out_ch, stride, True, eps) if needs_proj else None

    def forward(self, x: Tensor) -> Tensor:
        x_pre = self.norm1(x)
        shortcut = self.downsample(x_pre) if self.downsample is not None else x
        x = self.conv1(x_pre)
        x = self.conv2(self.norm2(x))
        x = self.conv3(self.norm3(x))
        return x + shortcut


class Bottleneck(nn.Module):
    """Official-hybrid unit: relu(shortcut + GN3(conv3(relu GN2(conv2(relu GN1(conv1 x))))))."""

    def __init__(self, in_ch: int, out_ch: int, stride: int, eps: float) -> None:
        super().__init__()
        mid = out_ch // 4
        self.conv1 = StdConv2d(in_ch, mid, 1, same_pad=True)
        self.norm1 = GroupNormAct(mid, eps)
        self.conv2 = StdConv2d(mid, mid, 3, stride=stride, same_pad=True)
        self.norm2 = GroupNormAct(mid, eps)
        self.conv3 = StdConv2d(mid, out_ch, 1, same_pad=True)
        self.norm3 = GroupNormAct(out_ch, eps, act=False)
        needs_proj = stride != 1 or in_ch != out_ch
        self.downsample = DownsampleConv(in_ch, out_ch, stride, False, eps) if needs_proj else None

    def forward(self, x: Tensor) -> Tensor:
        shortcut = self.downsample(x) if self.downsample is not None else x
        y = self.conv2(self.norm1(self.conv1(x)))
        y = self.norm3(self.conv3(self.norm2(y)))
        return F.relu(y + shortcut)


class ResNetStage(nn.Module):
    """`depth` units; the first one changes width and stride."""

    def __init__(self, in_ch: int, out_ch: int, stride: int, depth: int, preact: bool, eps: float) -> None:
        super().__init__()
        unit = PreActBottleneck if preact else Bottleneck
        self.blocks = nn.ModuleList(
            unit(in_ch if i == 0 else out_ch, out_ch, stride if i == 0 else 1, eps) for i in range(depth)
        )


class Stem(nn.Module):
    """Root: 7x7/2 std-conv, [GN+ReLU if post-act], 3x3/2 max-pool (total stride 4)."""

    def __init__(self, in_ch: int, width: int, preact: bool, eps: float) -> None:
        super().__init__()
        self.preact = preact
        self.conv = StdConv2d(in_ch, width, 7, stride=2, same_pad=not preact)
        self.norm = nn.Identity() if preact else GroupNormAct(width, eps)

    def forward(self, x: Tensor) -> Tensor:
        x = self.norm(self.conv(x))
        if self.preact:
            # BiT: constant zero pad of 1 then an unpadded 3x3/2 pool.
            return F.max_pool2d(F.pad(x, (1, 1, 1, 1)), kernel_size=3, stride=2)
        ph = same_pad_amounts(x.shape[-2], 3, 2)
        pw = same_pad_amounts(x.shape[-1], 3, 2)
        return F.max_pool2d(F.pad(x, (*pw, *ph), value=float("-inf")), kernel_size=3, stride=2)


class ResNetV2(nn.Module):
    """BiT ResNet classifier (`num_classes > 0`) or feature backbone (`num_classes == 0`)."""

    def __init__(self, cfg: ResNetConfig) -> None:
        super().__init__()
        self.cfg = cfg
        dims = cfg.dims
        # GN eps: PyTorch/BiT default for pre-act, Flax default (1e-6) for the official hybrid.
        eps = 1e-5 if dims.preact else 1e-6
        self.activation_checkpointing = cfg.activation_checkpointing
        self.stem = Stem(cfg.in_chans, dims.stem_width, dims.preact, eps)
        in_ch = dims.stem_width
        stages = []
        for i, (depth, out_ch) in enumerate(zip(dims.layers, dims.stage_widths)):
            stages.append(ResNetStage(in_ch, out_ch, 1 if i == 0 else 2, depth, dims.preact, eps))
            in_ch = out_ch
        self.stages = nn.ModuleList(stages)
        self.num_features = in_ch
        self.stride = dims.stride
        self.norm = GroupNormAct(in_ch, eps) if dims.preact else nn.Identity()
        self.head = zero_head(in_ch, cfg.num_classes, cfg.head_bias_init) if cfg.num_classes else None
        if has_values(self):
            self.init_weights()

    @property
    def num_classes(self) -> int:
        """Current classifier outputs (0 for a backbone)."""
        return self.cfg.num_classes

    def init_weights(self) -> None:
        """He-normal convs (scale is moot under weight standardisation); zero last GN in post-act units."""
        for m in self.modules():
            if isinstance(m, StdConv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            if isinstance(m, Bottleneck):
                nn.init.zeros_(m.norm3.weight)  # official: gn3 scale_init=zeros

    def no_weight_decay(self) -> set[str]:
        """No named exemptions (the optimiser skips every ndim <= 1 param anyway)."""
        return set()

    def reset_head(self, num_classes: int, bias_init: float = 0.0) -> None:
        """Replace the classifier with a zero-init C x K linear layer."""
        positive_int(num_classes, "num_classes")
        like = self.stem.conv.weight
        self.head = zero_head(self.num_features, num_classes, bias_init, like=like)
        self.cfg = dataclasses.replace(self.cfg, num_classes=num_classes, head_bias_init=float(bias_init))

    def forward_feature_map(self, x: Tensor) -> Tensor:
        """(B, C, H, W) -> (B, C', H/stride, W/stride) (after the final GN+ReLU for pre-act)."""
        if x.dim() != 4 or x.shape[1] != self.cfg.in_chans:
            raise ValueError(f"expected input (B, {self.cfg.in_chans}, H, W), got {tuple(x.shape)}")
        x = self.stem(x)
        ckpt = self.activation_checkpointing and self.training and torch.is_grad_enabled()
        for stage in cast("list[ResNetStage]", list(self.stages)):
            for blk in stage.blocks:
                x = torch.utils.checkpoint.checkpoint(blk, x, use_reentrant=False) if ckpt else blk(x)
        return self.norm(x)

    def forward_features(self, x: Tensor) -> Tensor:
        """(B, C, H, W) -> (B, C') global-average-pooled representation."""
        return self.forward_feature_map(x).mean(dim=(2, 3))

    def forward(self, x: Tensor) -> Tensor:
        """(B, C, H, W) -> logits (B, num_classes)."""
        if self.head is None:
            raise ValueError("this ResNetV2 is a backbone (num_classes=0); call reset_head() first")
        return self.head(self.forward_features(x))
