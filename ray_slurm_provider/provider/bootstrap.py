"""What `ray up` does to the cluster config before anything is submitted.

`bootstrap_config` runs the validation pipeline (provider/validation.py: the model, Ray's
schema, values, and the live cluster: partitions must exist, limits must fit), sets an unset
`upscaling_speed` to the largest gang `nodes` (validation.gang_speed), forces self-starting
workers, and copies into the provider section what the head's autoscaler needs
to build worker jobs: Ray hands a provider only its own section, yet workers must run the
YAML's initialization, setup and start commands.
`fillout_resources` fills a node type's omitted `resources` from its Slurm partition.
"""

from __future__ import annotations

import logging
import math
import os
import sys
from collections.abc import Callable
from typing import Any

import click

from ray_slurm_provider.cluster import (
    AUTO_PYTHON_KEY,
    DEFAULT_HEAD_START,
    NODE_TYPES_KEY,
    ClusterConfig,
    node_types_section,
    parse_cluster,
)
from ray_slurm_provider.config import ConfigError, parse_provider
from ray_slurm_provider.provider import defaults, validation
from ray_slurm_provider.slurm.client import ClusterInfo, SlurmClient, ask
from ray_slurm_provider.units import MIB, mem_bytes

logger = logging.getLogger(__name__)


def _cluster_info(config: dict[str, Any] | None = None,
                  sleep: Callable[[float], None] | None = None) -> ClusterInfo:
    """The live cluster, through the transport the config's provider section selects."""
    from ray_slurm_provider.slurm.factory import make_client

    pcfg = parse_provider((config or {}).get("provider") or {})
    if pcfg.ssh is not None:  # `ray-slurm validate` from a laptop: Slurm of the login node
        from ray_slurm_provider.slurm.cli import CliSlurmClient
        from ray_slurm_provider.slurm.ssh import SshLink

        client: SlurmClient = CliSlurmClient(remote=SshLink(pcfg.ssh))
    else:
        client = make_client(pcfg)

    # The first Slurm call of a run: a controller that does not answer in time once (a
    # rate-limited one answers slowly, issue 29) is asked again before `ray up` fails.
    return ask("asking Slurm for its partitions", client.cluster_info, say=logger.warning,
               sleep=sleep)


def laptop_preflight(config: dict[str, Any]) -> bool:
    """With provider.ssh (`ray up` on a laptop): before anything is submitted, the login node
    must answer, have Slurm's commands and `provider.python` with this package; else one
    line (click prints it without a traceback). Whether the config has provider.ssh."""
    provider = config.get("provider")
    if not (isinstance(provider, dict) and provider.get("ssh") is not None):
        return False
    from ray_slurm_provider.provider import laptop
    from ray_slurm_provider.slurm.ssh import SshLink

    try:
        pcfg = parse_provider(provider)
        python = laptop.login_python(pcfg)
    except ConfigError as e:
        raise click.ClickException(f"Invalid cluster config: {e}") from e
    assert pcfg.ssh is not None
    laptop.preflight(SshLink(pcfg.ssh), python)
    return True


def validate(config: dict[str, Any], live: bool = True) -> ClusterConfig:
    """The validation pipeline (provider/validation.py), against Slurm too when `live`;
    warnings are printed, the first error is raised as ConfigError naming the key path."""
    info = (lambda: _cluster_info(config)) if live else None
    cluster, found = validation.run(config, info=info, env=os.environ)
    validation.raise_first(found)
    for warning in found:
        logger.warning("%s", warning)
        click.echo(f"Warning: {warning}", err=True)
    assert cluster is not None  # no error: the model took it
    return cluster


def bootstrap_config(config: dict[str, Any]) -> dict[str, Any]:
    remote = laptop_preflight(config)
    try:
        defaults.apply(config)  # a no-op when fillout_resources merged them already
        cluster = validate(config)
    except ConfigError as e:
        raise click.ClickException(f"Invalid cluster config: {e}") from e
    speed = validation.gang_speed(config, cluster)
    if speed is not None:  # what the head's autoscaler reads (the resolved config)
        config["upscaling_speed"] = speed[0]
        logger.info("%s", speed[1])
    provider = config["provider"]
    provider["disable_node_updaters"] = True
    if "python" not in provider and not remote:  # over SSH it is required (preflight)
        provider["python"] = sys.executable
        provider[AUTO_PYTHON_KEY] = True
    from ray_slurm_provider.slurm.rest.client import pin_env_defaults

    pin_env_defaults(provider)
    if not config.get("head_start_ray_commands"):
        config["head_start_ray_commands"] = list(DEFAULT_HEAD_START)
    provider[NODE_TYPES_KEY] = node_types_section(cluster, config)
    return config


def fillout_resources(config: dict[str, Any]) -> dict[str, Any]:
    """Merge the defaults files (the partition may come from one), then fill omitted
    `resources` from the partition: CPUs, GPUs from GRES, memory (with provider.ssh, the
    login node's Slurm answers)."""
    defaults.apply(config)
    types = config.get("available_node_types") or {}
    missing = [t for t, nt in types.items() if "resources" not in nt]
    if not missing:
        return config
    cluster = parse_cluster(config)
    info = _cluster_info(config)
    frac = cluster.provider.object_store_fraction
    for t in missing:
        nt, ncfg = types[t], cluster.node_type(t).node_config
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
