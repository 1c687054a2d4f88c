"""The config reference (docs/config-reference.md), generated from the config model.

    python -m ray_slurm_provider.cli.docs            # print it
    ray-slurm docs --output docs/config-reference.md
    ray-slurm docs --check docs/config-reference.md   # exit 1 when the file is stale

Every key, type, default and description comes from the pydantic dataclasses in config.py
(each field's `description`); a unit test fails when the committed file differs from this
output.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import types
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin, get_type_hints

from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from ray_slurm_provider.config import NodeConfig, ProviderConfig
from ray_slurm_provider.schema import Duration, Text

HEADER = """# Config reference

Generated from the config model (`ray_slurm_provider/config.py`) by
`python -m ray_slurm_provider.cli.docs`; do not edit by hand. Two sections of a Ray cluster YAML
belong to this provider: `provider:` and each `available_node_types.<name>.node_config`.
Unknown keys are refused with the key's path and the valid keys; `ray-slurm validate CONFIG`
checks a config against this model and the live cluster; `ray-slurm schema` prints the same
model, within Ray's own cluster schema, as JSON Schema for editors.
"""

SECTIONS: tuple[tuple[str, type[Any], str], ...] = (
    ("provider", ProviderConfig, "Cluster-wide settings."),
    ("available_node_types.<name>.node_config", NodeConfig,
     "The Slurm job of one node type (one job per Ray node)."),
)


def type_name(tp: Any) -> str:
    if tp == Duration:
        return "string (quoted: a number is refused)"
    if tp == Text:
        return "string (or a whole number)"
    origin = get_origin(tp)
    if origin is Annotated:
        return type_name(get_args(tp)[0])
    if origin in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        inner = " or ".join(type_name(a) for a in args)
        return f"{inner} or null" if len(args) < len(get_args(tp)) else inner
    if origin is Literal:
        return "one of " + ", ".join(f"`{a}`" for a in get_args(tp))
    if origin is list:
        return f"list of {type_name(get_args(tp)[0])}s"
    if origin is dict:
        k, v = get_args(tp)
        return f"mapping of {type_name(k)} to {type_name(v)}"
    if dataclasses.is_dataclass(tp):
        return "mapping"
    return {str: "string", int: "integer", float: "number", bool: "boolean"}.get(tp, str(tp))


def default_text(f: FieldInfo) -> str:
    if f.default is not PydanticUndefined:
        value = f.default
    elif f.default_factory is not None:
        value = f.default_factory()  # type: ignore[call-arg]
        if dataclasses.is_dataclass(value):
            return "see below"
    else:
        return "required"
    if value is None:
        return "none"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, (dict, list)) and not value:
        return f"`{value!r}`"
    return f"`{value}`"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def section(path: str, cls: type[Any], intro: str) -> list[str]:
    """The markdown of one dataclass, then one section per nested dataclass."""
    hints = get_type_hints(cls, include_extras=True)
    lines = [f"## `{path}`", "", intro, "", "| Key | Type | Default | Description |",
             "|---|---|---|---|"]
    nested: list[tuple[str, type[Any], str]] = []
    for name, f in cls.__pydantic_fields__.items():
        tp = hints[name]
        doc = f.description or ""
        lines.append(f"| `{name}` | {_cell(type_name(tp))} | {default_text(f)} | "
                     f"{_cell(doc)} |")
        if dataclasses.is_dataclass(tp):
            nested.append((f"{path}.{name}", tp, _cell(doc)))  # type: ignore[arg-type]
    out = [*lines, ""]
    for sub_path, sub_cls, sub_doc in nested:
        out += section(sub_path, sub_cls, sub_doc)
    return out


def reference() -> str:
    lines = [HEADER]
    for path, cls, intro in SECTIONS:
        lines += section(path, cls, intro)
    return "\n".join(lines).rstrip("\n") + "\n"


def cmd_docs(args: argparse.Namespace) -> int:
    text = reference()
    if args.check:
        path = Path(args.check)
        current = path.read_text() if path.exists() else ""
        if current != text:
            print(f"{path} is stale: regenerate it with `ray-slurm docs --output {path}`",
                  file=sys.stderr)
            return 1
        print(f"{path} is up to date")
        return 0
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(text)
        print(f"wrote {args.output}")
        return 0
    sys.stdout.write(text)
    return 0


def register(sub: Any) -> None:
    p = sub.add_parser("docs", help="print (or write, or check) the config reference")
    p.add_argument("--output", "-o", help="write it to this file")
    p.add_argument("--check", metavar="FILE", help="exit 1 when FILE differs from the model")
    p.set_defaults(func=cmd_docs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ray_slurm_provider.cli.docs")
    parser.add_argument("--output", "-o")
    parser.add_argument("--check", metavar="FILE")
    return cmd_docs(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
