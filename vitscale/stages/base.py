"""What a stage is: its config sections, its checks, its run function, and what it needs and makes.

A stage is one module (under `vitscale/stages/`, or in its own package: the study's is
`vitscale/scaling/study/stage.py`) that defines `STAGE = Stage(...)`; the registry
(`vitscale/stages/__init__.py`) lists it by name. Stages hand each other typed results: a stage
that needs a pre-trained model says `needs=(Pretrained,)` and reads `context.need(Pretrained)`;
the registry refuses a pipeline in which no earlier stage makes what a stage needs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

from vitscale.config.pipeline import PipelineConfig

T = TypeVar("T")


class StageResult(Protocol):
    """What every stage's run returns."""

    def summary(self) -> dict[str, Any]:
        """Plain data for the final JSON line and summary.json."""
        ...

    def rows(self) -> list[tuple[str, str]]:
        """(what, value) lines for the human-readable table at the end of `vitscale run`."""
        ...

    # Optional: `headline() -> dict`, keys merged into the top level of the final JSON line.


@dataclass
class StageContext:
    """What the runner tells a stage: where the run lives and what earlier stages made."""

    run_dir: Path
    """The run's directory (logs, summary.json; checkpoints too on a local or shared filesystem)."""
    run_name: str
    """The run's stable name (`cluster.run_name` or the pipeline's name)."""
    results: list[Any] = field(default_factory=list)
    """Results of the stages that already ran, in order."""
    verbose: bool = True
    """Whether libraries' own output may reach the terminal (`vitscale run --verbose`)."""
    sync: Callable[[], object] = lambda: None
    """Push what the run wrote so far into its storage (the runner's RunMirror): a long stage calls it
    after each unit of work it must not lose with its node (a study's cell, a sweep's table)."""

    def need(self, kind: type[T]) -> T:
        """The latest result of type `kind` (the registry guarantees some earlier stage makes one)."""
        for result in reversed(self.results):
            if isinstance(result, kind):
                return result
        raise LookupError(f"no earlier stage produced a {kind.__name__}")


@dataclass(frozen=True)
class Stage:
    """One stage of a pipeline."""

    name: str
    """The name a pipeline's `stages:` list uses."""
    run: Callable[[PipelineConfig, StageContext], StageResult]
    """Runs the stage (on Ray; the runner has connected) and returns its typed result."""
    sections: Mapping[str, type] = field(default_factory=dict)
    """Config sections this stage reads: YAML key -> frozen dataclass with `validate()`. Several stages
    may share a section (the same class); the loader builds each once."""
    check: Callable[[PipelineConfig], None] | None = None
    """Checks across sections, no I/O (batch vs workers): run when a pipeline is loaded."""
    prepare: Callable[[PipelineConfig], None] | None = None
    """Checks that need the data (dataset exists, has the split, can fill a batch), run on the
    driver before Ray starts; may write a missing dataset from its configured source."""
    needs: tuple[type, ...] = ()
    """Result types this stage reads from earlier stages."""
    produces: type | None = None
    """The result type `run` returns (what later stages may need)."""


@dataclass(frozen=True)
class Pretrained:
    """A pre-trained model: made by the pretrain stage, read by probes and fine-tuning."""

    checkpoint: Any
    """A `ray.train.Checkpoint`: readable wherever it lives (local disk, NFS, s3://)."""
    metrics: Mapping[str, Any]
    """The final step's metrics (step, loss, examples_seen, cumulative_exaflops, ...)."""

    def summary(self) -> dict[str, Any]:
        return {**self.metrics, "checkpoint": getattr(self.checkpoint, "path", None)}

    def rows(self) -> list[tuple[str, str]]:
        m = self.metrics
        loss = m.get("loss")
        rows = [("steps", f"{m.get('step')}  (epoch {_fmt(m.get('epoch'))})"),
                ("final loss", _fmt(loss)),
                ("examples seen", f"{m.get('examples_seen')}"),
                ("compute", f"{_fmt(m.get('cumulative_exaflops'))} exaFLOPs")]
        if m.get("skipped_samples"):
            rows.append(("skipped samples", str(m["skipped_samples"])))
        if m.get("restarts"):
            again = f"{m['relaunches']} by running the command again; " if m.get("relaunches") else ""
            rows.append(("restarts", f"{m['restarts']} ({again}{_fmt(m.get('restart_lost_s'))} s without a step; "
                                     f"last at {m.get('world_size')} workers)"))
        rows.append(("checkpoint", str(getattr(self.checkpoint, "path", None))))
        return rows


def _fmt(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)
