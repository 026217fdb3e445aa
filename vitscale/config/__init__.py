"""The config layer: checks, the pipeline shell, and YAML -> frozen dataclasses.

The sections themselves live with their owners (`models/config.py`, `data/config.py`,
`train/config.py`, `eval/config.py`) and are registered by the stages that use them
(`vitscale.stages`), which is also where `load_pipeline` lives.
"""

from vitscale.config.checks import ConfigError
from vitscale.config.loader import apply_override, build_section, read_pipeline, to_dict, to_yaml
from vitscale.config.pipeline import ClusterConfig, PipelineConfig

__all__ = ["ClusterConfig", "ConfigError", "PipelineConfig", "apply_override", "build_section",
           "read_pipeline", "to_dict", "to_yaml"]
