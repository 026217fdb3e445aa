"""The sweep's settings and data checked before any trial starts, and the record a resumed search is held to.

`check_sweep` runs with the pipeline's other checks (the space's keys and values, every trial's batch split,
recipe and model); `prepare_sweep` reads what the trials will read (each dataset and set of weights once) and
refuses a search this run would resume with other settings (`refuse_changed_sweep` against its `SETTINGS`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vitscale.config.checks import ConfigError, check
from vitscale.config.loader import to_yaml
from vitscale.config.location import is_url
from vitscale.config.pipeline import PipelineConfig
from vitscale.data.carve import Carve
from vitscale.data.config import DataConfig
from vitscale.models.config import ModelConfig
from vitscale.stages.finetune import finetune_section
from vitscale.stages.sweep_space import (
    SCRATCH,
    TARGETS,
    SweepConfig,
    combinations,
    search_space,
    sweep_part,
    sweep_section,
    trial_cluster,
    trial_workers_key,
    with_params,
)
from vitscale.train.config import TrainConfig


def check_sweep(config: PipelineConfig) -> None:
    """The sweep's settings, before anything starts: `ConfigError` naming the key (and the trial whose values
    make it wrong) for a space with nothing to sweep, a key outside the target's sections, a value its section
    refuses, a batch a trial's workers cannot split, a metric or model the trials cannot give."""
    sweep = sweep_section(config)
    space = search_space(config)
    check(bool(space), "sweep.space", "nothing to sweep: name hyper-parameters (or a finetune preset/lr_grid)")
    prefixes = TARGETS[sweep.target]
    for key in space:
        check(key.startswith(prefixes), f"sweep.space.{key}",
              f"a {sweep.target} sweep tunes keys under {', '.join(p.rstrip('.') for p in prefixes)}")
    for key, values in space.items():
        for value in values:  # each value on its own: a bad one is named before any trial starts
            with_params(config, {key: value})
    check(sweep.target != "pretrain" or config.data.subset is None, "data.subset",
          "a pre-training sweep carves its dev set from the whole split; leave data.subset out")
    from vitscale.train.engine import check_settings

    workers = trial_cluster(config).world_sizes
    workers_key = trial_workers_key(config)
    for point in combinations(space):  # every trial's batch splits evenly over its workers
        trial = with_params(config, point)
        recipe, section = ((finetune_section(trial).train_config(), "finetune.train") if sweep.target == "finetune"
                           else (trial.section("train", TrainConfig), "train"))
        try:
            check(not sweep.metric.endswith("_polyak") or recipe.polyak is not None, "sweep.metric",
                  f"{sweep.metric} is measured with Polyak-averaged weights: set {section}.polyak (e.g. 0.9999)")
            recipe.check_batch_split(workers, section, workers_key)
            check_settings(recipe, section)
            _check_trial_model(trial, sweep.target)
        except ConfigError as exc:
            raise ConfigError(exc.key, exc.message + (f" (trial {point})" if point else "")) from None
    if sweep.target == "finetune":
        from vitscale.stages.finetune import check_transfer

        check_transfer(config, "sweep")


def _check_trial_model(trial: PipelineConfig, target: str) -> None:
    """What a trial trains fits what it is asked to: a fine-tuning trial's pre-trained model takes its
    `finetune.resolution` (a checkpoint's own model is checked with the data); a pre-training trial learns
    the labels its dev carve scores."""
    if target == "finetune":
        from vitscale.stages.finetune import check_resolution

        if finetune_section(trial).checkpoint is None:
            check_resolution(trial.section("model", ModelConfig), finetune_section(trial).resolution)
        return
    check(trial.section("train", TrainConfig).objective == "supervised", "sweep.target",
          "a pre-training sweep selects on the dev carve's top-1 accuracy, which train.objective masked_patch "
          "does not learn; sweep its fine-tuning (sweep.target: finetune) instead")


def prepare_sweep(config: PipelineConfig) -> None:
    """Every trial's data (and, fine-tuning, the weights it starts from), checked as the stage it trains checks
    them: a value of the space the dataset cannot serve (a split it lacks, a batch its rest of the dev carve
    cannot fill) is refused here, naming the trial, not found by that trial's workers. Trials that read the
    same data and weights are checked once. A sweep this run resumes with other settings is refused before
    Ray starts when the run's storage is a folder here (`_search` checks object storage's after its pull)."""
    storage = config.cluster.run_storage(config.run_name)
    if not is_url(storage):
        for label in ("", SCRATCH) if sweep_section(config).scratch_baseline else ("",):
            refuse_changed_sweep(config, Path(storage) / sweep_part(label))
    sweep, checked = sweep_section(config), set()
    for point in combinations(search_space(config)):
        trial = with_params(config, point)
        read = _what_a_trial_reads(trial, sweep.target)
        if read in checked:
            continue
        checked.add(read)
        try:
            _check_trial_data(trial, sweep)
        except ConfigError as exc:
            raise ConfigError(exc.key, exc.message + (f" (trial {point})" if point else ""), exc.source,
                              exc.also) from None


SETTINGS = "config.yaml"
"""The resolved config a search started with, in its folder (`sweep/`, `sweep/scratch/`): what a re-run that
resumes it (`Tuner.restore`) is compared with."""


def refuse_changed_sweep(config: PipelineConfig, directory: Path) -> None:
    """`ConfigError` naming every changed key when `config` would resume the search in `directory` (its
    `SETTINGS` there) with other settings: Tune restores the first run's trials and values and keeps its finished
    trials' scores, whatever `config` says. What a trial reads is compared (its stage's resume scope and
    `sweep:`), but not the swept keys themselves, nor what only watches or schedules the search (the fields
    marked `RESUME_FREE`); and the dataset the trials read (`sweep_record`). A search without the record (none
    yet, or one begun by an older vitscale) is not."""
    import yaml

    from vitscale.train.resume import (
        FINETUNE_SCOPE,
        PRETRAIN_SCOPE,
        RESUME_MAY_CHANGE,
        refuse_changed_run,
        resume_free_keys,
    )

    record = directory / SETTINGS
    if not record.is_file():
        return
    before = record.read_text()
    old_sweep = (yaml.safe_load(before) or {}).get("sweep") or {}
    swept = tuple(search_space(config)) + tuple(str(k) for k in old_sweep.get("space") or {})
    scope = (FINETUNE_SCOPE if sweep_section(config).target == "finetune" else PRETRAIN_SCOPE) + ("sweep",)
    data = _trials_data(config)
    refuse_changed_run(before, to_yaml(config), scope, f"the sweep in {directory}",
                       trained_on=None if data is None else {"dataset": data},
                       may_change=RESUME_MAY_CHANGE + resume_free_keys(SweepConfig, "sweep") + swept)


def sweep_record(config: PipelineConfig) -> str:
    """The search's `SETTINGS`: its resolved config, and under `trained.dataset` the dataset every trial reads
    (finished trials' scores were measured on it; a dataset written again under the same location is another)."""
    import yaml

    from vitscale.train.resume import TRAINED_KEY

    data = _trials_data(config)
    return to_yaml(config) + ("" if data is None else yaml.safe_dump({TRAINED_KEY: {"dataset": data}}))


def _trials_data(config: PipelineConfig) -> dict[str, Any] | None:
    """`dataset_identity` of the split every trial trains on, or None when the space sweeps the dataset itself."""
    from vitscale.data.format import read_meta
    from vitscale.train.resume import dataset_identity

    finetune = sweep_section(config).target == "finetune"
    prefix = "finetune.data." if finetune else "data."
    if any(key in (f"{prefix}url", f"{prefix}split") for key in search_space(config)):
        return None
    data = finetune_section(config).data_config(config.data.endpoint_url) if finetune \
        else config.section("data", DataConfig)
    return dataset_identity(read_meta(data.url, endpoint_url=data.endpoint_url), data.split)


def _what_a_trial_reads(trial: PipelineConfig, target: str) -> str:
    """What `_check_trial_data` reads of a trial (equal for trials that differ only in, say, their learning rate)."""
    if target == "finetune":
        fc = finetune_section(trial)
        return repr((fc.data_config(trial.data.endpoint_url), fc.train_config().global_batch, fc.test_split,
                     fc.dev_share(), fc.dev_seed, fc.checkpoint, fc.resolution, trial.model))
    return repr((trial.data, trial.train.global_batch, trial.train.objective))


def _check_trial_data(trial: PipelineConfig, sweep: SweepConfig) -> None:
    if sweep.target == "finetune":
        from vitscale.stages.finetune import check_checkpoint, check_downstream

        meta = check_downstream(trial)
        check_checkpoint(trial, meta.num_classes)
        return
    from vitscale.data.format import open_dataset
    from vitscale.stages.pretrain import check_pretrain_data

    data = trial.data
    meta = check_pretrain_data(trial, rest=Carve(sweep.dev_fraction, data.seed, "rest"))
    # A trial is scored by top-1 accuracy on its dev carve (`train/evaluate.py`): one label per image.
    check(not meta.multi_label, "data.url", f"{data.url} is multi-label; a pre-training sweep selects on top-1 "
                                            "accuracy on a dev carve, which needs one label per image")
    dev = open_dataset(data.url, data.split, endpoint_url=data.endpoint_url,
                       carve=Carve(sweep.dev_fraction, data.seed, "dev"))
    check(sum(dev.counts) >= 1, "sweep.dev_fraction", f"the dev carve of {data.url} is empty")
