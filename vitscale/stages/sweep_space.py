"""The `sweep:` section and its search space: what a sweep tunes, over which values, each trial's pipeline,
cluster and folder.

Pure configuration (no Ray): `stages/sweep.py` runs the trials, `stages/sweep_checks.py` checks them, and the
study reads `SweepConfig` to plan its cells. A trial is the pipeline with its values set, built and checked as
any pipeline is (`with_params`), so a bad value in `sweep.space` is named before any trial starts.
"""

from __future__ import annotations

import copy
import itertools
import json
from dataclasses import dataclass, field, replace
from typing import Any

from vitscale.config.checks import ConfigError, check, non_negative, one_of, positive, seed
from vitscale.config.fields import RESUME_FREE
from vitscale.config.loader import to_dict
from vitscale.config.pipeline import ClusterConfig, PipelineConfig
from vitscale.stages.finetune import finetune_section

__all__ = ["LR_KEY", "METRICS", "TARGETS", "SweepConfig", "combinations", "search_space", "sweep_section",
           "with_params"]

TARGETS = {"finetune": ("finetune.", "model."), "pretrain": ("train.", "model.", "data.")}
"""What a sweep tunes, and the config sections its hyper-parameters may come from."""
METRICS = ("dev_accuracy", "dev_accuracy_polyak")
"""What a trial reports on its dev carve (`train/evaluate.py`: the raw weights, and the Polyak-averaged ones
when `polyak` is set): Tune selects on one of these, and a name no trial reports would be found missing only
after every trial had run."""


@dataclass(frozen=True)
class SweepConfig:
    """A grid (or random draws) of hyper-parameters, each trial scored on the dev split."""

    target: str = "finetune"
    """"finetune" (Table 4 LR grids) or "pretrain" (Sec. 4.3 regularisation sweeps)."""
    space: dict[str, tuple[Any, ...]] = field(default_factory=dict)
    """Dotted config key -> values, e.g. {finetune.train.base_lr: [0.001, 0.01]}; empty = finetune.lr_grid /
    the preset's learning rates."""
    scheduler: str = "grid"
    """"grid" (every combination), "random" (`num_samples` draws) or "asha" (the grid, weak trials stopped early)."""
    num_samples: int = 8
    """Trials drawn by the random scheduler."""
    metric: str = "dev_accuracy"
    """Selection metric (maximised), measured on the dev carve of the training split: "dev_accuracy", or
    "dev_accuracy_polyak" (the Polyak-averaged weights: the trials' `polyak` must be set)."""
    max_concurrent: int | None = field(default=None, metadata=RESUME_FREE)
    """Trials at once; null = as many as the cluster's CPUs/GPUs fit with `workers_per_trial` each."""
    workers_per_trial: int | None = None
    """Ray Train workers per trial; null = cluster.num_workers."""
    grace_period: int | None = None
    """ASHA: steps every trial runs before the first cut; null = an eighth of the trial's steps
    (`sweep_asha.py`; measured in benchmarks/sweep_efficiency.py)."""
    reduction_factor: int = 3
    """ASHA: keep the best 1/reduction_factor at each rung."""
    evaluations: int = field(default=4, metadata=RESUME_FREE)
    """Evenly spaced dev evaluations per trial under ASHA, for the curves; each trial is also
    evaluated exactly at every rung, where ASHA judges it."""
    dev_fraction: float = 0.02
    """Pretrain target: share of the pre-training split held out as the dev set."""
    retrain: bool = field(default=True, metadata=RESUME_FREE)
    """Retrain the winner on the whole training split and test it once."""
    scratch_baseline: bool = field(default=False, metadata=RESUME_FREE)
    """Also run the same fine-tuning sweep from random weights (same architecture, recipe and budget),
    so the summary shows what pre-training adds."""
    trial_retries: int = field(default=1, metadata=RESUME_FREE)
    """Times a failed trial is retried before it is a row with its error (the sweep goes on)."""
    seed: int = 0
    """Seed of the random scheduler's draws."""

    def validate(self) -> None:
        one_of(self.target, tuple(TARGETS), "sweep.target")
        one_of(self.scheduler, ("grid", "random", "asha"), "sweep.scheduler")
        one_of(self.metric, METRICS, "sweep.metric")
        for key, values in self.space.items():
            check(bool(values), f"sweep.space.{key}", "needs at least one value")
            spelled = [json.dumps(v, sort_keys=True, default=str) for v in values]  # values may be lists or mappings
            # Every point of a grid (ASHA's too) is a trial: a value twice is the same trial trained twice.
            check(self.scheduler == "random" or len(set(spelled)) == len(spelled), f"sweep.space.{key}",
                  f"lists a value twice: {list(values)} (the same trial would run twice)")
        for key in ("num_samples", "max_concurrent", "workers_per_trial", "grace_period", "evaluations"):
            positive(getattr(self, key), f"sweep.{key}")
        check(self.reduction_factor >= 2, "sweep.reduction_factor", f"must be >= 2, got {self.reduction_factor}")
        positive(self.dev_fraction, "sweep.dev_fraction")
        check(self.dev_fraction < 1, "sweep.dev_fraction", f"must be below 1, got {self.dev_fraction}")
        non_negative(self.trial_retries, "sweep.trial_retries")
        seed(self.seed, "sweep.seed")
        check(not (self.scratch_baseline and self.target != "finetune"), "sweep.scratch_baseline",
              "compares fine-tuning from pre-trained and random weights: needs sweep.target finetune")


LR_KEY = "finetune.train.base_lr"
"""The key a fine-tuning sweep tunes by default (Table 4's learning-rate grid)."""


def sweep_section(config: PipelineConfig) -> SweepConfig:
    """The pipeline's `sweep:` section, typed."""
    return config.section("sweep", SweepConfig)


def search_space(config: PipelineConfig) -> dict[str, tuple[Any, ...]]:
    """`sweep.space`, or for a fine-tuning sweep without one, the learning-rate grid (Table 4)."""
    sweep = sweep_section(config)
    if sweep.space:
        return dict(sweep.space)
    grid = finetune_section(config).grid() if sweep.target == "finetune" else ()
    return {LR_KEY: grid} if grid else {}


def with_params(config: PipelineConfig, params: dict[str, Any]) -> PipelineConfig:
    """The pipeline with one trial's values set, re-validated (a bad value names its key)."""
    from vitscale.stages import build_pipeline

    raw = copy.deepcopy(to_dict(config))
    for key, value in params.items():
        node = raw
        *path, last = key.split(".")
        for part in path:
            if not isinstance(node.get(part), dict):
                raise ConfigError(f"sweep.space.{key}", f"{part!r} is not a config section")
            node = node[part]
        node[last] = list(value) if isinstance(value, tuple) else value
    try:
        # Values are checked by their sections; the stages' cross-checks ran on the base pipeline.
        return build_pipeline(raw, config.source, stage_checks=False)
    except ConfigError as exc:
        named = next((k for k in params if exc.key == k or exc.key.startswith((f"{k}.", f"{k}["))), None)
        if named is None:
            raise
        raise ConfigError(f"sweep.space.{named}", f"{params[named]!r}: {exc.message}", exc.source) from None


def combinations(space: dict[str, tuple[Any, ...]]) -> list[dict[str, Any]]:
    """Every point of the grid, in order (pure)."""
    keys = list(space)
    return [dict(zip(keys, values)) for values in itertools.product(*(space[k] for k in keys))]


def trial_cluster(config: PipelineConfig) -> ClusterConfig:
    """The cluster one trial (and the winner's retrain) runs on: `sweep.workers_per_trial` workers."""
    return replace(config.cluster, num_workers=sweep_section(config).workers_per_trial or config.cluster.num_workers)


def trial_workers_key(config: PipelineConfig) -> str:
    """The key that sets a trial's number of workers (what a run stopped for want of room says to lower)."""
    return "sweep.workers_per_trial" if sweep_section(config).workers_per_trial else "cluster.num_workers"


SWEEP_PART = "sweep"
"""The sweep's folder inside the run: its tables, and its trials' and retrains' Train runs
(`sweep/trials/<id>`, `sweep/final`; the random-weights search's under `sweep/scratch/`)."""
SCRATCH = "-scratch"
"""The label of the search from random weights (`sweep.scratch_baseline`)."""


def sweep_part(label: str) -> str:
    """The folder, inside the run, of the search labelled `label` ("" or `SCRATCH`)."""
    return f"{SWEEP_PART}/{label.lstrip('-')}" if label else SWEEP_PART
