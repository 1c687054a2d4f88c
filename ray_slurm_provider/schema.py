"""The loader from YAML data to the frozen pydantic dataclasses of config.py, and the types
that decide, key by key, what YAML value is accepted.

Nothing here knows about Ray or Slurm: `config.py` declares the model with `doc(...)` fields
(pydantic `Field(description=...)`), `load` builds it, refusing unknown keys (with a
did-you-mean) and wrong types with the key path, and `cli/docs.py` and `cli/schema.py` render
the same fields as the config reference and the JSON Schema.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
from collections.abc import Mapping
from typing import Annotated, Any, TypeVar, Union, get_args, get_origin, get_type_hints

import yaml
from pydantic import BeforeValidator, Field, Strict, TypeAdapter, ValidationError
from pydantic_core import PydanticCustomError

T = TypeVar("T")

#: Why an integer is refused for a duration: `ray up` hands us Ray's parsed dict, where an
#: unquoted 4:00:00 is already 14400 (YAML 1.1 base 60), the same as a literal 14400.
DURATION_HINT = ("write it as a string, e.g. '60' or '4:00:00' (YAML 1.1 reads 4:00:00 as "
                 "14400)")


class ConfigError(ValueError):
    """A config value is wrong; the message names the key path and what is allowed.

    `key` and `value` (when known) let a caller that has the YAML text point at the line."""

    def __init__(self, message: str, *, key: str = "", value: Any = None) -> None:
        super().__init__(message)
        self.key = key
        self.value = value


def with_source(err: ConfigError, text: str, file: str, *,
                only_surprises: bool = False) -> ConfigError:
    """`err` naming what the user wrote, when a line of the YAML `text` gives the bad key that
    value (`time: 4:00:00` for 14400): the parsed number alone would puzzle them.
    `only_surprises`: only when the text reads otherwise than the value (YAML 1.1's base 60,
    octal); else `err` itself."""
    if not err.key or err.value is None or isinstance(err.value, (Mapping, list)):
        return err
    name = err.key.rsplit(".", 1)[-1]
    pattern = re.compile(rf"(?<![\w-]){re.escape(name)}\s*:\s*([^,}}\]#\n]+)")
    for n, line in enumerate(text.splitlines(), 1):
        for m in pattern.finditer(line):
            raw = m.group(1).strip()
            try:
                value = yaml.safe_load(raw)
            except yaml.YAMLError:
                continue
            if value == err.value and type(value) is type(err.value):
                if only_surprises and raw == str(value):
                    return err
                return ConfigError(f"{err} ({file} line {n}: `{name}: {raw}`)", key=err.key,
                                   value=err.value)
    return err


def _duration(value: Any) -> Any:
    if isinstance(value, int) and not isinstance(value, bool):
        raise PydanticCustomError("duration_type", "got the number {n}; " + DURATION_HINT,
                                  {"n": value})
    return value


def _text(value: Any) -> Any:
    # A whole number reads back exactly (`account: 1234`); a float may not (`3.10` is 3.1).
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return value


#: A string, never a number: strict types refuse what YAML turned into something else.
Str = Annotated[str, Strict()]
Int = Annotated[int, Strict()]
Num = Annotated[float, Strict()]
Bool = Annotated[bool, Strict()]
#: A Slurm duration: a string only (see DURATION_HINT).
Duration = Annotated[str, BeforeValidator(_duration, json_schema_input_type=str), Strict()]
#: sbatch options whose value is a duration (the same YAML 1.1 trap as `time`).
DURATION_OPTIONS = frozenset({"time", "time-min", "t", "delay-boot"})


def _options(value: Any) -> Any:
    if isinstance(value, Mapping):
        for opt, v in value.items():
            if opt in DURATION_OPTIONS and isinstance(v, int) and not isinstance(v, bool):
                raise PydanticCustomError("duration_option", "{option}: got the number {n}; "
                                          + DURATION_HINT, {"option": opt, "n": v})
    return value


#: A name or value where a whole number is a fine string (an account `1234`, `nofile: 65536`).
Text = Annotated[str, BeforeValidator(_text, json_schema_input_type=str | int), Strict()]
#: `{option: value}` for sbatch: values as Text, durations as Duration.
SbatchOptions = Annotated[dict[str, Text], BeforeValidator(_options)]


def doc(text: str, default: Any = dataclasses.MISSING, **kw: Any) -> Any:
    """A model field with its documentation (`description`, as in the JSON Schema)."""
    if "default_factory" in kw:
        return Field(default_factory=kw["default_factory"], description=text)
    if default is dataclasses.MISSING:
        return Field(description=text)
    return Field(default, description=text)


def _model_of(tp: Any) -> Any:
    """The dataclass inside `tp` (`X`, `X | None`), else None."""
    if get_origin(tp) in (Union, types.UnionType):
        found = [a for a in get_args(tp) if dataclasses.is_dataclass(a)]
        return found[0] if found else None
    return tp if dataclasses.is_dataclass(tp) else None


def _clean(cls: Any, data: Any, path: str, passthrough_prefix: str) -> Any:
    """`data` without internal keys; unknown keys refused with the nearest valid one."""
    if not isinstance(data, Mapping):
        return data  # the model names the wrong type
    hints = get_type_hints(cls, include_extras=True)
    out = {}
    for key, value in data.items():
        if passthrough_prefix and str(key).startswith(passthrough_prefix):
            continue
        if key not in hints:
            near = difflib.get_close_matches(str(key), list(hints), n=1)
            hint = f"did you mean {near[0]!r}? " if near else ""
            raise ConfigError(f"{path}.{key}: unknown key; {hint}valid keys are: "
                              f"{', '.join(sorted(hints))}", key=f"{path}.{key}")
        inner = _model_of(hints[key])
        out[key] = value if inner is None else _clean(inner, value, f"{path}.{key}",
                                                      passthrough_prefix)
    return out


_EXPECTED = {"int_type": "an integer", "float_type": "a number", "bool_type": "true or false",
             "string_type": "a string", "dict_type": "a mapping", "list_type": "a list",
             "dataclass_type": "a mapping", "int_from_float": "an integer"}


_BOUNDS = {"greater_than_equal": ">=", "less_than_equal": "<=", "greater_than": ">",
           "less_than": "<"}


def _message(err: Any) -> str:
    kind, value = err["type"], err.get("input")
    if kind == "literal_error":
        choices = str(err["ctx"]["expected"]).replace(" or ", ", ")
        return f"{value!r} is not one of {choices}"
    if kind in _EXPECTED:
        return f"expected {_EXPECTED[kind]}, got {value!r}"
    ctx = err.get("ctx") or {}
    if kind in _BOUNDS:
        return f"must be {_BOUNDS[kind]} {next(iter(ctx.values()))}, got {value!r}"
    if kind == "string_pattern_mismatch":
        return f"{value!r} does not match {ctx['pattern']}"
    return str(err["msg"])


def error_of(exc: ValidationError, path: str) -> ConfigError:
    """The first error of pydantic's, as ConfigError naming the key path."""
    err = exc.errors()[0]
    key = path
    for part in err["loc"]:
        key += f"[{part}]" if isinstance(part, int) else f".{part}"
    if err["type"] == "duration_option":
        option = err["ctx"]["option"]
        key += f".{option}"
        return ConfigError(f"{key}: got the number {err['ctx']['n']}; {DURATION_HINT}",
                           key=key, value=err["ctx"]["n"])
    return ConfigError(f"{key}: {_message(err)}", key=key, value=err.get("input"))


_ADAPTERS: dict[Any, TypeAdapter[Any]] = {}


def adapter(cls: type[T]) -> TypeAdapter[T]:
    """The model's validator and JSON Schema (built once: building it is slow)."""
    if cls not in _ADAPTERS:
        _ADAPTERS[cls] = TypeAdapter(cls)
    return _ADAPTERS[cls]


def load(cls: type[T], data: Any, path: str, *, passthrough_prefix: str = "_") -> T:
    """Build model `cls` from `data`, rejecting unknown keys (keys starting with
    `passthrough_prefix` are internal and ignored) and values of the wrong type."""
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path}: expected a mapping, got {data!r}", key=path, value=data)
    try:
        model: T = adapter(cls).validate_python(_clean(cls, data, path, passthrough_prefix))
    except ValidationError as e:
        raise error_of(e, path) from None
    return model
