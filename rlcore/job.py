"""Loading a job spec: YAML + ``key.sub=value`` overrides onto ``JobConfig``, and the error type.

``load_job`` turns every OmegaConf/YAML failure into a one-sentence ``ConfigError`` that names the file
or the override and the dotted key; a key that moved (``rlcore.config.MOVED_KEYS``) is named with its
new place. What the types cannot check (files, pools, layouts that must divide the model and the
batch) is ``rlcore/validate.py``'s.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import os
import re
import typing
from typing import Any, Optional

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import (ConfigKeyError, MissingMandatoryValue, OmegaConfBaseException,
                              ValidationError)

from rlcore.config import MOVED_KEYS, JobConfig


class ConfigError(ValueError):
    """A job spec (or a model) that cannot run; the message is one sentence naming the file and/or the
    key. A ValueError: the Megatron side raises it for the same bad values (rlcore/layout.py)."""


# ------------------------------------------------------------------------------------------ loading
def load_job(path: Optional[str], overrides: list[str]) -> JobConfig:
    """The job spec: ``JobConfig``'s defaults, then the YAML file at ``path`` (if any), then each
    ``key.sub=value`` override in order."""
    merged = copy.deepcopy(_defaults())
    if path is not None:
        merged = _merge_file(merged, path)
    for override in overrides:
        merged = _merge_override(merged, override)
    try:
        return OmegaConf.to_object(merged)
    except MissingMandatoryValue as e:
        raise ConfigError(f"{e.full_key} is required but not set: give it in the job file or as an "
                          f"override {e.full_key}=...") from e
    except OmegaConfBaseException as e:
        raise ConfigError(f"the job spec is invalid at {e.full_key or '?'}: {_first_line(e)}") from e


@functools.lru_cache(maxsize=1)
def _defaults():
    """``JobConfig``'s defaults as an OmegaConf structured config, built once per process (~0.1 s;
    each job gets a deep copy, as ``OmegaConf.merge`` would have made)."""
    return OmegaConf.structured(JobConfig)


def _merge_file(merged, path: str):
    if not os.path.isfile(path):
        raise ConfigError(f"job file {path} not found")
    try:
        file_cfg = OmegaConf.load(path)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "an unknown line"
        problem = getattr(e, "problem", None) or str(e)
        raise ConfigError(f"job file {path} is not valid YAML at {where}: {problem}") from e
    if not OmegaConf.is_dict(file_cfg):
        raise ConfigError(f"job file {path} must be a mapping of sections (model:, actor:, ...), "
                          f"got a {type(OmegaConf.to_container(file_cfg)).__name__}")
    # One top-level section at a time, so an error that OmegaConf reports without a key path (a
    # section given as a scalar) still names its section.
    for section in file_cfg:
        try:
            # In place: ``OmegaConf.merge`` would deep-copy the whole spec for every section and override
            # (most of a load's time); a failed merge ends the load anyway.
            merged.merge_with({section: file_cfg[section]})
        except OmegaConfBaseException as e:
            full_key = e.full_key or str(section)
            line = _yaml_line(path, full_key)
            where = f"job file {path}" + (f" (line {line})" if line else "")
            raise ConfigError(_describe_merge_error(e, full_key, _select(file_cfg, full_key), where)) from e
    return merged


def _merge_override(merged, override: str):
    key, sep, raw_value = override.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"override {override!r} is not of the form key.sub=value")
    try:
        override_cfg = OmegaConf.from_dotlist([override])
    except (OmegaConfBaseException, yaml.YAMLError) as e:  # the value is parsed as YAML
        problem = getattr(e, "problem", None) or _first_line(e)
        raise ConfigError(f"override {override!r}: the value {raw_value!r} is not valid YAML ({problem})") from e
    try:
        merged.merge_with(override_cfg)
        return merged
    except OmegaConfBaseException as e:
        full_key = e.full_key or key
        value = _select(override_cfg, full_key)
        raise ConfigError(_describe_merge_error(e, full_key, value, f"override {override!r}")) from e


def _describe_merge_error(e: OmegaConfBaseException, full_key: str, value: Any, where: str) -> str:
    if isinstance(e, ConfigKeyError) and full_key in MOVED_KEYS:
        return f"{where}: {full_key} moved to {MOVED_KEYS[full_key]}"
    if isinstance(e, ConfigKeyError):
        hint = re.search(r"Did you mean[^\n]*", str(e))
        return f"{where}: unknown key {full_key}" + (f" ({hint.group(0)})" if hint else "")
    if isinstance(e, ValidationError):
        expected = _expected_type(full_key)
        if expected is not None:
            return f"{where}: {full_key}={value!r} has the wrong type, expected {expected}"
    return f"{where}: {full_key}: {_first_line(e)}"


def _first_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def _select(cfg, full_key: str) -> Any:
    value = OmegaConf.select(cfg, full_key, default=None, throw_on_missing=False)
    return OmegaConf.to_container(value) if OmegaConf.is_config(value) else value


def _type_name(tp) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Union and type(None) in args:
        inner = [a for a in args if a is not type(None)]
        return f"{_type_name(inner[0])} or null"
    if origin is list:
        return f"a list of {_type_name(args[0]).removeprefix('a ').removeprefix('an ')}s"
    if origin is dict:
        return f"a mapping of {_type_name(args[0])} to {_type_name(args[1])}"
    if dataclasses.is_dataclass(tp):
        return f"a mapping (section {tp.__name__})"
    return {int: "an integer", float: "a number", bool: "a boolean (true/false)", str: "a string"}.get(
        tp, getattr(tp, "__name__", str(tp)))


def _expected_type(full_key: str) -> Optional[str]:
    """What the schema expects at ``full_key`` (e.g. "actor.tp" -> "an integer"), or None."""
    tp: Any = JobConfig
    for part in re.sub(r"\[\d+\]", ".[]", full_key).split("."):
        if not part:
            continue
        origin, args = typing.get_origin(tp), typing.get_args(tp)
        if origin is typing.Union:
            non_null = [a for a in args if a is not type(None)]
            tp = non_null[0]
            origin, args = typing.get_origin(tp), typing.get_args(tp)
        if dataclasses.is_dataclass(tp):
            hints = typing.get_type_hints(tp)
            if part not in hints:
                return None
            tp = hints[part]
        elif origin is dict:
            tp = args[1]
        elif origin is list and part == "[]":
            tp = args[0]
        else:
            return None
    return _type_name(tp)


def _yaml_line(path: str, full_key: str) -> Optional[int]:
    """The 1-based line of ``full_key`` in the YAML file (for error messages), when it can be found."""
    with open(path) as f:
        node = yaml.compose(f)
    parts = [p for p in re.sub(r"\[\d+\]", "", full_key).split(".") if p]
    line = None
    for part in parts:
        if not isinstance(node, yaml.MappingNode):
            break
        for key_node, value_node in node.value:
            if key_node.value == part:
                line, node = key_node.start_mark.line + 1, value_node
                break
        else:
            break
    return line
