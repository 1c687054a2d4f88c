"""Stage 4 of the validation pipeline (provider/validation.py): each node type against
Slurm's view of the cluster. Its partition exists; its time limit, nodes, GPUs (and GPU type),
CPUs and memory fit the partition's nodes; its account and QOS are among the user's
associations. Every error names the key path, the bad value and the valid range.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from ray_slurm_provider.cluster import ClusterConfig
from ray_slurm_provider.config import ConfigError, NodeConfig
from ray_slurm_provider.slurm.client import ClusterInfo, Partition
from ray_slurm_provider.slurm.sacct import Association
from ray_slurm_provider.units import TIME_FORMS, fmt_duration, mem_mb, parse_duration


def time_limit_s(ncfg: NodeConfig, path: str) -> int | None:
    """The node type's own time limit in seconds (None: not set, or unlimited)."""
    if ncfg.time is None:
        return None
    try:
        return parse_duration(ncfg.time)
    except ValueError:
        raise ConfigError(f"{path}.time: {ncfg.time!r} is not a Slurm time limit; valid forms: "
                          f"{TIME_FORMS}") from None


def node_mem_mb(ncfg: NodeConfig, path: str) -> int | None:
    """The node type's `mem` in MiB (None: not set); a ConfigError names the key."""
    if ncfg.mem is None:
        return None
    try:
        return mem_mb(ncfg.mem)
    except ValueError as e:
        raise ConfigError(f"{path}.mem: {e}") from None


def _gpus(gres: str) -> list[tuple[str, int]]:
    """(type or "", count) of each GPU item of a GRES string ("gpu:h100:2(S:0)")."""
    out = []
    for item in re.sub(r"\([^)]*\)", "", gres).split(","):
        bits = item.strip().split(":")
        if bits[0].removeprefix("gres/") == "gpu":
            count = int(bits[-1]) if len(bits) > 1 and bits[-1].isdigit() else 1
            out.append((bits[1] if len(bits) == 3 else "", count))
    return out


def _gpu_types(part: Partition) -> list[str]:
    return sorted({t for node in part.nodes for t, _ in _gpus(node.gres) if t})


def _most_gpus(part: Partition, gpu_type: str | None) -> int:
    """The most GPUs (of `gpu_type`, when given) one node of the partition has: a site may
    mix node sizes and GPU types in one partition, and Slurm places a job on a node it fits."""
    if not part.nodes:
        return part.gpus_per_node
    return max(sum(n for t, n in _gpus(node.gres) if gpu_type is None or t == gpu_type)
               for node in part.nodes)


def check_partitions(cluster: ClusterConfig, info: ClusterInfo,
                     only: Iterable[str] | None = None) -> None:
    """Every partition a node type (all, or those in `only`) names exists."""
    names = sorted(p.name for p in info.partitions)
    for t in cluster.node_types if only is None else only:
        part = cluster.node_type(t).node_config.partition
        if part is not None and info.partition(part) is None:
            raise ConfigError(
                f"available_node_types.{t}.node_config.partition: {part!r} is not a partition "
                f"of this Slurm cluster; valid choices: {', '.join(names)}")


def check_live(cluster: ClusterConfig, info: ClusterInfo,
               only: Iterable[str] | None = None) -> list[str]:
    """Node types (all, or those in `only`) against their partitions; raise on what Slurm
    would refuse, return warnings (a node type without any time limit)."""
    warnings = []
    for t in cluster.node_types if only is None else only:
        nt = cluster.node_type(t)
        ncfg, nc, res = nt.node_config, f"available_node_types.{t}.node_config", nt.resources
        part = info.partition(ncfg.partition)
        if part is None:
            continue  # check_partitions names it
        if part.nodes and ncfg.nodes > len(part.nodes):
            raise ConfigError(f"{nc}.nodes: {ncfg.nodes} is more than the {len(part.nodes)} "
                              f"node(s) of partition {part.name!r}; valid: 1 to "
                              f"{len(part.nodes)}")
        own = time_limit_s(ncfg, nc)
        if own is not None and part.max_time_s is not None and own > part.max_time_s:
            raise ConfigError(
                f"{nc}.time: {ncfg.time!r} is longer than partition {part.name!r} allows; "
                f"valid: at most its MaxTime {fmt_duration(part.max_time_s)}")
        limit = own if ncfg.time is not None else (part.default_time_s or part.max_time_s)
        if limit is None:
            warnings.append(f"{nc}.time: not set and partition {part.name!r} has no time limit; "
                            "its jobs run until cancelled")
        elif ncfg.drain_before_limit_s >= limit:
            raise ConfigError(
                f"{nc}.drain_before_limit_s: {ncfg.drain_before_limit_s}s is not shorter than "
                f"the time limit {fmt_duration(limit)} of partition {part.name!r}; valid: 0 to "
                f"{limit - 1}")
        gpus, key = (ncfg.gpus, "gpus") if ncfg.gpus is not None else (res.get("GPU"), None)
        key = f"{nc}.gpus" if key else f"available_node_types.{t}.resources.GPU"
        types = _gpu_types(part)
        if gpus and ncfg.gpu_type is not None and ncfg.gpu_type not in types:
            raise ConfigError(f"{nc}.gpu_type: {ncfg.gpu_type!r} is not a GPU type of partition "
                              f"{part.name!r}; valid: {', '.join(types) or 'none (untyped GRES)'}")
        most = _most_gpus(part, ncfg.gpu_type if gpus else None)
        if gpus and int(gpus) > most:
            with_gpus = [p.name for p in info.partitions if _most_gpus(p, None)]
            kind = f"{ncfg.gpu_type} " if ncfg.gpu_type else ""
            raise ConfigError(
                f"{key}: {gpus} is more than the {most} {kind}GPUs of any node of "
                f"partition {part.name!r}; valid: 0 to {most}"
                + (f" (partitions with GPUs: {', '.join(with_gpus)})" if with_gpus else ""))
        cpus, ckey = (ncfg.cpus, f"{nc}.cpus") if ncfg.cpus is not None else (
            res.get("CPU"), f"available_node_types.{t}.resources.CPU")
        if cpus and part.cpus_per_node and int(cpus) > part.cpus_per_node:
            raise ConfigError(f"{ckey}: {cpus} is more than the {part.cpus_per_node} CPUs per "
                              f"node of partition {part.name!r}; valid: 1 to "
                              f"{part.cpus_per_node}")
        mem = node_mem_mb(ncfg, nc)
        if mem is not None and part.memory_mb_per_node and mem > part.memory_mb_per_node:
            raise ConfigError(f"{nc}.mem: {ncfg.mem!r} is more than the "
                              f"{part.memory_mb_per_node}M per node of partition "
                              f"{part.name!r}; valid: 0 (all) up to {part.memory_mb_per_node}M")
    return warnings


def check_account_qos(assocs: Sequence[Association], account: str | None,
                      qos: str | None, where: str) -> str | None:
    """What is wrong with submitting with `account` and `qos` (None: nothing), naming the
    valid choices; `where` is the config key path of the node type."""
    accounts = sorted({a.account for a in assocs})
    if account is not None and account not in accounts:
        return (f"{where}.account: {account!r} is not an account you may use on this "
                f"cluster; valid: {', '.join(accounts) or 'none (no association)'}")
    if qos is None:
        return None
    # Without an account Slurm takes the user's default one; any of theirs passes here.
    mine = [a for a in assocs if account is None or a.account == account]
    allowed = sorted({q for a in mine for q in a.qos})
    if qos not in allowed:
        whose = f"account {account!r}" if account else "your associations"
        return (f"{where}.qos: {qos!r} is not a QOS of {whose}; valid: "
                f"{', '.join(allowed) or 'none'}")
    return None
