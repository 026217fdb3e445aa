"""Small typed building blocks of the ViT encoder (timm parameter names).

Attention uses one fused qkv Linear (timm layout: weight rows are [q; k; v], each head-major)
and `F.scaled_dot_product_attention`; an optional learned 1-D relative-position bias is added
to the attention logits through SDPA's float ``attn_mask``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

LN_EPS = 1e-6  # Flax LayerNorm default, also timm's ViT.


def has_values(module: nn.Module) -> bool:
    """Whether `module`'s parameters hold values: not so under `with torch.device("meta")`, where a model is
    built only for its shapes and parameter count (a config's check, FLOPs). Initialising it there is moot and
    costs a second: meta tensors have no random kernels, so `normal_` goes through torch's Python reference
    implementations, whose first call imports torch.compile's tracer (`torch._dynamo`)."""
    return not any(p.is_meta for p in module.parameters())


def relative_index(seq_len: int, device: torch.device | None = None) -> Tensor:
    """(T, T) long indices into a (2T-1)-entry table: entry [i, j] = i - j + T - 1."""
    pos = torch.arange(seq_len, device=device)
    return pos[:, None] - pos[None, :] + (seq_len - 1)


class Attention(nn.Module):
    """Multi-head self-attention with a fused qkv projection.

    Args:
        dim: model width D.
        heads: number of heads; D_h = D / heads.
        attn_drop: dropout on attention probabilities (training only).
        proj_drop: dropout after the output projection.
        rel_pos_len: if set, the sequence length T of a learned 1-D relative-position logit
            bias `rel_bias` of shape (heads, 2T-1) (App. D.4 "relative"); None = no bias.
    """

    def __init__(
        self,
        dim: int,
        heads: int,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
        rel_pos_len: int | None = None,
    ) -> None:
        super().__init__()
        if dim % heads != 0:
            raise ValueError(f"width {dim} must be divisible by heads {heads}")
        self.heads = heads
        self.head_dim = dim // heads
        self.attn_drop = attn_drop
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)
        self.rel_bias: nn.Parameter | None = None
        if rel_pos_len is not None:
            self.rel_bias = nn.Parameter(torch.zeros(heads, 2 * rel_pos_len - 1))

    def init_weights(self) -> None:
        """Official/timm-jax init: xavier-uniform per q/k/v block, tiny normal biases."""
        dim = self.qkv.in_features
        bound = math.sqrt(6.0 / (dim + dim))  # fan of one of q/k/v, not the fused 3D x D matrix
        nn.init.uniform_(self.qkv.weight, -bound, bound)
        nn.init.xavier_uniform_(self.proj.weight)
        nn.init.normal_(self.qkv.bias, std=1e-6)
        nn.init.normal_(self.proj.bias, std=1e-6)
        if self.rel_bias is not None:
            nn.init.normal_(self.rel_bias, std=0.02)

    def logit_bias(self, seq_len: int) -> Tensor | None:
        """(1, heads, T, T) additive logit bias from the relative table, or None."""
        if self.rel_bias is None:
            return None
        table_len = self.rel_bias.shape[1]
        if table_len != 2 * seq_len - 1:
            raise ValueError(
                f"relative position table has {table_len} entries, needs {2 * seq_len - 1} "
                f"for sequence length {seq_len}; build the model for this image size"
            )
        idx = relative_index(seq_len, self.rel_bias.device)
        return self.rel_bias[:, idx].unsqueeze(0)

    def _qkv_bias(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """q, k, v (B, heads, T, D_h) and the logit bias (1, heads, T, T) or None."""
        b, t, _ = x.shape
        # (B, T, 3D) -> (3, B, heads, T, D_h)
        qkv = self.qkv(x).reshape(b, t, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        bias = self.logit_bias(t)
        return q, k, v, (bias.to(q.dtype) if bias is not None else None)

    def _out(self, y: Tensor) -> Tensor:  # (B, heads, T, D_h) -> (B, T, D)
        b, _, t, _ = y.shape
        return self.proj_drop(self.proj(y.transpose(1, 2).reshape(b, t, -1)))

    def forward(self, x: Tensor) -> Tensor:
        q, k, v, bias = self._qkv_bias(x)
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=bias, dropout_p=self.attn_drop if self.training else 0.0
        )  # (B, heads, T, D_h)
        return self._out(y)

    def forward_with_attention(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """`forward` with the attention probabilities made explicit, for analyses (no dropout).

        Returns (output (B, T, D), probabilities (B, heads, T, T), rows summing to 1): the
        softmax(q k^T / sqrt(D_h) + bias) that SDPA computes inside without handing it out.
        Training keeps the fused kernel; only this path materialises the T x T matrices.
        """
        q, k, v, bias = self._qkv_bias(x)
        logits = q @ k.transpose(-2, -1) * self.head_dim**-0.5  # (B, heads, T, T)
        if bias is not None:
            logits = logits + bias
        probs = logits.float().softmax(dim=-1).to(q.dtype)
        return self._out(probs @ v), probs


class Mlp(nn.Module):
    """Dense -> GELU -> Dropout -> Dense -> Dropout (official MlpBlock)."""

    def __init__(self, dim: int, hidden: int, drop: float = 0.0) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        # Exact GELU (timm); the Flax code uses the tanh approximation, ~1e-3 apart at most.
        self.act = nn.GELU()
        self.drop1 = nn.Dropout(drop)
        self.fc2 = nn.Linear(hidden, dim)
        self.drop2 = nn.Dropout(drop)

    def init_weights(self) -> None:
        """Xavier-uniform kernels, normal(1e-6) biases (official init)."""
        for fc in (self.fc1, self.fc2):
            nn.init.xavier_uniform_(fc.weight)
            nn.init.normal_(fc.bias, std=1e-6)

    def forward(self, x: Tensor) -> Tensor:
        return self.drop2(self.fc2(self.drop1(self.act(self.fc1(x)))))


class Block(nn.Module):
    """Pre-LN encoder block: z' = MSA(LN(z)) + z;  z = MLP(LN(z')) + z'."""

    def __init__(
        self,
        dim: int,
        heads: int,
        mlp_dim: int,
        drop: float = 0.0,
        attn_drop: float = 0.0,
        rel_pos_len: int | None = None,
    ) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=LN_EPS)
        self.attn = Attention(dim, heads, attn_drop=attn_drop, proj_drop=drop, rel_pos_len=rel_pos_len)
        self.norm2 = nn.LayerNorm(dim, eps=LN_EPS)
        self.mlp = Mlp(dim, mlp_dim, drop=drop)

    def init_weights(self) -> None:
        """Init attention and MLP; LayerNorms keep ones/zeros."""
        self.attn.init_weights()
        self.mlp.init_weights()

    def forward(self, x: Tensor) -> Tensor:  # (B, T, D) -> (B, T, D)
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))

    def forward_with_attention(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(`forward`'s output (B, T, D), attention probabilities (B, heads, T, T))."""
        y, probs = self.attn.forward_with_attention(self.norm1(x))
        x = x + y
        return x + self.mlp(self.norm2(x)), probs
