"""The study stage: a scaling study of (model x epochs x data size) cells, each pre-trained and
transferred by the existing stages, to Table 6's table, Figure 5's plot and per-family fits.

The rest of `vitscale/scaling/study/` has the Ray-free pieces (cells, plan, costs, state, fits,
report); `cell_pipelines.py` resolves the section into cells, `runner.py` runs them on Ray; this module
is the stage's shape: checks when the pipeline loads (every cell is a valid pipeline), checks
against the data before Ray starts (sizes, budget, downstream splits), and the run.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from vitscale.config.checks import ConfigError, check
from vitscale.config.location import canonical_location
from vitscale.config.pipeline import PipelineConfig
from vitscale.data.config import DataConfig
from vitscale.eval.config import FewshotConfig
from vitscale.models.config import ModelConfig
from vitscale.scaling.study.cell_pipelines import build_cell, resolve_cells
from vitscale.scaling.study.config import StudyConfig
from vitscale.scaling.study.plan import DataFacts, PlannedCell, Pricing, plan_study
from vitscale.scaling.study.state import planned_columns
from vitscale.stages.base import Stage, StageContext
from vitscale.stages.sweep_space import SweepConfig
from vitscale.train.config import TrainConfig
from vitscale.train.finetune import FinetuneConfig


@dataclass(frozen=True)
class StudyResult:
    directory: str
    records: dict[str, Any]
    """Cell id -> its record (as plain data)."""
    planned_exaflops: float
    report: Any
    """The `StudyReport` written at the end."""

    def summary(self) -> dict[str, Any]:
        failed = [i for i, r in self.records.items() if r["status"] == "failed"]
        return {"directory": self.directory, "cells": len(self.records),
                "done": sum(r["status"] == "done" for r in self.records.values()), "failed": failed,
                "exaflops_spent": sum(r["exaflops"] or 0.0 for r in self.records.values()),
                "exaflops_planned": self.planned_exaflops, "metric": self.report.metric,
                "fits": {f: fit.row() for f, fit in self.report.fits.items()}, "no_fit": self.report.refused,
                "files": self.report.files}

    def headline(self) -> dict[str, Any]:
        return {"study_dir": self.directory}

    def rows(self) -> list[tuple[str, str]]:
        from vitscale.scaling.study.report import fit_line

        metric = self.report.metric
        out = []
        for row in self.report.rows:
            score = row.get(metric) if metric else None
            text = f"{row['status']:<7} " + (f"{score:.4f}" if isinstance(score, float) else "-")
            if isinstance(row.get("exaflops"), float):
                text += f"  {row['exaflops']:.3g} exaFLOPs"
            if row.get("error"):
                text += f"  ({row['error'][:120]})"
            out.append((row["cell"], text))
        for family, fit in self.report.fits.items():
            out.append((f"fit {family}", fit_line(fit)))
            out += [(f"fit {family}", f"warning: {w}") for w in fit.warnings]
        for family, why in self.report.refused.items():
            out.append((f"fit {family}", f"none: {why}"))
        out.append(("results", f"{self.directory}/results.md"))
        return out


def check_study(config: PipelineConfig) -> None:
    """Every cell is a pipeline the loader and its stages accept (a bad model names its cell)."""
    study = config.section("study")
    check(bool(study.models) or bool(study.cells), "study.models", "a study needs models (or cells)")
    for cell in resolve_cells(config):
        build_cell(cell, config.source)
    if study.fit_metric is not None:  # a column no cell reports would leave every fit refused after the study
        # Named as the run will name them: from the canonical locations (`.` is the folder's own name).
        probes = [canonical_location(url, "fewshot.datasets") for url in config.fewshot.datasets]
        downstream = config.finetune.data_config().url
        columns = planned_columns(study.transfer, probes, config.fewshot.shots,
                                  canonical_location(downstream, "finetune.data.url") if downstream else None)
        check(study.fit_metric in columns, "study.fit_metric",
              f"{study.fit_metric!r} is no column the cells report; they report: {', '.join(columns) or 'none'}")


def data_facts(config: PipelineConfig, *, planning: bool) -> DataFacts:
    """The pre-training split's size and classes: from the dataset (written from its source when
    missing, unless `planning`), or, when the dataset is not there yet and `planning`, from
    `study.planned_*` or from the size its generated source will have: `vitscale study plan`
    writes no data."""
    from vitscale.data.format import has_dataset
    from vitscale.stages.datasets import ensure_dataset, require_split

    data, study = config.data, config.section("study")
    missing = not has_dataset(data.url, endpoint_url=data.endpoint_url)
    if missing and study.planned_examples is not None and (planning or data.create_if_missing is None):
        check(planning, "data.url", f"no dataset at {data.url}: study.planned_examples can plan a study, "
                                    f"but running it needs the data")
        return DataFacts(study.planned_examples, study.planned_classes, planned=True)
    if missing and planning:
        source = data.create_if_missing
        check(source is not None and source.kind in ("synthetic", "fractal"), "data.url",
              f"no dataset at {data.url} yet: set study.planned_examples and study.planned_classes to plan "
              f"before it is written (or write it: vitscale shards write)")
        assert source is not None
        share = (source.splits or {"train": 1.0}).get(data.split)
        check(share is not None, "data.split", f"the source writes no split {data.split!r}")
        return DataFacts(round(source.count * float(share or 0.0)), source.classes, planned=True)
    meta = ensure_dataset(data.url, data.create_if_missing, data.endpoint_url, "data.url")
    samples = require_split(meta, data.split, "data.split", data.url)
    if study.planned_examples is not None:
        check((study.planned_examples, study.planned_classes) == (samples, meta.num_classes), "study.planned_examples",
              f"plans {study.planned_examples} samples and {study.planned_classes} classes, but split "
              f"{data.split!r} of {data.url} has {samples} and {meta.num_classes}")
    return DataFacts(samples, meta.num_classes)


def pricing(config: PipelineConfig) -> Pricing:
    """How the plan prices cells: the study's device, price and overhead, the cluster's devices per
    cell and cells at once, and the measured MFU table when there is one."""
    import os
    from pathlib import Path

    from vitscale.config.pipeline import ray_address
    from vitscale.scaling.study.costs import (
        DEFAULT_OVERHEAD_S,
        device_class,
        read_mfu_table,
    )

    study, cluster = config.section("study"), config.cluster
    device = study.device or ("H100" if cluster.use_gpu else "CPU")
    per_cell = cluster.max_workers * (cluster.gpus_per_worker if cluster.use_gpu else cluster.cpus_per_worker)
    if study.max_concurrent:
        at_once = study.max_concurrent
    elif not cluster.use_gpu and not ray_address(cluster.address):
        cpus = cluster.local_num_cpus or os.cpu_count() or 1
        at_once = max(1, int(cpus // max(1, cluster.max_workers * cluster.cpus_per_worker)))
    else:
        at_once = 1  # a cluster's size is not known before it is reached: study.max_concurrent says it
    # A table named but not there would be passed over in silence, and every cell priced from the estimate.
    check(not study.mfu_results or Path(study.mfu_results).is_file(), "study.mfu_results",
          f"no file {study.mfu_results}: name a markdown table with model and MFU columns (benchmarks/RESULTS.md), "
          "or leave it out")
    candidates = [Path(study.mfu_results)] if study.mfu_results else \
        [Path.cwd() / "benchmarks" / "RESULTS.md", Path(__file__).resolve().parents[2] / "benchmarks" / "RESULTS.md"]
    table, source = [], "benchmarks/RESULTS.md"
    for path in candidates:
        table = read_mfu_table(path)
        if table:
            source = str(path)
            break
    overhead = study.overhead_s_per_cell if study.overhead_s_per_cell is not None \
        else DEFAULT_OVERHEAD_S[device_class(device)]
    return Pricing(device=device, devices_per_cell=float(per_cell), overhead_s=overhead,
                   price=study.price_per_device_hour, concurrency=at_once, mfu_table=table, mfu_source=source)


def plan(config: PipelineConfig, *, planning: bool = False, check_data: bool = True
         ) -> tuple[DataFacts, list[PlannedCell]]:
    """Every cell's planned compute, after checking each cell against the data (before any compute);
    `check_data=False` when `prepare_study` has checked them already, or when only planning."""
    from vitscale.stages.run import preflight

    cells = resolve_cells(config)
    facts = data_facts(config, planning=planning)
    if facts.num_classes == 0:  # images alone: a cell that learns from labels cannot run (planning or not)
        for cell in cells:
            check(build_cell(cell, config.source).train.objective != "supervised", cell.key,
                  f"train.objective 'supervised' needs labels, and split {config.data.split!r} of "
                  f"{config.data.url} has none (images alone are for train.objective: masked_patch)")
    planned = plan_study(cells, facts, config.section("study").max_exaflops, pricing(config))
    if check_data and not facts.planned:
        checked: set[str] = set()
        for cell in cells:
            built = build_cell(cell, config.source)
            key = repr((built.data, built.stages, built.train.global_batch, built.train.micro_batch, built.model))
            if key in checked:
                continue  # the same data checks as a cell already checked
            checked.add(key)
            try:
                preflight(built)
            except ConfigError as exc:  # the cell's key first; the file named once
                raise ConfigError(cell.key, f"{exc.key}: {exc.message}", exc.source) from None
            except FileNotFoundError as exc:
                raise ConfigError(cell.key, str(exc)) from None
    return facts, planned


def study_directory(config: PipelineConfig) -> str:
    """Where the study keeps its plan, its cells' records and their runs: `study.directory`, else inside the run's
    storage. The run's storage, not the driver's disk: on a cluster whose nodes share only object storage the cells'
    Train runs (under `cells/`) must be reachable from every node."""
    study = config.section("study")
    return study.directory or f"{config.cluster.run_storage(config.run_name).rstrip('/')}/study"


def datasets_read(config: PipelineConfig) -> dict[str, dict[str, Any]]:
    """What the cells read, by canonical location: the setting that names the dataset (`key`) and the
    `dataset_identity` of each split read (`splits`): the pre-training split, and the splits of each dataset the
    study's transfer stages read. A dataset not written yet is left out (the study writes it from its source)."""
    from vitscale.data.format import has_dataset, read_meta
    from vitscale.stages.finetune import finetune_section
    from vitscale.train.resume import dataset_identity

    study, endpoint = config.section("study"), config.data.endpoint_url
    wanted: list[tuple[str, str, tuple[str, ...]]] = [("data.url", config.data.url, (config.data.split,))]
    if "fewshot" in study.transfer:
        probe = config.section("fewshot", FewshotConfig)
        wanted += [(f"fewshot.datasets[{i}]", url, (probe.train_split, probe.test_split))
                   for i, url in enumerate(probe.datasets)]
    if {"finetune", "sweep"} & set(study.transfer):
        downstream = finetune_section(config)
        data = downstream.data_config(endpoint)
        if data.url:
            wanted.append(("finetune.data.url", data.url, (data.split, downstream.test_split)))
    read: dict[str, dict[str, Any]] = {}
    for key, url, splits in wanted:
        if has_dataset(url, endpoint_url=endpoint):
            meta = read_meta(url, endpoint_url=endpoint)
            read[canonical_location(url, key)] = {"key": key, "splits": {
                split: dataset_identity(meta, split) for split in splits if split in meta.splits}}
    return read


def refuse_changed_data(config: PipelineConfig) -> None:
    """`ConfigError` naming the setting when a dataset this study's recorded cells read was written again since
    (its plan's `datasets`): a finished cell is never run again, so its results, and every fit and
    recommendation made from them, would be the old data's beside the new data's cells. A plan written by an
    older vitscale (no `datasets`), or a study with no cell recorded yet, is not checked."""
    from vitscale.scaling.study.state import StudyState, StudyStateError
    from vitscale.train.resume import dataset_change

    directory = study_directory(config)
    state = StudyState(directory, config.data.endpoint_url)
    try:
        recorded = state.plan().get("datasets") if state.storage.exists("plan.json") else None
    except StudyStateError:
        return  # the run writes the plan again; the cells' records are checked as they are read
    if not isinstance(recorded, dict) or not any(state.storage.exists(f"state/{cell.id}.json")
                                                 for cell in resolve_cells(config)):
        return
    for location, now in datasets_read(config).items():
        before = recorded.get(location)
        if not isinstance(before, dict) or not isinstance(before.get("splits"), dict):
            continue
        for split, identity in now["splits"].items():
            change = dataset_change(before["splits"].get(split), identity)
            if change is not None:
                raise ConfigError(now["key"], f"{location} is not the dataset this study's cells in {directory} "
                                  f"read ({change}): their results are the old data's and a finished cell is never "
                                  "run again; put that dataset back, or run the study under another "
                                  f"cluster.run_name (or remove {directory}) to run every cell on this one")


def prepare_study(config: PipelineConfig) -> None:
    plan(config)
    refuse_changed_data(config)


def run_study(config: PipelineConfig, context: StageContext) -> StudyResult:
    from vitscale.scaling.study.report import publish_report
    from vitscale.scaling.study.runner import run_cells
    from vitscale.scaling.study.state import StudyState

    study = config.section("study")
    directory = study_directory(config)
    cells = resolve_cells(config)
    facts, planned = plan(config, check_data=False)  # `prepare_study` checked every cell before Ray started
    state = StudyState(directory, config.data.endpoint_url)
    state.write_plan({"study": config.run_name, "planned_at": time.time(), "fit_metric": study.fit_metric,
                      "data": {"url": config.data.url, "split": config.data.split, "examples": facts.examples,
                               "num_classes": facts.num_classes},
                      "datasets": datasets_read(config),  # what `refuse_changed_data` compares on the next run
                      "cells": [p.row() | {"data_size": c.data_size, "key": c.key} for c, p in zip(cells, planned)]})
    records = run_cells(config, cells, planned, state, retries=study.retries, max_concurrent=study.max_concurrent)
    report = publish_report(state, study.fit_metric)
    return StudyResult(directory, {i: vars(r) for i, r in records.items()}, sum(p.exaflops for p in planned), report)


STAGE = Stage(
    name="study",
    sections={"study": StudyConfig, "model": ModelConfig, "data": DataConfig, "train": TrainConfig,
              "fewshot": FewshotConfig, "finetune": FinetuneConfig, "sweep": SweepConfig},
    check=check_study,
    prepare=prepare_study,
    run=run_study,
    produces=StudyResult,
)
