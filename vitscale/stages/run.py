"""`vitscale run`: check every stage on the driver, then run them in order on Ray.

Everything that can be wrong with a pipeline (config, model name, missing or inconsistent data)
is found before a single Ray worker starts: the config when it is loaded, each stage's
`prepare` here, before Ray is even connected.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from vitscale.config.checks import ConfigError
from vitscale.config.loader import absolute_paths, to_yaml
from vitscale.config.pipeline import PipelineConfig, ray_address
from vitscale.data.storage import open_storage
from vitscale.data.storage.atomic import write_atomic
from vitscale.data.storage.mirror import RunMirror
from vitscale.say import say
from vitscale.stages import get_stage
from vitscale.stages.base import StageContext

# A wheel ships the pipelines inside the package (setup.py); a checkout or editable install has
# pipelines/ beside it. The shipped copy first: site-packages/pipelines could be anyone's.
_SHIPPED_PIPELINES = Path(__file__).resolve().parents[1] / "pipelines"
PIPELINES_DIR = _SHIPPED_PIPELINES if _SHIPPED_PIPELINES.is_dir() else Path(__file__).resolve().parents[2] / "pipelines"


def resolve_pipeline_path(name_or_path: str) -> Path:
    """A pipeline file from a path, or a name under pipelines/ (e.g. "pretrain", "recipes/jft-vit-l16")."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    for root in (Path.cwd() / "pipelines", PIPELINES_DIR):
        for candidate in (root / name_or_path, root / f"{name_or_path}.yaml",
                          root / "recipes" / f"{name_or_path}.yaml"):
            if candidate.is_file():
                return candidate
    available = sorted(str(p.relative_to(PIPELINES_DIR).with_suffix("")) for p in PIPELINES_DIR.rglob("*.yaml"))
    raise FileNotFoundError(f"no pipeline file {name_or_path!r}; pipelines shipped: {', '.join(available)}")


def preflight(config: PipelineConfig) -> PipelineConfig:
    """Every stage's driver-side checks (may write a missing dataset); returns the config with absolute paths."""
    config = absolute_paths(config)
    try:
        check_local_ray(config)
        for name in config.stages:
            stage = get_stage(name)
            if stage.prepare is not None:
                stage.prepare(config)
    except ConfigError as exc:
        raise exc.in_file(config.source) if config.source else exc from None
    return config


def check_local_ray(config: PipelineConfig) -> None:
    """A Ray that `vitscale run` starts on this machine fits one run's workers.

    Ray Train waits for resources that never come rather than failing, so a local run that asks
    for more CPUs or GPUs than the machine has would hang. Nothing is checked when joining a
    cluster (its size is its own) or when this process already holds a Ray connection.
    """
    import os
    import sys

    ray = sys.modules.get("ray")
    if ray_address(config.cluster.address) or (ray is not None and ray.is_initialized()):
        return
    cluster = config.cluster
    # An elastic run starts once its fewest workers fit.
    widths = [cluster.min_workers] if {"pretrain", "finetune"} & set(config.stages) else []
    if "sweep" in config.stages:
        widths.append(config.sweep.workers_per_trial or cluster.min_workers)
    if not widths:
        return
    cpus = cluster.local_num_cpus or os.cpu_count() or 1
    gpus = 0
    if cluster.use_gpu:
        import torch

        gpus = torch.cuda.device_count()
    where = f"the local Ray ({'cluster.local_num_cpus' if cluster.local_num_cpus else 'this machine'})"
    cluster.check_fits(max(widths), cpus, gpus, where)
    check_cpu_adam(config)


def check_cpu_adam(config: PipelineConfig) -> None:
    """A local run that offloads AdamW (`train.offload`) has DeepSpeed build its CPU Adam in every worker, JIT-
    compiling it where it is not built yet: built here once instead (the workers, on this machine, load it), and
    where this machine cannot build it (no C++ compiler or ninja), refused naming the key, not by every worker."""
    import os

    from vitscale.stages.finetune import finetune_section

    recipes = []
    if "pretrain" in config.stages or ("sweep" in config.stages and config.section("sweep").target == "pretrain"):
        recipes.append(("train", config.train))
    if "finetune" in config.stages or ("sweep" in config.stages and config.section("sweep").target == "finetune"):
        recipes.append(("finetune.train", finetune_section(config).train_config()))
    section = next((s for s, train in recipes if train.offload and train.optimizer == "adamw"), None)
    if section is None:
        return
    from vitscale.train.engine import BuildLockLeft, build_cpu_adam

    before = os.environ.get("DS_ACCELERATOR")  # the driver's environment reaches the workers: left as it was
    try:
        build_cpu_adam()
    except BuildLockLeft as exc:  # a killed build's lock: not a machine that cannot build
        raise ConfigError(f"{section}.offload", f"offloads AdamW to DeepSpeed's CPU Adam: {exc}") from None
    except Exception as exc:  # noqa: BLE001 -- whatever the build raised, the workers would have raised too
        first = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
        raise ConfigError(f"{section}.offload", f"offloads AdamW to DeepSpeed's CPU Adam, which this machine cannot "
                                                f"build ({first}); install a C++ compiler and ninja, then `make "
                                                f"cpu-adam`, or set {section}.optimizer: sgd") from None
    finally:
        if before is None:
            os.environ.pop("DS_ACCELERATOR", None)


class StoppedBeforeStart(KeyboardInterrupt):
    """Ctrl-C (or SIGTERM, SIGHUP) while the driver checked the run's settings or waited for or wrote its datasets
    (`preflight`): before anything of the run was written, so there is no run to resume (a dataset it was writing
    is not kept either: `write_dataset` aborts it)."""


def run_pipeline(config: PipelineConfig, *, address: str | None = None, verbose: bool = True,
                 force: bool = False) -> dict[str, Any]:
    """Run every stage of `config`; prints a summary table and returns the summary (the final JSON line).

    The run's lease (`data/storage/lease.py`) is held from before its first write to the end: a
    second writer of the same run is refused in one line; `force` takes over a dead holder's lease.
    """
    from vitscale.data.config import DataConfig
    from vitscale.data.storage.base import StorageError
    from vitscale.data.storage.endpoint import run_endpoint
    from vitscale.data.storage.lease import hold_run_lease
    from vitscale.data.storage.outputs import check_output
    from vitscale.data.storage.space import is_no_space, no_space_line

    t0 = time.time()
    if address:  # --address: the run joins that cluster, and the checks below must know it
        config = replace(config, cluster=replace(config.cluster, address=address))
    try:
        config = preflight(config)
    except KeyboardInterrupt:
        raise StoppedBeforeStart from None
    # One endpoint for the run's datasets, checkpoints and files, in this driver and every worker it starts.
    storage = config.cluster.run_storage(config.run_name)
    endpoint = config.section("data", DataConfig).endpoint_url
    # A storage path that is a file, or not writable, or a bucket that does not answer: named by its key.
    check_output(config.cluster.storage_path, "cluster.storage_path", folder=True, endpoint_url=endpoint)
    with run_endpoint(endpoint), hold_run_lease(storage, force=force):
        try:
            return _run_stages(config, verbose, t0)
        except OSError as exc:  # the driver's own files (config, logs, summary) on a full disk: one line
            if isinstance(exc, StorageError) or not is_no_space(exc):
                raise
            from vitscale.train.checkpoint import next_checkpoint_bytes

            needed = next_checkpoint_bytes(storage, config.cluster.max_workers)
            raise StorageError(no_space_line(getattr(exc, "filename", None) or storage, exc.strerror or str(exc),
                                             needed=needed)) from exc


def _run_stages(config: PipelineConfig, verbose: bool, t0: float) -> dict[str, Any]:
    from vitscale.launch.run_place import run_place

    run_dir = run_place(config.cluster, config.run_name).local_dir()
    run_dir.mkdir(parents=True, exist_ok=True)
    # The run's storage is the truth and this node's folder a cache of it (data/storage/mirror.py): on a
    # cluster whose nodes share only object storage, the driver's files must outlive its node, and a
    # re-run from a machine that never saw the run starts from what the storage holds (a study's state,
    # a sweep's finished trials). The pull, before this run writes anything, also removes what the storage
    # lacks: a run deleted from its storage leaves nothing in this node's cache for a new run to push.
    mirror = RunMirror(run_dir, open_storage(config.cluster.run_storage(config.run_name)))
    mirror.pull()
    write_atomic(run_dir / "config.yaml", to_yaml(config))  # whole or not at all (data/storage/atomic.py)
    mirror.push()
    where = "" if mirror.same_place else f" (a cache of {mirror.storage.url})"
    say(f"run directory: {run_dir}{where}")
    mirror.push_every(30.0)
    try:
        return _stages(config, verbose, t0, run_dir, mirror)
    finally:
        try:
            mirror.close()
        except OSError as exc:
            say(f"could not push the run's files to {mirror.storage.url}: {exc}")


def _stages(config: PipelineConfig, verbose: bool, t0: float, run_dir: Path, mirror: RunMirror) -> dict[str, Any]:
    """The stages in order on Ray; `mirror` pushes each stage's files to the run's storage."""
    from vitscale.launch.console import quiet_driver_logs, route_ray_output, run_ended, summary_table
    from vitscale.launch.ray_train import ensure_ray

    log_path = run_dir / "logs" / "ray.log"
    quiet_driver_logs(log_path, verbose=verbose)
    say(f"{ensure_ray(config.cluster.address, config.cluster.local_num_cpus)}")
    routed = route_ray_output(log_path, verbose=verbose)
    if routed:
        say(f"{routed}")
    context = StageContext(run_dir=run_dir, run_name=config.run_name, verbose=verbose, sync=mirror.push)
    try:
        summary, table = _each_stage(config, run_dir, mirror, context)
    finally:
        run_ended()  # whatever workers still print, the driver's last lines (summary, JSON, resume) stay last
    summary["seconds"] = round(time.time() - t0, 1)
    write_atomic(run_dir / "summary.json", json.dumps(summary, indent=2, default=str))
    print(f"\n{config.name}: done in {summary['seconds']:.0f} s, run directory {run_dir}\n"
          f"{summary_table(table)}\n", flush=True)
    return summary


def _each_stage(config: PipelineConfig, run_dir: Path, mirror: RunMirror,
                context: StageContext) -> tuple[dict[str, Any], list[tuple[str, list[tuple[str, str]]]]]:
    """Each stage in order: the run's summary and the rows of its closing table."""
    summary: dict[str, Any] = {"pipeline": config.name, "run": config.run_name, "run_dir": str(run_dir), "ok": True}
    table: list[tuple[str, list[tuple[str, str]]]] = []
    for name in config.stages:
        say(f"stage {name}")
        started = time.time()
        result = get_stage(name).run(config, context)
        context.results.append(result)
        summary[name] = result.summary()
        summary.update(getattr(result, "headline", dict)())  # a stage's result at a glance, at the top level
        table.append((name, [*result.rows(), ("time", f"{time.time() - started:.0f} s")]))
        mirror.push()  # a stage's tables and plots reach storage as soon as it ends
    return summary, table
