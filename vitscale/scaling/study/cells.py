"""The study's cells as pipelines of the existing stages: pretrain, then the transfer stages.

A cell is the study's own pipeline with the cell's model, recipe, epochs and `data.subset` set
and `stages: [pretrain, *study.transfer]`, validated by the same loader and stage checks as any
pipeline: the study runs pre-training, probes and sweeps as they are, it copies none of them.

A cell's id names its directory and state file: readable (model, epochs, data size) and ended by
a hash of everything that decides its result (model, train, data and transfer sections). Change a
cell's settings and it is a new cell: its old state is never resumed from.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

from vitscale.config.checks import ConfigError
from vitscale.config.loader import merge, read_pipeline, to_dict
from vitscale.config.pipeline import PipelineConfig
from vitscale.scaling.study.config import CellSpec

RESULT_SECTIONS = ("model", "train", "data", "fewshot", "finetune", "sweep")
"""The sections that decide a cell's result (and so its id)."""


@dataclass(frozen=True)
class Cell:
    """One cell of the study, resolved: its pipeline as plain data, and how results name it."""

    id: str
    """Directory and state-file name: slug of label, epochs, data size, plus a settings hash."""
    label: str
    """The model's name in tables and plots."""
    model: str
    """The model name (`vitscale models`)."""
    family: str
    """"vit", "resnet" or "hybrid" (Figure 5's marker families)."""
    epochs: float
    data_size: int | None
    """Pre-training samples (null: the whole split)."""
    throughput: float | None
    """Images/s per device for the plan's device-time estimate."""
    raw: dict[str, Any]
    """The cell's pipeline as plain data (validated by `build_cell`)."""
    key: str
    """Where the study section names this cell."""


def slug(text: str) -> str:
    """A file-name-safe lower-case form: "ViT-B/16" -> "vit-b16"."""
    return re.sub(r"[^a-z0-9.]+", "-", text.lower().replace("/", "")).strip("-.")


def settings_hash(raw: dict[str, Any]) -> str:
    """Six hex digits of the sections that decide a cell's result (and its stages).

    Only values that differ from vitscale's defaults count: a later vitscale that adds a config
    key (with a default that changes nothing) keeps every cell's id, so its studies still resume.
    """
    defaults = _defaults()  # read only
    decided = {k: _changed(raw.get(k), defaults.get(k)) for k in RESULT_SECTIONS}
    decided["stages"] = raw.get("stages")
    return hashlib.sha256(json.dumps(decided, sort_keys=True, default=str).encode()).hexdigest()[:6]


@functools.cache
def _defaults() -> dict[str, Any]:
    """Every result section's defaults as plain data (built once: the model's validates on meta)."""
    from vitscale.config.loader import build_section
    from vitscale.stages import config_sections

    return {name: to_dict(build_section(cls, {}, name)) for name, cls in config_sections().items()
            if name in RESULT_SECTIONS}


def _changed(value: Any, default: Any) -> Any:
    """`value` without the keys (recursively) that equal `default`'s."""
    if isinstance(value, dict) and isinstance(default, dict):
        return {k: _changed(v, default.get(k)) for k, v in value.items() if k not in default or v != default[k]}
    return value


def resolve_cells(config: PipelineConfig) -> list[Cell]:
    """Every cell of the study as a pipeline (plain data), in the study's order; ids are unique."""
    from vitscale.models.variants import parse_model_name
    from vitscale.stages.run import resolve_pipeline_path

    base = to_dict(config)
    base.pop("study", None)
    study = config.section("study")
    cells, seen = [], {}
    for spec in study.specs():
        model, train = dict(base["model"]), dict(base["train"])
        if spec.entry.recipe is not None:
            try:
                recipe = read_pipeline(resolve_pipeline_path(spec.entry.recipe))
            except (FileNotFoundError, ConfigError) as exc:
                raise ConfigError(f"{spec.key}.recipe", str(exc)) from None
            model, train = dict(recipe.get("model", {})), merge(train, recipe.get("train", {}))
        else:
            model = {}  # the study pipeline's model options belong to its model, not this one
        model = {**model, **spec.entry.model}
        model.setdefault("img_size", base["model"]["img_size"])
        train = merge(train, dict(spec.entry.train))
        if spec.epochs is not None:
            train["epochs"] = spec.epochs
        raw = copy.deepcopy(base)
        raw.update(stages=["pretrain", *study.transfer], model=model, train=train)
        raw["data"] = {**raw["data"], "subset": spec.data_size}
        try:
            name = parse_model_name(str(model.get("name"))).name
        except ValueError as exc:
            raise ConfigError(f"{spec.key}.name", str(exc)) from None
        label = spec.entry.label or name
        epochs = float(train.get("epochs", 0))
        cell_id = f"{slug(label)}-e{epochs:g}-{'n' + str(spec.data_size) if spec.data_size else 'all'}-{settings_hash(raw)}"
        if cell_id in seen:
            raise ConfigError(spec.key, f"the same cell as {seen[cell_id]} ({label}, {epochs:g} epochs, "
                                        f"data size {spec.data_size or 'all'})")
        seen[cell_id] = spec.key
        cells.append(Cell(cell_id, label, name, parse_model_name(name).family, epochs, spec.data_size,
                          spec.entry.throughput or study.throughput, raw, spec.key))
    return cells


def build_cell(cell: Cell, source: str | None = None) -> PipelineConfig:
    """The cell's pipeline, validated with every stage's checks; errors name the study key."""
    from vitscale.stages import build_pipeline

    try:
        return build_pipeline(cell.raw, source)
    except ConfigError as exc:
        raise ConfigError(cell.key, f"{exc.key}: {exc.message}", exc.source) from None


def cell_run(config: PipelineConfig, cell: Cell, cells_storage: str) -> PipelineConfig:
    """The cell's pipeline as it runs: its own run name, under the study's `cells/` storage."""
    from dataclasses import replace

    built = build_cell(cell, config.source)
    cluster = replace(built.cluster, storage_path=cells_storage, run_name=cell.id)
    return replace(built, name=cell.id, cluster=cluster)
