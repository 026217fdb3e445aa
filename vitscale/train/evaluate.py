"""Top-1 accuracy on an evaluation set, and Polyak averaging of the weights (App. B.1.1).

Plain PyTorch: the loop calls these on rank 0 with the engine's whole weights.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from vitscale.data.config import DEFAULT_ERROR_BUDGET
from vitscale.train.job import EvalSet


@torch.no_grad()
def accuracy(model: torch.nn.Module, eval_set: EvalSet, *, resolution: int, batch_size: int,
             device: torch.device, dtype: torch.dtype, endpoint_url: str | None = None,
             error_budget: float = DEFAULT_ERROR_BUDGET) -> float:
    """Top-1 accuracy of `model` over all of `eval_set` (centre crop; rows refilled after a bad sample skipped).

    Past `error_budget` (the job's `data.error_budget`, a fraction of the set) unreadable samples it
    fails rather than score a test set that is mostly missing."""
    from vitscale.data.loader.stream import ShardStream
    from vitscale.data.loader.transforms import normalize_on_device

    stream = ShardStream(eval_set.url, eval_set.split, batch_size=batch_size, resolution=resolution, train=False,
                         num_workers=0, endpoint_url=endpoint_url, carve=eval_set.carve, error_budget=error_budget)
    was_training = model.training
    model.eval()
    correct = total = 0
    for batch in stream:
        keep = batch["valid"]
        images = normalize_on_device(batch["image"][keep].to(device)).to(dtype)
        if images.shape[0] == 0:
            continue
        predicted = model(images).float().argmax(dim=-1).cpu()
        correct += int((predicted == batch["label"][keep]).sum())
        total += int(keep.sum())
    model.train(was_training)
    if total == 0:
        raise ValueError(f"{eval_set.name} set {eval_set.url} ({eval_set.split}) has no readable samples")
    return correct / total


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
