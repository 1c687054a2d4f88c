"""Checks of a cluster's node types against the live cluster (pure: config + ClusterInfo).

Each node type's job must fit its partition: the partition exists and is up, the time limit is
within its MaxTime, and the CPUs, memory and GPUs the job asks for (computed exactly as the
job will ask, jobs.slurm_resources) exist on at least one of its nodes. A job that asks for
more than any node has pends forever (or is refused: "Requested node configuration is not
available"), which is what these checks prevent.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ray_slurm_provider.bootstrap import mem_bytes
from ray_slurm_provider.config import ConfigError, NodeConfig, ProviderConfig
from ray_slurm_provider.jobs import slurm_resources
from ray_slurm_provider.slurm.client import ClusterInfo, Partition
from ray_slurm_provider.slurm.parse import parse_duration, parse_gres_gpus

from .common import Finding, duration

MIB = 1024 * 1024


def node_type_findings(t: str, nt: Mapping[str, Any], ncfg: NodeConfig, pcfg: ProviderConfig,
                       info: ClusterInfo) -> list[Finding]:
    """What is wrong (or fine) with node type `t` on this cluster."""
    where = f"available_node_types.{t}"
    names = ", ".join(sorted(p.name for p in info.partitions))
    part = info.partition(ncfg.partition)
    if part is None:
        if ncfg.partition is None:
            return [Finding("fail", where, "no partition is set and the cluster reports no "
                            "default partition", f"set {where}.node_config.partition to one of: "
                            f"{names}")]
        return [Finding("fail", f"{where}.node_config.partition",
                        f"{ncfg.partition!r} is not a partition of this cluster",
                        f"use one of: {names}")]
    out = [Finding("ok", where, f"partition {part.name} ({len(part.nodes)} nodes, "
                   f"MaxTime {duration(part.max_time_s)})")]
    if part.state.upper() != "UP":
        out.append(Finding("warn", where, f"partition {part.name} is {part.state}",
                           "jobs pend until an admin sets it UP; pick another partition"))
    out += _time(where, ncfg, part)
    resources = {k: int(v) for k, v in (nt.get("resources") or {}).items()}
    if "resources" not in nt:
        out.append(Finding("info", where, "no `resources`: they are taken from partition "
                           f"{part.name}'s smallest node at `ray up`"))
    try:
        asked = slurm_resources(ncfg, resources, pcfg.object_store_fraction)
        mem_mb = (mem_bytes(str(asked["mem"])) or 0) // MIB if asked["mem"] else None
    except ConfigError as e:
        return [*out, Finding("fail", f"{where}.node_config.mem", str(e), "e.g. 16G or 4000")]
    out += _fits(where, part, "CPUs", asked["cpus_per_task"], [n.cpus for n in part.nodes],
                 "node_config.cpus (or resources.CPU)")
    if mem_mb:  # None: not set; 0: all of the node's memory
        out += _fits(where, part, "MiB of memory", mem_mb, [n.memory_mb for n in part.nodes],
                     "node_config.mem (or resources.memory)")
    out += _gpus(where, ncfg, asked["gres"], part)
    return out


def _time(where: str, ncfg: NodeConfig, part: Partition) -> list[Finding]:
    if ncfg.time is None:
        limit = part.default_time_s if part.default_time_s is not None else part.max_time_s
        return [Finding("info", f"{where}.node_config.time", "not set: jobs get the partition's "
                        f"{'DefaultTime' if part.default_time_s is not None else 'MaxTime'} "
                        f"({duration(limit)})")]
    try:
        asked = parse_duration(ncfg.time)
    except ValueError as e:
        return [Finding("fail", f"{where}.node_config.time", str(e), "e.g. 4:00:00 or 2-00:00:00")]
    if part.max_time_s is not None and (asked is None or asked > part.max_time_s):
        return [Finding("fail", f"{where}.node_config.time",
                        f"{ncfg.time} is more than partition {part.name}'s MaxTime "
                        f"{duration(part.max_time_s)}: the job would pend forever "
                        "(PartitionTimeLimit)", f"set time to at most {duration(part.max_time_s)}")]
    return [Finding("ok", f"{where}.node_config.time", f"{ncfg.time} is within MaxTime")]


def _fits(where: str, part: Partition, what: str, asked: int | None, sizes: list[int],
          key: str) -> list[Finding]:
    if asked is None or not sizes:
        return []
    if asked > max(sizes):
        return [Finding("fail", where, f"asks for {asked} {what}, but the largest node of "
                        f"partition {part.name} has {max(sizes)}",
                        f"lower {key} to at most {max(sizes)}")]
    if asked > min(sizes):
        fit = sum(s >= asked for s in sizes)
        return [Finding("warn", where, f"asks for {asked} {what}: only {fit} of "
                        f"{len(sizes)} nodes of partition {part.name} have that many",
                        f"lower {key} to {min(sizes)} to fit on every node")]
    return [Finding("ok", where, f"{asked} {what} fit on every node of {part.name}")]


def _gpus(where: str, ncfg: NodeConfig, gres: str | None, part: Partition) -> list[Finding]:
    if not gres:
        return []
    asked = parse_gres_gpus(gres)
    if ncfg.gpu_type and not any(f":{ncfg.gpu_type}:" in f":{n.gres}" or
                                 f"gpu:{ncfg.gpu_type}" in n.gres for n in part.nodes):
        kinds = sorted({n.gres for n in part.nodes if n.gres}) or ["none"]
        return [Finding("fail", f"{where}.node_config.gpu_type",
                        f"no node of partition {part.name} has GPUs of type {ncfg.gpu_type!r} "
                        f"(GRES there: {', '.join(kinds)})", "fix gpu_type or the partition")]
    found = _fits(where, part, "GPUs", asked, [parse_gres_gpus(n.gres) for n in part.nodes],
                  "node_config.gpus (or resources.GPU)")
    if found and found[0].level == "fail" and not any(parse_gres_gpus(n.gres)
                                                      for n in part.nodes):
        return [Finding("fail", where, f"asks for {asked} GPUs (--gres={gres}), but partition "
                        f"{part.name} has no GPUs", "use a GPU partition or drop the GPUs")]
    return found
