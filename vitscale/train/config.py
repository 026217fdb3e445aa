"""The `train` section: the pre-training recipe (Table 3, App. B.1) and how the loop runs it.

Field names are the YAML keys: `train.base_lr` in a pipeline file or `--set train.base_lr=4e-4`.
Defaults are the paper's ImageNet-21k ViT-B/16 recipe.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vitscale.config.checks import (
    ConfigError,
    check,
    check_address,
    finite,
    non_negative,
    non_negative_int,
    one_of,
    positive,
    probability,
    seed,
)
from vitscale.config.fields import RESUME_FREE
from vitscale.train.batch import derive_batch, elastic_split
from vitscale.train.deepspeed_keys import check_overrides as check_deepspeed_overrides

PEAK_FLOPS_NAMES = ("auto", "H200", "H100", "A100")
OBJECTIVES = ("supervised", "masked_patch")
UNREAD_BY_OBJECTIVE = {"supervised": ("masked_patch",), "masked_patch": ("loss", "label_smoothing")}
"""The `train:` keys each objective never reads: a recipe may carry them for the other objective (a study
cell switches it), and a resumed run may change them (`train/resume.py`)."""
PATCH_TARGETS = ("mean_colour", "downsized_4x4", "pixels")  # models/masked_patch.py's TARGETS
COMPILE_MODES = ("default", "max-autotune-no-cudagraphs", "max-autotune", "reduce-overhead")


@dataclass(frozen=True)
class FaultConfig:
    """Fault injection for tests and drills: kill one rank once at a given step."""

    kill_rank: int | None = None
    """Rank whose process exits abruptly; null = no fault."""
    kill_at_step: int | None = None
    """Optimizer step after which that rank dies (only on the first attempt)."""
    kill_with: str = "exit"
    """How: "exit" ends the process on the spot (what a segfault or an OOM kill looks like to Ray);
    "SIGTERM" sends it the signal a spot VM's shutdown or a pod's deletion sends (a preemption
    notice: the run checkpoints at the next step, then the rank leaves)."""

    def validate(self, section: str = "train.fault") -> None:
        check((self.kill_rank is None) == (self.kill_at_step is None), section,
              "kill_rank and kill_at_step go together")
        one_of(self.kill_with, ("exit", "SIGTERM"), f"{section}.kill_with")
        non_negative(self.kill_rank, f"{section}.kill_rank")
        positive(self.kill_at_step, f"{section}.kill_at_step")


@dataclass(frozen=True)
class MaskedPatchConfig:
    """Masked patch prediction (Sec. 4.6, App. B.1.2): what is corrupted and what is predicted.

    The defaults are the paper's: 50% of the patch embeddings corrupted, of those 80% replaced by the
    [mask] embedding, 10% by another patch's, 10% kept; each corrupted patch's 3-bit mean colour predicted
    (512-way softmax). Which patches: `data/corruption.py`; the model and targets: `models/masked_patch.py`.
    """

    target: str = "mean_colour"
    """"mean_colour" (3-bit mean colour, 512 classes), "downsized_4x4" (16 x 3-bit colours of the patch
    downsized to 4 x 4) or "pixels" (the whole patch, L2)."""
    corrupt: float = 0.5
    """Share of each image's patches corrupted and predicted."""
    mask: float = 0.8
    """Share of the corrupted patches replaced by the learnable [mask] embedding."""
    swap: float = 0.1
    """Share of the corrupted patches replaced by the embedding of another patch of the same image."""
    bits: int = 3
    """Bits per colour channel of the colour targets."""

    def validate(self, section: str = "train.masked_patch") -> None:
        one_of(self.target, PATCH_TARGETS, f"{section}.target")
        check(0.0 < self.corrupt <= 1.0, f"{section}.corrupt", f"must be in (0, 1], got {self.corrupt!r}")
        for key in ("mask", "swap"):
            value = getattr(self, key)
            check(isinstance(value, (int, float)) and 0.0 <= value <= 1.0, f"{section}.{key}",
                  f"must be in [0, 1], got {value!r}")
        if self.mask + self.swap > 1.0:
            raise ConfigError(f"{section}.swap", f"mask + swap ({self.mask} + {self.swap}) must be at most 1: the "
                                                 "rest of the corrupted patches are kept", also=(f"{section}.mask",))
        # 2^(3 bits) classes per colour: 4,096 at 4 bits; at 5 a ViT-B/16 head would hold 25M weights per
        # colour predicted (16 of them for downsized_4x4), more than the encoder it trains.
        check(isinstance(self.bits, int) and not isinstance(self.bits, bool) and 1 <= self.bits <= 4,
              f"{section}.bits", f"must be an int in [1, 4] (2^(3 x bits) colour classes), got {self.bits!r}")


@dataclass(frozen=True)
class TrainConfig:
    global_batch: int = 4096
    """Images per optimizer step over all workers (Table 3: 4096)."""
    micro_batch: int = 64
    """The most images one worker takes per forward/backward; accumulation steps are derived. A worker whose
    share of `global_batch` is smaller takes its whole share at once."""
    epochs: float = 90.0
    """Passes over the training split (Table 3: 90 for ImageNet-21k, 7/14 for JFT)."""
    max_steps: int | None = None
    """Stop after this many optimizer steps (overrides epochs for the schedule length)."""
    base_lr: float = 1e-3
    """Peak learning rate after warm-up (Table 3)."""
    end_lr: float = 0.0
    """Learning rate reached at the last step (at most `base_lr`)."""
    warmup_steps: int = 10_000
    """Linear warm-up steps (App. B.1: 10k). A run of no more steps never reaches `base_lr` (the ramp is cut off
    at its last step, `optim.lr_at`); rank 0 says so in one line as such a run starts."""
    lr_decay: str = "linear"
    """"linear" or "cosine" decay after warm-up."""
    weight_decay: float = 0.03
    """Decoupled weight decay (not on biases, norms, tokens, position embeddings)."""
    optimizer: str = "adamw"
    """"adamw" (pre-training, App. B.1) or "sgd" with momentum (fine-tuning, App. B.1.1)."""
    momentum: float = 0.9
    """SGD momentum (optimizer "sgd" only)."""
    adam_beta1: float = 0.9
    """Adam β1."""
    adam_beta2: float = 0.999
    """Adam β2."""
    grad_clip: float | None = 1.0
    """Global-norm gradient clipping; null = off."""
    label_smoothing: float = 0.0
    """Label smoothing, for either loss."""
    loss: str = "softmax"
    """"softmax" cross-entropy, or "sigmoid" (multi-label, JFT-style); supervised objective only."""
    objective: str = "supervised"
    """What pre-training learns from: "supervised" (the labels, Sec. 4.1-4.5) or "masked_patch" (no labels:
    masked patch prediction, Sec. 4.6; `masked_patch` says how). Fine-tuning is always supervised."""
    masked_patch: MaskedPatchConfig = field(default_factory=MaskedPatchConfig)
    """The masked patch objective's settings (read only when `objective` is "masked_patch")."""
    zero_stage: int = 1
    """DeepSpeed ZeRO stage 0-3."""
    offload: bool = False
    """Offload optimizer state (and parameters at stage 3) to CPU memory (needs zero_stage >= 1)."""
    precision: str = "bf16"
    """"bf16" or "fp32" (bf16 on CPU works but is slow)."""
    checkpoint_every: int = field(default=1000, metadata=RESUME_FREE)
    """Save a checkpoint every N optimizer steps (and at the end)."""
    keep_checkpoints: int = field(default=3, metadata=RESUME_FREE)
    """How many recent checkpoints Ray keeps."""
    log_every: int = field(default=10, metadata=RESUME_FREE)
    """Print a progress line every N steps (metrics are recorded every step)."""
    seed: int = 0
    """Seed of parameter initialisation and dropout."""
    peak_flops: str = field(default="auto", metadata=RESUME_FREE)
    """Peak bf16 FLOP/s per device for MFU: "auto", "H200", "H100", "A100" or a number."""
    metrics_port: int | None = field(default=None, metadata=RESUME_FREE)
    """Base port of the per-worker Prometheus endpoint (the worker with local rank r on a node serves on
    port + r, so a one-GPU pod always answers on this port); 0 = any free port; null = off. A port another
    process holds is served on a free one instead, named in the worker's line (`train/metrics.py`)."""
    metrics_addr: str = field(default="127.0.0.1", metadata=RESUME_FREE)
    """Interface the Prometheus endpoint binds: loopback by default (the metrics are not for the
    network at large); "0.0.0.0" lets a Prometheus in the cluster scrape the pod (k8s/ sets it)."""
    max_skipped_steps: int = field(default=10, metadata=RESUME_FREE)
    """Steps whose loss or gradients are not finite (or that DeepSpeed skips itself) that are skipped,
    not applied, before the run stops with an error naming the step. Counted over the whole run,
    restarts included (the count is in every checkpoint)."""
    polyak: float | None = None
    """Polyak averaging of the weights (an exponential moving average with this factor, e.g. 0.9999),
    evaluated beside the raw weights; null = off. Needs zero_stage <= 2 (whole weights on every rank)."""
    eval_every: int | None = field(default=None, metadata=RESUME_FREE)
    """Evaluate the job's evaluation sets every N steps (and always after the last); null = last only."""
    fault: FaultConfig = field(default_factory=FaultConfig, metadata=RESUME_FREE)
    """Fault injection (tests and drills)."""
    record_samples: bool = field(default=False, metadata=RESUME_FREE)
    """Log the keys of every sample each rank consumes (run_dir/samples/rank{r}.jsonl), for audits."""
    compile: bool | str = field(default="auto", metadata=RESUME_FREE)
    """torch.compile the model inside the DeepSpeed engine (inductor): true, false, or "auto" = on when the
    worker trains on a GPU at ZeRO 0-2, or at ZeRO 3 on one rank without offload. Same weights, checkpoints
    and resume either way; the first step of each worker process pays the compilation (under a minute for
    ViT-B/16). ZeRO 0-2 compile the whole model (`engine.compile`). ZeRO 3 fetches parameters from hooks
    that torch.compile cannot trace through (it recompiles them per layer type, then falls back): measured
    on an H200 with a hook per layer, a compiled ZeRO-3 ViT-B/16 step ran at two thirds of the eager one's
    speed (benchmarks/RESULTS.md). On one rank, where the weights stay put and those hooks are removed
    (`train/one_rank.py`), the whole model is compiled as at ZeRO 1; on several ranks "auto" leaves ZeRO 3
    eager, and true compiles the whole model, hooks and all."""
    compile_mode: str = field(default="default", metadata=RESUME_FREE)
    """torch.compile's mode when compiling: "default", "max-autotune-no-cudagraphs" (searches matmul
    and fusion configs: longer compilation), "max-autotune" or "reduce-overhead" (both add CUDA graphs)."""
    deepspeed: dict[str, Any] = field(default_factory=dict, metadata=RESUME_FREE)
    """DeepSpeed settings merged over the config vitscale generates (e.g. {zero_optimization:
    {reduce_bucket_size: 5.0e8}}); keys vitscale derives from this section are refused
    (`train/deepspeed_keys.py`). Tuning knobs: a resumed run may change them, except those that change what a
    step computes or how a checkpoint is laid out (`FIXED_ON_RESUME`: `communication_data_type`,
    `zero_optimization.sub_group_size`, ...)."""

    def compiles(self, on_gpu: bool, world_size: int = 1) -> bool:
        """Whether the worker compiles the model: `compile`, "auto" resolved by the device, the ZeRO stage and,
        at ZeRO 3, the world size and offload."""
        if self.compile != "auto":
            return bool(self.compile)
        return on_gpu and (self.zero_stage < 3 or (world_size == 1 and not self.offload))

    def check_batch_split(self, workers: int | range, section: str = "train",
                          workers_key: str = "cluster.num_workers") -> None:
        """The one batch rule, checked before Ray starts: `global_batch` is `micro_batch` x `workers` x the
        accumulation steps (`train/batch.py`'s `derive_batch` decides). A range of world sizes (an elastic
        run) needs a batch plan at every one of them (`elastic_split`): sizes that do not divide the global
        batch take uneven, loss-weighted shares; only a micro-batch that would be empty is refused."""
        try:
            if isinstance(workers, range) and len(workers) > 1:
                elastic_split(self.global_batch, self.micro_batch, workers, section=section, world=workers_key)
            else:
                derive_batch(self.global_batch, self.micro_batch, workers[0] if isinstance(workers, range) else workers,
                             section=section, world=workers_key)
        except ValueError as exc:
            raise ConfigError(f"{section}.global_batch", str(exc).removeprefix(f"{section}.global_batch=")) from None

    def validate(self, section: str = "train") -> None:
        """Check every value; errors name `section.key` (`finetune.train.base_lr` in a fine-tuning job)."""
        s = section
        positive(self.global_batch, f"{s}.global_batch")
        positive(self.micro_batch, f"{s}.micro_batch")
        positive(self.epochs, f"{s}.epochs")
        positive(self.max_steps, f"{s}.max_steps")
        positive(self.base_lr, f"{s}.base_lr")
        non_negative(self.end_lr, f"{s}.end_lr")
        check(self.end_lr <= self.base_lr, f"{s}.end_lr",
              f"({self.end_lr}) cannot exceed {s}.base_lr ({self.base_lr})")
        non_negative(self.warmup_steps, f"{s}.warmup_steps")
        one_of(self.lr_decay, ("linear", "cosine"), f"{s}.lr_decay")
        non_negative(self.weight_decay, f"{s}.weight_decay")
        one_of(self.optimizer, ("adamw", "sgd"), f"{s}.optimizer")
        probability(self.momentum, f"{s}.momentum")
        probability(self.adam_beta1, f"{s}.adam_beta1")
        probability(self.adam_beta2, f"{s}.adam_beta2")
        positive(self.grad_clip, f"{s}.grad_clip")
        probability(self.label_smoothing, f"{s}.label_smoothing")
        one_of(self.loss, ("softmax", "sigmoid"), f"{s}.loss")
        one_of(self.objective, OBJECTIVES, f"{s}.objective")
        self.masked_patch.validate(f"{s}.masked_patch")
        one_of(self.zero_stage, (0, 1, 2, 3), f"{s}.zero_stage")
        check(not (self.offload and self.zero_stage == 0), f"{s}.offload",
              f"needs {s}.zero_stage >= 1 (ZeRO-Offload moves optimizer state)")
        one_of(self.precision, ("bf16", "fp32"), f"{s}.precision")
        positive(self.checkpoint_every, f"{s}.checkpoint_every")
        positive(self.keep_checkpoints, f"{s}.keep_checkpoints")
        positive(self.log_every, f"{s}.log_every")
        seed(self.seed, f"{s}.seed")
        if self.polyak is not None:
            probability(self.polyak, f"{s}.polyak")
            check(self.zero_stage <= 2, f"{s}.polyak",
                  f"needs {s}.zero_stage <= 2 (stage 3 shards the weights being averaged)")
        positive(self.eval_every, f"{s}.eval_every")
        check(self.metrics_port is None or 0 <= self.metrics_port < 65536, f"{s}.metrics_port",
              f"must be a TCP port or null, got {self.metrics_port}")
        check_address(self.metrics_addr, f"{s}.metrics_addr")
        non_negative_int(self.max_skipped_steps, f"{s}.max_skipped_steps")
        if self.peak_flops not in PEAK_FLOPS_NAMES:
            try:
                value = float(self.peak_flops)
            except ValueError:
                raise ConfigError(f"{s}.peak_flops", f"must be one of {list(PEAK_FLOPS_NAMES)} or FLOP/s, "
                                                      f"got {self.peak_flops!r}") from None
            finite(value, f"{s}.peak_flops")
            positive(value, f"{s}.peak_flops")
        one_of(self.compile, (True, False, "auto"), f"{s}.compile")
        one_of(self.compile_mode, COMPILE_MODES, f"{s}.compile_mode")
        self.fault.validate(f"{s}.fault")
        check_deepspeed_overrides(self.deepspeed, s)
