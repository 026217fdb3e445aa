"""Cells on Ray: as many at once as the cluster fits, each a Ray task that runs the cell's stages.

A cell's task drives its own Ray Train run (and probe task, or Tune sweep) exactly as `vitscale
run` would for the cell's pipeline, the way a Tune trial drives a `TorchTrainer`; the driver here
only schedules, records and reports. Each cell's run has a stable name under
`STUDY_DIR/cells/`, so a re-run of the study resumes an interrupted cell from its checkpoints,
and stages a cell already finished (recorded in `state/CELL.stages.json`) are not run again.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from vitscale.config.location import is_url
from vitscale.config.pipeline import PipelineConfig
from vitscale.launch.errors import PipelineFailed
from vitscale.say import say
from vitscale.scaling.study.cell_pipelines import cell_run
from vitscale.scaling.study.cells import Cell
from vitscale.scaling.study.plan import PlannedCell
from vitscale.scaling.study.state import (
    HEARTBEAT_S,
    CellRecord,
    StudyState,
    accuracies,
    runnable,
)

PROGRESS_EVERY_S = 15.0
"""Seconds between a running cell's progress lines."""


@dataclass(frozen=True)
class Recorded:
    """A stage finished in an earlier run of the cell: its summary, as a stage result."""

    name: str
    recorded: dict[str, Any]

    def summary(self) -> dict[str, Any]:
        return self.recorded

    def rows(self) -> list[tuple[str, str]]:
        return []


def _restored(name: str, summary: dict[str, Any]) -> Any:
    """A finished stage's result rebuilt for later stages (the pre-trained model's checkpoint)."""
    if name != "pretrain":
        return Recorded(name, summary)
    from ray.train import Checkpoint

    from vitscale.stages.base import Pretrained

    metrics = {k: v for k, v in summary.items() if k not in ("checkpoint", "checkpoint_uri", "wall_s", "finished_at")}
    return Pretrained(checkpoint=Checkpoint(summary.get("checkpoint_uri") or summary["checkpoint"]), metrics=metrics)


def checkpoint_uri(checkpoint: Any) -> str | None:
    """Where a `ray.train.Checkpoint` lives as a URI: its `path` drops the scheme of object storage."""
    path = getattr(checkpoint, "path", None)
    kind = getattr(getattr(checkpoint, "filesystem", None), "type_name", "local")
    return None if path is None else (path if kind == "local" or is_url(path) else f"{kind}://{path}")


def run_cell(config: PipelineConfig, cell_id: str, state_url: str, endpoint_url: str | None,
             study_run: str | None = None) -> dict[str, Any]:
    """In the cell's Ray task: its stages in order, skipping those an earlier run finished. ``study_run``:
    the study's own run, whose lease its driver holds (the cells' runs lie inside it by default)."""
    from vitscale.data.storage.lease import hold_run_lease
    from vitscale.launch.run_place import run_place
    from vitscale.stages import get_stage
    from vitscale.stages.base import StageContext

    state = StudyState(state_url, endpoint_url)
    done = state.stages(cell_id)
    run_dir = run_place(config.cluster, config.run_name).local_dir()
    run_dir.mkdir(parents=True, exist_ok=True)
    context = StageContext(run_dir=run_dir, run_name=config.run_name, verbose=False)
    # One writer per cell run, as for `vitscale run` (data/storage/lease.py).
    with hold_run_lease(config.cluster.run_storage(config.run_name), part_of=study_run):
        for name in config.stages:
            if name in done:
                context.results.append(_restored(name, done[name]))
                continue
            started = time.time()
            result = _probe_here(config, context) if name == "fewshot" and not config.cluster.use_gpu \
                else get_stage(name).run(config, context)
            context.results.append(result)
            extra = {"checkpoint_uri": checkpoint_uri(result.checkpoint)} if hasattr(result, "checkpoint") else {}
            state.stage_done(cell_id, name, {**result.summary(), **extra, "wall_s": time.time() - started})
    return state.stages(cell_id)


def _probe_here(config: PipelineConfig, context: Any) -> Any:
    """The fewshot stage in this cell's task, not in a Ray task of its own: on CPU the probe needs
    no device, and a new worker process would import torch and vitscale again (~5-15 s per cell of
    a local study; docs/study.md). The cell's pre-training has ended, so its CPUs are free."""
    from vitscale.stages.base import Pretrained
    from vitscale.stages.fewshot import FewshotResult, probe_checkpoint

    with context.need(Pretrained).checkpoint.as_directory() as directory:
        return FewshotResult(probe_checkpoint(config, directory))


def devices(config: PipelineConfig) -> float:
    """Devices one run holds: its GPUs, or its workers' CPU cores on CPU (the plan prices a core)."""
    cluster = config.cluster
    return cluster.max_workers * (cluster.gpus_per_worker if cluster.use_gpu else cluster.cpus_per_worker)


def _progress(config: PipelineConfig, planned: PlannedCell) -> str | None:
    """The cell's latest step from rank 0's metrics file (local runs), as one line."""
    from vitscale.launch.run_place import run_place

    path = run_place(config.cluster, config.run_name).local_dir() / "metrics" / "rank0.jsonl"
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, 2) - 4096))
            last = json.loads(f.read().splitlines()[-1])
    except (OSError, ValueError, IndexError):
        return None
    if not isinstance(last, dict):  # a line that is JSON but not a record: no progress to show
        return None
    share = _number(last.get("examples_seen")) / max(1, planned.examples_seen)
    # A non-finite loss is null in the metrics line (JSON has no NaN): it reads "nan" here, as it was.
    return (f"step {last.get('step')} ({share:.0%} of {planned.examples_seen:,} examples) "
            f"loss {_number(last.get('loss'), float('nan')):.4f}, {_number(last.get('images_per_s')):.0f} img/s")


def _number(value: object, otherwise: float = 0.0) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else otherwise


def run_cells(config: PipelineConfig, cells: list[Cell], planned: list[PlannedCell], state: StudyState,
              *, retries: int, max_concurrent: int | None) -> dict[str, CellRecord]:
    """Run every cell that is not done (nor failed for good); returns every cell's record."""
    import ray

    from vitscale.launch.console import workers_off_terminal
    from vitscale.launch.ray_train import concurrent_runs

    plans = {p.id: p for p in planned}
    records = {c.id: state.record_or_migrate(c.id, c.legacy_id) for c in cells}
    runs = {c.id: cell_run(config, c, state.cells_storage(), records[c.id].run_name) for c in cells}
    queue = [c for c in cells if runnable(records[c.id], retries)]
    done = sum(r.status == "done" for r in records.values())
    resumed = [c.id for c in queue if records[c.id].runs]
    width = concurrent_runs(runs[cells[0].id].cluster, ray.cluster_resources()) if cells else 1
    at_once = max_concurrent or width
    say(f"study: {len(cells)} cells, {done} done, {len(queue)} to run"
          + (f" ({len(resumed)} resumed)" if resumed else "") + f", {at_once} at a time; state in {state.url}")
    task = ray.remote(num_cpus=0, max_retries=0)(run_cell)
    running: dict[Any, tuple[Cell, float]] = {}
    last_line: dict[str, tuple[float, str]] = {}
    heartbeat = time.time()
    endpoint = config.data.endpoint_url
    study_run = config.cluster.run_storage(config.run_name)  # held by this driver: its cells are part of it
    with workers_off_terminal():
        while queue or running:
            while queue and len(running) < at_once:
                cell = queue.pop(0)
                record = records[cell.id]
                record.status, record.runs, record.error = "running", record.runs + 1, None
                record.started_at = record.started_at or time.time()
                record.open_attempt(devices(runs[cell.id]))  # a killed attempt's time counts too
                state.write(record)
                say(f"cell {cell.id}: started (run {record.runs})")
                running[task.remote(runs[cell.id], cell.id, state.url, endpoint, study_run)] = (cell, time.time())
            ready, _ = ray.wait(list(running), num_returns=1, timeout=5.0)
            for ref in ready:
                cell, started = running.pop(ref)
                if _collect(ref, cell, started, records[cell.id], runs[cell.id], state, queue, retries):
                    finished = sum(r.status == "done" for r in records.values())
                    spent = sum(r.exaflops or 0.0 for r in records.values())
                    say(f"cells {finished}/{len(cells)} done; {spent:.4g} of "
                          f"{sum(p.exaflops for p in planned):.4g} planned exaFLOPs spent")
            now = time.time()
            if now - heartbeat >= HEARTBEAT_S:  # a killed driver loses at most this much time from the record
                heartbeat = now
                for cell, started in running.values():
                    records[cell.id].open_attempt_s = now - started
                    state.write(records[cell.id])
            for cell, _ in running.values():
                line = _progress(runs[cell.id], plans[cell.id])
                previous = last_line.get(cell.id)
                if line and (previous is None or (line != previous[1] and now - previous[0] >= PROGRESS_EVERY_S)):
                    last_line[cell.id] = (now, line)
                    say(f"cell {cell.id}: {line}")
    return records


def _collect(ref: Any, cell: Cell, started: float, record: CellRecord, run: PipelineConfig, state: StudyState,
             queue: list[Cell], retries: int) -> bool:
    """A cell's task has ended: record how (done; failed, run again while retries last; or its node lost,
    queued again), writing the record. False when its node died (the cell is neither done nor failed)."""
    import ray

    record.close_attempt(time.time() - started)
    try:
        stages = ray.get(ref)
    except (ray.exceptions.LocalRayletDiedError, ray.exceptions.NodeDiedError) as exc:
        # The machine under the cell went away, not the cell: it stays "running" (a
        # re-run resumes it) and no failure is counted against it.
        record.error = _one_line(exc)
        state.write(record)
        if isinstance(exc, ray.exceptions.LocalRayletDiedError):
            raise PipelineFailed(
                f"the local Ray node died under cell {cell.id} ({record.error}); run the same command "
                "again: finished cells are kept, interrupted ones resume") from exc
        say(f"cell {cell.id}: its node died; running it again")
        queue.append(cell)
        return False
    except Exception as exc:  # noqa: BLE001 -- a failed cell is a row with its error; the study goes on
        record.failures += 1
        record.error = _one_line(exc)
        record.status = "failed"
        again = record.failures <= retries
        say(f"cell {cell.id}: failed ({record.error})"
              + ("; running it again" if again else "; failed for good"))
        if again:
            queue.append(cell)
    else:
        _finish(record, stages, run)
        say(f"cell {cell.id}: done in {record.wall_s:.0f} s, "
              + ", ".join(f"{k} {v:.3f}" for k, v in record.accuracies.items()))
    state.write(record)
    return True


def _finish(record: CellRecord, stages: dict[str, Any], config: PipelineConfig) -> None:
    pretrain = stages.get("pretrain") or {}
    record.status, record.finished_at = "done", time.time()
    record.examples_seen = pretrain.get("examples_seen")
    record.exaflops = pretrain.get("cumulative_exaflops")
    record.pretrain_wall_s = float(pretrain.get("wall_s") or 0.0)
    transferred = {"finetune", "sweep"} & set(config.stages)
    record.accuracies = accuracies(stages, config.finetune.data_config().url if transferred else None)


def _one_line(exc: BaseException) -> str:
    """The root error of a failed cell task, in one line."""
    cause = getattr(exc, "cause", None) or exc
    text = [line for line in str(cause).splitlines() if line.strip()]
    return (text[-1] if text else type(cause).__name__)[:500]


