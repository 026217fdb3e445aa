"""Fine-tuning (App. B.1.1, Table 4): the `finetune` section, the paper's recipe and presets.

A fine-tuning job is a training job: the same `TrainConfig` and `DataConfig` as pre-training, with
the paper's fine-tuning recipe as their defaults. The section holds what only fine-tuning has (the
weights to start from, a Table 4 preset, the dev carve, the test split, the resolution) and two
mappings laid over those defaults, `train:` and `data:`, which take every key of the `train:` and
`data:` sections:

    finetune:
      checkpoint: runs/pretrain            # where the weights come from
      preset: cifar10                      # Table 4: 10k steps, LR grid {0.001, ..., 0.03}, 2% dev
      train: {global_batch: 512, micro_batch: 32, base_lr: 0.01}
      data: {url: s3://bucket/cifar10, error_budget: 0.0}

What the preset fills in stays derived until a job is built (`train_config`): a sweep over
`finetune.train.max_steps` gets each trial's warm-up from its own step count.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, ClassVar

from vitscale.config.checks import ConfigError, check, one_of, plain_name, positive, seed
from vitscale.config.fields import PATH, RESUME_FREE, overrides
from vitscale.config.location import canonical_location
from vitscale.data.config import DataConfig
from vitscale.models.config import ModelConfig
from vitscale.train.config import TrainConfig


@dataclass(frozen=True)
class Preset:
    """One row of Table 4 (and the VTAB-1k protocol)."""

    steps: int
    lr_grid: tuple[float, ...]
    dev_fraction: float
    """Share of the training split held out for selection (10% Pets/Flowers, 2% CIFAR, 1% ImageNet)."""


PRESETS: dict[str, Preset] = {
    "imagenet": Preset(20_000, (0.003, 0.01, 0.03, 0.06), 0.01),
    "cifar100": Preset(10_000, (0.001, 0.003, 0.01, 0.03), 0.02),
    "cifar10": Preset(10_000, (0.001, 0.003, 0.01, 0.03), 0.02),
    "pets": Preset(500, (0.001, 0.003, 0.01, 0.03), 0.10),
    "flowers": Preset(500, (0.001, 0.003, 0.01, 0.03), 0.10),
    # VTAB-1k: 1000 examples per task, 800 to train and 200 to validate; one setting for every task.
    "vtab": Preset(2_500, (0.01,), 0.20),
}
"""Table 4 of the paper: steps and learning-rate grid per dataset; dev shares from App. B.1.1."""

RECIPE: Mapping[str, Any] = MappingProxyType({
    "optimizer": "sgd", "momentum": 0.9,        # "SGD with a momentum of 0.9"
    "global_batch": 512, "micro_batch": 32,     # "batch size 512"
    "lr_decay": "cosine", "end_lr": 0.0,        # "cosine learning rate decay"
    "weight_decay": 0.0,                        # "no weight decay"
    "grad_clip": 1.0,                           # "grad clipping at global norm 1"
    "zero_stage": 0,                            # one model fits a device: plain data parallelism
    "log_every": 20,
})
"""The paper's fine-tuning recipe (App. B.1.1) as `TrainConfig` values: the defaults of `finetune.train`.
Every other `TrainConfig` key keeps its own default (loss, precision, checkpoints, error handling)."""

DEFAULT_STEPS = 10_000
"""Fine-tuning steps without a preset (Table 4's CIFAR row)."""
DEFAULT_DEV_FRACTION = 0.02
"""Dev share without a preset (Table 4's CIFAR row)."""
MAX_WARMUP = 500
"""Warm-up, unless set, is a tenth of the run and at most this many steps."""


def default_warmup(steps: int) -> int:
    """`finetune.train.warmup_steps` when unset: a tenth of the run, at most `MAX_WARMUP` steps."""
    return min(MAX_WARMUP, steps // 10)


@dataclass(frozen=True)
class FinetuneConfig:
    """A fine-tuning job: the weights to start from, the downstream data, and the training recipe."""

    MOVED: ClassVar[Mapping[str, str]] = MappingProxyType({
        "base_lr": "train.base_lr", "batch": "train.global_batch", "micro_batch": "train.micro_batch",
        "steps": "train.max_steps", "warmup_steps": "train.warmup_steps", "momentum": "train.momentum",
        "grad_clip": "train.grad_clip", "polyak": "train.polyak", "zero_stage": "train.zero_stage",
        "precision": "train.precision", "checkpoint_every": "train.checkpoint_every",
        "log_every": "train.log_every", "eval_every": "train.eval_every",
        "seed": "train.seed and finetune.data.seed", "dataset": "data.url", "train_split": "data.split",
        "create_if_missing": "data.create_if_missing", "num_workers": "data.num_workers",
    })
    """The section's older shape (its own copies of `train:` and `data:` keys): where each key went."""

    checkpoint: str | None = field(default=None, metadata=PATH)
    """Weights to start from: a run directory, a vitscale export, an official .npz or a timm state dict;
    null = the pretrain stage's. For .npz and timm files the `model:` section names the architecture."""
    preset: str | None = None
    """A row of Table 4: imagenet, cifar10, cifar100, pets, flowers, vtab (steps, LR grid, dev share)."""
    train: dict[str, Any] = field(default_factory=dict, metadata=overrides(TrainConfig))
    """Any `train:` key, over the fine-tuning recipe (`RECIPE`). Unset here: `max_steps` = the preset's
    (else 10000), `warmup_steps` = a tenth of the run (at most 500), `base_lr` = the preset's only
    learning rate (VTAB); a preset with several leaves the choice to the sweep stage."""
    data: dict[str, Any] = field(default_factory=dict, metadata=overrides(DataConfig))
    """Any `data:` key for the downstream dataset: `url` (a folder or s3:// prefix with a training and
    a test split; required), `split` (trained on, the dev split carved from it; default train),
    `create_if_missing`, `num_workers`, `error_budget`, ... Unset `endpoint_url` = `data.endpoint_url`."""
    test_split: str = "test"
    """Split the final model is tested on, once."""
    lr_grid: tuple[float, ...] = ()
    """Learning rates the sweep selects from; empty = the preset's grid (else `train.base_lr` alone)."""
    dev_fraction: float | None = None
    """Share of the training split held out for selection; null = the preset's (else 0.02)."""
    dev_seed: int = 0
    """Seed of the dev carve."""
    resolution: int = 384
    """Fine-tuning resolution; position embeddings are resampled to the new grid (Sec. 3.2)."""
    eval_batch: int = field(default=128, metadata=RESUME_FREE)
    """Images per forward pass during evaluation."""

    def validate(self) -> None:
        if self.checkpoint is not None:
            # "" is not "unset": the stage checks would take it for weights given and fail on reading them.
            check(self.checkpoint != "", "finetune.checkpoint",
                  "must name weights (a run directory, a vitscale export, an .npz or timm file), or be null for "
                  "the pretrain stage's")
            canonical_location(self.checkpoint, "finetune.checkpoint")  # a malformed location is refused here
        if self.preset is not None:
            one_of(self.preset, tuple(PRESETS), "finetune.preset")
        if self.dev_fraction is not None:
            positive(self.dev_fraction, "finetune.dev_fraction")
            check(self.dev_fraction < 1, "finetune.dev_fraction", f"must be below 1, got {self.dev_fraction}")
        seed(self.dev_seed, "finetune.dev_seed")
        plain_name(self.test_split, "finetune.test_split")
        positive(self.resolution, "finetune.resolution")
        positive(self.eval_batch, "finetune.eval_batch")
        for i, lr in enumerate(self.lr_grid):
            positive(lr, f"finetune.lr_grid[{i}]")
        check(len(set(self.lr_grid)) == len(self.lr_grid), "finetune.lr_grid",
              f"lists a learning rate twice: {list(self.lr_grid)} (the sweep would train it twice)")
        objective = self.train.get("objective", "supervised")
        check(objective == "supervised", "finetune.train.objective",
              f"fine-tuning learns the downstream labels: only 'supervised', got {objective!r}"
              + (" (a pre-training objective)" if objective == "masked_patch" else ""))
        check("epochs" not in self.train, "finetune.train.epochs",
              "fine-tuning is counted in steps (Table 4): set finetune.train.max_steps")
        # The recipe at its own rate, or at every rate of the grid a sweep may give it (end_lr <= base_lr, ...).
        rates: tuple[float | None, ...] = (None,) if "base_lr" in self.train else self.grid() or (None,)
        for rate in rates:
            self.train_config(rate).validate("finetune.train")
        # The dataset is the finetune and sweep stages' to require (a pipeline without them needs none).
        data = self.data_config()
        replace(data, url=data.url or "unset").validate("finetune.data")
        check(data.split != self.test_split, "finetune.test_split",
              f"must differ from finetune.data.split ({data.split!r})")

    # -- what the preset and the recipe fill in -----------------------------------------------------

    def _preset(self) -> Preset | None:
        return PRESETS[self.preset] if self.preset else None

    def total_steps(self) -> int:
        """Optimizer steps: `train.max_steps`, else the preset's, else 10000."""
        preset = self._preset()
        steps = self.train.get("max_steps")  # 0 is the recipe's to refuse, not "the preset's"
        return steps if steps is not None else preset.steps if preset else DEFAULT_STEPS

    def grid(self) -> tuple[float, ...]:
        """The learning rates a sweep selects from: `lr_grid`, else the preset's, else `train.base_lr` alone."""
        if self.lr_grid:
            return self.lr_grid
        preset = self._preset()
        if preset is not None:
            return preset.lr_grid
        return (float(self.train["base_lr"]),) if "base_lr" in self.train else ()

    def single_lr(self) -> float | None:
        """The learning rate of one run without selection: `train.base_lr`, else the grid's only value;
        None when only a sweep can choose it."""
        if "base_lr" in self.train:
            return float(self.train["base_lr"])
        grid = self.grid()
        return grid[0] if len(grid) == 1 else None

    def dev_share(self) -> float:
        preset = self._preset()
        if self.dev_fraction is not None:
            return self.dev_fraction
        return preset.dev_fraction if preset else DEFAULT_DEV_FRACTION

    def train_config(self, base_lr: float | None = None) -> TrainConfig:
        """The training recipe: `RECIPE`, the preset's steps and the derived warm-up, then `train:`'s keys.

        `base_lr` (a sweep trial's or the winner's) wins over all; without one the single learning rate,
        else `TrainConfig`'s default stands in (the stages refuse a run whose rate nobody chose).
        """
        steps = self.total_steps()
        values: dict[str, Any] = {**RECIPE, "max_steps": steps, "warmup_steps": default_warmup(steps)}
        values.update({k: v for k, v in self.train.items() if k != "max_steps"})  # null there = the preset's
        lr = base_lr if base_lr is not None else self.single_lr()
        if lr is not None:
            values["base_lr"] = lr
        return TrainConfig(**values)

    def data_config(self, endpoint_url: str | None = None) -> DataConfig:
        """The downstream dataset as a `DataConfig`: `data:`'s keys over `DataConfig`'s defaults (no url);
        `endpoint_url` (the pipeline's `data.endpoint_url`) unless `data:` names its own."""
        values: dict[str, Any] = {"url": "", "endpoint_url": endpoint_url, **self.data}
        return DataConfig(**values)


def finetune_model(model: ModelConfig, resolution: int) -> ModelConfig:
    """The pre-trained architecture at the fine-tuning resolution, without the pre-logits layer (Sec. 3.1)."""
    options = {k: v for k, v in model.options.items() if k != "representation_size"}
    return replace(model, img_size=resolution, options=options)


def refuse_unset_lr(config: FinetuneConfig, what: str) -> float:
    """The single learning rate of a run without selection, or `ConfigError` naming `finetune.train.base_lr`."""
    lr = config.single_lr()
    if lr is None and not config.grid():
        raise ConfigError("finetune.train.base_lr",
                          f"{what} trains one learning rate and none is set: set it, or a preset with one "
                          f"(vtab); a sweep stage selects one of a preset's grid on the dev split")
    if lr is None:
        raise ConfigError("finetune.train.base_lr",
                          f"{what} trains one learning rate; set it, or let the sweep stage select one of "
                          f"{list(config.grid())} on the dev split")
    return lr
