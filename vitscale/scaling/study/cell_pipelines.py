"""The study section resolved into cells, each a pipeline of the existing stages.

A cell is the study's own pipeline with the cell's model, recipe, epochs and `data.subset` set
and `stages: [pretrain, *study.transfer]`, validated by the same loader and stage checks as any
pipeline: the study runs pre-training, probes and sweeps as they are, it copies none of them.
What a cell is and how it is named (pure) is `scaling/study/cells.py`.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import replace
from typing import Any

from vitscale.config.checks import NAME_MAX_BYTES, ConfigError, check, name_bytes
from vitscale.config.loader import merge, read_pipeline, to_dict
from vitscale.config.pipeline import PipelineConfig
from vitscale.scaling.study.cells import RESULT_SECTIONS, Cell, cell_id, settings_hash


@functools.cache
def result_defaults() -> dict[str, Any]:
    """Every result section's defaults as plain data (built once: the model's validates on meta)."""
    from vitscale.config.loader import build_section
    from vitscale.stages import config_sections

    return {name: to_dict(build_section(cls, {}, name)) for name, cls in config_sections().items()
            if name in RESULT_SECTIONS}


def resolve_cells(config: PipelineConfig) -> list[Cell]:
    """Every cell of the study as a pipeline (plain data), in the study's order; ids are unique."""
    from vitscale.models.variants import parse_model_name
    from vitscale.stages.run import resolve_pipeline_path

    base = to_dict(config)
    base.pop("study", None)
    study = config.section("study")
    defaults = result_defaults()
    cells: list[Cell] = []
    seen: dict[str, str] = {}
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
        ident = cell_id(label, epochs, spec.data_size, settings_hash(raw, defaults))
        legacy = cell_id(label, epochs, spec.data_size, settings_hash(raw, defaults, locations=True))
        # The id names the cell's run folder and its records (`state/<id>.stages.json`): a file name.
        size = name_bytes(ident)
        check(size <= NAME_MAX_BYTES, f"{spec.key}.label" if spec.entry.label else spec.key,
              f"makes a cell id of {size} bytes ({ident[:24]}...{ident[-16:]}), which names the cell's run "
              f"folder: at most {NAME_MAX_BYTES}; shorten the label")
        if ident in seen:
            raise ConfigError(spec.key, f"the same cell as {seen[ident]} ({label}, {epochs:g} epochs, "
                                        f"data size {spec.data_size or 'all'})")
        seen[ident] = spec.key
        cells.append(Cell(ident, label, name, parse_model_name(name).family, epochs, spec.data_size,
                          spec.entry.throughput or study.throughput, raw, spec.key,
                          legacy if legacy != ident else None))
    return cells


def build_cell(cell: Cell, source: str | None = None) -> PipelineConfig:
    """The cell's pipeline, validated with every stage's checks; errors name the study key."""
    from vitscale.stages import build_pipeline

    try:
        return build_pipeline(cell.raw, source)
    except ConfigError as exc:
        raise ConfigError(cell.key, f"{exc.key}: {exc.message}", exc.source) from None


def cell_run(config: PipelineConfig, cell: Cell, cells_storage: str, run_name: str | None = None) -> PipelineConfig:
    """The cell's pipeline as it runs: its own run name (its id, or the directory an earlier
    vitscale gave it), under the study's `cells/` storage."""
    built = build_cell(cell, config.source)
    name = run_name or cell.id
    cluster = replace(built.cluster, storage_path=cells_storage, run_name=name)
    return replace(built, name=name, cluster=cluster)
