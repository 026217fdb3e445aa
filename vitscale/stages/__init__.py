"""The stage registry: every stage a pipeline may name, and loading a pipeline against it.

To add a stage, write one module here that defines `STAGE = vitscale.stages.base.Stage(...)`
(see docs/architecture.md) and add one line to `REGISTRY`; a stage that is one part of a larger
package lives in it instead (the study: `vitscale/scaling/study/stage.py`). Nothing else: the loader learns the
stage's config sections from it, `run_pipeline` runs it, and a pipeline naming a stage that is
not registered is refused when it is loaded.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from vitscale.config.checks import ConfigError
from vitscale.config.loader import build_pipeline as _build_pipeline
from vitscale.config.loader import read_pipeline
from vitscale.config.pipeline import PipelineConfig
from vitscale.stages.base import Stage

REGISTRY: dict[str, str] = {
    "pretrain": "vitscale.stages.pretrain",
    "fewshot": "vitscale.stages.fewshot",
    "finetune": "vitscale.stages.finetune",
    "sweep": "vitscale.stages.sweep",
    "study": "vitscale.scaling.study.stage",
}
"""Stage name -> the module defining its `STAGE` (imported on first use: no torch or Ray at import)."""


def get_stage(name: str) -> Stage:
    """The registered stage `name`."""
    if name not in REGISTRY:
        raise ConfigError("stages", f"unknown stage {name!r}; stages: {', '.join(REGISTRY)}")
    stage = importlib.import_module(REGISTRY[name]).STAGE
    if stage.name != name:
        raise RuntimeError(f"{REGISTRY[name]}.STAGE is named {stage.name!r}, registered as {name!r}")
    return stage


def config_sections() -> dict[str, type]:
    """Every registered stage's config sections: YAML key -> config class (one class per key)."""
    sections: dict[str, type] = {}
    for name in REGISTRY:
        for key, cls in get_stage(name).sections.items():
            if sections.setdefault(key, cls) is not cls:
                raise RuntimeError(f"section {key!r} is declared by two stages with different classes")
    return sections


def build_pipeline(raw: Mapping[str, Any], source: str | None = None, *, stage_checks: bool = True) -> PipelineConfig:
    """A validated pipeline from plain data (parsed YAML): sections, then each stage's own checks.

    `stage_checks=False` validates the sections only: a sweep re-validates each trial's values
    that way from inside its own check.
    """
    config = _build_pipeline(dict(raw), sections=config_sections(), stage_names=tuple(REGISTRY), source=source)
    if not stage_checks:
        return config
    try:
        made: list[type] = []
        for name in config.stages:
            stage = get_stage(name)
            for kind in stage.needs:
                if not any(issubclass(m, kind) for m in made):
                    makers = [n for n in REGISTRY if get_stage(n).produces is kind]
                    raise ConfigError("stages", f"{name} needs a {kind.__name__} from an earlier stage; "
                                                f"put {' or '.join(makers) or 'a stage that makes one'} before it")
            if stage.check is not None:
                stage.check(config)
            if stage.produces is not None:
                made.append(stage.produces)
    except ConfigError as exc:
        raise exc.in_file(source) if source else exc from None
    return config


def load_pipeline(path: str | Path, overrides: Iterable[str] = ()) -> PipelineConfig:
    """Read a pipeline YAML file (following `extends:`), apply `key=value` overrides, validate."""
    return build_pipeline(read_pipeline(path, overrides), str(path))


__all__ = ["REGISTRY", "build_pipeline", "config_sections", "get_stage", "load_pipeline"]
