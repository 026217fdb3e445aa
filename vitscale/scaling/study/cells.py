"""A study's cell and its id (pure): what a cell is, and the name its directory and state carry.

A cell is the study's own pipeline with the cell's model, recipe, epochs and `data.subset` set
and `stages: [pretrain, *study.transfer]`; `cell_pipelines.py` resolves the study section
into cells and validates each with the same loader and stage checks as any pipeline.

A cell's id names its directory and state file: readable (model, epochs, data size) and ended by
a hash of everything that decides its result (model, train, data and transfer sections). Change a
cell's settings and it is a new cell: its old state is never resumed from.

Where the data lives is not a setting that decides a result: the hash sees each dataset location
by its name (the last path component, `/data/jft300m` and `s3://bucket/jft300m` alike), so the
same pipeline run from another directory, or with its data moved, is the same study. Ids of
vitscale before this rule hashed absolute paths; `legacy_id` is that id, so a study started then
is still found (`StudyState.record_or_migrate`).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vitscale.config.location import is_url

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
    """Measured images/s per device, overriding the FLOP-based device-time estimate; null = none."""
    raw: dict[str, Any]
    """The cell's pipeline as plain data (validated by `build_cell`)."""
    key: str
    """Where the study section names this cell."""
    legacy_id: str | None = None
    """The id earlier vitscale gave this cell (absolute data paths hashed), to find its old state."""


def slug(text: str) -> str:
    """A file-name-safe lower-case form: "ViT-B/16" -> "vit-b16"."""
    return re.sub(r"[^a-z0-9.]+", "-", text.lower().replace("/", "")).strip("-.")


def location_free(value: Any) -> Any:
    """`value` with every absolute path or URL replaced by its last component (a dataset's name)."""
    if isinstance(value, Mapping):
        return {k: location_free(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [location_free(v) for v in value]
    if isinstance(value, str) and (value.startswith("/") or is_url(value)):
        return value.rstrip("/").rsplit("/", 1)[-1]
    return value


def settings_hash(raw: Mapping[str, Any], defaults: Mapping[str, Any], *, locations: bool = False) -> str:
    """Six hex digits of the sections that decide a cell's result (and its stages).

    Only values that differ from vitscale's `defaults` count: a later vitscale that adds a config
    key (with a default that changes nothing) keeps every cell's id, so its studies still resume.
    Dataset locations count by name only, unless `locations` (the legacy rule).
    """
    decided = {k: _changed(raw.get(k), defaults.get(k)) for k in RESULT_SECTIONS}
    decided["stages"] = raw.get("stages")
    if not locations:
        decided = location_free(decided)
    return hashlib.sha256(json.dumps(decided, sort_keys=True, default=str).encode()).hexdigest()[:6]


def _changed(value: Any, default: Any) -> Any:
    """`value` without the keys (recursively) that equal `default`'s."""
    if isinstance(value, dict) and isinstance(default, dict):
        return {k: _changed(v, default.get(k)) for k, v in value.items() if k not in default or v != default[k]}
    return value


def cell_id(label: str, epochs: float, data_size: int | None, settings: str) -> str:
    """`vit-b16-e7-all-1a2b3c`: label, epochs, data size, settings hash."""
    return f"{slug(label)}-e{epochs:g}-{'n' + str(data_size) if data_size else 'all'}-{settings}"
