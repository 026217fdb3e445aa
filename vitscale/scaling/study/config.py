"""The `study` section: which cells to run, how each is judged, and the compute budget.

    study:
      models:                       # a model name, or a mapping
        - ViT-B/32
        - {recipe: jft-vit-l16}     # model and train sections of a recipe (Table 3)
        - {name: ViT-Ti/4, img_size: 32, depth: 2, train: {base_lr: 0.002}, throughput: 900}
      epochs: [7, 14]               # every model x every epochs x every data size
      data_sizes: [9000000, null]   # first N samples of a fixed permutation; null = the whole split
      cells:                        # or/and cells listed one by one (Table 6 is not a full grid)
        - {model: {recipe: jft-vit-h14}, epochs: 14}
      transfer: [fewshot]           # stages run on each pre-trained cell: fewshot, finetune, sweep
      max_exaflops: 5000

A model entry's keys are the `model:` section's (name, img_size, the model's options), plus
`recipe` (a pipeline whose `model:` and `train:` sections are the entry's starting point), `train`
(overrides of the recipe), `label` (its name in tables and plots) and `throughput` (measured
images/s per device: the plan prices the cell from it instead of from its FLOPs and MFU).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from vitscale.config.checks import ConfigError, check, non_negative, positive
from vitscale.config.location import canonical_location

TRANSFER_STAGES = ("fewshot", "finetune", "sweep")
"""Stages a cell may run after its pre-training, in this order."""
ENTRY_KEYS = ("recipe", "train", "label", "throughput")
"""Keys of a model entry that are not the model's own."""


@dataclass(frozen=True)
class ModelEntry:
    """One model of the study: a model section, the recipe it trains with, and its name in results."""

    model: Mapping[str, Any]
    """`model:` keys set by the entry (name, img_size, options); over the recipe's."""
    recipe: str | None = None
    """A pipeline (a path or a name under pipelines/, e.g. jft-vit-l16) giving `model:` and `train:`."""
    train: Mapping[str, Any] = field(default_factory=dict)
    """`train:` keys set for this model (over the recipe's, or the study pipeline's)."""
    label: str | None = None
    """Its name in tables and plots; null = the model name."""
    throughput: float | None = None
    """Images/s per device, for the plan's device-time estimate; null = `study.throughput`."""

    @classmethod
    def parse(cls, raw: Any, key: str) -> ModelEntry:
        if isinstance(raw, str):
            return cls(model={"name": raw})
        check(isinstance(raw, Mapping), key, f"must be a model name or a mapping, got {raw!r}")
        raw = dict(raw)
        recipe, train, label, throughput = (raw.pop(k, None) for k in ENTRY_KEYS)
        check(recipe is None or isinstance(recipe, str), f"{key}.recipe",
              f"must be a pipeline name or path, got {recipe!r}")
        check(train is None or isinstance(train, Mapping), f"{key}.train",
              f"must be a mapping of train keys, got {train!r}")
        check(label is None or isinstance(label, str), f"{key}.label", f"must be a string, got {label!r}")
        check(recipe is not None or "name" in raw, key, "needs a model `name` or a `recipe`")
        positive(throughput, f"{key}.throughput")
        return cls(model=raw, recipe=recipe, train=dict(train or {}), label=label,
                   throughput=None if throughput is None else float(throughput))


@dataclass(frozen=True)
class CellSpec:
    """One cell before it is resolved against the pipeline: a model entry, epochs, a data size."""

    entry: ModelEntry
    epochs: float | None
    """Passes over the (subset of the) split; null = the entry's recipe's `train.epochs`."""
    data_size: int | None
    """Pre-training samples (the first N of a fixed permutation); null = the whole split."""
    key: str
    """Where the cell is written in the study section (errors name it)."""


@dataclass(frozen=True)
class StudyConfig:
    """A scaling study: cells of (model x epochs x data size), each pre-trained then transferred."""

    models: tuple[Any, ...] = ()
    """Model entries crossed with `epochs` and `data_sizes` (see the module docstring)."""
    epochs: tuple[float, ...] = ()
    """Pre-training epochs of the grid; empty = each recipe's `train.epochs`."""
    data_sizes: tuple[int | None, ...] = (None,)
    """Pre-training data sizes of the grid (first N samples of a fixed permutation; null = all)."""
    cells: tuple[Any, ...] = ()
    """Cells listed one by one: {model: entry, epochs: E, data_size: N}."""
    transfer: tuple[str, ...] = ("fewshot",)
    """Stages each cell runs after pre-training: fewshot (the `fewshot:` section), finetune and/or
    sweep (the `finetune:` and `sweep:` sections)."""
    max_exaflops: float | None = None
    """Budget: the plan is refused when its pre-training compute exceeds this; null = no budget."""
    throughput: float | None = None
    """Measured images/s per device of models without their own (`throughput:` in an entry): the
    plan prices them from it instead of from FLOPs and MFU; null = from FLOPs (scaling/study/costs.py)."""
    device: str | None = None
    """The device the plan prices: H100, H200, A100, V100, TPUv3 or CPU (one CPU core); null = H100
    when `cluster.use_gpu`, else CPU."""
    price_per_device_hour: float | None = None
    """Money per device-hour (any currency): the plan prints each cell's cost and the total; null = none."""
    overhead_s_per_cell: float | None = None
    """Seconds per cell that FLOPs do not count (start-up, teardown, transfer) in the plan's wall
    time; null = costs.DEFAULT_OVERHEAD_S for the device class."""
    mfu_results: str | None = field(default=None, metadata={"path": True})
    """A measured MFU table (markdown with `model` and `MFU` columns); null = benchmarks/RESULTS.md
    of the working directory or of vitscale's source tree, when present."""
    max_concurrent: int | None = None
    """Cells at once; null = as many as the cluster's CPUs/GPUs fit."""
    retries: int = 1
    """Times a failed cell is run again (over all runs of the study) before it has failed for good."""
    directory: str | None = field(default=None, metadata={"path": True})
    """Where the study's state and results live (a folder or s3://...); null = the run's storage
    (`cluster.storage_path/run_name`) + `/study`. Every node must reach it: its cells' runs live there."""
    planned_examples: int | None = None
    """Plan from this split size when the pre-training dataset cannot be read yet (budgeting a
    study before its data exists); `vitscale run` still needs the data, and checks it agrees."""
    planned_classes: int | None = None
    """The class count that goes with `planned_examples`."""
    fit_metric: str | None = None
    """The accuracy column fits, frontiers and `recommend` use (e.g. "digits fewshot 5shot");
    null = the first accuracy column of the table."""

    def validate(self) -> None:
        if self.directory:
            canonical_location(self.directory, "study.directory")  # a malformed location is refused here
        for i, raw in enumerate(self.models):
            ModelEntry.parse(raw, f"study.models[{i}]")
        for i, epochs in enumerate(self.epochs):
            positive(epochs, f"study.epochs[{i}]")
        check(bool(self.data_sizes), "study.data_sizes", "needs at least one size (null = the whole split)")
        for i, size in enumerate(self.data_sizes):
            positive(size, f"study.data_sizes[{i}]")
        self.specs()  # cells parse
        for i, stage in enumerate(self.transfer):
            check(stage in TRANSFER_STAGES, f"study.transfer[{i}]",
                  f"must be one of {', '.join(TRANSFER_STAGES)}, got {stage!r}")
        check(len(set(self.transfer)) == len(self.transfer), "study.transfer", "names a stage twice")
        for key in ("max_exaflops", "throughput", "max_concurrent", "planned_examples", "planned_classes",
                    "price_per_device_hour"):
            positive(getattr(self, key), f"study.{key}")
        non_negative(self.retries, "study.retries")
        non_negative(self.overhead_s_per_cell, "study.overhead_s_per_cell")
        if self.device is not None:
            from vitscale.scaling.study.costs import peak_flops

            try:
                peak_flops(self.device)
            except ValueError as exc:
                raise ConfigError("study.device", str(exc)) from None
        check((self.planned_examples is None) == (self.planned_classes is None), "study.planned_examples",
              "set planned_examples and planned_classes together")

    def specs(self) -> list[CellSpec]:
        """The grid's cells (models x epochs x data sizes), then the listed ones, in order."""
        out = []
        for i, raw in enumerate(self.models):
            entry = ModelEntry.parse(raw, f"study.models[{i}]")
            for epochs in self.epochs or (None,):
                for size in self.data_sizes:
                    out.append(CellSpec(entry, epochs, size, f"study.models[{i}]"))
        for i, raw in enumerate(self.cells):
            key = f"study.cells[{i}]"
            check(isinstance(raw, Mapping), key, f"must be a mapping {{model, epochs, data_size}}, got {raw!r}")
            unknown = sorted(set(raw) - {"model", "epochs", "data_size"})
            check(not unknown, f"{key}.{unknown[0]}" if unknown else key,
                  "unknown key; a cell has model, epochs, data_size")
            check("model" in raw, f"{key}.model", "a cell needs a model")
            epochs, size = raw.get("epochs"), raw.get("data_size")
            for name, value in (("epochs", epochs), ("data_size", size)):
                if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
                    raise ConfigError(f"{key}.{name}", f"expected a number, got {value!r}")
            positive(epochs, f"{key}.epochs")
            positive(size, f"{key}.data_size")
            check(size is None or float(size).is_integer(), f"{key}.data_size", f"must be a whole number, got {size!r}")
            out.append(CellSpec(ModelEntry.parse(raw["model"], f"{key}.model"),
                                None if epochs is None else float(epochs), None if size is None else int(size), key))
        return out
