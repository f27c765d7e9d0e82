"""runtime.toml -> dataclasses, checked against the JSON schema; command-line flags override the file."""

from mixserve.config.flags import add_engine_flags, config_from_args, overrides_from_args
from mixserve.config.loader import ConfigError, load_config, schema
from mixserve.config.runtime_config import EngineConfig, RuntimeConfig, ServerConfig

__all__ = [
    "ConfigError",
    "EngineConfig",
    "RuntimeConfig",
    "ServerConfig",
    "add_engine_flags",
    "config_from_args",
    "load_config",
    "overrides_from_args",
    "schema",
]
