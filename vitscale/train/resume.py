"""What a resumed run may change, and the check that refuses everything else.

A run resumes (a Ray Train restart, or the same pipeline submitted again with the same run name)
from a checkpoint that holds the resolved config it was written with. Exact resumption
(`train/loop.py`) holds only if the sample order, the schedule and the model are the ones the
checkpoint was trained with, so any change to the keys that fix them is refused, naming each key
and both values. docs/resume.md lists the rules; `RESUME_MAY_CHANGE` is the list they come from.

Keys are compared only within a job's *scope*: the sections its training reads. Pre-training
reads `model`, `data`, `train` and the world size; fine-tuning reads `model`, `finetune` (whose
`train:` and `data:` are its recipe and dataset) and the world size. A later stage's section
(`fewshot:`) never blocks resuming an earlier one.

The dataset a run reads can change without its config changing (the same `data.url` written again
with other samples or labels): each checkpoint also records the dataset it was trained on
(`dataset_identity`, under `trained.dataset`), and a resume on another one is refused the same way.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from typing import Any

import yaml

from vitscale.config.checks import ConfigError
from vitscale.config.fields import is_resume_free, overridden
from vitscale.config.loader import to_dict
from vitscale.config.location import is_url
from vitscale.data.config import DataConfig
from vitscale.data.format import LABEL_SOURCE, DatasetMeta
from vitscale.train.config import UNREAD_BY_OBJECTIVE, TrainConfig
from vitscale.train.deepspeed_keys import FIXED_ON_RESUME
from vitscale.train.finetune import FinetuneConfig

WORKERS_KEY = "cluster.num_workers"
PRETRAIN_SCOPE: tuple[str, ...] = ("model", "data", "train", WORKERS_KEY)
"""What fixes a pre-training run: the model, the sample order, the schedule, the world size."""
FINETUNE_SCOPE: tuple[str, ...] = ("model", "finetune", WORKERS_KEY)
"""What fixes a fine-tuning run (its recipe and data are the `finetune` section's `train:` and `data:`)."""


def resume_free_keys(cls: type, prefix: str) -> tuple[str, ...]:
    """The dotted keys of `cls` (a section class, read as `prefix`) whose fields are marked `RESUME_FREE`,
    including those inside its `overrides(...)` mappings (`finetune.train.log_every`)."""
    keys: list[str] = []
    for f in dataclasses.fields(cls):
        key = f"{prefix}.{f.name}"
        target = overridden(f.metadata)
        if is_resume_free(f.metadata):
            keys.append(key)
        elif target is not None:
            keys.extend(resume_free_keys(target, key))
    return tuple(keys)


RESUME_MAY_CHANGE: tuple[str, ...] = (resume_free_keys(TrainConfig, "train") + resume_free_keys(DataConfig, "data")
                                      + resume_free_keys(FinetuneConfig, "finetune"))
"""Keys inside a scope that a resumed run may change (a key or a whole sub-section): the fields marked
`RESUME_FREE` (config/fields.py) where they are declared. They say how a run is watched (logging,
metrics, audits), checkpointed, drilled, and where and how its bytes are read; never which samples
it reads in which order (a pure function of seed, epoch, rank and world size), its schedule or its model."""

RESUME_KEPT: Mapping[str, str] = {f"{section}.deepspeed.{key}": why for section in ("train", "finetune.train")
                                  for key, why in FIXED_ON_RESUME.items()}
"""Keys inside a free sub-section that a resumed run may not change, and what each fixes: the `train.deepspeed`
settings that change what a step computes or how a checkpoint is laid out (`train/deepspeed_keys.py`)."""

TRAINED_KEY = "trained"
"""The key of a checkpoint's `config.yaml` naming what its weights are (`TrainJob.checkpoint_yaml`): their
architecture and objective, and what its run read and started from, compared on resume (a checkpoint written
before a record is not): `dataset`, the `dataset_identity` of its data; `init`, fine-tuning's pre-trained
weights as loaded (`checkpoint.state_sha256`: the pipeline's pre-training or `finetune.checkpoint`, whose run
may have trained on since, or whose file may have been written again)."""

ABSENT = "<absent>"
"""How a key one config has and the other lacks is shown."""


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested mappings as {dotted key: leaf value}; lists and scalars are leaves."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping):  # an empty mapping holds no keys (and so equals an absent one)
            out.update(flatten(value, f"{dotted}."))
        else:
            out[dotted] = value
    return out


def _under(key: str, prefixes: tuple[str, ...]) -> bool:
    return any(key == p or key.startswith(f"{p}.") for p in prefixes)


def changed_keys(old: Mapping[str, Any], new: Mapping[str, Any], scope: tuple[str, ...] = PRETRAIN_SCOPE,
                 may_change: tuple[str, ...] = RESUME_MAY_CHANGE) -> list[tuple[str, Any, Any]]:
    """(dotted key, old value, new value) for every key in `scope` that differs, sorted by key.

    Keys under `may_change` are ignored but those under `RESUME_KEPT`, as are those the objective of both never
    reads (`unread_keys`); a key present on one side only shows `ABSENT` on the other.
    Pure: both arguments are plain nested mappings (parsed YAML).
    """
    a, b = flatten(old), flatten(new)
    may_change = may_change + tuple(set(unread_keys(old)) & set(unread_keys(new)))
    kept = tuple(RESUME_KEPT)
    out = []
    for key in sorted(set(a) | set(b)):
        if not _under(key, scope) or (_under(key, may_change) and not _under(key, kept)):
            continue
        va, vb = a.get(key, ABSENT), b.get(key, ABSENT)
        if va != vb and not (key == WORKERS_KEY and is_range(va) and is_range(vb)):
            out.append((key, va, vb))
    return out


def is_range(workers: Any) -> bool:
    """An elastic `cluster.num_workers` `[MIN, MAX]` with MIN < MAX (`[W, W]` is the fixed `W`).

    One range may become another on resume (`[2, 4]` -> `[2, 8]` once the cluster grew): an elastic run's step
    is the global batch's mean at any world size (uneven shares, weighted micro-batches) and its checkpoints
    are resharded to the size it restarts at, so the range says only where it may run. A fixed size and a
    range are not interchangeable: a fixed run keeps the classic batch rule and refuses another size."""
    return (isinstance(workers, (list, tuple)) and len(workers) == 2
            and all(isinstance(w, int) and not isinstance(w, bool) for w in workers) and workers[0] < workers[1])


def unread_keys(config: Mapping[str, Any]) -> tuple[str, ...]:
    """The `train:` keys the config's pre-training objective never reads (`UNREAD_BY_OBJECTIVE`)."""
    train = config.get("train")
    objective = train.get("objective", "supervised") if isinstance(train, Mapping) else "supervised"
    return tuple(f"train.{key}" for key in UNREAD_BY_OBJECTIVE.get(objective, ()))


SECTIONS_WITH_DEFAULTS: Mapping[str, type] = {"train": TrainConfig, "data": DataConfig, "finetune": FinetuneConfig}
"""The compared sections whose every key has a default (the model's keys are its name's and the options set)."""


def with_defaults(config: Mapping[str, Any]) -> dict[str, Any]:
    """A parsed config with each key its sections lack (`SECTIONS_WITH_DEFAULTS`) at today's default, as both
    sides are compared: a key vitscale gained after a checkpoint was written (`train.objective`) did, at its
    default, what the code did before it existed, so a run resumed with it is the same run, and one resumed with
    another value is refused naming that default. A `cluster.num_workers` range `[W, W]` reads as the `W` it is,
    and a model's name as the model it names (`vit-b/16`, `vit_base_patch16_224`: ViT-B/16)."""
    out = dict(config)
    for name, cls in SECTIONS_WITH_DEFAULTS.items():
        if isinstance(config.get(name), Mapping):
            out[name] = _filled(config[name], to_dict(cls()))
    cluster = config.get("cluster")
    if isinstance(cluster, Mapping):
        workers = cluster.get("num_workers")
        if isinstance(workers, list) and len(workers) == 2 and workers[0] == workers[1]:
            out["cluster"] = {**cluster, "num_workers": workers[0]}  # a range [W, W] is a fixed W (docs/elastic.md)
    model = config.get("model")
    if isinstance(model, Mapping) and isinstance(model.get("name"), str):
        out["model"] = {**model, "name": _model_named(model["name"])}
    return out


def _model_named(name: str) -> str:
    """The canonical name of the model `name` spells (any case, or timm's spelling), or `name` if it names none."""
    from vitscale.models.variants import parse_model_name

    try:
        return parse_model_name(name).name
    except ValueError:
        return name


def _filled(values: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(values)
    for key, default in defaults.items():
        if key not in out:
            out[key] = default
        elif isinstance(out[key], Mapping) and isinstance(default, Mapping):
            out[key] = _filled(out[key], default)
    return out


def describe(changes: list[tuple[str, Any, Any]]) -> str:
    """'train.global_batch 16 -> 32, data.seed 0 -> 1'; a `train.deepspeed` key kept on resume says what it fixes
    ('train.deepspeed.communication_data_type 'bf16' -> 'fp32' (the dtype gradients are averaged in)')."""
    return ", ".join(f"{key} {old!r} -> {new!r}{_why_kept(key)}" for key, old, new in changes)


def _why_kept(key: str) -> str:
    return next((f" ({why})" for kept, why in RESUME_KEPT.items() if _under(key, (kept,))), "")


def dataset_identity(meta: DatasetMeta, split: str) -> dict[str, Any]:
    """What fixes the samples a run reads, their order and their labels, from `dataset.json`: the split's
    shards (names, sample counts, sizes, hashes), the classes and where the labels come from, as a digest
    beside the counts a refusal names. Not the index's layout: `vitscale shards reindex` keeps it."""
    entry = meta.split(split)
    what = {"split": split, "shards": [sh.to_json() for sh in entry.shards], "samples": entry.samples,
            "classes": list(meta.classes), "num_classes": meta.num_classes, "multi_label": meta.multi_label,
            "labels": [meta.extra.get(LABEL_SOURCE), meta.extra.get("label_member")]}
    digest = hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()
    return {"split": split, "samples": entry.samples, "num_classes": meta.num_classes, "sha256": digest}


def dataset_change(old: Any, new: Mapping[str, Any] | None) -> str | None:
    """How the dataset `new` differs from the checkpoint's record `old` ('40 samples of 3 classes -> 44
    samples of 3 classes'), or None: the same, or unknown (a checkpoint written before the record)."""
    if new is None or not isinstance(old, Mapping) or old.get("sha256") == new["sha256"]:
        return None
    before, after = _counts(old), _counts(new)
    if before == after:
        return f"split {new['split']!r}: {after} as before, other shards or labels"
    return f"split {new['split']!r}: {before} -> {after}"


def _counts(identity: Mapping[str, Any]) -> str:
    return f"{identity.get('samples')} samples of {identity.get('num_classes')} classes"


def refuse_changed_run(old_yaml: str, new_yaml: str, scope: tuple[str, ...], where: str,
                       old_world_size: int | None = None, new_world_size: int | None = None,
                       trained_on: Mapping[str, Any] | None = None,
                       may_change: tuple[str, ...] = RESUME_MAY_CHANGE) -> None:
    """Raise `ConfigError` naming every changed key if `new_yaml` may not resume `old_yaml`'s checkpoint.

    `where` names the checkpoint. World sizes, when given, are compared too (a sweep's trials take
    theirs from `sweep.workers_per_trial`, so the manifest's is the one that counts), and so is
    `trained_on` (what the job reads and starts from now: `TRAINED_KEY`) with what the checkpoint records.
    `may_change`: the keys in `scope` that may differ (a sweep's adds its own, `stages/sweep_checks.py`).
    """
    old = with_defaults(yaml.safe_load(old_yaml) or {})
    new = with_defaults(yaml.safe_load(new_yaml) or {})
    changes = changed_keys(old, new, scope, may_change)
    if old_world_size is not None and new_world_size is not None and old_world_size != new_world_size \
            and not any(key == WORKERS_KEY for key, _, _ in changes):
        changes.append(("world size", old_world_size, new_world_size))
    if changes:
        raise ConfigError(
            changes[0][0],
            f"cannot resume {where}: it was trained with other settings ({describe(changes)}); "
            "restore them, or start a new run with another cluster.run_name (docs/resume.md)")
    trained = old.get(TRAINED_KEY)
    recorded = trained if isinstance(trained, Mapping) else {}
    now = trained_on or {}
    change = dataset_change(recorded.get("dataset"), now.get("dataset"))
    if change is not None:
        key = "finetune.data.url" if "finetune" in scope else "data.url"
        raise ConfigError(key, f"cannot resume {where}: the dataset {key} names is not the one it was trained on "
                          f"({change}); put that dataset back, or start a new run with another "
                          "cluster.run_name (docs/resume.md)")
    before, after = recorded.get("init"), now.get("init")
    if isinstance(before, str) and after is not None and before != after:
        raise ConfigError("finetune.checkpoint", f"cannot resume {where}: it started from other pre-trained weights "
                          f"than finetune.checkpoint (or the pipeline's pre-training) gives now (their tensors' "
                          f"sha256 {before[:12]}... -> {after[:12]}...: a run trained on since, or a file written "
                          "again); use those weights, or start a new run with another cluster.run_name "
                          "(docs/resume.md)")


def refuse_changed_run_in(run_storage: str, new_yaml: str, scope: tuple[str, ...], world_size: int | None,
                          trained_on: Mapping[str, Any] | None = None) -> None:
    """The driver's check, before Ray starts: `refuse_changed_run` against the run's newest complete
    checkpoint, when the run's storage is a folder this machine can read (object storage is
    checked by the workers, on the checkpoint Ray hands them). `world_size` None: an elastic run,
    whose checkpoints may have any world size in its range. `trained_on`: what it reads (`TRAINED_KEY`)."""
    from pathlib import Path

    from vitscale.train import checkpoint as ckpt

    if is_url(run_storage):
        return
    root = Path(run_storage)
    candidates = [p for p in root.glob("checkpoint_*") if p.is_dir()]
    # Sizes, not hashes: only config.yaml is read here, and a multi-GB checkpoint is not re-hashed on the driver.
    found = ckpt.latest_complete(candidates, hash_ranks=set()) if candidates else None
    if found is None or not (found / "config.yaml").is_file():
        return
    info = ckpt.manifest_info(found)
    refuse_changed_run((found / "config.yaml").read_text(), new_yaml, scope, f"run {root} ({found.name})",
                       info[1] if info else None, world_size, trained_on)
