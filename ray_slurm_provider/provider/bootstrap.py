"""What `ray up` does to the cluster config before anything is submitted.

`bootstrap_config` validates the provider and every node type against the config model (and
the live cluster: partitions must exist), forces self-starting workers, and copies into the
provider section what the head's autoscaler needs to build worker jobs: Ray hands a provider
only its own section, yet workers must run the YAML's initialization, setup and start commands.
`fillout_resources` fills a node type's omitted `resources` from its Slurm partition.
"""

from __future__ import annotations

import logging
import math
import sys
from typing import Any

import click

from ray_slurm_provider.config import (
    ConfigError,
    NodeConfig,
    check_name,
    parse_node_config,
    parse_provider,
)
from ray_slurm_provider.provider.checks import check_live, check_static
from ray_slurm_provider.slurm.client import ClusterInfo, SlurmError
from ray_slurm_provider.units import MIB, mem_bytes

logger = logging.getLogger(__name__)

DEFAULT_HEAD_START = ["ray start --head --autoscaling-config=~/ray_bootstrap_config.yaml"]
DEFAULT_WORKER_START = ["ray start --address=$RAY_HEAD_IP:$RAY_GCS_PORT"]


def _cluster_info(config: dict[str, Any] | None = None) -> ClusterInfo:
    """The live cluster, through the transport the config's provider section selects."""
    from ray_slurm_provider.slurm.factory import make_client

    return make_client(parse_provider((config or {}).get("provider") or {})).cluster_info()


def check_partitions(config: dict[str, Any], info: ClusterInfo) -> None:
    names = sorted(p.name for p in info.partitions)
    for t, nt in config.get("available_node_types", {}).items():
        part = (nt.get("node_config") or {}).get("partition")
        if part is not None and info.partition(str(part)) is None:
            raise ConfigError(
                f"available_node_types.{t}.node_config.partition: {part!r} is not a partition "
                f"of this Slurm cluster; valid choices: {', '.join(names)}"
            )


def validate(config: dict[str, Any], live: bool = True) -> dict[str, NodeConfig]:
    """Check every key this provider owns; return the parsed node configs."""
    check_name(str(config.get("cluster_name", "")), "cluster_name")
    parse_provider(config.get("provider") or {})
    types = config.get("available_node_types") or {}
    if not types:
        raise ConfigError("available_node_types: at least one node type is required")
    out = {}
    for t, nt in types.items():
        check_name(str(t), f"available_node_types.{t}")
        out[t] = parse_node_config((nt or {}).get("node_config"), t)
    check_static(config, out)
    if live:
        try:
            info = _cluster_info(config)
            check_partitions(config, info)
            for warning in check_live(config, out, info):
                logger.warning(warning)
                click.echo(f"Warning: {warning}", err=True)
        except SlurmError as e:
            logger.warning("Could not check partitions against Slurm: %s", e.slurm_message)
    return out


def bootstrap_config(config: dict[str, Any]) -> dict[str, Any]:
    try:
        validate(config)
    except ConfigError as e:
        raise click.ClickException(f"Invalid cluster config: {e}") from e
    provider = config["provider"]
    provider["disable_node_updaters"] = True
    provider.setdefault("python", sys.executable)
    from ray_slurm_provider.slurm.rest.client import pin_env_defaults

    pin_env_defaults(provider)
    if not config.get("head_start_ray_commands"):
        config["head_start_ray_commands"] = list(DEFAULT_HEAD_START)
    start = list(config.get("worker_start_ray_commands") or DEFAULT_WORKER_START)
    node_types: dict[str, Any] = {}
    for t, nt in config["available_node_types"].items():
        node_types[t] = {
            "node_config": nt.get("node_config") or {},
            "resources": nt.get("resources") or {},
            "labels": nt.get("labels") or {},
            "commands": {
                "initialization": list(
                    nt.get("initialization_commands", config.get("initialization_commands"))
                    or []
                ),
                "setup": list(
                    nt.get("worker_setup_commands", config.get("worker_setup_commands")) or []
                ),
                "start": start,
            },
        }
    provider["_node_types"] = node_types
    return config


def fillout_resources(config: dict[str, Any]) -> dict[str, Any]:
    """Fill omitted `resources` from the partition: CPUs, GPUs from GRES, memory."""
    types = config.get("available_node_types") or {}
    missing = [t for t, nt in types.items() if "resources" not in nt]
    if not missing:
        return config
    info = _cluster_info(config)
    frac = float((config.get("provider") or {}).get("object_store_fraction", 0.3))
    for t in missing:
        nt = types[t]
        ncfg = parse_node_config(nt.get("node_config"), t)
        part = info.partition(ncfg.partition)
        if part is None:
            raise ConfigError(f"available_node_types.{t}: partition {ncfg.partition!r} not found")
        cpus = ncfg.cpus if ncfg.cpus is not None else part.cpus_per_node
        gpus = ncfg.gpus if ncfg.gpus is not None else part.gpus_per_node
        mem = mem_bytes(ncfg.mem) if ncfg.mem else part.memory_mb_per_node * MIB
        res: dict[str, int] = {"CPU": cpus}
        if gpus:
            res["GPU"] = gpus
        if mem:
            # Ray's `memory` excludes the object store, which takes its share of the job's.
            res["memory"] = math.floor(mem * (1 - frac))
        nt["resources"] = res
        # The job must ask Slurm for the shape Ray will advertise.
        nc = nt.setdefault("node_config", {})
        nc.setdefault("cpus", cpus)
        if gpus:
            nc.setdefault("gpus", gpus)
        if mem and not ncfg.mem:
            nc.setdefault("mem", f"{mem // MIB}M")
    return config
