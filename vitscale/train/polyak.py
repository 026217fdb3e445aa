"""Polyak averaging of the weights (App. B.1.1): the paper's headline ImageNet numbers use factor 0.9999."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


class Polyak:
    """An exponential moving average of the weights: avg <- f * avg + (1 - f) * weights, every step.

    The paper's headline ImageNet numbers use factor 0.9999. The average lives in fp32 beside the
    model and is checkpointed with each rank's part, so a resumed run continues the same average.
    """

    def __init__(self, model: torch.nn.Module, factor: float):
        self.factor = factor
        self.average = {n: p.detach().float().clone() for n, p in model.named_parameters()}

    @torch.no_grad()
    def update(self, model: torch.nn.Module) -> None:
        for name, param in model.named_parameters():
            self.average[name].mul_(self.factor).add_(param.detach().float(), alpha=1.0 - self.factor)

    @contextlib.contextmanager
    @torch.no_grad()
    def swapped_in(self, model: torch.nn.Module) -> Iterator[torch.nn.Module]:
        """`model` with the averaged weights for the duration (the raw weights restored after)."""
        raw = {n: p.detach().clone() for n, p in model.named_parameters()}
        for name, param in model.named_parameters():
            param.copy_(self.average[name].to(param.dtype))
        try:
            yield model
        finally:
            for name, param in model.named_parameters():
                param.copy_(raw[name])

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {n: t.cpu() for n, t in self.average.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for name, tensor in state.items():
            self.average[name].copy_(tensor)
