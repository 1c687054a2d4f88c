"""Value checks of the node types, before `ray up` submits anything.

config.py checks each key's type and rejects unknown keys. Here are the checks that need
more than one key, or Slurm's own view of the cluster: time-limit format and the partition's
MaxTime, the drain lead time against the time limit, GPUs (and GPU type), CPUs and memory
against the partition's nodes, and everything the batch-script renderer would refuse
(environment names, sbatch options, paths). Every error names the key path, the bad value
and what is allowed.
"""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import Iterable, Mapping

from ray_slurm_provider.cluster import ClusterConfig
from ray_slurm_provider.config import ConfigError, NodeConfig
from ray_slurm_provider.jobs import build_job, temp_dir_root_max
from ray_slurm_provider.slurm.client import ClusterInfo, Partition
from ray_slurm_provider.slurm.script import ScriptError, validate
from ray_slurm_provider.units import TIME_FORMS, fmt_duration, mem_mb, parse_duration

logger = logging.getLogger(__name__)

#: A container image reference or file: reaches the runtime's argv, where a leading `-` would
#: be taken as an option (`--privileged`); blanks and control characters are never part of one.
IMAGE = re.compile(r"[A-Za-z0-9_./~][!-~]*")
#: JobSpec field (named in a ScriptError) -> the config key it comes from.
_SOURCE = {
    "job_name": "cluster_name", "output": "provider.state_dir", "command": "provider.python",
    "environment": "provider.environment / {nc}.environment", "signal": "{nc}.drain_before_limit_s",
    "gres": "{nc}.gpus / {nc}.gpu_type", "cpus_per_task": "{nc}.cpus / resources.CPU",
    "mem": "{nc}.mem / resources.memory",
    "setup": "{nc}.prologue / initialization_commands / worker_setup_commands",
}


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


def check_static(cluster: ClusterConfig) -> None:
    """Checks that need no Slurm: formats, lead time, and every job's fields as the batch
    script renderer would check them."""
    pcfg = cluster.provider
    if len(pcfg.temp_dir_root.rstrip("/")) > temp_dir_root_max():
        raise ConfigError(
            f"provider.temp_dir_root: {pcfg.temp_dir_root!r} is longer than "
            f"{temp_dir_root_max()} characters; Ray's Unix socket paths below it would pass "
            "Linux's 107-byte limit (valid: a short node-local path such as /tmp)")
    for t, nt in cluster.node_types.items():
        ncfg, nc = nt.node_config, f"available_node_types.{t}.node_config"
        limit = time_limit_s(ncfg, nc)
        node_mem_mb(ncfg, nc)
        if ncfg.drain_before_limit_s < 0:
            raise ConfigError(f"{nc}.drain_before_limit_s: {ncfg.drain_before_limit_s} is "
                              "negative; valid: 0 (off) or seconds before the time limit")
        if limit is not None and ncfg.drain_before_limit_s >= limit:
            raise ConfigError(
                f"{nc}.drain_before_limit_s: {ncfg.drain_before_limit_s}s is not shorter than "
                f"the time limit {ncfg.time!r}; valid: 0 to {limit - 1}")
        for key in ("image", "image_tag"):
            img = getattr(ncfg.container, key)
            if img is not None and not IMAGE.fullmatch(img):
                raise ConfigError(
                    f"{nc}.container.{key}: {img!r} is not an image reference or file; valid: "
                    "e.g. nvcr.io/nvidia/pytorch:24.05-py3, a local tag or a path, printable "
                    "ASCII without blanks, not starting with '-'")
        try:
            validate(build_job(pcfg, cluster.name, nt, kind=cluster.kind(t),
                               python=pcfg.python or sys.executable))
        except ScriptError as e:
            field = str(e).split(":", 1)[0].removeprefix("JobSpec.").split("[", 1)[0]
            where = _SOURCE.get(field, f"{{nc}}.{field}").format(nc=nc)
            raise ConfigError(f"{where}: {str(e).split(': ', 1)[-1]}") from None


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


def check_partitions(cluster: ClusterConfig, info: ClusterInfo) -> None:
    """Every partition a node type names exists."""
    names = sorted(p.name for p in info.partitions)
    for t, nt in cluster.node_types.items():
        part = nt.node_config.partition
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


def v1_colocation_warning(cluster: ClusterConfig, env: Mapping[str, str]) -> str | None:
    """Autoscaler v1 (`RAY_UP_enable_autoscaler_v2=0`) keys load and idleness by node IP, so
    two Ray nodes on one host merge and a busy one can be terminated as idle. Slurm places
    jobs side by side unless they take whole nodes."""
    if env.get("RAY_UP_enable_autoscaler_v2") != "0":
        return None  # v2 matches each raylet to its job id
    shared = [t for t, nt in cluster.node_types.items() if not nt.node_config.exclusive]
    if not shared:
        return None
    keys = ", ".join(f"available_node_types.{t}.node_config.exclusive" for t in shared)
    return ("autoscaler v1 tells Ray nodes apart by IP, and Slurm may place two of this "
            "cluster's jobs on one node: they then count as one, and a busy node can be "
            f"terminated as idle. Set {keys} to true, or use autoscaler v2 (the default)")
