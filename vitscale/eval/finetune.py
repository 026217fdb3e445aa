"""Fine-tuning (App. B.1.1, Table 4): the `finetune` section, the paper's presets, and the two jobs.

The protocol: a small learning-rate grid is selected on a dev split carved from the training
split (`data/carve.py`); the winner is retrained on the whole training split and evaluated once
on the test split. Selection and the final run are two job builders, and only `final_job` can
name the test split: a selection job cannot read it, by construction (`TrainJob` refuses a job
that selects on a dev carve and evaluates anything else).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from vitscale.config.checks import check, non_negative, one_of, plain_name, positive, probability, seed
from vitscale.data.carve import Carve
from vitscale.data.config import DataConfig, SourceConfig
from vitscale.models.config import ModelConfig
from vitscale.train.config import TrainConfig
from vitscale.train.job import EvalSet, TrainJob
from vitscale.train.resume import FINETUNE_SCOPE


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


@dataclass(frozen=True)
class FinetuneConfig:
    """The paper's fine-tuning recipe: SGD momentum 0.9, batch 512, cosine decay, no weight decay."""

    dataset: str = field(default="", metadata={"path": True})
    """Downstream dataset (folder or s3:// prefix) with a training and a test split."""
    create_if_missing: SourceConfig | None = None
    """Write the downstream dataset from this source when it is absent (quickstart: digits)."""
    preset: str | None = None
    """A row of Table 4: imagenet, cifar10, cifar100, pets, flowers, vtab (steps, LR grid, dev share)."""
    checkpoint: str | None = field(default=None, metadata={"path": True})
    """Weights to start from: a run directory, a vitscale export, an official .npz or a timm state dict;
    null = the pretrain stage's. For .npz and timm files the `model:` section names the architecture."""
    train_split: str = "train"
    """Split that is fine-tuned on (the dev split is carved from it)."""
    test_split: str = "test"
    """Split the final model is tested on, once."""
    dev_fraction: float | None = None
    """Share of the training split held out for selection; null = the preset's (else 0.02)."""
    dev_seed: int = 0
    """Seed of the dev carve."""
    steps: int | None = None
    """Optimizer steps; null = the preset's (else 10000)."""
    base_lr: float | None = None
    """Learning rate of a single fine-tuning run; null = the preset's, when its grid has one value."""
    lr_grid: tuple[float, ...] = ()
    """Learning rates the sweep selects from; empty = the preset's grid."""
    resolution: int = 384
    """Fine-tuning resolution; position embeddings are resampled to the new grid (Sec. 3.2)."""
    batch: int = 512
    """Global batch (App. B.1.1: 512)."""
    micro_batch: int = 32
    """Images per worker per forward/backward."""
    warmup_steps: int | None = None
    """Linear warm-up steps; null = min(500, steps / 10)."""
    momentum: float = 0.9
    """SGD momentum."""
    grad_clip: float | None = 1.0
    """Global-norm clipping."""
    polyak: float | None = None
    """Polyak averaging factor of the weights (the paper: 0.9999 for its headline ImageNet numbers)."""
    zero_stage: int = 0
    """DeepSpeed ZeRO stage (0 = plain data parallelism)."""
    precision: str = "bf16"
    """"bf16" or "fp32"."""
    checkpoint_every: int = 1000
    """Checkpoint every N steps (and at the end); a re-run resumes."""
    log_every: int = 20
    """Progress line every N steps."""
    eval_every: int | None = None
    """Evaluate (dev during selection) every N steps, for schedulers that stop weak trials early."""
    eval_batch: int = 128
    """Images per forward pass during evaluation."""
    num_workers: int = 2
    """DataLoader worker processes per rank."""
    seed: int = 0
    """Seed of the data order and of the new head's dropout."""

    def validate(self) -> None:
        if self.preset is not None:
            one_of(self.preset, tuple(PRESETS), "finetune.preset")
        if self.create_if_missing is not None:
            self.create_if_missing.validate("finetune.create_if_missing")
        if self.dev_fraction is not None:
            positive(self.dev_fraction, "finetune.dev_fraction")
            check(self.dev_fraction < 1, "finetune.dev_fraction", f"must be below 1, got {self.dev_fraction}")
        seed(self.dev_seed, "finetune.dev_seed")
        plain_name(self.train_split, "finetune.train_split")
        plain_name(self.test_split, "finetune.test_split")
        for key in ("steps", "base_lr", "resolution", "batch", "micro_batch", "grad_clip", "checkpoint_every",
                    "log_every", "eval_every", "eval_batch"):
            positive(getattr(self, key), f"finetune.{key}")
        for i, lr in enumerate(self.lr_grid):
            positive(lr, f"finetune.lr_grid[{i}]")
        check(self.micro_batch <= self.batch, "finetune.micro_batch",
              f"({self.micro_batch}) cannot exceed finetune.batch ({self.batch})")
        non_negative(self.warmup_steps, "finetune.warmup_steps")
        probability(self.momentum, "finetune.momentum")
        if self.polyak is not None:
            probability(self.polyak, "finetune.polyak")
        one_of(self.zero_stage, (0, 1, 2, 3), "finetune.zero_stage")
        check(self.polyak is None or self.zero_stage <= 2, "finetune.polyak", "needs finetune.zero_stage <= 2")
        one_of(self.precision, ("bf16", "fp32"), "finetune.precision")
        non_negative(self.num_workers, "finetune.num_workers")
        seed(self.seed, "finetune.seed")
        check(self.train_split != self.test_split, "finetune.test_split",
              f"must differ from finetune.train_split ({self.train_split!r})")

    # -- what the preset fills in --------------------------------------------------------------

    def _preset(self) -> Preset | None:
        return PRESETS[self.preset] if self.preset else None

    def total_steps(self) -> int:
        preset = self._preset()
        return self.steps or (preset.steps if preset else 10_000)

    def grid(self) -> tuple[float, ...]:
        """The learning rates a sweep selects from."""
        preset = self._preset()
        return self.lr_grid or (preset.lr_grid if preset else ()) or ((self.base_lr,) if self.base_lr else ())

    def single_lr(self) -> float | None:
        """The learning rate of one run without selection (None when only a sweep can choose it)."""
        if self.base_lr is not None:
            return self.base_lr
        grid = self.grid()
        return grid[0] if len(grid) == 1 else None

    def dev_share(self) -> float:
        preset = self._preset()
        return self.dev_fraction or (preset.dev_fraction if preset else 0.02)

    def warmup(self) -> int:
        steps = self.total_steps()
        return self.warmup_steps if self.warmup_steps is not None else min(500, steps // 10)

    def recipe(self, base_lr: float) -> TrainConfig:
        """The training recipe at `base_lr`: SGD momentum, cosine decay after linear warm-up, no weight decay."""
        return TrainConfig(
            global_batch=self.batch, micro_batch=self.micro_batch, max_steps=self.total_steps(), epochs=1.0,
            base_lr=base_lr, end_lr=0.0, warmup_steps=self.warmup(), lr_decay="cosine", weight_decay=0.0,
            optimizer="sgd", momentum=self.momentum, grad_clip=self.grad_clip, loss="softmax",
            zero_stage=self.zero_stage, precision=self.precision, checkpoint_every=self.checkpoint_every,
            log_every=self.log_every, seed=self.seed, polyak=self.polyak, eval_every=self.eval_every,
            peak_flops="auto")

    def data(self, endpoint_url: str | None) -> DataConfig:
        return DataConfig(url=self.dataset, split=self.train_split, endpoint_url=endpoint_url,
                          num_workers=self.num_workers, seed=self.seed, shuffle_buffer=10_000)


def finetune_model(model: ModelConfig, resolution: int) -> ModelConfig:
    """The pre-trained architecture at the fine-tuning resolution, without the pre-logits layer (Sec. 3.1)."""
    options = {k: v for k, v in model.options.items() if k != "representation_size"}
    return replace(model, img_size=resolution, options=options)


def selection_job(cfg: FinetuneConfig, model: ModelConfig, init: str | None, base_lr: float, *,
                  use_gpu: bool, endpoint_url: str | None, config_yaml: str = "") -> TrainJob:
    """One trial of the selection: train on the rest of the dev carve, score on the dev part.

    Takes no test split: nothing in a selection job can read it.
    """
    carve = Carve(cfg.dev_share(), cfg.dev_seed, "rest")
    dev = EvalSet("dev", cfg.dataset, cfg.train_split, replace(carve, part="dev"))
    return TrainJob(model=model, data=cfg.data(endpoint_url), train=cfg.recipe(base_lr), use_gpu=use_gpu,
                    carve=carve, init=init, evals=(dev,), eval_batch=cfg.eval_batch, config_yaml=config_yaml,
                    resume_scope=FINETUNE_SCOPE)


def final_job(cfg: FinetuneConfig, model: ModelConfig, init: str | None, base_lr: float, *,
              use_gpu: bool, endpoint_url: str | None, config_yaml: str = "") -> TrainJob:
    """The run that counts: the whole training split, tested once on the test split."""
    test = EvalSet("test", cfg.dataset, cfg.test_split)
    return TrainJob(model=model, data=cfg.data(endpoint_url), train=cfg.recipe(base_lr), use_gpu=use_gpu,
                    init=init, evals=(test,), eval_batch=cfg.eval_batch, config_yaml=config_yaml,
                    resume_scope=FINETUNE_SCOPE)
