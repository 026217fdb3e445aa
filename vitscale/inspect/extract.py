"""What the analyses read from a model: embedding filters, the position table, attention on images.

Each reader returns plain numpy arrays (the inputs of :mod:`vitscale.inspect.analyses`) or, where
the model has no such thing, None and a sentence saying why, which the output carries as a note.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from vitscale.config.errors import UserError
from vitscale.models.posemb import posemb_2d
from vitscale.models.vit import PatchEmbed, VisionTransformer


def resnet_refusal(name: str) -> UserError:
    """The one-line error for a model without attention (a BiT ResNet)."""
    return UserError(f"{name} is a ResNet: inspect analyses ViTs and hybrids (attention, position "
                      "embeddings, patch embedding)")


def check_inspectable(model: nn.Module) -> VisionTransformer:
    """The model as a ViT (plain or hybrid); `resnet_refusal` for anything else."""
    if not isinstance(model, VisionTransformer):
        raise resnet_refusal(getattr(getattr(model, "spec", None), "name", type(model).__name__))
    return model


def patch_filters(model: VisionTransformer) -> tuple[np.ndarray | None, str | None]:
    """((D, C, P, P) linear embedding filters, None), or (None, why there are none: a hybrid)."""
    if not isinstance(model.patch_embed, PatchEmbed):
        return None, ("filter components skipped: a hybrid embeds ResNet features with a 1x1 conv, "
                      "not pixel patches, so Figure 7 (left) does not apply")
    return model.patch_embed.proj.weight.detach().float().cpu().numpy(), None


def position_table(model: VisionTransformer) -> tuple[np.ndarray | None, str | None]:
    """((N, D) absolute position embeddings of the patch tokens, note or None), or (None, why not).

    1-D tables drop the class token's row; 2-D (row + column) tables are expanded to one
    embedding per patch. A model with one table per layer is shown with its first layer's table
    (the note says so). Relative-position and position-free models have no absolute table.
    """
    prefix = model.num_prefix_tokens
    if model.pos_embed is not None:
        tables = model.pos_embed.detach().float().cpu()  # (layers or 1, T, D)
        table = tables[0, prefix:]
    elif model.pos_embed_row is not None and model.pos_embed_col is not None:
        tables = model.pos_embed_row.detach().float().cpu()
        table = posemb_2d(tables[:1], model.pos_embed_col.detach().float().cpu()[:1])[0]  # (N, D)
    else:
        return None, ("position-embedding similarity skipped: the model has no absolute position "
                      "embeddings (relative or none)")
    note = ("position embeddings: one table per layer; the first layer's is shown"
            if tables.shape[0] > 1 else None)
    return table.numpy(), note


@dataclass
class AttentionStats:
    """What the attention analyses keep from the images, reduced layer by layer as they come.

    The full (B, heads, T, T) maps of every layer would be large for big models; the distance per
    head and the head-averaged matrix (the rollout's input) are all the figures need.
    """

    distance: np.ndarray
    """(layers, B, heads) mean attention distance in pixels per image."""
    head_mean: list[np.ndarray]
    """Per layer (B, T, T) attention averaged over heads."""


def images_per_pass(model: VisionTransformer, budget_bytes: int = 2**30, most: int = 16) -> int:
    """Images per forward pass so that every layer's (B, heads, T, T) float32 maps fit in `budget_bytes`.

    `forward_attention` hands back all layers at once: 16 images of ViT-L/16 at 384 px would be 8 GiB.
    """
    t = model.cfg.seq_len
    per_image = len(model.blocks) * model.cfg.dims.heads * t * t * 4
    return max(1, min(most, budget_bytes // per_image))


@torch.no_grad()
def attention_stats(model: VisionTransformer, batches: Iterable[torch.Tensor], device: torch.device) -> AttentionStats:
    """Run the images (batches of (B, C, H, W) normalised floats) and reduce their attention."""
    from vitscale.inspect.analyses import mean_attention_distance

    model = model.to(device).eval()
    grid, stride, prefix = model.cfg.grid, int(model.patch_embed.stride), model.num_prefix_tokens
    distances: list[np.ndarray] = []  # per batch (layers, B, heads)
    head_means: list[list[np.ndarray]] = []  # per batch, per layer (B, T, T)
    for images in batches:
        _, maps = model.forward_attention(images.to(device))
        probs = [m.float().cpu().numpy() for m in maps]
        distances.append(np.stack([mean_attention_distance(p, grid, stride, prefix) for p in probs]))
        head_means.append([p.mean(axis=1) for p in probs])
    if not distances:
        raise UserError("no images to inspect")
    layers = len(head_means[0])
    return AttentionStats(distance=np.concatenate(distances, axis=1),
                          head_mean=[np.concatenate([b[i] for b in head_means]) for i in range(layers)])
