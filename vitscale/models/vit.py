"""Vision Transformer for one device (Dosovitskiy et al., Sec. 3.1 and App. D), timm naming.

Parameter names follow timm's VisionTransformer so timm state dicts load 1:1:
``patch_embed.proj``, ``cls_token``, ``pos_embed``, ``blocks.{i}.{norm1,attn.qkv,attn.proj,
norm2,mlp.fc1,mlp.fc2}``, ``norm`` (class-token models) / ``fc_norm`` (GAP models, LayerNorm
after pooling, as timm does), ``pre_logits.fc`` (optional tanh representation layer, timm's
pre-2022 name) and ``head``. Variants without a timm counterpart add ``pos_embed_row`` /
``pos_embed_col`` (2-D), a leading per-layer axis on the position embeddings
("every_layer"), and ``blocks.{i}.attn.rel_bias`` (relative).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any, cast

import torch
import torch.utils.checkpoint
from torch import Tensor, nn

from vitscale.config.checks import positive_int
from vitscale.models.layers import LN_EPS, Block, has_values
from vitscale.models.options import ViTConfig
from vitscale.models.posemb import posemb_2d


def lecun_normal_(weight: Tensor) -> None:
    """Flax's default kernel init: truncated normal (±2σ), variance 1/fan_in."""
    fan_in = weight[0].numel()
    std = math.sqrt(1.0 / fan_in) / 0.87962566103423978  # undo the truncation's variance loss
    nn.init.trunc_normal_(weight, std=std, a=-2 * std, b=2 * std)


class PatchEmbed(nn.Module):
    """Non-overlapping P x P patches -> D dims: conv with kernel = stride = P ("VALID")."""

    def __init__(self, in_chans: int, dim: int, patch_size: int) -> None:
        super().__init__()
        self.stride = patch_size
        self.proj = nn.Conv2d(in_chans, dim, kernel_size=patch_size, stride=patch_size)

    def init_weights(self) -> None:
        """LeCun-normal kernel, zero bias (official Flax conv)."""
        lecun_normal_(self.proj.weight)
        if self.proj.bias is not None:
            nn.init.zeros_(self.proj.bias)

    def forward(self, x: Tensor) -> Tensor:  # (B, C, H, W) -> (B, N, D), N row-major
        return self.proj(x).flatten(2).transpose(1, 2)


class PreLogits(nn.Module):
    """The pre-training head's hidden layer: Linear + tanh (named ``pre_logits.fc``)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, hidden)
        self.act = nn.Tanh()

    def forward(self, x: Tensor) -> Tensor:
        return self.act(self.fc(x))


def zero_head(in_features: int, num_classes: int, bias_init: float, like: Tensor | None = None) -> nn.Linear:
    """A D x K linear classifier with zero weights and constant bias (paper's fine-tuning head); K = 0: none."""
    kw: dict[str, Any] = {} if like is None else {"device": like.device, "dtype": like.dtype}
    with warnings.catch_warnings():  # 0 classes (an encoder): torch warns that initialising nothing does nothing
        warnings.simplefilter("ignore", UserWarning)
        head = nn.Linear(in_features, num_classes, **kw)
    nn.init.zeros_(head.weight)
    nn.init.constant_(head.bias, float(bias_init))
    return head


class VisionTransformer(nn.Module):
    """ViT classifier. `forward(x) -> (B, num_classes)`, `forward_features(x) -> (B, D')`.

    Args:
        cfg: validated `ViTConfig`.
        patch_embed: module mapping (B, C, H, W) -> (B, N, D) with an int ``stride`` attribute
            (pixels per token); None builds a `PatchEmbed` (the hybrid passes its ResNet embed).
    """

    def __init__(self, cfg: ViTConfig, patch_embed: nn.Module | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        d, depth = cfg.dims.width, cfg.dims.depth
        # Any module with a `stride` (pixels per token): PatchEmbed, or the hybrid's ResNet stem + projection.
        self.patch_embed: PatchEmbed | Any = patch_embed if patch_embed is not None else PatchEmbed(
            cfg.in_chans, d, cfg.patch_size)
        self.activation_checkpointing = cfg.activation_checkpointing
        self.cls_token = nn.Parameter(torch.zeros(1, 1, d)) if cfg.classifier == "token" else None
        # Additive embeddings: a leading axis of 1 (input / shared) or depth (one per layer).
        n_tables = depth if cfg.pos_emb_placement == "every_layer" else 1
        self.pos_embed = self.pos_embed_row = self.pos_embed_col = None
        if cfg.pos_emb == "learn_1d":
            self.pos_embed = nn.Parameter(torch.zeros(n_tables, cfg.seq_len, d))
        elif cfg.pos_emb == "learn_2d":
            self.pos_embed_row = nn.Parameter(torch.zeros(n_tables, cfg.grid[0], d // 2))
            self.pos_embed_col = nn.Parameter(torch.zeros(n_tables, cfg.grid[1], d - d // 2))
        self.pos_drop = nn.Dropout(cfg.dropout)
        rel_len = cfg.seq_len if cfg.pos_emb == "relative" else None
        self.blocks = nn.ModuleList(
            Block(d, cfg.dims.heads, cfg.dims.mlp_dim, cfg.dropout, cfg.attention_dropout, rel_len)
            for _ in range(depth)
        )
        # Class token: final LN on all tokens (timm `norm`). GAP: LN after pooling (timm `fc_norm`).
        token = cfg.classifier == "token"
        self.norm = nn.LayerNorm(d, eps=LN_EPS) if token else nn.Identity()
        self.fc_norm = nn.Identity() if token else nn.LayerNorm(d, eps=LN_EPS)
        rep = cfg.representation_size
        self.pre_logits = PreLogits(d, rep) if rep is not None else nn.Identity()
        self.num_features = rep if rep is not None else d
        self.head = zero_head(self.num_features, cfg.num_classes, cfg.head_bias_init)
        if has_values(self):
            self.init_weights()

    @property
    def num_prefix_tokens(self) -> int:
        """1 with a class token, 0 for GAP."""
        return self.cfg.num_prefix_tokens

    @property
    def num_classes(self) -> int:
        """Current classifier outputs."""
        return self.cfg.num_classes

    def init_weights(self) -> None:
        """Official init: zero class token, N(0, 0.02) position embeddings, zero head."""
        init = getattr(self.patch_embed, "init_weights", None)
        if init is not None:
            init()
        for p in (self.pos_embed, self.pos_embed_row, self.pos_embed_col):
            if p is not None:
                nn.init.normal_(p, std=0.02)
        for blk in self._blocks():
            blk.init_weights()
        if isinstance(self.pre_logits, PreLogits):
            lecun_normal_(self.pre_logits.fc.weight)
            nn.init.zeros_(self.pre_logits.fc.bias)

    def no_weight_decay(self) -> set[str]:
        """Parameter names that must not be weight-decayed (tokens, position tables)."""
        tables = {"cls_token", "pos_embed", "pos_embed_row", "pos_embed_col"}
        return {n for n, _ in self.named_parameters() if n in tables or n.endswith("attn.rel_bias")}

    def reset_head(self, num_classes: int, bias_init: float = 0.0) -> None:
        """Fine-tuning head: drop pre-logits, attach a zero-init D x K linear layer."""
        positive_int(num_classes, "num_classes")
        self.pre_logits = nn.Identity()
        self.num_features = self.cfg.dims.width
        self.head = zero_head(self.num_features, num_classes, bias_init, like=self.head.weight)
        self.cfg = dataclasses.replace(
            self.cfg, num_classes=num_classes, representation_size=None, head_bias_init=float(bias_init)
        )

    def _posemb(self, layer: int) -> Tensor | None:
        """(1, T, D) additive embedding for the given layer, or None."""
        idx = layer if self.cfg.pos_emb_placement == "every_layer" else 0
        if self.pos_embed is not None:
            return self.pos_embed[idx : idx + 1]
        if self.pos_embed_row is not None and self.pos_embed_col is not None:
            emb = posemb_2d(self.pos_embed_row[idx : idx + 1], self.pos_embed_col[idx : idx + 1])
            if self.num_prefix_tokens:  # the class token is itself learned: no 2-D position for it
                emb = torch.cat([emb.new_zeros(1, self.num_prefix_tokens, emb.shape[-1]), emb], dim=1)
            return emb
        return None

    def _blocks(self) -> list[Block]:
        """The encoder's blocks, typed (a ModuleList yields plain Modules to the type checker)."""
        return cast("list[Block]", list(self.blocks))

    def _check_input(self, x: Tensor) -> None:
        if x.dim() != 4 or x.shape[1] != self.cfg.in_chans:
            raise ValueError(f"expected input (B, {self.cfg.in_chans}, H, W), got {tuple(x.shape)}")
        s = int(self.patch_embed.stride)
        h, w = x.shape[-2:]
        if h % s or w % s:
            raise ValueError(f"image size {h}x{w} is not a multiple of the token stride {s}")
        if self.cfg.pos_emb != "none" and (h // s, w // s) != self.cfg.grid:
            g = self.cfg.grid
            raise ValueError(
                f"image size {h}x{w} gives a {h // s}x{w // s} grid but the model was built for "
                f"{g[0] * s}x{g[1] * s} ({g[0]}x{g[1]}); create it with that img_size "
                "(load_pretrained resamples position embeddings)"
            )

    def forward_encoder(self, x: Tensor) -> Tensor:
        """(B, C, H, W) -> (B, T, D) encoder output after the final `norm` (identity for GAP)."""
        return self._encode(x)

    def forward_attention(self, x: Tensor) -> tuple[Tensor, list[Tensor]]:
        """(`forward_encoder`'s output, each layer's attention probabilities (B, heads, T, T)).

        For analyses (Sec. 4.5): the attention is computed explicitly (`Attention.forward_with_attention`),
        so call it under `torch.no_grad()` in eval mode; training never takes this path.
        """
        maps: list[Tensor] = []
        return self._encode(x, maps), maps

    def embed_patches(self, x: Tensor) -> Tensor:
        """(B, C, H, W) -> (B, N, D): the patch embeddings x_p E of Eq. 1, before any token or position is added
        (masked patch prediction corrupts these: `models/masked_patch.py`)."""
        self._check_input(x)
        return cast(Tensor, self.patch_embed(x))

    def _encode(self, x: Tensor, attention: list[Tensor] | None = None) -> Tensor:
        """The encoder; with a list, every block's attention probabilities are appended to it."""
        return self.encode_patches(self.embed_patches(x), attention)

    def encode_patches(self, x: Tensor, attention: list[Tensor] | None = None) -> Tensor:
        """(B, N, D) patch embeddings -> (B, T, D): class token, position embeddings, the blocks, `norm`."""
        if self.cls_token is not None:
            x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)  # (B, 1+N, D)
        every = self.cfg.pos_emb_placement != "input"
        ckpt = self.activation_checkpointing and self.training and torch.is_grad_enabled()
        for i, blk in enumerate(self._blocks()):
            if i == 0 or every:
                emb = self._posemb(i)
                if emb is not None:
                    x = x + emb
            if i == 0:
                x = self.pos_drop(x)
            if attention is not None:
                x, probs = blk.forward_with_attention(x)
                attention.append(probs)
            else:
                x = torch.utils.checkpoint.checkpoint(blk, x, use_reentrant=False) if ckpt else blk(x)
        return self.norm(x)

    def forward_features(self, x: Tensor) -> Tensor:
        """(B, C, H, W) -> (B, D') pre-head representation (after pre-logits when present)."""
        x = self.forward_encoder(x)
        x = x[:, 0] if self.cls_token is not None else x.mean(dim=1)  # (B, D)
        return self.pre_logits(self.fc_norm(x))

    def forward(self, x: Tensor) -> Tensor:
        """(B, C, H, W) float, already normalised -> logits (B, num_classes)."""
        return self.head(self.forward_features(x))
