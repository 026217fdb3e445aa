"""Top-1 accuracy on the evaluation sets, with the raw and the Polyak-averaged weights (`polyak.py`).

Plain PyTorch: the loop calls `evaluate` on every rank; rank 0 measures with the engine's whole weights.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from vitscale.data.config import DEFAULT_ERROR_BUDGET
from vitscale.say import say
from vitscale.train.engine import whole_weights
from vitscale.train.job import EvalSet

if TYPE_CHECKING:
    from vitscale.train.worker import Worker


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


def evaluation_due(worker: Worker, step: int) -> bool:
    """Whether the job evaluates after `step`: its last step, every `eval_every`, and the steps it names."""
    job = worker.job
    return bool(job.evals) and (step == worker.total_steps or bool(worker.eval_every and step % worker.eval_every == 0)
                                or step in job.eval_steps)


def evaluate(worker: Worker) -> dict[str, float]:
    """Accuracy on every evaluation set, with the raw and (if on) the averaged weights; rank 0 measures.

    Every rank enters (gathering ZeRO-3 weights is a collective) and waits at the barrier, so
    ranks stay in step; the scores are rank 0's, which is whose metrics Ray keeps.
    """
    job, polyak = worker.job, worker.polyak
    dtype = torch.bfloat16 if job.train.precision == "bf16" else torch.float32
    scores: dict[str, float] = {}
    with whole_weights(worker.engine) as model:
        if worker.ctx.rank == 0:
            for eval_set in job.evals:
                def measure(m: torch.nn.Module, eval_set: EvalSet = eval_set) -> float:
                    return accuracy(m, eval_set, resolution=job.model.img_size, batch_size=job.eval_batch,
                                    device=worker.device, dtype=dtype, endpoint_url=job.data.endpoint_url,
                                    error_budget=job.data.error_budget)

                scores[f"{eval_set.name}_accuracy"] = measure(model)
                if polyak is not None:
                    with polyak.swapped_in(model) as averaged:
                        scores[f"{eval_set.name}_accuracy_polyak"] = measure(averaged)
            say("  ".join(f"{k} {v:.4f}" for k, v in scores.items()))
        torch.distributed.barrier()
    return scores
