"""Shared by the model and checkpoint tests: tiny dimensions and non-zero random weights."""

from __future__ import annotations

import torch
from torch import nn

TINY = {"depth": 2, "width": 32, "mlp_dim": 64, "heads": 2}
X32 = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))


def randomize(model: nn.Module, seed: int = 0) -> nn.Module:
    """Every parameter non-zero random: a zero-init head would hide gradients, and a parameter that
    fails to load must change the logits."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            for name, p in module.named_parameters(recurse=False):
                noise = torch.randn(p.shape, generator=g) * 0.1
                is_scale = isinstance(module, (nn.LayerNorm, nn.GroupNorm)) and name == "weight"
                p.copy_(noise + 1.0 if is_scale else noise)
    return model
