"""Load runtime.toml, apply overrides, and check the result against the JSON schema."""

from __future__ import annotations

import dataclasses
import json
import tomllib
from collections.abc import Mapping
from functools import cache
from importlib import resources
from typing import TYPE_CHECKING, Any

from mixserve.config.runtime_config import EngineConfig, RuntimeConfig, ServerConfig

if TYPE_CHECKING:
    import jsonschema

SECTIONS: dict[str, type] = {"engine": EngineConfig, "server": ServerConfig}


class ConfigError(ValueError):
    """A bad configuration file, key or value; the message is one line naming the key and the rule."""


@cache
def schema() -> dict[str, Any]:
    """The JSON schema of runtime.toml, read from the package data."""
    text = resources.files("mixserve.config").joinpath("runtime.schema.json").read_text(encoding="utf-8")
    return json.loads(text)


def load_config(path: str | None = None, overrides: Mapping[str, Any] | None = None) -> RuntimeConfig:
    """Read `path` (None = defaults only), apply `overrides`, validate, and build the dataclasses.

    `overrides` is either nested (`{"engine": {"prefill_chunk": 64}}`) or flat (`{"prefill_chunk": 64}`,
    each key looked up in [engine] then [server]); a value of None means "not given" and is skipped.
    """
    data: dict[str, dict[str, Any]] = {}
    if path:
        data = _read_toml(path)
        _validate(data, where=path)
        data = {name: dict(table) for name, table in data.items()}
    for section, key, value in _flatten_overrides(overrides or {}):
        data.setdefault(section, {})[key] = value
    _validate(data, where="")  # the file was valid, so an error here names an override
    return RuntimeConfig(**{name: cls(**data.get(name, {})) for name, cls in SECTIONS.items()})


def _read_toml(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the config file ({e.strerror})") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML ({e})") from None


def _flatten_overrides(overrides: Mapping[str, Any]) -> list[tuple[str, str, Any]]:
    fields = {name: {f.name for f in dataclasses.fields(cls)} for name, cls in SECTIONS.items()}
    out: list[tuple[str, str, Any]] = []
    for key, value in overrides.items():
        if key in SECTIONS and isinstance(value, Mapping):
            out.extend((key, k, v) for k, v in value.items() if v is not None)
            continue
        if value is None:
            continue
        section = next((name for name, keys in fields.items() if key in keys), None)
        if section is None:
            raise ConfigError(f"{key}: unknown configuration key")
        out.append((section, key, value))
    return out


def _validate(data: Mapping[str, Any], where: str) -> None:
    import jsonschema  # here, not at import: a runner-only machine (the GPU bench) may not have it

    validator = jsonschema.Draft202012Validator(schema())
    errors = sorted(validator.iter_errors(data), key=lambda e: list(e.absolute_path))
    if errors:
        raise ConfigError(f"{where}: {_describe(errors[0])}" if where else _describe(errors[0]))


# JSON Schema rule -> the one-line explanation of a value that breaks it
_RULE_MESSAGES = {
    "type": "must be of type {limit}, got {value!r}",
    "enum": "must be one of {limit}, got {value!r}",
    "minimum": "must be >= {limit}, got {value!r}",
    "exclusiveMinimum": "must be > {limit}, got {value!r}",
    "maximum": "must be <= {limit}, got {value!r}",
    "pattern": "must match {limit}, got {value!r}",
    "minLength": "must not be empty",
}


def _describe(error: jsonschema.ValidationError) -> str:
    """One line: the dotted key, then the rule it breaks."""
    key = ".".join(str(p) for p in error.absolute_path)
    prefix = f"{key}: " if key else ""
    rule = error.validator
    value = error.instance
    if rule == "additionalProperties":
        allowed = set(error.schema.get("properties", {}))
        unknown = sorted(k for k in value if k not in allowed)
        where = f"{key}." if key else ""
        return f"{where}{unknown[0]}: unknown key (allowed: {', '.join(sorted(allowed))})"
    template = _RULE_MESSAGES.get(rule)
    if template is not None:
        limit = error.validator_value
        if rule == "enum":
            limit = ", ".join(map(str, limit))
        return prefix + template.format(limit=limit, value=value)
    return f"{prefix}{error.message}"
