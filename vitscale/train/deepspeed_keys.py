"""`train.deepspeed`: DeepSpeed settings vitscale does not own, merged over the config it generates.

vitscale writes the DeepSpeed config from the `train:` section (`train/engine.py`). A few of its keys
are vitscale's own: the batch split, the optimizer and its schedule (the LR is set every step from
`lr_at`), precision, clipping, the ZeRO stage and offload. Setting one of those here would silently
disagree with the `train:` value the run directory records, so it is refused, naming the `train:` key
to set instead. Everything else (bucket sizes, `overlap_comm`, ZeRO-3 prefetch knobs, communication
dtype, the flops profiler, ...) is passed to DeepSpeed as given. Pure: no torch, no DeepSpeed, so
the loader checks it before Ray starts.

DeepSpeed's own reading of the rest (`train/engine.py` `check_settings`, when the pipeline loads) is worded
here: `ReadKeys` records which top-level keys its parser asks for, `check_spelling` refuses a key it never
read that is spelt close to one it did, and `refused_section` names the key a section model of DeepSpeed's
refused. A key resembling none DeepSpeed reads is left to it, which ignores it: some are read outside its
config class (sequence parallelism's), and refusing a valid key would leave no way to pass it.
"""

from __future__ import annotations

import re
import typing
from collections.abc import KeysView, Mapping
from typing import Any

from vitscale.config.checks import ConfigError
from vitscale.config.suggest import closest

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
    # DeepSpeed's deprecated spellings of the two offloads: it turns them into those (an offloaded optimizer that
    # vitscale's torch optimizer cannot be, refused by every worker as it built its engine).
    "zero_optimization.cpu_offload": "train.offload",
    "zero_optimization.cpu_offload_param": "train.offload",
    # Mixed precision by autocast: another precision than train.precision's, which a resumed run could change.
    "torch_autocast": "train.precision",
    "zero_force_ds_cpu_optimizer": "train.offload",
    "zero_allow_untested_optimizer": "train.optimizer",
}
"""DeepSpeed config keys (dotted) that vitscale derives from a `train:` key, and that key."""

FIXED_ON_RESUME: dict[str, str] = {
    "communication_data_type": "the dtype gradients are averaged in",
    "data_types": "the dtype gradients accumulate in (grad_accum_dtype)",
    "gradient_predivide_factor": "how gradients are scaled around their average",
    "prescale_gradients": "how gradients are scaled around their average",
    "sparse_gradients": "how embedding gradients are reduced",
    "progressive_layer_drop": "which layers a step trains",
    "zero_optimization.sub_group_size": "how ZeRO 3 groups the optimizer state it saves",
    "zero_optimization.round_robin_gradients": "which rank's partition holds each gradient",
    "zero_optimization.parameter_alignment": "the padding of the partitions a checkpoint holds",
    "zero_optimization.elastic_checkpoint": "the layout of the optimizer state a checkpoint holds",
    "zero_optimization.zero_hpz_partition_size": "how parameters are partitioned (hpZ)",
    "zero_optimization.zero_quantized_weights": "the precision weights are gathered in",
    "zero_optimization.zero_quantized_nontrainable_weights": "the precision weights are gathered in",
    "zero_optimization.zero_quantized_gradients": "the precision gradients are reduced in",
    "zero_optimization.compute_grad_norm": "whether the gradient norm clips the step",
    "zero_optimization.zenflow": "the optimizer's update rule (ZenFlow)",
}
"""`train.deepspeed` keys (dotted) that change what a step computes or how a checkpoint is laid out, and what: a
resumed run keeps them (`train/resume.py`) as it keeps `train.precision`. The rest of `train.deepspeed` is
tuning (bucket sizes, overlap, prefetch, persistence, logging), the same steps and checkpoints either way."""


MERGED_SECTIONS = ("zero_optimization", "timers")
"""Sections vitscale writes keys of its own into (`train/engine.py`), which a user's merge into key by key: a value
there that is not a mapping would replace vitscale's whole section, and `deepspeed_config` reads inside it."""


def check_overrides(overrides: Mapping[str, Any], section: str = "train") -> None:
    """Refuse any key of `overrides` (the `deepspeed:` mapping) that vitscale owns, naming what to set, and a
    section vitscale merges into (`MERGED_SECTIONS`) that is not a mapping."""
    for name in MERGED_SECTIONS:
        if name in overrides and not isinstance(overrides[name], Mapping):
            raise ConfigError(f"{section}.deepspeed.{name}", f"must be a mapping of DeepSpeed's {name} "
                              f"settings (merged key by key over vitscale's), got {overrides[name]!r}")
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


class ReadKeys(dict[str, Any]):
    """A config mapping that records which top-level keys a parser asked for, present or not (`read`); a
    shallow copy shares the record, so the copy DeepSpeedConfig makes of it counts too."""

    def __init__(self, values: Mapping[str, Any]) -> None:
        super().__init__(values)
        self.read: set[str] = set()

    def get(self, key: Any, default: Any = None) -> Any:
        self.read.add(key)
        return super().get(key, default)

    def __getitem__(self, key: Any) -> Any:
        self.read.add(key)
        return super().__getitem__(key)

    def __contains__(self, key: Any) -> bool:
        self.read.add(key)
        return super().__contains__(key)

    def keys(self) -> Any:  # DeepSpeed also asks `key in config.keys()`
        return _ReadKeysView(self)


class _ReadKeysView(KeysView[str]):
    def __init__(self, config: ReadKeys) -> None:
        super().__init__(config)
        self.config = config

    def __contains__(self, key: Any) -> bool:
        return key in self.config


def check_spelling(overrides: Mapping[str, Any], read: set[str], section: str, version: str) -> None:
    """Refuse a top-level key of `overrides` that the parser never `read`, where one it did read is spelt close."""
    for key in overrides:
        near = None if key in read else closest(key, read - set(overrides))
        if near is not None:
            raise ConfigError(f"{section}.deepspeed.{key}", f"{version} reads no such key (did you mean {near!r}?)")


def refused_key(message: str, overrides: Mapping[str, Any], section: str, version: str) -> ConfigError:
    """The `ConfigError` for DeepSpeed's own refusal (`DeepSpeedConfigError`, a key it no longer supports): the
    user's key its `message` quotes (the longest such path), else a top-level key it names ("Apex AMP" for
    `amp`), else the section."""
    paths = {".".join(leaf.split(".")[:n]) for leaf in leaves(overrides) for n in range(1, leaf.count(".") + 2)}
    quoted = [p for p in paths if f"'{p}'" in message or f"'{p.rsplit('.', 1)[-1]}'" in message]
    named = [k for k in overrides if re.search(rf"\b{re.escape(str(k))}\b", message, re.IGNORECASE)]
    key = max(quoted, key=len) if quoted else named[0] if named else None
    return ConfigError(f"{section}.deepspeed.{key}" if key else f"{section}.deepspeed",
                       f"{version} refuses it: {message}")


def refused_section(title: str, error: Mapping[str, Any], overrides: Mapping[str, Any], section: str, version: str,
                    root: type) -> ConfigError:
    """The `ConfigError` for the first `error` (pydantic's dict: `loc`, `msg`, `type`) of DeepSpeed's section model
    named `title`, whose models all subclass `root`: the user's key whose path ends with the error's (its `loc`
    is relative to that model), and for an unknown setting the nearest the model takes."""
    inside = ".".join(str(part) for part in error["loc"])
    key = next((k for k in leaves(overrides) if k == inside or k.endswith(f".{inside}")), None)
    name = str(error["loc"][-1])
    near = closest(name, _fields_of(root, title, tuple(error["loc"][:-1]))) \
        if error["type"] == "extra_forbidden" else None
    # A name the model takes, refused as extra: the section holds the same setting under its other name too.
    hint = (" (the section sets it under its other name too: set it once)" if near == name
            else f" (did you mean {near!r}?)" if near else "")
    return ConfigError(f"{section}.deepspeed.{key}" if key else f"{section}.deepspeed",
                       f"{version} refuses it: {error['msg']}" + ("" if key else f" ({title}.{inside})") + hint)


def _fields_of(root: type, title: str, path: tuple[Any, ...]) -> set[str]:
    """The settings (names and aliases) that the subclass of pydantic model `root` named `title` takes at `path`
    (its nested sections followed field by field); empty where the path leaves its models."""
    models, model = [root], None
    while models and model is None:
        candidate = models.pop()
        models.extend(candidate.__subclasses__())
        model = candidate if candidate.__name__ == title else None
    for part in path:
        fields = getattr(model, "model_fields", {})
        info = fields.get(part) or next((f for f in fields.values() if f.alias == part), None)
        # The section's model: the field's type, or the model inside an Optional[...] of it.
        kinds = (info.annotation, *typing.get_args(info.annotation)) if info is not None else ()
        model = next((k for k in kinds if isinstance(k, type) and hasattr(k, "model_fields")), None)
    return {name for field, info in getattr(model, "model_fields", {}).items() for name in (field, info.alias) if name}
