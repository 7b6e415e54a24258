"""Turning YAML values into typed config fields: the checks and the coercion behind ``swarm.config``.

    check(lr > 0, "train.lr", "must be positive")          # raises ConfigError("train.lr: must be ...")
    cfg = build(RunConfig, yaml.safe_load(text))           # every field coerced to its annotation

A value of the wrong type or out of range raises ``ConfigError`` with one line naming the field.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Literal


class ConfigError(ValueError):
    """A config value is missing, of the wrong type or out of range. The message names the field."""


def check(cond: bool, name: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{name}: {msg}")


def coerce(value: Any, tp: Any, name: str) -> Any:
    """Convert a YAML value to the annotated type, or raise ConfigError naming the field."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return coerce(value, arg, name)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{name}: invalid value {value!r}")
    if origin is Literal:
        choices = typing.get_args(tp)
        check(value in choices, name, f"must be one of {list(choices)}, got {value!r}")
        return value
    if origin in (list, tuple):
        check(isinstance(value, (list, tuple)), name, f"must be a list, got {value!r}")
        (inner, *_) = typing.get_args(tp) or (Any,)
        return [coerce(v, inner, f"{name}[{i}]") for i, v in enumerate(value)]
    if dataclasses.is_dataclass(tp):
        check(isinstance(value, dict), name, f"must be a mapping, got {value!r}")
        return build(tp, value, name)
    if tp is bool:
        check(isinstance(value, bool), name, f"must be true or false, got {value!r}")
        return value
    if tp is int:
        check(
            isinstance(value, int) and not isinstance(value, bool), name, f"must be an integer, got {value!r}"
        )
        return value
    if tp is float:
        if isinstance(value, str):  # PyYAML reads 5e-4 (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        check(
            isinstance(value, (int, float)) and not isinstance(value, bool),
            name,
            f"must be a number, got {value!r}",
        )
        return float(value)
    if tp is str:
        check(isinstance(value, str), name, f"must be a string, got {value!r}")
        return value
    return value


def build(cls: type, raw: dict[str, Any], prefix: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    for key in raw:
        check(
            key in known, f"{prefix}{'.' if prefix else ''}{key}", f"unknown field (known: {sorted(known)})"
        )
    kwargs = {k: coerce(v, hints[k], f"{prefix}{'.' if prefix else ''}{k}") for k, v in raw.items()}
    try:
        return cls(**kwargs)
    except TypeError as e:  # a required field missing
        raise ConfigError(f"{prefix or 'config'}: {e}") from None
