"""Turning the YAML's `ray start` into the one this job must run.

Ray does not read the Slurm allocation: left alone it takes every CPU and GPU of the host,
30 % of the host's RAM for the object store, the hostname's IP, and fixed ports that collide
with any other Ray node on the same host. The agent therefore adds, unless the user set them:
the allocation's CPUs/GPUs/memory, the node's address, the cluster's port block, OS-chosen
per-node ports, a short node-local temp dir and `--block`; and it exports what the v2
autoscaler and token auth need.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from ray_slurm_provider import auth, shellcmd
from ray_slurm_provider.nodespec import GROUP_LABEL, INDEX_LABEL, split
from ray_slurm_provider.ports import port_block

if TYPE_CHECKING:
    from ray_slurm_provider.nodespec import NodeSpec
    from ray_slurm_provider.state import ClusterDir

STANDARD = ("CPU", "GPU", "memory", "object_store_memory")
MIB = 1024 * 1024


def allocation(env: Mapping[str, str]) -> tuple[int | None, int | None, int | None]:
    """CPUs, GPUs and memory (bytes) that Slurm gave this job, from its environment."""
    cpus = int(env["SLURM_CPUS_ON_NODE"]) if env.get("SLURM_CPUS_ON_NODE") else None
    gpus: int | None = None
    cvd = env.get("CUDA_VISIBLE_DEVICES")
    if cvd is not None and cvd.strip() and cvd.strip() != "NoDevFiles":
        gpus = len([g for g in cvd.split(",") if g.strip()])
    elif env.get("SLURM_GPUS_ON_NODE"):
        gpus = int(env["SLURM_GPUS_ON_NODE"])
    mem: int | None = None
    if env.get("SLURM_MEM_PER_NODE"):
        mem = int(env["SLURM_MEM_PER_NODE"]) * MIB
    elif env.get("SLURM_MEM_PER_CPU") and cpus:
        mem = int(env["SLURM_MEM_PER_CPU"]) * cpus * MIB
    return cpus, gpus, mem


def _add(argv: list[str], flag: str, value: object) -> list[str]:
    return argv if shellcmd.has_flag(argv, flag) else [*argv, f"{flag}={value}"]


def ray_start_argv(
    spec: NodeSpec,
    prog: shellcmd.Program,
    *,
    env: dict[str, str],
    job_id: str,
    node_ip: str,
    head_ip: str,
    temp_dir: str,
    head_port: int | None = None,
    cluster_dir: ClusterDir,
) -> tuple[list[str], dict[str, str]]:
    """The final argv and environment of this node's `ray start`."""
    ports = port_block(spec.cluster_name, spec.ports_base)
    head = spec.kind == "head"
    token = cluster_dir.root / auth.TOKEN_FILE if spec.auth_mode == "token" else None
    run_env = {
        **env,
        "RAY_HEAD_IP": head_ip,
        # Workers join the port the head really took (its start line may have set one).
        "RAY_GCS_PORT": str(head_port or ports.gcs),
        "RAY_CLOUD_INSTANCE_ID": job_id,
        "RAY_NODE_TYPE_NAME": spec.node_type,
        # Read from Ray 2.57 on, whose SIGTERM handler drains first and ignores a second
        # SIGTERM (Slurm signals every process of the job, the agent signals `ray start`).
        # On 2.55.0 4 of 5 cancelled workers' Ray outlived KillWait (10 s on the sandbox) and
        # their logs were lost: the last reason for pyproject.toml's floor.
        "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": str(spec.drain_timeout_s),
        "RAY_USAGE_STATS_ENABLED": env.get("RAY_USAGE_STATS_ENABLED", "0"),
        **auth.auth_env(spec.auth_mode, token),
    }
    if head:
        run_env["AUTOSCALER_METRIC_PORT"] = str(ports.autoscaler_metrics)
        run_env["DASHBOARD_METRIC_PORT"] = str(ports.dashboard_metrics)
        # A queued worker job is not a failed one: give Slurm's queue time before the v2
        # autoscaler gives up on an allocated-but-not-running node.
        run_env.setdefault("RAY_AUTOSCALER_RECONCILE_ALLOCATE_STATUS_TIMEOUT_S", "86400")
        # A submitted job is listed (PENDING) within one tick. One that is never listed ended
        # at once (its node went DOWN, its prologue failed): v2 would hold the launch
        # request, and the type's slot, for 10 minutes before asking again (seen on the
        # sandbox); two minutes still outlast a slurmctld restart.
        run_env.setdefault("RAY_AUTOSCALER_RECONCILE_REQUEST_STATUS_TIMEOUT_S", "120")
        # Ray splits a launch of k nodes of a type into create calls of at most 5 nodes
        # (its default, sized for cloud APIs); here one call is one `sbatch --array`, so a
        # burst of k is one RPC instead of k/5 (bench P5).
        run_env.setdefault("AUTOSCALER_MAX_LAUNCH_BATCH", "1000")
    for k, v in prog.exports.items():
        run_env[k] = _expand(v, run_env)
    labels = dict(spec.labels)
    if spec.group_size > 1:  # a gang member: its group and index (provider/gangs.py)
        group, index = split(job_id)
        labels.update({GROUP_LABEL: group, INDEX_LABEL: str(index)})
    if labels:
        run_env["RAY_OVERRIDE_LABELS"] = json.dumps(labels)

    assert prog.ray_start is not None
    argv = [_ray_binary(), *(_expand(a, run_env) for a in prog.ray_start[1:])]
    cpus, gpus, mem = allocation(env)
    res = spec.resources
    argv = _add(argv, "--node-ip-address", node_ip)
    if head:
        argv = _add(argv, "--port", ports.gcs)
        argv = _add(argv, "--dashboard-host", node_ip)
        argv = _add(argv, "--dashboard-port", ports.dashboard)
        argv = _add(argv, "--ray-client-server-port", ports.client)
        conf = shellcmd.get_flag(argv, "--autoscaling-config")
        if conf is not None:
            # One bootstrap config per cluster, not one per user's home.
            argv = shellcmd.set_flag(argv, "--autoscaling-config",
                                     str(cluster_dir.bootstrap_config))
    else:
        argv = _add(argv, "--address", f"{head_ip}:{head_port or ports.gcs}")
    ncpu = res.get("CPU", cpus)
    if ncpu is not None:
        argv = _add(argv, "--num-cpus", ncpu)
    ngpu = res.get("GPU", gpus)
    if ngpu is not None:
        argv = _add(argv, "--num-gpus", ngpu)
    # The object store's share comes out of the job's allocation, as Ray's own rule takes it
    # out of the node's memory: Ray's `memory` is what is left (never the whole allocation).
    basis = mem if mem is not None else res.get("memory")
    osm = spec.object_store_memory or (
        int(basis * spec.object_store_fraction) if basis else None
    )
    if osm is not None:
        osm = max(osm, 78643200)
        argv = _add(argv, "--object-store-memory", osm)
    memory = res.get("memory")
    if memory is None and mem is not None:  # the store as given (maybe on the YAML's line)
        memory = max(mem - int(shellcmd.get_flag(argv, "--object-store-memory") or 0), 0)
    if memory is not None:
        argv = _add(argv, "--memory", memory)
    custom = {k: v for k, v in res.items() if k not in STANDARD}
    if custom:
        argv = _add(argv, "--resources", json.dumps(custom, sort_keys=True))
    # Ray before 2.55 dropped --temp-dir on a worker node (its Ray wrote into the head's temp
    # dir, so its logs were never kept per job): one of the reasons for pyproject.toml's floor.
    argv = _add(argv, "--temp-dir", temp_dir)
    # Ray before 2.54 took 0 here as "pick a port" for its records but still handed the agent
    # 0, which then bound another: `ray job submit` tailed the driver's log from a port
    # nothing listened on (another reason for the floor). 2.54 reads back the bound port.
    argv = _add(argv, "--dashboard-agent-listen-port", 0)
    argv = _add(argv, "--min-worker-port", 0)
    argv = _add(argv, "--max-worker-port", 0)
    if "--block" not in argv:
        argv.append("--block")
    return argv, run_env


_VAR = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)\}|([A-Za-z_][A-Za-z0-9_]*))")


def _expand(value: str, env: Mapping[str, str]) -> str:
    """Expand $VAR, ${VAR} and a leading ~/ against the job's environment, as a shell would
    for the simple words of a `ray start` line (unknown variables stay as they are)."""
    if value.startswith("~/"):
        value = env.get("HOME", str(Path.home())) + value[1:]
    return _VAR.sub(lambda m: env.get(m.group(1) or m.group(2), m.group(0)), value)


def _ray_binary() -> str:
    """`ray` of the agent's own Python environment, so the versions always match."""
    cand = Path(sys.executable).with_name("ray")
    return str(cand) if cand.exists() else "ray"
