"""vitscale: pre-train Vision Transformers at scale on Ray Train + DeepSpeed ZeRO, as the ViT paper did.

The Python API (docs/api.md); names are imported on first use, so ``import vitscale`` loads
neither torch nor Ray:

    import vitscale

    model = vitscale.create_model("vit_base_patch16_224", num_classes=10)   # or "ViT-B/16"
    with vitscale.DatasetWriter("data/mine", name="mine", classes=["cat", "dog"]) as w:
        w.add(image, 0)                                                     # bytes, PIL or uint8 array
    ds = vitscale.ShardDataset("data/mine", batch_size=32, resolution=224)  # a torch IterableDataset
    config = vitscale.load_pipeline("quickstart", ["train.steps=10"])       # a name or a YAML path
    summary = vitscale.run_pipeline(config)                                 # what `vitscale run` does
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vitscale._version import __version__

if TYPE_CHECKING:
    from vitscale.config.pipeline import PipelineConfig
    from vitscale.data.dataset import ShardDataset
    from vitscale.data.order import rank_order
    from vitscale.data.writer import DatasetWriter
    from vitscale.models.factory import create_model, model_names
    from vitscale.stages.run import run_pipeline

_EXPORTS: dict[str, str] = {
    "create_model": "vitscale.models.factory",
    "model_names": "vitscale.models.variants",
    "ShardDataset": "vitscale.data.dataset",
    "DatasetWriter": "vitscale.data.writer",
    "rank_order": "vitscale.data.order",
    "run_pipeline": "vitscale.stages.run",
}
"""Public name -> the module that defines it."""

__all__ = ["DatasetWriter", "ShardDataset", "__version__", "create_model", "load_pipeline", "model_names",
           "rank_order", "run_pipeline"]


def load_pipeline(name_or_path: str | Path, overrides: Iterable[str] = ()) -> PipelineConfig:
    """A validated pipeline from a YAML path or a shipped pipeline's name ("quickstart", "pretrain",
    "recipes/jft-vit-l16"), with ``key=value`` overrides applied (as ``vitscale run --set``)."""
    from vitscale.stages import load_pipeline as load
    from vitscale.stages.run import resolve_pipeline_path

    return load(resolve_pipeline_path(str(name_or_path)), overrides)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'vitscale' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
