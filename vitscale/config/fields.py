"""What a config field's metadata may say, spelled once: the loader and the resume rules read these.

- `PATH`: the value is a local path (or URL) a user typed; the driver makes it absolute before
  Ray workers, which run elsewhere, read it (`loader.absolute_paths`).
- `RESUME_FREE`: a resumed run may change it (how a run is watched, checkpointed or read, never
  which samples it sees in which order, its schedule or its model). `train/resume.py` derives the
  allow-list from these marks; docs/resume.md lists them.
- `overrides(cls)`: the field is a mapping of some of `cls`'s fields (YAML keys), laid over defaults
  its owner chooses (the fine-tuning recipe over `TrainConfig`): keys and types are checked
  against `cls` when the pipeline is loaded, and errors name the whole dotted key.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

PATH: Mapping[str, Any] = MappingProxyType({"path": True})
RESUME_FREE: Mapping[str, Any] = MappingProxyType({"resume": "free"})


def overrides(cls: type) -> Mapping[str, Any]:
    """Metadata of a field holding overrides of `cls`'s fields."""
    return MappingProxyType({"overrides": cls})


def is_path(metadata: Mapping[str, Any]) -> bool:
    return bool(metadata.get("path"))


def is_resume_free(metadata: Mapping[str, Any]) -> bool:
    return metadata.get("resume") == "free"


def overridden(metadata: Mapping[str, Any]) -> type | None:
    """The class a field's mapping overrides, or None."""
    cls = metadata.get("overrides")
    return cls if isinstance(cls, type) else None
