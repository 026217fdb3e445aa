"""`train.deepspeed`: DeepSpeed settings vitscale does not own, merged over the config it generates.

vitscale writes the DeepSpeed config from the `train:` section (`train/engine.py`). A few of its keys
are vitscale's own: the batch split, the optimizer and its schedule (the LR is set every step from
`lr_at`), precision, clipping, the ZeRO stage and offload. Setting one of those here would silently
disagree with the `train:` value the run directory records, so it is refused, naming the `train:` key
to set instead. Everything else (bucket sizes, `overlap_comm`, ZeRO-3 prefetch knobs, communication
dtype, the flops profiler, ...) is passed to DeepSpeed as given. Pure: no torch, no DeepSpeed, so
the loader checks it before Ray starts.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vitscale.config.checks import ConfigError

OWNED: dict[str, str] = {
    "train_batch_size": "train.global_batch",
    "train_micro_batch_size_per_gpu": "train.micro_batch",
    "gradient_accumulation_steps": "train.global_batch / train.micro_batch",
    "optimizer": "train.optimizer (and its base_lr, weight_decay, momentum, adam_beta1/2)",
    "scheduler": "train.lr_decay / train.warmup_steps (vitscale sets the LR every step)",
    "bf16": "train.precision",
    "fp16": "train.precision",
    "gradient_clipping": "train.grad_clip",
    "zero_optimization.stage": "train.zero_stage",
    "zero_optimization.offload_optimizer": "train.offload",
    "zero_optimization.offload_param": "train.offload",
    "zero_force_ds_cpu_optimizer": "train.offload",
    "zero_allow_untested_optimizer": "train.optimizer",
}
"""DeepSpeed config keys (dotted) that vitscale derives from a `train:` key, and that key."""


def check_overrides(overrides: Mapping[str, Any], section: str = "train") -> None:
    """Refuse any key of `overrides` (the `deepspeed:` mapping) that vitscale owns, naming what to set."""
    for dotted in leaves(overrides):
        for owned, instead in OWNED.items():
            if dotted == owned or dotted.startswith(f"{owned}."):
                raise ConfigError(f"{section}.deepspeed.{dotted}", f"is vitscale's own; set {instead} instead")


def merge_overrides(generated: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """`generated` with `overrides` merged over it, mappings key by key (pure; neither input changes)."""
    out = dict(generated)
    for key, value in overrides.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merge_overrides(out[key], value)
        else:
            out[key] = value
    return out


def leaves(mapping: Mapping[str, Any], prefix: str = "") -> list[str]:
    """The dotted keys of `mapping`'s leaves (an owned section counts as one)."""
    out: list[str] = []
    for key, value in mapping.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping) and value and not any(o == dotted for o in OWNED):
            out.extend(leaves(value, f"{dotted}."))
        else:
            out.append(dotted)
    return out
