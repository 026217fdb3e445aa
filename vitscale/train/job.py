"""One training run as plain data: what a Ray Train worker is handed, for pre-training and fine-tuning alike.

Pre-training (`stages/pretrain.py`) and fine-tuning (`stages/finetune.py`) build a `TrainJob` and
run the same loop (`train/loop.py`) on it: the only differences are the recipe (`train`), where
the weights start (`init`), which part of the data is trained on (`carve`) and what is evaluated
(`evals`).

Fine-tuning's protocol (App. B.1.1) is two job builders: a learning rate is selected on a dev split
carved from the training split (`selection_job`), and the winner is retrained on the whole
training split and evaluated once on the test split (`final_job`). Only `final_job` can name the
test split: a selection job cannot read it, by construction (`TrainJob` refuses a job that selects
on a dev carve and evaluates anything else).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import yaml

from vitscale.config.loader import to_dict
from vitscale.data.carve import Carve
from vitscale.data.config import DataConfig
from vitscale.models.config import ModelConfig
from vitscale.train.config import TrainConfig
from vitscale.train.finetune import FinetuneConfig
from vitscale.train.resume import FINETUNE_SCOPE, PRETRAIN_SCOPE, TRAINED_KEY


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
    """The resolved config, written into every checkpoint (with `trained:`, `checkpoint_yaml`)."""
    resume_scope: tuple[str, ...] = PRETRAIN_SCOPE
    """The config keys (dotted prefixes) this job's training reads: a resume that changes one of them
    is refused (`train/resume.py`); fine-tuning jobs read the `finetune` section instead of `train` and `data`."""

    def __post_init__(self) -> None:
        # Selection (a job scored on the dev part of a carve) must never see held-out data:
        # it trains on the rest of that carve and evaluates nothing but its dev part.
        dev = [e.carve for e in self.evals if e.carve is not None and e.carve.part == "dev"]
        if dev:
            others = [e for e in self.evals if e.carve is None or e.carve.part != "dev"
                      or (e.url, e.split) != (self.data.url, self.data.split)]
            if others or self.carve is None or self.carve.part != "rest" or self.carve.fraction != dev[0].fraction \
                    or self.carve.seed != dev[0].seed:
                raise ValueError("a job selecting on a dev carve trains on the rest of that carve and evaluates "
                                 f"only its dev part; it cannot evaluate {[e.name for e in others] or 'this split'}")

    @property
    def train_key(self) -> str:
        """Where this job's recipe is set: `train` for pre-training, `finetune.train` for fine-tuning."""
        return "finetune.train" if self.resume_scope == FINETUNE_SCOPE else "train"

    def checkpoint_yaml(self, trained_on: dict[str, Any] | None = None) -> str:
        """A checkpoint's `config.yaml`: the resolved config, then under `trained:` the architecture and
        objective of the weights this job trains, which `train/export.py` rebuilds them as. A fine-tuning
        job's are not the pipeline's `model:` and `train:` (its resolution, no pre-logits, the pre-trained
        weights' own architecture, always supervised). Outside every resume scope; `trained_on` (what the job
        reads and starts from, `resume.TRAINED_KEY`) is compared on resume by `resume.refuse_changed_run`."""
        trained: dict[str, Any] = {TRAINED_KEY: {"model": to_dict(self.model), "objective": self.train.objective}}
        trained[TRAINED_KEY].update(trained_on or {})
        head = self.config_yaml if not self.config_yaml or self.config_yaml.endswith("\n") else f"{self.config_yaml}\n"
        return head + yaml.safe_dump(trained, sort_keys=False)


def trained_sections(raw: dict[str, Any]) -> tuple[Any, str]:
    """(the `model:` mapping, the objective) of a checkpoint's parsed `config.yaml`: its `trained:` record,
    else (checkpoints written before it) the pipeline's own `model:` and `train.objective`."""
    trained: dict[str, Any] = raw.get(TRAINED_KEY) or {}
    train: dict[str, Any] = raw.get("train") or {}
    return (trained.get("model", raw.get("model")),
            str(trained.get("objective", train.get("objective", "supervised"))))


def selection_job(cfg: FinetuneConfig, model: ModelConfig, init: str | None, base_lr: float, *,
                  use_gpu: bool, endpoint_url: str | None, config_yaml: str = "") -> TrainJob:
    """One trial of the selection: train on the rest of the dev carve, score on the dev part.

    Takes no test split: nothing in a selection job can read it. `endpoint_url` is the pipeline's
    `data.endpoint_url`, used unless `finetune.data` names its own.
    """
    data = cfg.data_config(endpoint_url)
    carve = Carve(cfg.dev_share(), cfg.dev_seed, "rest")
    dev = EvalSet("dev", data.url, data.split, replace(carve, part="dev"))
    return TrainJob(model=model, data=data, train=cfg.train_config(base_lr), use_gpu=use_gpu, carve=carve,
                    init=init, evals=(dev,), eval_batch=cfg.eval_batch, config_yaml=config_yaml,
                    resume_scope=FINETUNE_SCOPE)


def final_job(cfg: FinetuneConfig, model: ModelConfig, init: str | None, base_lr: float, *,
              use_gpu: bool, endpoint_url: str | None, config_yaml: str = "") -> TrainJob:
    """The run that counts: the whole training split, tested once on the test split."""
    data = cfg.data_config(endpoint_url)
    test = EvalSet("test", data.url, cfg.test_split)
    return TrainJob(model=model, data=data, train=cfg.train_config(base_lr), use_gpu=use_gpu, init=init,
                    evals=(test,), eval_batch=cfg.eval_batch, config_yaml=config_yaml, resume_scope=FINETUNE_SCOPE)
