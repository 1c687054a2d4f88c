"""A strict loader from YAML data to frozen dataclasses, and the field helper that documents
each key.

Nothing here knows about Ray or Slurm: `config.py` declares the model with `doc(...)` fields,
`load` builds it, rejecting unknown keys and wrong types with the key path and the valid
choices, and `cli/docs.py` renders the same fields as the config reference.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
from collections.abc import Mapping
from dataclasses import field
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

T = TypeVar("T")


class ConfigError(ValueError):
    """A config value is wrong; the message names the key path and what is allowed."""


def doc(text: str, default: Any = dataclasses.MISSING, **kw: Any) -> Any:
    """A dataclass field with documentation attached."""
    if default is dataclasses.MISSING and "default_factory" not in kw:
        return field(metadata={"doc": text}, **kw)
    if "default_factory" in kw:
        return field(metadata={"doc": text}, **kw)
    return field(default=default, metadata={"doc": text})


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp)).replace("NoneType", "null")


def _convert(tp: Any, value: Any, path: str) -> Any:
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _convert(args[0], value, path)
    if origin is Literal:
        choices = get_args(tp)
        if value not in choices:
            raise ConfigError(
                f"{path}: {value!r} is not one of {', '.join(map(repr, choices))}"
            )
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{path}: expected a list, got {value!r}")
        (item,) = get_args(tp)
        return [_convert(item, v, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{path}: expected a mapping, got {value!r}")
        _, vt = get_args(tp)
        return {str(k): _convert(vt, v, f"{path}.{k}") for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        return load(tp, value, path)  # type: ignore[arg-type]
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{path}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise ConfigError(f"{path}: expected a string, got {value!r}")
        return str(value)
    raise ConfigError(f"{path}: unsupported type {_type_name(tp)}")


def load(cls: type[T], data: Any, path: str, *, passthrough_prefix: str = "_") -> T:
    """Build dataclass `cls` from `data`, rejecting unknown keys (keys starting with
    `passthrough_prefix` are internal and ignored)."""
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path}: expected a mapping, got {data!r}")
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if passthrough_prefix and str(key).startswith(passthrough_prefix):
            continue
        if key not in fields:
            near = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f"did you mean {near[0]!r}? " if near else ""
            raise ConfigError(
                f"{path}.{key}: unknown key; {hint}valid keys are: {', '.join(sorted(fields))}"
            )
        kwargs[key] = _convert(hints[key], value, f"{path}.{key}")
    return cls(**kwargs)
