"""The `train` section: the pre-training recipe (Table 3, App. B.1) and how the loop runs it.

Field names are the YAML keys: `train.base_lr` in a pipeline file or `--set train.base_lr=4e-4`.
Defaults are the paper's ImageNet-21k ViT-B/16 recipe.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vitscale.config.checks import (ConfigError, check, check_address, finite, non_negative, non_negative_int, one_of,
                                    positive, probability, seed)

PEAK_FLOPS_NAMES = ("auto", "H200", "H100", "A100")


@dataclass(frozen=True)
class FaultConfig:
    """Fault injection for tests and drills: kill one rank once at a given step."""

    kill_rank: int | None = None
    """Rank whose process exits abruptly; null = no fault."""
    kill_at_step: int | None = None
    """Optimizer step after which that rank dies (only on the first attempt)."""

    def validate(self) -> None:
        check((self.kill_rank is None) == (self.kill_at_step is None), "train.fault",
              "kill_rank and kill_at_step go together")
        non_negative(self.kill_rank, "train.fault.kill_rank")
        positive(self.kill_at_step, "train.fault.kill_at_step")


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
    """Learning rate reached at the last step (at most `base_lr`)."""
    warmup_steps: int = 10_000
    """Linear warm-up steps (App. B.1: 10k)."""
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
    """"softmax" cross-entropy, or "sigmoid" (multi-label, JFT-style)."""
    zero_stage: int = 1
    """DeepSpeed ZeRO stage 0-3."""
    offload: bool = False
    """Offload optimizer state (and parameters at stage 3) to CPU memory (needs zero_stage >= 1)."""
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
    metrics_addr: str = "127.0.0.1"
    """Interface the Prometheus endpoint binds: loopback by default (the metrics are not for the
    network at large); "0.0.0.0" lets a Prometheus in the cluster scrape the pod (k8s/ sets it)."""
    max_skipped_steps: int = 10
    """Steps whose loss or gradients are not finite (or that DeepSpeed skips itself) that are skipped,
    not applied, before the run stops with an error naming the step. Counted over the whole run,
    restarts included (the count is in every checkpoint)."""
    polyak: float | None = None
    """Polyak averaging of the weights (an exponential moving average with this factor, e.g. 0.9999),
    evaluated beside the raw weights; null = off. Needs zero_stage <= 2 (whole weights on every rank)."""
    eval_every: int | None = None
    """Evaluate the job's evaluation sets every N steps (and always after the last); null = last only."""
    fault: FaultConfig = field(default_factory=FaultConfig)
    """Fault injection (tests and drills)."""
    record_samples: bool = False
    """Log the keys of every sample each rank consumes (run_dir/samples/rank{r}.jsonl), for audits."""

    def validate(self) -> None:
        positive(self.global_batch, "train.global_batch")
        positive(self.micro_batch, "train.micro_batch")
        check(self.micro_batch <= self.global_batch, "train.micro_batch",
              f"({self.micro_batch}) cannot exceed train.global_batch ({self.global_batch})")
        positive(self.epochs, "train.epochs")
        positive(self.max_steps, "train.max_steps")
        positive(self.base_lr, "train.base_lr")
        non_negative(self.end_lr, "train.end_lr")
        check(self.end_lr <= self.base_lr, "train.end_lr",
              f"({self.end_lr}) cannot exceed train.base_lr ({self.base_lr})")
        non_negative(self.warmup_steps, "train.warmup_steps")
        one_of(self.lr_decay, ("linear", "cosine"), "train.lr_decay")
        non_negative(self.weight_decay, "train.weight_decay")
        one_of(self.optimizer, ("adamw", "sgd"), "train.optimizer")
        probability(self.momentum, "train.momentum")
        probability(self.adam_beta1, "train.adam_beta1")
        probability(self.adam_beta2, "train.adam_beta2")
        positive(self.grad_clip, "train.grad_clip")
        probability(self.label_smoothing, "train.label_smoothing")
        one_of(self.loss, ("softmax", "sigmoid"), "train.loss")
        one_of(self.zero_stage, (0, 1, 2, 3), "train.zero_stage")
        check(not (self.offload and self.zero_stage == 0), "train.offload",
              "needs train.zero_stage >= 1 (ZeRO-Offload moves optimizer state)")
        one_of(self.precision, ("bf16", "fp32"), "train.precision")
        positive(self.checkpoint_every, "train.checkpoint_every")
        positive(self.keep_checkpoints, "train.keep_checkpoints")
        positive(self.log_every, "train.log_every")
        seed(self.seed, "train.seed")
        if self.polyak is not None:
            probability(self.polyak, "train.polyak")
            check(self.zero_stage <= 2, "train.polyak",
                  "needs train.zero_stage <= 2 (stage 3 shards the weights being averaged)")
        positive(self.eval_every, "train.eval_every")
        check(self.metrics_port is None or 0 <= self.metrics_port < 65536, "train.metrics_port",
              f"must be a TCP port or null, got {self.metrics_port}")
        check_address(self.metrics_addr, "train.metrics_addr")
        non_negative_int(self.max_skipped_steps, "train.max_skipped_steps")
        if self.peak_flops not in PEAK_FLOPS_NAMES:
            try:
                value = float(self.peak_flops)
            except ValueError:
                raise ConfigError("train.peak_flops", f"must be one of {list(PEAK_FLOPS_NAMES)} or FLOP/s, "
                                                      f"got {self.peak_flops!r}") from None
            finite(value, "train.peak_flops")
            positive(value, "train.peak_flops")
        self.fault.validate()
