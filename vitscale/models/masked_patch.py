"""Masked patch prediction (Sec. 4.6, App. B.1.2): the encoder predicts what its corrupted patches held.

A ViT's patch embeddings are corrupted (which ones: `data/corruption.py`, a pure function of the seed,
the epoch and the sample's key): masked ones take a learnable ``[mask]`` embedding, swapped ones the
embedding of another patch of the image, kept ones stay. The class token and the position embeddings
are added after, as for any image, and a linear layer on each corrupted position's output token predicts
the patch's target. The paper's targets, each a named choice (`TARGETS`):

- ``mean_colour`` (the paper's headline choice): the patch's mean colour at 3 bits per channel, one of
  512 classes, softmax cross-entropy;
- ``downsized_4x4``: the patch downsized to 4 x 4, each of the 16 colours at 3 bits: 16 parallel
  512-way softmax predictions (their cross-entropies averaged);
- ``pixels``: the whole patch (P x P x 3 values in the model's [-1, 1] input scale) by L2 regression
  (mean squared error).

Targets are computed on the device from the same uint8 pixels the model sees (after the crop and flip).
The prediction head and the [mask] embedding exist only for pre-training: transfer takes the encoder
(`MaskedPatchPredictor.encoder`, a `VisionTransformer` without a classifier), whose fine-tuning head is
zero-initialised like any other (Sec. 3.2).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vitscale.models.layers import has_values
from vitscale.models.vit import VisionTransformer, lecun_normal_

__all__ = ["TARGETS", "MaskedPatchPredictor", "PatchTarget", "colour_classes", "patch_targets"]

TARGETS = ("mean_colour", "downsized_4x4", "pixels")


@dataclass(frozen=True)
class PatchTarget:
    """What is predicted for each corrupted patch of `patch` x `patch` pixels."""

    name: str = "mean_colour"
    """One of `TARGETS`."""
    patch: int = 16
    """Pixels per patch side (the model's token stride)."""
    bits: int = 3
    """Bits per colour channel of the colour targets (3: 8 levels, 512 colours)."""

    def __post_init__(self) -> None:
        if self.name not in TARGETS:
            raise ValueError(f"target must be one of {list(TARGETS)}, got {self.name!r}")
        if self.name == "downsized_4x4" and self.patch % 4:
            raise ValueError(f"downsized_4x4 needs a patch side divisible by 4, got {self.patch}")
        if not 1 <= self.bits <= 4:  # train/config.py's MaskedPatchConfig says why
            raise ValueError(f"bits must be in [1, 4], got {self.bits}")

    @property
    def colours(self) -> int:
        """Classes of one colour: 2^(3 x bits) (512 at 3 bits)."""
        return 2 ** (3 * self.bits)

    @property
    def parts(self) -> int:
        """Predictions per patch: 1 mean colour, 16 colours of the 4 x 4 downsizing, P x P x 3 pixel values."""
        return {"mean_colour": 1, "downsized_4x4": 16, "pixels": self.patch * self.patch * 3}[self.name]

    @property
    def outputs(self) -> int:
        """Width of the prediction head per corrupted patch."""
        return self.parts if self.name == "pixels" else self.parts * self.colours

    @property
    def classifies(self) -> bool:
        """Softmax targets (colours), not a regression."""
        return self.name != "pixels"


def colour_classes(pixels: Tensor, bits: int) -> Tensor:
    """Colours (..., 3, ...) with channel axis 1, values in [0, 255] -> class ids r * 2^2b + g * 2^b + b.

    Each channel is quantised to ``bits`` bits by ``floor(v * 2^bits / 256)``: 8 equal bins of 32 levels at
    3 bits, the paper's 512 colours.
    """
    levels = 2 ** bits
    q = (pixels.float() * (levels / 256.0)).floor().clamp_(0, levels - 1).long()  # (B, 3, ...)
    return (q[:, 0] * levels + q[:, 1]) * levels + q[:, 2]


def patch_targets(images: Tensor, target: PatchTarget) -> Tensor:
    """Every patch's target, row-major over the grid, from the uint8 images (B, 3, H, W) the model sees.

    Returns int64 (B, N) for ``mean_colour``, int64 (B, N, 16) for ``downsized_4x4``, float32 (B, N, P*P*3)
    in [-1, 1] for ``pixels`` (the model's input scale: mean 0.5, std 0.5).
    """
    p = target.patch
    b, c, h, w = images.shape
    if target.name == "pixels":
        x = images.float() / 127.5 - 1.0  # (B, 3, H, W)
        x = x.reshape(b, c, h // p, p, w // p, p).permute(0, 2, 4, 3, 5, 1)  # (B, gh, gw, P, P, 3)
        return x.reshape(b, (h // p) * (w // p), p * p * c)
    cell = p if target.name == "mean_colour" else p // 4
    means = F.avg_pool2d(images.float(), cell)  # (B, 3, H/cell, W/cell): each cell's mean colour
    classes = colour_classes(means, target.bits)  # (B, H/cell, W/cell)
    if target.name == "mean_colour":
        return classes.flatten(1)  # (B, N)
    gh, gw = h // p, w // p
    cells = classes.reshape(b, gh, 4, gw, 4).permute(0, 1, 3, 2, 4)  # (B, gh, gw, 4, 4)
    return cells.reshape(b, gh * gw, 16)


class MaskedPatchPredictor(nn.Module):
    """A ViT encoder, the learnable [mask] embedding and the per-patch prediction head.

    `forward(x, positions, sources)` -> predictions (B, corrupted, `target.outputs`) at `positions`; the
    plan's counts come from the plan itself (`masked` first, then `swapped` = `sources.shape[1]`, then kept).

    Args:
        encoder: a `VisionTransformer` built without a classifier (``num_classes=0``) and without
            pre-logits; its ``fc_norm`` (GAP models) normalises each output token before the head.
        target: what the head predicts.
        masked: corrupted positions (of each row's plan) that take the [mask] embedding.
    """

    def __init__(self, encoder: VisionTransformer, target: PatchTarget, masked: int) -> None:
        super().__init__()
        if encoder.num_classes != 0 or not isinstance(encoder.pre_logits, nn.Identity):
            raise ValueError("the masked patch encoder has no classifier and no pre-logits "
                             "(build it with num_classes=0 and representation_size=None)")
        self.encoder = encoder
        self.encoder.head = nn.Identity()  # type: ignore[assignment]  # the 0-class head has no weights: none left unused in training
        self.target = target
        self.masked = masked
        width = encoder.cfg.dims.width
        # [mask] starts small and random, as BERT's embeddings do, and is learned from there.
        self.mask_token = nn.Parameter(torch.zeros(width))
        self.head = nn.Linear(width, target.outputs)
        if has_values(self):
            nn.init.normal_(self.mask_token, std=0.02)
            lecun_normal_(self.head.weight)
            nn.init.zeros_(self.head.bias)

    def corrupt(self, tokens: Tensor, positions: Tensor, sources: Tensor) -> Tensor:
        """Patch embeddings (B, N, D) with the plan applied: [mask] at the first `masked` positions, the
        embedding of `sources` at the next ones, the rest as they are."""
        d = tokens.shape[-1]
        swapped = sources.shape[1]
        take = tokens.gather(1, sources.unsqueeze(-1).expand(-1, -1, d))  # (B, swapped, D), before any change
        at_mask = positions[:, : self.masked].unsqueeze(-1).expand(-1, -1, d)  # (B, masked, D)
        at_swap = positions[:, self.masked: self.masked + swapped].unsqueeze(-1).expand(-1, -1, d)
        mask = self.mask_token.to(tokens.dtype).expand(tokens.shape[0], self.masked, d)
        return tokens.scatter(1, at_mask, mask).scatter(1, at_swap, take)

    def forward(self, x: Tensor, positions: Tensor, sources: Tensor) -> Tensor:
        enc = self.encoder
        tokens = self.corrupt(enc.embed_patches(x), positions, sources)
        out = enc.encode_patches(tokens)[:, enc.num_prefix_tokens:]  # (B, N, D): the patches' output tokens
        picked = out.gather(1, positions.unsqueeze(-1).expand(-1, -1, out.shape[-1]))  # (B, corrupted, D)
        return self.head(enc.fc_norm(picked))  # (B, corrupted, outputs)

    def loss(self, predictions: Tensor, targets: Tensor, positions: Tensor) -> Tensor:
        """Mean loss over the batch's corrupted patches (float32): `targets` are `patch_targets`' of the batch."""
        picked = _at(targets, positions)  # (B, corrupted[, parts])
        z = predictions.float()
        if not self.target.classifies:
            return F.mse_loss(z, picked.float())
        z = z.reshape(*z.shape[:2], self.target.parts, self.target.colours)  # (B, corrupted, parts, colours)
        return F.cross_entropy(z.flatten(0, 2), picked.reshape(-1))

    def hits(self, predictions: Tensor, targets: Tensor, positions: Tensor) -> Tensor:
        """Per corrupted patch, whether the predicted colour is the target (every part of it): bool (B, corrupted).
        Regression targets have no hit; all False."""
        picked = _at(targets, positions)
        if not self.target.classifies:
            return torch.zeros(positions.shape, dtype=torch.bool, device=positions.device)
        z = predictions.reshape(*predictions.shape[:2], self.target.parts, self.target.colours)
        return (z.argmax(-1) == picked.reshape(z.shape[:3])).all(-1)


def _at(targets: Tensor, positions: Tensor) -> Tensor:
    """`targets` (B, N[, parts]) at `positions` (B, corrupted)."""
    if targets.dim() == 2:
        return targets.gather(1, positions)
    return targets.gather(1, positions.unsqueeze(-1).expand(-1, -1, targets.shape[-1]))
