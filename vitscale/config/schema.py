"""One typed, frozen config per pipeline stage.

Every field has a default and a docstring-style comment; `loader.py` turns YAML into these classes
and rejects unknown keys and wrong types, and each class's `validate()` rejects impossible values.
Field names are the YAML keys: `train.base_lr` in a pipeline file or on the command line
(`--set train.base_lr=4e-4`) is `TrainConfig.base_lr`.

Defaults follow the paper (../shared/vit-paper.md): the ImageNet-21k ViT-B/16 recipe of Table 3
for pre-training and Table 4 / App. B.1.1 for fine-tuning.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


class ConfigError(ValueError):
    """A config value a user must fix; the message names the dotted key (and file when known)."""

    def __init__(self, key: str, message: str, source: str | None = None):
        self.key = key
        self.source = source
        where = f" (in {source})" if source else ""
        super().__init__(f"{key}: {message}{where}")


def _check(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(key, message)


def _positive(value: float | int | None, key: str) -> None:
    _check(value is None or value > 0, key, f"must be > 0, got {value!r}")


def _non_negative(value: float | int | None, key: str) -> None:
    _check(value is None or value >= 0, key, f"must be >= 0, got {value!r}")


def _one_of(value: Any, choices: tuple, key: str) -> None:
    _check(value in choices, key, f"must be one of {list(choices)}, got {value!r}")


def _probability(value: float, key: str) -> None:
    _check(0.0 <= value < 1.0, key, f"must be in [0, 1), got {value!r}")


@dataclass(frozen=True)
class ModelConfig:
    name: str = "ViT-B/16"
    """Model name as in the paper: "ViT-B/16", "R50x1", "R50x1+ViT-B/16" (`vitscale models` lists them)."""
    img_size: int = 224
    """Input resolution in pixels (square)."""
    classifier: str = "token"
    """"token" (class token, the paper's default) or "gap" (global average pooling, App. D.3)."""
    representation_size: int | None = None
    """Width of the pre-logits layer (dense + tanh) used in pre-training; null = no such layer."""
    pos_emb: str = "learn_1d"
    """"learn_1d" (default), "learn_2d", "none" or "relative" (App. D.4)."""
    pos_emb_placement: str = "input"
    """"input" (default), "every_layer" or "every_layer_shared" (App. D.4)."""
    dropout: float = 0.0
    """Dropout after every dense layer except qkv, and after the position-embedding add."""
    attention_dropout: float = 0.0
    """Dropout on the attention weights."""
    head_bias_init: float = 0.0
    """Initial bias of the zero-initialised head (negative, e.g. -10, for sigmoid multi-label)."""
    activation_checkpointing: bool = False
    """Recompute each block's activations in the backward pass to save memory."""
    depth: int | None = None
    """Override the variant table's number of layers (tiny models for tests and the quickstart)."""
    width: int | None = None
    """Override the variant table's hidden size D."""
    mlp_dim: int | None = None
    """Override the variant table's MLP size."""
    heads: int | None = None
    """Override the variant table's number of attention heads."""

    def validate(self) -> None:
        _positive(self.img_size, "model.img_size")
        _one_of(self.classifier, ("token", "gap"), "model.classifier")
        _one_of(self.pos_emb, ("learn_1d", "learn_2d", "none", "relative"), "model.pos_emb")
        _one_of(self.pos_emb_placement, ("input", "every_layer", "every_layer_shared"),
                "model.pos_emb_placement")
        _probability(self.dropout, "model.dropout")
        _probability(self.attention_dropout, "model.attention_dropout")
        for key in ("representation_size", "depth", "width", "mlp_dim", "heads"):
            _positive(getattr(self, key), f"model.{key}")

    def overrides(self) -> dict[str, Any]:
        """Keyword overrides for `vitscale.models.create_model` (None dims mean "from the table")."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if f.name not in ("name", "img_size")}
        return {k: v for k, v in out.items()
                if not (k in ("depth", "width", "mlp_dim", "heads") and v is None)}


@dataclass(frozen=True)
class SourceConfig:
    """What `vitscale shards write` would be given; used to create a dataset that is absent."""

    kind: str = "synthetic"
    """"synthetic", "digits", "folder:PATH" or "manifest:FILE"."""
    count: int = 2000
    """Number of images (synthetic only)."""
    classes: int = 10
    """Number of classes (synthetic only)."""
    image_size: int = 64
    """Side of generated images in pixels (synthetic only)."""
    multi_label: bool = False
    """Generate JFT-style multi-label samples (synthetic only)."""
    shard_size: int = 500
    """Samples per tar shard."""
    max_side: int = 384
    """Images are pre-resized so their longer side is at most this."""
    quality: int = 90
    """JPEG quality of the written shards."""
    splits: dict[str, float] = field(default_factory=lambda: {"train": 1.0})
    """Named fractions carved reproducibly from the source, e.g. {train: 0.9, minival: 0.1}."""

    def validate(self, prefix: str) -> None:
        _check(self.kind in ("synthetic", "digits") or self.kind.startswith(("folder:", "manifest:")),
               f"{prefix}.kind", f"must be synthetic, digits, folder:PATH or manifest:FILE, got {self.kind!r}")
        for key in ("count", "classes", "image_size", "shard_size", "max_side"):
            _positive(getattr(self, key), f"{prefix}.{key}")
        _check(1 <= self.quality <= 95, f"{prefix}.quality", f"must be in [1, 95] (JPEG), got {self.quality}")
        _check(bool(self.splits) and all(v > 0 for v in self.splits.values()), f"{prefix}.splits",
               f"needs at least one split with a positive fraction, got {self.splits!r}")
        _check(abs(sum(self.splits.values()) - 1.0) < 1e-6, f"{prefix}.splits",
               f"fractions must add up to 1, got {sum(self.splits.values())}")


@dataclass(frozen=True)
class DataConfig:
    url: str = "data/synthetic"
    """Pre-training dataset: a local folder or s3://bucket/prefix of WebDataset shards."""
    split: str = "train"
    """Split of the dataset to pre-train on."""
    create_if_missing: SourceConfig | None = None
    """When set and `url` holds no dataset, write one from this source first (quickstart)."""
    endpoint_url: str | None = None
    """S3-compatible endpoint (MinIO, moto, ...); null = AWS or $AWS_ENDPOINT_URL."""
    num_workers: int = 2
    """DataLoader worker processes per training rank."""
    shuffle_buffer: int = 10_000
    """Bounded shuffle window in samples: memory stays flat however large the dataset."""
    seed: int = 0
    """Seed of the shard and sample order (which rank sees which sample, in which order)."""
    error_budget: float = 0.001
    """Fraction of corrupt/unreadable samples tolerated before the run fails, naming the shards."""

    def validate(self) -> None:
        _check(bool(self.url), "data.url", "must name a folder or s3:// prefix")
        _non_negative(self.num_workers, "data.num_workers")
        _positive(self.shuffle_buffer, "data.shuffle_buffer")
        _check(0.0 <= self.error_budget <= 1.0, "data.error_budget",
               f"must be a fraction in [0, 1], got {self.error_budget}")
        if self.create_if_missing is not None:
            self.create_if_missing.validate("data.create_if_missing")


@dataclass(frozen=True)
class FaultConfig:
    """Fault injection for tests and drills: kill one rank once at a given step."""

    kill_rank: int | None = None
    """Rank whose process exits abruptly; null = no fault."""
    kill_at_step: int | None = None
    """Optimizer step after which that rank dies (only on the first attempt)."""

    def validate(self) -> None:
        _check((self.kill_rank is None) == (self.kill_at_step is None), "train.fault",
               "kill_rank and kill_at_step go together")
        _non_negative(self.kill_rank, "train.fault.kill_rank")
        _positive(self.kill_at_step, "train.fault.kill_at_step")


@dataclass(frozen=True)
class TrainConfig:
    global_batch: int = 4096
    """Images per optimizer step over all workers (Table 3: 4096)."""
    micro_batch: int = 64
    """Images per worker per forward/backward; accumulation steps are derived."""
    epochs: float = 90.0
    """Passes over the training split (Table 3: 90 for ImageNet-21k, 7/14 for JFT)."""
    max_steps: int | None = None
    """Stop after this many optimizer steps (overrides epochs for the schedule length)."""
    base_lr: float = 1e-3
    """Peak learning rate after warm-up (Table 3)."""
    end_lr: float = 0.0
    """Learning rate reached at the last step."""
    warmup_steps: int = 10_000
    """Linear warm-up steps (App. B.1: 10k)."""
    lr_decay: str = "linear"
    """"linear" or "cosine" decay after warm-up."""
    weight_decay: float = 0.03
    """Decoupled weight decay (not on biases, norms, tokens, position embeddings)."""
    adam_beta1: float = 0.9
    """Adam β1."""
    adam_beta2: float = 0.999
    """Adam β2."""
    grad_clip: float | None = 1.0
    """Global-norm gradient clipping; null = off."""
    label_smoothing: float = 0.0
    """Label smoothing, for either loss."""
    loss: str = "softmax"
    """"softmax" cross-entropy, or "sigmoid" (multi-label, JFT-style)."""
    zero_stage: int = 1
    """DeepSpeed ZeRO stage 0-3."""
    offload: bool = False
    """Offload optimizer state (and parameters at stage 3) to CPU memory."""
    precision: str = "bf16"
    """"bf16" or "fp32" (bf16 on CPU works but is slow)."""
    checkpoint_every: int = 1000
    """Save a checkpoint every N optimizer steps (and at the end)."""
    keep_checkpoints: int = 3
    """How many recent checkpoints Ray keeps."""
    log_every: int = 10
    """Print a progress line every N steps (metrics are recorded every step)."""
    seed: int = 0
    """Seed of parameter initialisation and dropout."""
    peak_flops: str = "auto"
    """Peak bf16 FLOP/s per device for MFU: "auto", "H200", "H100", "A100" or a number."""
    metrics_port: int | None = None
    """Base port of the per-worker Prometheus endpoint (the worker with local rank r on a node serves on
    port + r, so a one-GPU pod always answers on this port); 0 = any free port; null = off."""
    fault: FaultConfig = field(default_factory=FaultConfig)
    """Fault injection (tests and drills)."""
    record_samples: bool = False
    """Log the keys of every sample each rank consumes (run_dir/samples/rank{r}.jsonl), for audits."""

    def validate(self) -> None:
        _positive(self.global_batch, "train.global_batch")
        _positive(self.micro_batch, "train.micro_batch")
        _check(self.micro_batch <= self.global_batch, "train.micro_batch",
               f"({self.micro_batch}) cannot exceed train.global_batch ({self.global_batch})")
        _positive(self.epochs, "train.epochs")
        _positive(self.max_steps, "train.max_steps")
        _positive(self.base_lr, "train.base_lr")
        _non_negative(self.end_lr, "train.end_lr")
        _non_negative(self.warmup_steps, "train.warmup_steps")
        _one_of(self.lr_decay, ("linear", "cosine"), "train.lr_decay")
        _non_negative(self.weight_decay, "train.weight_decay")
        _probability(self.adam_beta1, "train.adam_beta1")
        _probability(self.adam_beta2, "train.adam_beta2")
        _positive(self.grad_clip, "train.grad_clip")
        _probability(self.label_smoothing, "train.label_smoothing")
        _one_of(self.loss, ("softmax", "sigmoid"), "train.loss")
        _one_of(self.zero_stage, (0, 1, 2, 3), "train.zero_stage")
        _one_of(self.precision, ("bf16", "fp32"), "train.precision")
        _positive(self.checkpoint_every, "train.checkpoint_every")
        _positive(self.keep_checkpoints, "train.keep_checkpoints")
        _positive(self.log_every, "train.log_every")
        _check(self.metrics_port is None or 0 <= self.metrics_port < 65536, "train.metrics_port",
               f"must be a TCP port or null, got {self.metrics_port}")
        if self.peak_flops not in ("auto", "H200", "H100", "A100"):
            try:
                _positive(float(self.peak_flops), "train.peak_flops")
            except ValueError:
                raise ConfigError("train.peak_flops",
                                  f"must be auto, H200, H100, A100 or FLOP/s, got {self.peak_flops!r}")
        self.fault.validate()


@dataclass(frozen=True)
class EvalConfig:
    """Few-shot linear evaluation (Sec. 4.1): closed-form regularised least squares."""

    datasets: tuple[str, ...] = ()
    """Datasets to probe (folders or s3:// prefixes with train and test splits)."""
    create_if_missing: SourceConfig | None = None
    """Write the (first) probe dataset from this source when it is absent (quickstart: digits)."""
    train_split: str = "train"
    """Split the few-shot examples are drawn from."""
    test_split: str = "test"
    """Split accuracy is reported on."""
    shots: tuple[int, ...] = (1, 5, 10, 25)
    """Examples per class."""
    l2: float = 1.0
    """Ridge regularisation of the least-squares fit."""
    resolution: int = 224
    """Evaluation resolution (resize + centre crop)."""
    batch_size: int = 128
    """Images per forward pass during feature extraction."""
    seed: int = 0
    """Seed of the few-shot example draw."""
    baseline: bool = False
    """Also probe the same architecture with its initial (untrained) weights, to show what training added."""

    def validate(self) -> None:
        _check(all(s > 0 for s in self.shots), "eval.shots", f"must be positive, got {self.shots}")
        _non_negative(self.l2, "eval.l2")
        _positive(self.resolution, "eval.resolution")
        _positive(self.batch_size, "eval.batch_size")
        if self.create_if_missing is not None:
            self.create_if_missing.validate("eval.create_if_missing")


@dataclass(frozen=True)
class FinetuneConfig:
    """Fine-tuning recipe (App. B.1.1, Table 4): SGD momentum, cosine decay, no weight decay."""

    dataset: str = ""
    """Dataset to fine-tune on (folder or s3:// prefix)."""
    train_split: str = "train"
    """Split that is fine-tuned on (the dev split is carved from it)."""
    test_split: str = "test"
    """Split the winner is tested on, once."""
    dev_fraction: float = 0.02
    """Fraction of the training split held out for selection (10% Pets/Flowers, 2% CIFAR, 1% ImageNet)."""
    steps: int = 10_000
    """Optimizer steps (Table 4)."""
    batch_size: int = 512
    """Global batch (App. B.1.1: 512)."""
    base_lr: float = 0.01
    """Peak learning rate."""
    warmup_steps: int = 500
    """Linear warm-up steps."""
    momentum: float = 0.9
    """SGD momentum."""
    grad_clip: float | None = 1.0
    """Global-norm clipping."""
    resolution: int = 384
    """Fine-tuning resolution; position embeddings are resampled to the new grid."""
    checkpoint: str | None = None
    """Pre-trained weights (.npz, .pth, .safetensors or a vitscale export); null = the pretrain stage's."""

    def validate(self) -> None:
        _check(0.0 < self.dev_fraction < 1.0, "finetune.dev_fraction",
               f"must be in (0, 1), got {self.dev_fraction}")
        for key in ("steps", "batch_size", "base_lr", "resolution"):
            _positive(getattr(self, key), f"finetune.{key}")
        _non_negative(self.warmup_steps, "finetune.warmup_steps")
        _probability(self.momentum, "finetune.momentum")
        _positive(self.grad_clip, "finetune.grad_clip")


@dataclass(frozen=True)
class SweepConfig:
    """Ray Tune grid over fine-tuning (Table 4 learning-rate grids) and regularisation knobs."""

    base_lr: tuple[float, ...] = (0.001, 0.003, 0.01, 0.03)
    """Learning-rate grid (Table 4)."""
    weight_decay: tuple[float, ...] = ()
    """Optional weight-decay grid (Sec. 4.3 regularisation sweep)."""
    dropout: tuple[float, ...] = ()
    """Optional dropout grid."""
    label_smoothing: tuple[float, ...] = ()
    """Optional label-smoothing grid."""
    metric: str = "dev_accuracy"
    """Selection metric, measured on the dev split carved from the training set."""
    max_concurrent: int = 2
    """Trials run at once."""
    scheduler: str = "fifo"
    """"fifo" or "asha" (early stopping of weak trials)."""

    def validate(self) -> None:
        _check(len(self.base_lr) > 0 and all(v > 0 for v in self.base_lr), "sweep.base_lr",
               f"needs positive values, got {self.base_lr}")
        _positive(self.max_concurrent, "sweep.max_concurrent")
        _one_of(self.scheduler, ("fifo", "asha"), "sweep.scheduler")


@dataclass(frozen=True)
class StudyConfig:
    """Scaling study (Sec. 4.4): a grid of model x epochs x data, compute in exaFLOPs."""

    models: tuple[str, ...] = ()
    """Models of the grid."""
    epochs: tuple[float, ...] = (7.0,)
    """Pre-training epochs per cell."""
    datasets: tuple[str, ...] = ()
    """Pre-training datasets per cell."""
    out: str = "study"
    """Folder (under the run directory) for tables and plots."""

    def validate(self) -> None:
        _check(all(e > 0 for e in self.epochs), "study.epochs", f"must be positive, got {self.epochs}")


@dataclass(frozen=True)
class ClusterConfig:
    """Where and how wide the Ray Train job runs."""

    num_workers: int = 8
    """Ray Train workers (one per GPU)."""
    use_gpu: bool = True
    """Give each worker a GPU."""
    cpus_per_worker: float = 8.0
    """CPU cores reserved per worker (data loading happens there)."""
    gpus_per_worker: float = 1.0
    """GPUs per worker when use_gpu."""
    storage_path: str = "~/vitscale-runs"
    """Run storage shared by all nodes: a local/NFS path or s3://bucket/prefix."""
    run_name: str | None = None
    """Stable run name: re-submitting a job with the same name resumes it; null = pipeline name."""
    max_failures: int = 3
    """Worker-group restarts Ray Train attempts before giving up (-1 = unlimited)."""
    address: str | None = None
    """Ray address; null = $RAY_ADDRESS, or a new local Ray on this machine."""
    local_num_cpus: int | None = None
    """CPUs a locally started Ray may use; null = all."""

    def validate(self) -> None:
        _positive(self.num_workers, "cluster.num_workers")
        _positive(self.cpus_per_worker, "cluster.cpus_per_worker")
        _positive(self.gpus_per_worker, "cluster.gpus_per_worker")
        _check(self.max_failures >= -1, "cluster.max_failures", f"must be >= -1, got {self.max_failures}")
        _positive(self.local_num_cpus, "cluster.local_num_cpus")


STAGES = ("pretrain", "fewshot", "finetune", "sweep", "study")


@dataclass(frozen=True)
class PipelineConfig:
    """A whole pipeline: which stages run, and one config per stage."""

    name: str = "pipeline"
    """Pipeline name; the default run name."""
    stages: tuple[str, ...] = ("pretrain",)
    """Stages to run, in order: pretrain, fewshot, finetune, sweep, study."""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)
    sweep: SweepConfig = field(default_factory=SweepConfig)
    study: StudyConfig = field(default_factory=StudyConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)

    def validate(self) -> None:
        _check(bool(self.name) and "/" not in self.name, "name", f"must be a plain name, got {self.name!r}")
        _check(len(self.stages) > 0, "stages", "needs at least one stage")
        for stage in self.stages:
            _one_of(stage, STAGES, "stages")
        self.model.validate()
        self.data.validate()
        self.train.validate()
        self.eval.validate()
        self.finetune.validate()
        self.sweep.validate()
        self.study.validate()
        self.cluster.validate()
        # Cross-stage combinations that cannot work.
        _check(not (self.train.offload and self.train.zero_stage == 0), "train.offload",
               "needs train.zero_stage >= 1 (ZeRO-Offload moves optimizer state)")
        _check(self.train.fault.kill_rank is None or self.train.fault.kill_rank < self.cluster.num_workers,
               "train.fault.kill_rank",
               f"({self.train.fault.kill_rank}) must be below cluster.num_workers ({self.cluster.num_workers})")
        per_step = self.train.micro_batch * self.cluster.num_workers
        if self.train.global_batch % per_step:
            lower = max(per_step, self.train.global_batch // per_step * per_step)
            raise ConfigError(
                "train.global_batch",
                f"({self.train.global_batch}) must be a multiple of train.micro_batch x cluster.num_workers "
                f"= {self.train.micro_batch} x {self.cluster.num_workers} = {per_step}; "
                f"try {lower} or {lower + per_step}")
        if "fewshot" in self.stages:
            _check(len(self.eval.datasets) > 0, "eval.datasets", "the fewshot stage needs at least one dataset")
        if "finetune" in self.stages or "sweep" in self.stages:
            _check(bool(self.finetune.dataset), "finetune.dataset", "the finetune/sweep stages need a dataset")
