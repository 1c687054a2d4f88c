"""Hydra-style `key=value` overrides applied to a recipe's config object.

    model.tensor_model_parallel_size=4   set an existing field (nested by dots)
    +model.my_new_knob=1                 add a field that does not exist yet
    ~logger.wandb_project                set an existing field to None

Values are parsed as YAML scalars or flow collections (`4`, `1e-4`, `true`, `null`, `[1,2]`,
`{a: 1}`, `bf16_mixed`); quote to force a string (`name='007'`). The config can be nested
dataclasses, plain objects or dicts, as Megatron-Bridge's `ConfigContainer` is. A key that does
not exist is an error that lists the valid names, so a typo never silently trains the wrong
model. When the current value is a number or bool, the new value must be of that kind
(an int is accepted for a float). Pure logic.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

import yaml


class OverrideError(ValueError):
    pass


#: A number in exponent form, e.g. `3e-4`, which PyYAML (YAML 1.1) leaves a string: read as
#: a number where the field is a float (a string field keeps `2e71543`, a git hash).
_EXPONENT = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+$")


@dataclass(frozen=True)
class Override:
    path: tuple[str, ...]
    value: Any
    add: bool = False
    text: str = ""


def parse_override(text: str) -> Override:
    if text.startswith("~"):
        key = text[1:]
        if not key or "=" in key:
            raise OverrideError(f"override {text!r}: expected ~dotted.key")
        return Override(_split(key, text), None, False, text)
    add = text.startswith("+")
    body = text[1:] if add else text
    key, sep, raw = body.partition("=")
    if not sep or not key.strip():
        raise OverrideError(f"override {text!r}: expected dotted.key=value")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise OverrideError(f"override {text!r}: cannot parse value: {e}") from e
    return Override(_split(key.strip(), text), value, add, text)


def parse_overrides(items: Iterable[str]) -> list[Override]:
    return [parse_override(t) for t in items]


def _split(key: str, text: str) -> tuple[str, ...]:
    parts = tuple(key.split("."))
    if any(not p.isidentifier() and not p.isdigit() for p in parts):
        raise OverrideError(f"override {text!r}: bad key {key!r}")
    return parts


def _names(obj: Any) -> list[str]:
    if isinstance(obj, Mapping):
        return sorted(str(k) for k in obj)
    if dataclasses.is_dataclass(obj):
        return sorted(f.name for f in dataclasses.fields(obj))
    return sorted(k for k in vars(obj) if not k.startswith("_")) if hasattr(obj, "__dict__") \
        else []


def _has(obj: Any, name: str) -> bool:
    if isinstance(obj, Mapping):
        return name in obj
    return hasattr(obj, name)


def _get(obj: Any, name: str) -> Any:
    return obj[name] if isinstance(obj, Mapping) else getattr(obj, name)


def _set(obj: Any, name: str, value: Any) -> None:
    if isinstance(obj, MutableMapping):
        obj[name] = value
    else:
        setattr(obj, name, value)


def _check_kind(old: Any, new: Any, text: str) -> Any:
    if old is None or new is None:
        return new
    if isinstance(old, bool):
        if not isinstance(new, bool):
            raise OverrideError(f"override {text!r}: expected true/false, got {new!r}")
    elif isinstance(old, int):
        if isinstance(new, bool) or not isinstance(new, int):
            raise OverrideError(f"override {text!r}: expected an integer, got {new!r}")
    elif isinstance(old, float):
        if isinstance(new, str) and _EXPONENT.match(new):
            new = float(new)  # YAML 1.1 reads `3e-4` (no dot) as a string
        if isinstance(new, bool) or not isinstance(new, (int, float)):
            raise OverrideError(f"override {text!r}: expected a number, got {new!r}")
        if not math.isfinite(new):
            raise OverrideError(f"override {text!r}: expected a finite number, got {new!r}")
        return float(new)
    return new


def apply_override(cfg: Any, ov: Override) -> None:
    obj = cfg
    for i, name in enumerate(ov.path[:-1]):
        if not _has(obj, name):
            where = ".".join(ov.path[:i]) or "the config"
            raise OverrideError(f"override {ov.text!r}: {where} has no {name!r}; "
                                f"valid: {', '.join(_names(obj))}")
        obj = _get(obj, name)
        if obj is None:
            raise OverrideError(f"override {ov.text!r}: {'.'.join(ov.path[:i + 1])} is None")
    leaf = ov.path[-1]
    if not _has(obj, leaf):
        if not ov.add:
            where = ".".join(ov.path[:-1]) or "the config"
            raise OverrideError(f"override {ov.text!r}: {where} has no {leaf!r} (use +key=... "
                                f"to add one); valid: {', '.join(_names(obj))}")
        _set(obj, leaf, ov.value)
        return
    if ov.add:
        raise OverrideError(f"override {ov.text!r}: {'.'.join(ov.path)} already exists")
    _set(obj, leaf, _check_kind(_get(obj, leaf), ov.value, ov.text))


def apply_overrides(cfg: Any, items: Iterable[str | Override]) -> list[str]:
    """Apply every override in order; return the applied texts (for the log)."""
    done = []
    for item in items:
        ov = parse_override(item) if isinstance(item, str) else item
        apply_override(cfg, ov)
        done.append(ov.text)
    return done
