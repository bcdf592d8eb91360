"""Reading a config: a preset name or a YAML file (which may start with
``extends: PRESET_OR_PATH`` and list only what it changes), then ``a.b=value`` overrides, then
validation. Errors become one-line ``UserInputError`` messages that name the field, the value seen
and the fix."""

from __future__ import annotations

from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from treegrpo_ray.config.schema import JobConfig
from treegrpo_ray.errors import UserInputError


def preset_names() -> list[str]:
    files = resources.files("treegrpo_ray").joinpath("presets").iterdir()
    return sorted(f.name.removesuffix(".yaml") for f in files if f.name.endswith(".yaml"))


def read_yaml(name_or_path: str) -> dict[str, Any]:
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or path.exists():
        if not path.is_file():
            raise UserInputError(f"config file {path} does not exist; pass a preset name or a path")
        text = path.read_text()
    elif name_or_path in preset_names():
        text = resources.files("treegrpo_ray").joinpath(f"presets/{name_or_path}.yaml").read_text()
    else:
        raise UserInputError(
            f"unknown preset '{name_or_path}'; available presets: {', '.join(preset_names())} "
            "(or pass a path to a .yaml file)"
        )
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as err:
        raise UserInputError(f"malformed YAML in {name_or_path}: {err}".replace("\n", " ")) from err
    if not isinstance(data, dict):
        raise UserInputError(f"{name_or_path}: the top level must be a mapping of sections")
    if "extends" in data:  # a preset name or path whose fields this file overrides
        return _merged(read_yaml(str(data.pop("extends"))), data)
    return data


def _merged(base: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``changes`` applied: sections merged key by key, other values replaced."""
    out = dict(base)
    for key, value in changes.items():
        both_sections = isinstance(value, dict) and isinstance(base.get(key), dict)
        out[key] = _merged(base[key], value) if both_sections else value
    return out


def apply_override(data: dict[str, Any], override: str) -> None:
    """Set ``a.b.c=value`` in nested ``data``; the value is parsed as YAML (``4``, ``null``...)."""
    key, sep, raw = override.partition("=")
    if not sep or not key:
        raise UserInputError(f"override '{override}' is not KEY=VALUE, e.g. --set tree.m=4")
    *parents, leaf = key.strip().split(".")
    node = data
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise UserInputError(f"override '{override}': '{part}' is not a section")
    try:
        node[leaf] = yaml.safe_load(raw)
    except yaml.YAMLError as err:
        raise UserInputError(f"override '{override}': value is not valid YAML") from err


def _describe(error: Mapping[str, Any]) -> str:
    field = ".".join(str(p) for p in error["loc"]) or "config"
    if error["type"] == "extra_forbidden":
        return f"unknown field '{field}'; check the spelling against the preset"
    return f"{field}: {error['msg']} (got {error.get('input')!r})"


def load_config(name_or_path: str, overrides: list[str] | None = None) -> JobConfig:
    """Load a preset name or YAML path, apply ``a.b=value`` overrides and validate."""
    return validate(read_yaml(name_or_path), overrides, name_or_path)


def validate(data: dict[str, Any], overrides: list[str] | None, source: str) -> JobConfig:
    for override in overrides or []:
        apply_override(data, override)
    try:
        cfg = JobConfig.model_validate(data)
    except ValidationError as err:
        problems = "; ".join(_describe(e) for e in err.errors())
        raise UserInputError(f"invalid config {source}: {problems}") from err
    return with_vllm_device_resolved(cfg)


def with_vllm_device_resolved(cfg: JobConfig) -> JobConfig:
    """``engine.vllm.device: auto`` made the build installed here: resolved once, by the process
    that reads the config (the driver), and saved with the run, so no worker probes its own."""
    vllm = cfg.engine.vllm
    if vllm.device != "auto":
        return cfg
    resolved = vllm.model_copy(update={"device": vllm.resolved_device()})
    return cfg.model_copy(update={"engine": cfg.engine.model_copy(update={"vllm": resolved})})
