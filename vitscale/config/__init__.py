"""Typed pipeline configuration: one frozen dataclass per stage, loaded from YAML."""

from vitscale.config.loader import apply_override, build_pipeline, load_pipeline, to_dict, to_yaml
from vitscale.config.schema import (
    ClusterConfig,
    ConfigError,
    DataConfig,
    EvalConfig,
    FaultConfig,
    FinetuneConfig,
    ModelConfig,
    PipelineConfig,
    SourceConfig,
    StudyConfig,
    SweepConfig,
    TrainConfig,
)

__all__ = [
    "ClusterConfig", "ConfigError", "DataConfig", "EvalConfig", "FaultConfig", "FinetuneConfig",
    "ModelConfig", "PipelineConfig", "SourceConfig", "StudyConfig", "SweepConfig", "TrainConfig",
    "apply_override", "build_pipeline", "load_pipeline", "to_dict", "to_yaml",
]
