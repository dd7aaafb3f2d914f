"""The run configuration: the schema (`schema.py`) and its strict loader (`loader.py`).

`from sage_jax import config` gives both modules' public names: `config.load_config(...)`,
`config.Config`, `config.ConfigError`, ...
"""

from sage_jax.config.loader import (
    CONFIG_DIR, DEFAULT_CONFIG, apply_overrides, from_dict, load_config, resolve_config_path,
    save_config, to_dict, to_yaml,
)
from sage_jax.config.schema import (
    HINTED_METHODS, LORA_TARGETS, PAPER_BENCHMARKS, CheckpointConfig, Config, ConfigError,
    DataConfig, DType, EvalConfig, HintConfig, LoggingConfig, LoraConfig, MeshConfig,
    ModelConfig, OptimConfig, RLConfig, RolloutConfig, Section, TaskConfig, TrainConfig,
    check_sampling, require,
)

__all__ = [
    "CONFIG_DIR", "DEFAULT_CONFIG", "apply_overrides", "from_dict", "load_config",
    "resolve_config_path", "save_config", "to_dict", "to_yaml",
    "HINTED_METHODS", "LORA_TARGETS", "PAPER_BENCHMARKS", "CheckpointConfig", "Config",
    "ConfigError", "DataConfig", "DType",
    "EvalConfig", "HintConfig", "LoggingConfig", "LoraConfig", "MeshConfig", "ModelConfig",
    "OptimConfig",
    "RLConfig", "RolloutConfig", "Section", "TaskConfig", "TrainConfig", "check_sampling",
    "require",
]
