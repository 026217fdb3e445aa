"""A whole pipeline: its name, the stages it runs, where it runs, and one config section per stage.

The sections are not listed here: each stage declares the sections it owns
(`vitscale/stages/`), and the loader builds every registered section from the YAML (defaults
where the file is silent). `config.train` reads the `train` section; `config.section("train")`
says the same thing explicitly.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any, TypeVar, overload

from vitscale.config.checks import check, finite, non_negative, plain_name, positive
from vitscale.config.location import STORAGE_KEY, canonical_location, run_location


@dataclass(frozen=True)
class ClusterConfig:
    """Where and how wide the Ray Train job runs."""

    num_workers: int | tuple[int, ...] = 8
    """Ray Train workers (one per GPU); `[MIN, MAX]`: elastic, starting with what is free (at least MIN),
    growing to MAX, and going on with fewer when workers are lost (docs/elastic.md)."""
    use_gpu: bool = True
    """Give each worker a GPU."""
    cpus_per_worker: float = 8.0
    """CPU cores reserved per worker (data loading happens there)."""
    gpus_per_worker: float = 1.0
    """GPUs per worker when use_gpu."""
    storage_path: str = field(default="~/vitscale-runs", metadata={"path": True})
    """Run storage shared by all nodes: a local/NFS path or s3://bucket/prefix."""
    run_name: str | None = None
    """Stable run name: re-submitting a job with the same name resumes it; null = pipeline name."""
    max_failures: int = 3
    """Worker-group restarts Ray Train attempts before giving up (-1 = unlimited); preemptions are not counted."""
    elastic_resize_s: float = 60.0
    """An elastic run looks for free workers to grow to MAX this often (Ray Train's resize monitor); each
    growth restarts the worker group from the latest checkpoint."""
    preemption_grace_s: float = 120.0
    """How long workers may go on past a preemption notice's deadline to finish and upload the checkpoint
    they write on the notice (Ray Train's `FailureConfig.preemption_grace_s`); a spot pod's
    `terminationGracePeriodSeconds` must exceed it (k8s/components/spot). SIGTERM sent straight to a
    worker carries no deadline: this is then how long the worker may take to reach the checkpoint it
    writes on the signal before it leaves without one (0: it leaves at once, as Ray's own handler would;
    train/termination.py). And how long a `vitscale run` told to stop (Ctrl-C, SIGTERM) waits for its workers
    to checkpoint at their next step before it aborts them (launch/stop_request.py)."""
    worker_wait_s: float | None = 600.0
    """How long a run may go without room in the cluster for its fewest workers (`num_workers`, or MIN),
    at start or after nodes were lost, before it stops with one line saying so; null = wait forever
    (Ray Train's own behaviour). A run queued behind other work on a cluster big enough for it waits on
    (docs/elastic.md)."""
    address: str | None = None
    """Ray address; null = $RAY_ADDRESS, or a new local Ray on this machine."""
    local_num_cpus: int | None = None
    """CPUs a locally started Ray may use; null = all."""

    @property
    def min_workers(self) -> int:
        """The fewest workers a run goes on with (`num_workers`, or MIN of `[MIN, MAX]`)."""
        return self.num_workers if isinstance(self.num_workers, int) else self.num_workers[0]

    @property
    def max_workers(self) -> int:
        """The most workers a run uses (`num_workers`, or MAX of `[MIN, MAX]`): what a cluster is sized for."""
        return self.num_workers if isinstance(self.num_workers, int) else self.num_workers[-1]

    @property
    def elastic(self) -> bool:
        """`num_workers` is a range: the world size may change between restarts of the run."""
        return self.min_workers != self.max_workers

    @property
    def world_sizes(self) -> range:
        """Every world size the run may train at."""
        return range(self.min_workers, self.max_workers + 1)

    @property
    def fixed_world_size(self) -> int | None:
        """The one world size every checkpoint of the run has, or None when the run is elastic."""
        return None if self.elastic else self.max_workers

    def scaling(self) -> int | tuple[int, int]:
        """Ray Train's `ScalingConfig.num_workers`: an int, or `(min, max)` for elastic scaling."""
        return (self.min_workers, self.max_workers) if self.elastic else self.max_workers

    @property
    def storage_root(self) -> str:
        """`storage_path` in its one canonical form (config/location.py): what every reader and writer of
        the cluster's runs uses, so two spellings of one place are one place."""
        return canonical_location(self.storage_path, STORAGE_KEY)

    def run_storage(self, run_name: str) -> str:
        """Where the run `run_name` keeps its checkpoints: `storage_path/run_name` (a folder or URL), canonical."""
        return run_location(self.storage_path, run_name)

    def check_fits(self, workers: int, cpus: float, gpus: int, where: str) -> None:
        """`workers` workers of this cluster's size fit in `cpus` CPUs and `gpus` GPUs; else Ray Train would
        wait for them forever. `where` says whose resources those are."""
        need = workers * self.cpus_per_worker
        check(need <= cpus, "cluster.cpus_per_worker",
              f"{workers} workers x {self.cpus_per_worker} CPUs = {need:g} CPUs, but {where} has {cpus:g}; "
              "lower it, or set cluster.address to a larger Ray cluster")
        if self.use_gpu:
            need = workers * self.gpus_per_worker
            check(need <= gpus, "cluster.use_gpu",
                  f"{workers} workers x {self.gpus_per_worker} GPUs = {need:g} GPUs, but {where} has {gpus}; "
                  "set cluster.use_gpu false, or cluster.address to a Ray cluster with GPUs")

    def validate(self) -> None:
        if isinstance(self.num_workers, tuple):
            check(len(self.num_workers) == 2 and 1 <= self.num_workers[0] <= self.num_workers[1],
                  "cluster.num_workers", f"a range is [MIN, MAX] with 1 <= MIN <= MAX, got {list(self.num_workers)}")
        else:
            positive(self.num_workers, "cluster.num_workers")
        positive(self.cpus_per_worker, "cluster.cpus_per_worker")
        positive(self.gpus_per_worker, "cluster.gpus_per_worker")
        check(self.max_failures >= -1, "cluster.max_failures", f"must be >= -1, got {self.max_failures}")
        positive(self.elastic_resize_s, "cluster.elastic_resize_s")
        non_negative(self.preemption_grace_s, "cluster.preemption_grace_s")
        # Each worker and the driver wait it out on a thread timer, which cannot take longer (an OverflowError
        # in that thread: the run would never leave after a SIGTERM, nor abort after a Ctrl-C).
        check(self.preemption_grace_s <= threading.TIMEOUT_MAX, "cluster.preemption_grace_s",
              f"must be at most {threading.TIMEOUT_MAX:.0f} seconds, got {self.preemption_grace_s!r}")
        if self.worker_wait_s is not None:
            finite(self.worker_wait_s, "cluster.worker_wait_s")
            check(self.worker_wait_s > 0, "cluster.worker_wait_s",
                  f"must be > 0 seconds (null waits forever), got {self.worker_wait_s!r}")
        positive(self.local_num_cpus, "cluster.local_num_cpus")
        check(bool(self.storage_path), STORAGE_KEY, "must name a folder or s3:// prefix")
        canonical_location(self.storage_path, STORAGE_KEY)  # one with no canonical spelling is refused here
        if self.run_name is not None:
            plain_name(self.run_name, "cluster.run_name")


def ray_address(address: str | None) -> str | None:
    """The Ray cluster to join: `address`, else $RAY_ADDRESS; None means start a local Ray on this machine."""
    return address or os.environ.get("RAY_ADDRESS") or None


def local_cluster() -> dict[str, Any]:
    """A `cluster:` section sized to a Ray started on this machine: one worker per GPU, or on a machine
    without one a single CPU worker with every core (ClusterConfig's defaults are a GPU cluster's)."""
    import torch

    gpus, cpus = torch.cuda.device_count(), os.cpu_count() or 1
    workers = max(1, gpus)
    return {"num_workers": workers, "use_gpu": gpus > 0, "cpus_per_worker": max(1, cpus // workers)}


S = TypeVar("S")


@dataclass(frozen=True)
class PipelineConfig:
    """A whole pipeline: which stages run, where, and every stage's config section."""

    name: str = "pipeline"
    """Pipeline name; the default run name."""
    stages: tuple[str, ...] = ("pretrain",)
    """Stages to run, in order (`vitscale/stages/__init__.py` lists the registered ones)."""
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    """Where and how wide the Ray jobs run."""
    sections: Mapping[str, Any] = field(default_factory=dict)
    """Section name ("model", "data", "train", "fewshot", ...) -> that section's frozen config."""
    source: str | None = field(default=None, compare=False)
    """The file the config came from (named in errors found later, e.g. by a stage's preflight)."""

    def validate(self) -> None:
        plain_name(self.name, "name")
        check(len(self.stages) > 0, "stages", "needs at least one stage")
        twice = sorted({s for s in self.stages if self.stages.count(s) > 1})
        # A stage's outputs live at fixed places in the run (the pre-training's checkpoints, `sweep/`): a second
        # run of it would resume or overwrite the first, not run again.
        check(not twice, "stages", f"each stage runs once in a pipeline; {list(self.stages)} lists "
                                   f"{' and '.join(twice)} more than once")
        self.cluster.validate()

    @property
    def run_name(self) -> str:
        """The run's stable name: `cluster.run_name`, else the pipeline's name."""
        return self.cluster.run_name or self.name

    @overload
    def section(self, name: str) -> Any: ...
    @overload
    def section(self, name: str, kind: type[S]) -> S: ...

    def section(self, name: str, kind: type[S] | None = None) -> Any:
        """The config section `name` (KeyError naming the sections there are).

        With `kind`, typed: `config.section("train", TrainConfig)` is a `TrainConfig` to the type
        checker, and a section of another class is a TypeError here rather than a surprise later.
        """
        sections = self.__dict__.get("sections") or {}
        if name not in sections:
            raise KeyError(f"no config section {name!r}; sections: {sorted(sections)}")
        value = sections[name]
        if kind is not None and not isinstance(value, kind):
            raise TypeError(f"config section {name!r} is a {type(value).__name__}, not a {kind.__name__}")
        return value

    def __getattr__(self, name: str) -> Any:
        # Only called when normal lookup fails: `config.train` is `config.section("train")`, untyped
        # (`Any`): code that wants the type checker's help asks `config.section("train", TrainConfig)`.
        # Dunder and private names must fail normally (pickle and copy probe them).
        if name.startswith("_"):
            raise AttributeError(name)
        try:
            return self.section(name)
        except KeyError as exc:
            raise AttributeError(str(exc)) from None

    def with_sections(self, **changes: Any) -> PipelineConfig:
        """A copy with top-level fields (name, stages, cluster) and/or whole sections replaced."""
        own = {f.name for f in fields(self)}
        top = {k: v for k, v in changes.items() if k in own}
        rest = {k: v for k, v in changes.items() if k not in own}
        for key in rest:
            self.section(key)  # only existing sections can be replaced
        return replace(self, **top, sections={**self.sections, **rest})
