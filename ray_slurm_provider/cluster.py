"""A Ray cluster YAML, parsed once into a ClusterConfig.

`parse_cluster` reads the keys this provider owns (cluster and node-type names, `provider:`,
every `node_config`) and the Ray keys a Slurm job needs (a node type's `resources`, `labels`
and the commands its job runs). `ray up` parses the whole YAML; the head's autoscaler gets only
the `provider:` section from Ray, so `bootstrap` copies the node types into it
(`provider._node_types`, see `node_types_section`) and `parse_provider_section` reads them back.
Nothing else digs node types out of a raw dict.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from ray_slurm_provider.config import NodeConfig, ProviderConfig, parse_node_config, parse_provider
from ray_slurm_provider.nodespec import DEFAULT_WORKER_START
from ray_slurm_provider.schema import ConfigError

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
#: Where bootstrap puts the node types in the provider section for the head's autoscaler.
NODE_TYPES_KEY = "_node_types"
#: Set by bootstrap when `provider.python` is its default (the Python running `ray up`), not the
#: user's: Ray's config cache may hand such a config to another checkout's `ray up`.
AUTO_PYTHON_KEY = "_python_auto"
DEFAULT_HEAD_START = ["ray start --head --autoscaling-config=~/ray_bootstrap_config.yaml"]


def check_name(value: str, path: str) -> str:
    """Cluster and node-type names end up in job names, file names and env vars."""
    if not NAME_RE.match(value):
        raise ConfigError(
            f"{path}: {value!r} is not a valid name (letters, digits, '_', '.', '-'; "
            "at most 63 characters, starting with a letter or digit)"
        )
    return value


@dataclass(frozen=True)
class NodeCommands:
    """The YAML commands a worker job runs itself (the head's go through `ray up`)."""

    initialization: list[str] = field(default_factory=list)
    setup: list[str] = field(default_factory=list)
    start: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class NodeType:
    """One entry of `available_node_types`, as a Slurm job needs it."""

    name: str
    node_config: NodeConfig
    resources: dict[str, int] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)
    commands: NodeCommands = field(default_factory=NodeCommands)
    #: `resources` was given in the YAML (else `ray up` fills it from the partition).
    has_resources: bool = True


@dataclass(frozen=True)
class ClusterConfig:
    name: str
    provider: ProviderConfig
    head_type: str
    node_types: dict[str, NodeType]
    python_auto: bool = False  # provider.python is bootstrap's default, not the user's

    def node_type(self, name: str) -> NodeType:
        """The node type `name`; an unknown name (a stale config) gets the defaults."""
        found = self.node_types.get(name)
        return found if found is not None else NodeType(name, parse_node_config({}, name))

    def agent_python(self, *, head: bool) -> str:
        """The Python of a job's agent: the user's `provider.python`, else the one running
        this process. The head is created by `ray up`, whose own Python wins over a default
        that Ray's config cache may have kept from another checkout."""
        if self.provider.python and not (head and self.python_auto):
            return self.provider.python
        return sys.executable

    def kind(self, node_type: str) -> str:
        return "head" if node_type == self.head_type else "worker"


def _strs(value: Any) -> list[str]:
    return [str(v) for v in value or []]


def _resources(value: Any, path: str) -> dict[str, int]:
    if not isinstance(value or {}, Mapping):
        raise ConfigError(f"{path}: expected a mapping, got {value!r}")
    out = {}
    for k, v in (value or {}).items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
            raise ConfigError(f"{path}.{k}: expected a whole number >= 0, got {v!r}")
        out[str(k)] = int(v)
    return out


def _node_type(name: str, nt: Mapping[str, Any], commands: NodeCommands) -> NodeType:
    check_name(name, f"available_node_types.{name}")
    if not isinstance(nt, Mapping):
        raise ConfigError(f"available_node_types.{name}: expected a mapping, got {nt!r}")
    return NodeType(
        name=name,
        node_config=parse_node_config(nt.get("node_config"), name),
        resources=_resources(nt.get("resources"), f"available_node_types.{name}.resources"),
        labels={str(k): str(v) for k, v in (nt.get("labels") or {}).items()},
        commands=commands,
        has_resources="resources" in nt,
    )


def parse_cluster(raw: Mapping[str, Any]) -> ClusterConfig:
    """The whole cluster YAML (after Ray's own defaults) through the config model: names,
    types, unknown keys; ConfigError names the key path. The checks across keys are
    provider/validation.py's."""
    name = check_name(str(raw.get("cluster_name", "")), "cluster_name")
    provider = parse_provider(raw.get("provider") or {})
    types = raw.get("available_node_types") or {}
    if not types:
        raise ConfigError("available_node_types: at least one node type is required")
    start = _strs(raw.get("worker_start_ray_commands")) or list(DEFAULT_WORKER_START)
    node_types = {}
    for t, nt in types.items():
        nt = nt or {}
        commands = NodeCommands(
            _strs(nt.get("initialization_commands", raw.get("initialization_commands"))),
            _strs(nt.get("worker_setup_commands", raw.get("worker_setup_commands"))),
            start)
        node_types[str(t)] = _node_type(str(t), nt, commands)
    return ClusterConfig(name, provider, str(raw.get("head_node_type", "")), node_types)


def node_types_section(cluster: ClusterConfig, raw: Mapping[str, Any]) -> dict[str, Any]:
    """What the head's autoscaler needs of each node type, for `provider._node_types` (the
    node_config stays as written: the head parses it again with the same model)."""
    types = raw.get("available_node_types") or {}
    return {
        t: {"node_config": dict((types.get(t) or {}).get("node_config") or {}),
            "resources": dict(nt.resources), "labels": dict(nt.labels),
            "commands": asdict(nt.commands)}
        for t, nt in cluster.node_types.items()
    }


def parse_provider_section(provider: Mapping[str, Any], cluster_name: str,
                           head_type: str = "") -> ClusterConfig:
    """The cluster as the head's autoscaler sees it: its provider section, with the node
    types `bootstrap` copied into it."""
    node_types = {}
    for t, nt in (provider.get(NODE_TYPES_KEY) or {}).items():
        cmds = nt.get("commands") or {}
        commands = NodeCommands(_strs(cmds.get("initialization")), _strs(cmds.get("setup")),
                                _strs(cmds.get("start")) or list(DEFAULT_WORKER_START))
        node_types[str(t)] = _node_type(str(t), nt, commands)
    return ClusterConfig(cluster_name, parse_provider(provider), head_type, node_types,
                         python_auto=bool(provider.get(AUTO_PYTHON_KEY)))
