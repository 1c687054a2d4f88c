"""Site-wide and personal defaults, merged under a cluster YAML before anything parses it.

Files, in order (a later one overrides an earlier one; the cluster YAML overrides both):
``/etc/ray-slurm/defaults.yaml`` (the site's), then ``~/.config/ray-slurm/defaults.yaml``
(yours); either may be absent. ``RAY_SLURM_DEFAULTS`` replaces that list (colon-separated
paths, ``~`` expanded; empty: none): a file it names must exist, or the config is refused
naming it (a typo would silently drop the site's partition and account).

A defaults file has the cluster YAML's own shape, two sections only::

    provider:            # under the cluster's `provider:` section
      slurm_api: rest
      rest: {url: https://slurm.example.org:6820}
    node_config:         # under every node type's `node_config`
      partition: gpu
      account: proj42
      container: {runtime: apptainer, image: /shared/ray.sif, mounts: ["/scratch:/scratch"]}

Mappings merge key by key; a scalar or a list in the YAML replaces the default's whole. Keys are
checked with the config model (unknown ones are refused with the file and the key path).
The merge runs where `ray up` first sees the config (login node) and records the files in
``provider._defaults_from``: the head's autoscaler gets the merged config and never merges the
files of its own node.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml

from ray_slurm_provider.config import ConfigError, parse_node_config, parse_provider
from ray_slurm_provider.schema import with_source

ENV = "RAY_SLURM_DEFAULTS"
SITE_FILE = "/etc/ray-slurm/defaults.yaml"
USER_FILE = "~/.config/ray-slurm/defaults.yaml"
APPLIED_KEY = "_defaults_from"
#: Provider keys a defaults file may not set: they name the provider itself, or are Ray's.
_NOT_DEFAULTS = frozenset({"type", "module", "use_internal_ips", "disable_node_updaters",
                           "disable_launch_config_check", "foreground_node_launch",
                           "worker_liveness_check"})


@dataclass
class Defaults:
    """The merged defaults files and, for each leaf key path, the file it came from."""

    files: list[str] = field(default_factory=list)
    provider: dict[str, Any] = field(default_factory=dict)
    node_config: dict[str, Any] = field(default_factory=dict)
    origin: dict[str, str] = field(default_factory=dict)  # "node_config.partition" -> file


def default_paths(env: Mapping[str, str] | None = None) -> list[str]:
    """The defaults files to read, in order: RAY_SLURM_DEFAULTS's, else the site's and yours."""
    env = os.environ if env is None else env
    if ENV in env:
        return [os.path.expanduser(p) for p in env[ENV].split(":") if p]
    return [SITE_FILE, os.path.expanduser(USER_FILE)]


def optional_paths(env: Mapping[str, str] | None = None) -> list[str]:
    """The defaults files that may be absent: the two default ones, unless RAY_SLURM_DEFAULTS
    replaces them (a file it names must exist)."""
    env = os.environ if env is None else env
    return [] if ENV in env else [SITE_FILE, os.path.expanduser(USER_FILE)]


def _leaves(data: Mapping[str, Any], prefix: str) -> list[str]:
    out = []
    for k, v in data.items():
        path = f"{prefix}.{k}"
        out += _leaves(v, path) if isinstance(v, Mapping) and v else [path]
    return out


def _merge_under(base: dict[str, Any], over: Mapping[str, Any]) -> None:
    """`over` onto `base` in place: mappings key by key, anything else replaced."""
    for k, v in over.items():
        if isinstance(v, Mapping) and isinstance(base.get(k), dict):
            _merge_under(base[k], v)
        else:
            base[k] = copy.deepcopy(v)


def _check(path: str, data: Any, text: str = "") -> tuple[dict[str, Any], dict[str, Any]]:
    if data is None:
        return {}, {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path}: a defaults file must be a mapping, got {type(data).__name__}")
    extra = sorted(set(data) - {"provider", "node_config"})
    if extra:
        raise ConfigError(f"{path}: {extra[0]}: unknown key; a defaults file has only "
                          "`provider` and `node_config`")
    provider = dict(data.get("provider") or {})
    node_config = dict(data.get("node_config") or {})
    for key in provider:
        if key in _NOT_DEFAULTS or str(key).startswith("_"):
            raise ConfigError(f"{path}: provider.{key}: cannot be a default (set it in the "
                              "cluster YAML)")
    try:  # the model's own checks: unknown keys (with a did-you-mean), types, values
        parse_provider(provider)
        parse_node_config(node_config, "*")
    except ConfigError as e:
        e = with_source(e, text, path)
        raise ConfigError(f"{path}: {str(e).replace('available_node_types.*.', '')}",
                          key=e.key, value=e.value) from e
    return provider, node_config


def load(paths: list[str], optional: Collection[str] = ()) -> Defaults:
    """Read the defaults files in order; one in `optional` may be absent. ConfigError names
    the file (and the key)."""
    d = Defaults()
    for path in paths:
        try:
            with open(path) as f:
                text = f.read()
        except FileNotFoundError as e:
            if path in optional:
                continue
            raise ConfigError(f"{path}: no such defaults file (named in {ENV}); fix the path "
                              f"or remove it from {ENV}") from e
        except OSError as e:
            raise ConfigError(f"{path}: cannot read the defaults file: {e.strerror}") from e
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {e}") from e
        provider, node_config = _check(path, data, text)
        _merge_under(d.provider, provider)
        _merge_under(d.node_config, node_config)
        for leaf in _leaves(provider, "provider") + _leaves(node_config, "node_config"):
            d.origin[leaf] = path
        d.files.append(path)
    return d


def _from_defaults(written: Mapping[str, Any], defaults: Mapping[str, Any], prefix: str,
                   origin: Mapping[str, str], key: str) -> dict[str, str]:
    """Leaf paths of `defaults` that `written` (the YAML) leaves to them -> their file."""
    out = {}
    for k, v in defaults.items():
        here = f"{key}.{k}"
        mine = written.get(k) if isinstance(written, Mapping) else None
        if isinstance(v, Mapping) and v and (mine is None or isinstance(mine, Mapping)):
            out.update(_from_defaults(mine or {}, v, f"{prefix}.{k}", origin, here))
        elif k not in written:
            out[f"{prefix}.{k}"] = origin.get(here, "?")
    return out


def apply(config: dict[str, Any], paths: list[str] | None = None) -> dict[str, str]:
    """Merge the defaults files under `config` in place (once: a config that records
    `provider._defaults_from` is left alone). `paths`: default_paths(); each must exist but
    the default ones. Returns each key path the defaults supplied, with its file."""
    provider = config.setdefault("provider", {})
    if not isinstance(provider, dict) or APPLIED_KEY in provider:
        return {}
    d = load(default_paths(), optional_paths()) if paths is None else load(paths)
    provider[APPLIED_KEY] = d.files
    if not d.files:
        return {}
    supplied = _from_defaults(provider, d.provider, "provider", d.origin, "provider")
    merged = copy.deepcopy(d.provider)
    _merge_under(merged, provider)
    provider.clear()
    provider.update(merged)
    for name, nt in (config.get("available_node_types") or {}).items():
        if not isinstance(nt, dict):
            continue
        written = nt.get("node_config") or {}
        supplied.update(_from_defaults(written, d.node_config,
                                       f"available_node_types.{name}.node_config", d.origin,
                                       "node_config"))
        merged = copy.deepcopy(d.node_config)
        _merge_under(merged, written)
        nt["node_config"] = merged
    return supplied


def describe(supplied: Mapping[str, str], config: Mapping[str, Any]) -> list[str]:
    """One line per value the defaults supplied: key, value, file, and the node types."""
    groups: dict[tuple[str, str, str], list[str]] = {}
    for path, origin in supplied.items():
        parts = path.split(".")
        value: Any = config
        for p in parts:
            value = value.get(p) if isinstance(value, Mapping) else None
        if parts[0] == "available_node_types":
            key, where = ".".join(parts[2:]), parts[1]
        else:
            key, where = path, ""
        groups.setdefault((key, repr(value), origin), []).append(where)
    return [f"{key} = {value} from {origin}" + (f" ({', '.join(w for w in where)})"
                                                  if any(where) else "")
            for (key, value, origin), where in sorted(groups.items())]
