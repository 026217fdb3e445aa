"""One training run as plain data: what a Ray Train worker is handed, for pre-training and fine-tuning alike.

Pre-training (`stages/pretrain.py`) and fine-tuning (`stages/finetune.py`) build a `TrainJob` and
run the same loop (`train/loop.py`) on it: the only differences are the recipe (`train`), where
the weights start (`init`), which part of the data is trained on (`carve`) and what is evaluated
(`evals`).
"""

from __future__ import annotations

from dataclasses import dataclass

from vitscale.data.carve import Carve
from vitscale.data.config import DataConfig
from vitscale.models.config import ModelConfig
from vitscale.train.config import TrainConfig
from vitscale.train.resume import PRETRAIN_SCOPE


@dataclass(frozen=True)
class EvalSet:
    """A labelled set the loop measures top-1 accuracy on (single-label datasets)."""

    name: str
    """What the metric is called: `{name}_accuracy` ("dev", "test")."""
    url: str
    """Dataset folder or s3:// prefix."""
    split: str
    """Split to read."""
    carve: Carve | None = None
    """Read one part of a carve of the split (the dev part during selection)."""


@dataclass(frozen=True)
class TrainJob:
    """Everything one training run needs; built on the driver, pickled to every worker."""

    model: ModelConfig
    """The architecture (its `img_size` is the training resolution)."""
    data: DataConfig
    """The dataset trained on (url, split, loader settings)."""
    train: TrainConfig
    """The recipe: batch, schedule, optimizer, precision, checkpoints."""
    use_gpu: bool = True
    """Train on the worker's GPU when it has one."""
    carve: Carve | None = None
    """Train on one part of a carve of `data.split` (selection trains on the rest of a dev carve)."""
    init: str | None = None
    """A weights file `models.load_pretrained` reads (export, .npz, timm); None = random init."""
    evals: tuple[EvalSet, ...] = ()
    """Evaluated every `train.eval_every` steps and after the last step, on rank 0."""
    eval_batch: int = 128
    """Images per forward pass during evaluation."""
    evaluations: int | None = None
    """Evaluate this many times, evenly spaced over the run, when `train.eval_every` is not set
    (scores along the way for a sweep's curves, whatever the schedule's length)."""
    eval_steps: tuple[int, ...] = ()
    """Also evaluate after exactly these steps (a sweep's ASHA rungs, `stages/sweep_asha.py`)."""
    config_yaml: str = ""
    """The resolved config, written into every checkpoint."""
    resume_scope: tuple[str, ...] = PRETRAIN_SCOPE
    """The config keys (dotted prefixes) this job's training reads: a resume that changes one of them
    is refused (`train/resume.py`); fine-tuning jobs read the `finetune` section instead of `train`."""

    def __post_init__(self) -> None:
        # Selection (a job scored on the dev part of a carve) must never see held-out data:
        # it trains on the rest of that carve and evaluates nothing but its dev part.
        dev = [e for e in self.evals if e.carve is not None and e.carve.part == "dev"]
        if dev:
            others = [e for e in self.evals if e.carve is None or e.carve.part != "dev"
                      or (e.url, e.split) != (self.data.url, self.data.split)]
            if others or self.carve is None or self.carve.part != "rest" or self.carve.fraction != dev[0].carve.fraction \
                    or self.carve.seed != dev[0].carve.seed:
                raise ValueError("a job selecting on a dev carve trains on the rest of that carve and evaluates "
                                 f"only its dev part; it cannot evaluate {[e.name for e in others] or 'this split'}")
