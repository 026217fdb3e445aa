"""The sweep stage: Ray Tune over Ray Train trials, selected on a dev split, the winner retrained and tested once.

Each trial is a Tune function that builds and fits a `TorchTrainer` (Ray 2.60's pattern for Tune
over Train V2): the trial's run is named after its trial id, so a restarted trial resumes its own
checkpoints, and `TuneReportCallback` forwards rank 0's reports to Tune (and so to TensorBoard
and the schedulers). A trial trains on the rest of a dev carve of the training split and is scored
on its dev part (`data/carve.py`); it cannot read the test split (`train/job.py`). The best
trial's settings are then retrained on the whole training split and tested once.

`target: finetune` sweeps fine-tuning (Table 4's learning-rate grid by default) over any key of the
`finetune:` section, its `train:` and `data:` included; `target: pretrain` sweeps pre-training
(Sec. 4.3's weight decay x dropout x label smoothing on a smaller dataset) over `train:`, `data:`
and `model:`. A trial is the pipeline with its values set, built and checked as any pipeline is.
Re-running the same command resumes a sweep whose driver died (`Tuner.restore`): finished trials
are not run again, unfinished ones continue from their checkpoints. Tune restores the trials and values
it was given first, so a re-run with other settings is refused (`refuse_changed_sweep`).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

from vitscale.config.checks import ConfigError
from vitscale.config.loader import to_yaml
from vitscale.config.pipeline import PipelineConfig
from vitscale.data.carve import Carve
from vitscale.data.config import DataConfig
from vitscale.data.storage.atomic import write_atomic
from vitscale.data.storage.filesystem import run_filesystem
from vitscale.launch.run_place import RunPlace
from vitscale.models.config import ModelConfig
from vitscale.say import say
from vitscale.stages.base import Pretrained, Stage, StageContext
from vitscale.stages.finetune import finetune_section
from vitscale.stages.sweep_asha import asha_grace, asha_rungs
from vitscale.stages.sweep_checks import SETTINGS, check_sweep, prepare_sweep, refuse_changed_sweep, sweep_record
from vitscale.stages.sweep_results import (
    SweepResult,
    finished_trials,
    flat_row,
    plot_searches,
    pretrain_exaflops,
    save_final_report,
    trial_id_of,
    trial_row,
)
from vitscale.stages.sweep_space import (
    SCRATCH,
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
from vitscale.train.finetune import FinetuneConfig, finetune_model
from vitscale.train.job import EvalSet, TrainJob, final_job, selection_job

# -- the jobs -------------------------------------------------------------------------------------


def trial_job(config: PipelineConfig, model: ModelConfig | None, init: str | None, *, final: bool) -> TrainJob:
    """A trial's selection job, or (`final`) the winner's retrain on the whole split, tested once."""
    yaml, sweep = to_yaml(config), sweep_section(config)
    data = config.section("data", DataConfig)
    if sweep.target == "finetune":
        fc = finetune_section(config)
        lr = fc.single_lr() or fc.grid()[0]  # a trial's own rate, once the space sets it
        build = final_job if final else selection_job
        job = build(fc, finetune_model(model or config.section("model", ModelConfig), fc.resolution), init, lr,
                    use_gpu=config.cluster.use_gpu, endpoint_url=data.endpoint_url, config_yaml=yaml)
    else:
        carve = Carve(sweep.dev_fraction, data.seed, "rest")
        evals = (EvalSet("dev", data.url, data.split, replace(carve, part="dev")),)
        job = TrainJob(model=config.section("model", ModelConfig), data=data,
                       train=config.section("train", TrainConfig),
                       use_gpu=config.cluster.use_gpu, carve=None if final else carve, evals=() if final else evals,
                       config_yaml=yaml)
    if sweep.scheduler == "asha" and not final:
        steps = trial_steps(config, job)
        rungs = asha_rungs(steps, asha_grace(steps, sweep.grace_period), sweep.reduction_factor)
        job = replace(job, eval_steps=rungs, evaluations=sweep.evaluations if job.train.eval_every is None else None)
    return job


def trial_steps(config: PipelineConfig, job: TrainJob) -> int:
    """A trial's total steps (ASHA's horizon), computed as the loop will from the trained samples."""
    from vitscale.data.format import open_dataset
    from vitscale.train.optim import schedule_length

    if job.train.max_steps:
        return job.train.max_steps
    samples = sum(open_dataset(job.data.url, job.data.split, endpoint_url=job.data.endpoint_url,
                               carve=job.carve).counts)
    return schedule_length(samples, job.train.global_batch, job.train.epochs, None)[1]


def _trial(params: dict[str, Any], base: PipelineConfig, model: ModelConfig | None, init: str | None,
           trials: RunPlace, finished: dict[str, dict[str, Any]] | None = None) -> None:
    """One Tune trial: a TorchTrainer run of the selection job with this trial's values, stored inside the
    pipeline run at `trials/<trial id>` (`sweep/trials/<id>`)."""
    import ray.tune
    from ray.tune.integration.ray_train import TuneReportCallback

    from vitscale.launch.console import trial_label
    from vitscale.launch.ray_train import final_metrics, trainer_for

    started = time.time()
    trial_id = ray.tune.get_context().get_trial_id()
    if finished and trial_id in finished:
        # It finished after Tune's last snapshot of the experiment and before the driver died: its
        # final report is on record, so report it again (its times included) rather than retrain.
        ray.tune.report(finished[trial_id])
        return
    config = with_params(base, params)
    job = trial_job(config, model, init, final=False)
    # Named after the trial id (no timestamp): a restarted trial finds and resumes its own checkpoints.
    place = trials.sub(trial_id)
    trainer = trainer_for(job, trial_cluster(config), place, callbacks=[TuneReportCallback()],
                          label=trial_label(trial_id, params),  # trials run at once: each line names its trial
                          workers_key=trial_workers_key(config))
    result = trainer.fit()
    report = {**final_metrics(result), "started_at": started, "finished_at": time.time()}
    save_final_report(place.storage, report)  # before Tune hears of it: a driver killed next cannot lose it
    ray.tune.report(report)


# -- the stage ------------------------------------------------------------------------------------

def run_sweep(config: PipelineConfig, context: StageContext) -> SweepResult:
    model, init = None, None
    if sweep_section(config).target == "finetune":
        from vitscale.stages.finetune import initial_weights

        model, init = initial_weights(config, context)
    directory = context.run_dir / sweep_part("")
    searches = [(init, directory, "")]
    if sweep_section(config).scratch_baseline:
        searches.append((None, context.run_dir / sweep_part(SCRATCH), SCRATCH))
    selections = []
    for start, folder, label in searches:
        if label:
            say("the same sweep from random weights (same architecture, recipe and budget)")
        selections.append(_search(config, context, model, start, folder, label))
    finals = _retrain_winners(config, model, [(start, folder, label, selected)
                                              for (start, folder, label), (_, selected) in zip(searches, selections)])
    (rows, selected), final = selections[0], finals[0]
    scratch = {"selected": selections[1][1], **finals[1]} if len(searches) > 1 else None
    # Both searches on one axis, each winner's value starred and its test accuracy beside it.
    plot_searches(directory / "lr_vs_accuracy.png", next(iter(search_space(config))), sweep_section(config).metric,
                  [("pre-trained" if start is not None else "random weights", trial_rows, chosen, tested)
                   for (start, _, _), (trial_rows, chosen), tested in zip(searches, selections, finals)])
    return SweepResult(directory=str(directory), trials=rows, selected=selected, final=final, scratch=scratch)


def _search(config: PipelineConfig, context: StageContext, model: ModelConfig | None, init: str | None,
            directory: Path, label: str) -> tuple[tuple[dict[str, Any], ...], dict[str, Any]]:
    """Run the trials on Tune and select on the dev metric: (one row per trial, the selection)."""
    import ray
    from ray import tune

    from vitscale.eval.tables import write_table
    from vitscale.launch.console import library_output_to
    from vitscale.launch.ray_train import concurrent_runs, log_tracebacks
    from vitscale.launch.run_place import run_place

    sweep = sweep_section(config)
    directory.mkdir(parents=True, exist_ok=True)
    space = search_space(config)
    tune_space = {k: (tune.choice(list(v)) if sweep.scheduler == "random" else tune.grid_search(list(v)))
                  for k, v in space.items()}
    tune_storage = config.cluster.run_storage(config.run_name)  # the run's own place, trials in it
    experiment = f"{tune_storage}/sweep-trials{label}"
    # Object storage: Tune's experiment state goes through the same retrying filesystem as checkpoints.
    filesystem, tune_path = run_filesystem(tune_storage)
    where = experiment if filesystem is None else f"{tune_path}/sweep-trials{label}"  # as Tune reads it
    restoring = tune.Tuner.can_restore(where, storage_filesystem=filesystem)
    if restoring:  # Tune restores the first run's trials and values: the same settings, or a new run name
        refuse_changed_sweep(config, directory)
    else:
        write_atomic(directory / SETTINGS, sweep_record(config))
    # The trial function only drives its TorchTrainer: it takes no CPU from the workers (Ray wants
    # some resource in a trial's bundle, so it asks for a token 64 MiB of memory).
    trials = run_place(config.cluster, config.run_name, f"{sweep_part(label)}/trials")
    trainable = tune.with_resources(
        tune.with_parameters(_trial, base=config, model=model, init=init, trials=trials,
                             finished=finished_trials(trials.storage) if restoring else {}),
        {"cpu": 0, "memory": 64 * 2**20})
    metric = sweep.metric
    concurrent = sweep.max_concurrent or concurrent_runs(trial_cluster(config), ray.cluster_resources())
    # The dev metric is reported when it is measured (every eval_every steps and at the end); the
    # reports between carry training metrics only. Tune's strict check would call those errors;
    # ASHA already ignores results without its metric.
    os.environ["TUNE_DISABLE_STRICT_METRIC_CHECKING"] = "1"
    # Ctrl-C is Python's KeyboardInterrupt, as in every other stage: Tune's own handler would end `fit` as
    # if the sweep had finished (no trial scored, an error) with its advice to call `Tuner.restore`; the
    # CLI says instead that the same command resumes the sweep (its trials' checkpoints and results kept).
    os.environ["TUNE_DISABLE_SIGINT_HANDLER"] = "1"
    if restoring:
        say(f"resuming the sweep in {experiment}")
        tuner = tune.Tuner.restore(where, trainable=trainable, resume_unfinished=True, resume_errored=True,
                                   storage_filesystem=filesystem)
    else:
        tuner = tune.Tuner(
            trainable, param_space=tune_space,
            tune_config=tune.TuneConfig(metric=metric, mode="max", scheduler=_scheduler(config, model, init),
                                        max_concurrent_trials=concurrent,
                                        num_samples=sweep.num_samples if sweep.scheduler == "random" else 1),
            run_config=tune.RunConfig(name=f"sweep-trials{label}", storage_path=tune_path, verbose=0,
                                      storage_filesystem=filesystem,
                                      failure_config=tune.FailureConfig(max_failures=sweep.trial_retries)))
    count = len(combinations(space)) if sweep.scheduler != "random" else sweep.num_samples
    say(f"sweep{label}: {count} trial(s), {concurrent} at a time, {sweep.scheduler}; "
          f"TensorBoard: tensorboard --logdir {context.run_dir}")
    with library_output_to(context.run_dir / "logs" / "tune.log", verbose=context.verbose):
        grid = tuner.fit()  # Tune's own progress tables go to the log; vitscale's lines stay on the terminal
    pre_exaflops = 0.0 if init is None else pretrain_exaflops(
        [r for r in context.results if isinstance(r, Pretrained)],
        finetune_section(config).checkpoint if sweep.target == "finetune" else None)
    results = [grid[i] for i in range(len(grid))]  # ResultGrid indexes; it declares no __iter__
    for result in results:  # a failed trial's row says why; the run's log says where (its ranks' tracebacks)
        if result.error is not None:
            log_tracebacks(getattr(result.error, "cause", None) or result.error, f"trial {trial_id_of(result)}")
    rows = tuple(sorted((trial_row(result, space, metric, pre_exaflops) for result in results),
                        key=lambda r: str(r["trial_id"])))
    write_table([flat_row(r) for r in rows], directory, "results")
    return rows, _select(rows, metric, directory)


def _scheduler(config: PipelineConfig, model: ModelConfig | None, init: str | None) -> Any:
    """ASHA stopping trials early on the dev metric (`sweep.scheduler: asha`), or None: every trial runs whole."""
    sweep = sweep_section(config)
    if sweep.scheduler != "asha":
        return None
    from ray.tune.schedulers import ASHAScheduler

    steps = trial_steps(config, trial_job(config, model, init, final=False))
    return ASHAScheduler(time_attr="step", max_t=steps, grace_period=asha_grace(steps, sweep.grace_period),
                         reduction_factor=sweep.reduction_factor)


def _select(rows: tuple[dict[str, Any], ...], metric: str, directory: Path) -> dict[str, Any]:
    """The trial of the best dev `metric`, written to `directory/selected.json`; refused when none scored."""
    scored = [r for r in rows if isinstance(r.get("metric"), float)]
    if not scored:
        raise ConfigError("sweep", f"no trial reported {metric}; see {directory}/results.md")
    best = max(scored, key=lambda r: r["metric"])
    selected = {"trial_id": best["trial_id"], "params": best["params"], "metric": best["metric"], "metric_name": metric}
    # On disk as soon as it is chosen (with `retrain: false`, or a retrain that fails, this is the
    # sweep's answer); `_retrain` rewrites it with the winner's test accuracy.
    write_atomic(directory / "selected.json", json.dumps(selected, indent=2, default=str))
    return selected


def _retrain_winners(config: PipelineConfig, model: ModelConfig | None,
                     winners: list[tuple[str | None, Path, str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """Retrain each search's winner on the whole training split and test it once: as many at once as
    the cluster fits (the pre-trained and the random-weights winners share the cluster instead of
    one waiting for the other). Returns each one's test accuracies, in order."""
    import ray

    from vitscale.launch.interruption import side_by_side
    from vitscale.launch.ray_train import concurrent_runs

    if not sweep_section(config).retrain:
        return [{} for _ in winners]
    at_once = min(len(winners), concurrent_runs(trial_cluster(config), ray.cluster_resources()))
    if at_once > 1:
        say(f"retraining {len(winners)} winners at once")
    # TorchTrainer.fit from a thread is what Tune itself does; each run has its own name and folder.
    # Daemon threads: a Ctrl-C does not wait for the retrains to finish (launch/interruption.py).
    return side_by_side([partial(_retrain, config, model, *winner) for winner in winners], at_once)


def _retrain(config: PipelineConfig, model: ModelConfig | None, init: str | None, directory: Path, label: str,
             selected: dict[str, Any]) -> dict[str, Any]:
    from vitscale.launch.ray_train import launch_training
    from vitscale.launch.run_place import run_place

    start = "pre-trained" if init is not None else "random weights"
    say(f"retraining the winner {json.dumps(selected['params'])} from {start} on the whole "
          "training split")
    winner = with_params(config, selected["params"])
    # The same world size as the trials: the winner's recipe (batch split, schedule) unchanged.
    _, metrics = launch_training(trial_job(winner, model, init, final=True), trial_cluster(config),
                                 run_place(config.cluster, config.run_name, f"{sweep_part(label)}/final"),
                                 what="the winner's retrain", workers_key=trial_workers_key(config),
                                 # Both winners retrain at once: each line says which, as the trials' lines do.
                                 label=f"final {'pretrained' if init is not None else 'scratch'}")
    final = {k: v for k, v in metrics.items() if k.startswith("test_accuracy")}
    final["final_exaflops"] = metrics.get("cumulative_exaflops")
    write_atomic(directory / "selected.json", json.dumps({**selected, **final}, indent=2, default=str))
    return final


STAGE = Stage(
    name="sweep",
    sections={"sweep": SweepConfig, "finetune": FinetuneConfig, "model": ModelConfig, "data": DataConfig,
              "train": TrainConfig},
    check=check_sweep,
    prepare=prepare_sweep,
    run=run_sweep,
    produces=SweepResult,
)
