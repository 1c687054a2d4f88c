"""From a Ray node type to a Slurm job: the job spec and the tags it carries.

A Ray node is one Slurm job. All jobs of a cluster share the job name `ray-<cluster>`, so one
`squeue --name` lists the whole cluster; the creation tags Ray passes (kind, node type,
launch hash, launch request) travel in the job comment, so Slurm itself remembers which node
is what, readable from the login node and from the head alike.
"""

from __future__ import annotations

import functools
import json
import math
import os
from collections.abc import Mapping
from dataclasses import asdict
from typing import Any

from ray_slurm_provider.cluster import NodeType
from ray_slurm_provider.config import NodeConfig, ProviderConfig
from ray_slurm_provider.nodespec import NodeSpec
from ray_slurm_provider.ports import port_block
from ray_slurm_provider.slurm.script import JobSpec
from ray_slurm_provider.state import ClusterDir
from ray_slurm_provider.units import MIB

COMMENT_PREFIX = "ray-slurm:"
#: Job-comment tag of a gang job: its number of nodes (provider/gangs.py; not shown to Ray).
GROUP_TAG = "ray-slurm-nodes"
#: Linux's limit on a Unix socket path (sun_path holds 108 bytes with the final NUL).
SOCKET_PATH_MAX = 107
#: Ray's longest socket path below a job's own temp dir (a 10-digit job id, a gang member's
#: index up to 999, and a 7-digit pid): /<job>[.<k>]/session_<date>_<time>_<usec>_<pid>/
#: sockets/plasma_store.
_LONGEST_BELOW_JOB = len("/1234567890.999/session_2026-01-01_00-00-00_000000_4194304"
                         "/sockets/plasma_store")


def longest_socket_below_root(uid: int | None = None) -> int:
    """The longest Ray socket path below `provider.temp_dir_root` for this user."""
    return len(f"/rsp-{os.getuid() if uid is None else uid}") + _LONGEST_BELOW_JOB


def temp_dir_root_max(uid: int | None = None) -> int:
    """The longest `provider.temp_dir_root` that keeps every Ray socket path in the limit."""
    return SOCKET_PATH_MAX - longest_socket_below_root(uid)


def job_name(cluster_name: str) -> str:
    """Every job of a cluster has this name: one `squeue --name` lists the whole cluster."""
    return f"ray-{cluster_name}"


def temp_dir(root: str, job_id: str, uid: int | None = None) -> str:
    """A node's Ray temp dir: short, per job (the numeric SLURM_JOB_ID; `<id>.<k>` for a
    gang member, nodespec.py), node-local, below
    the user's own private parent `<root>/rsp-<uid>` (Ray makes its own dirs 0777, so the
    parent is what keeps other users of the node out; the agent creates and checks it)."""
    return f"{root.rstrip('/')}/rsp-{os.getuid() if uid is None else uid}/{job_id}"


def encode_tags(tags: Mapping[str, str]) -> str:
    """Creation tags as the job comment (compact JSON; passed as an argv, never in a script)."""
    return COMMENT_PREFIX + json.dumps(dict(tags), sort_keys=True, separators=(",", ":"))


def decode_tags(comment: str) -> dict[str, str] | None:
    """Tags from a job comment (a new dict each call), or None when the job is not ours."""
    items = _decode(comment)
    return dict(items) if items is not None else None


@functools.lru_cache(maxsize=65536)
def _decode(comment: str) -> tuple[tuple[str, str], ...] | None:
    # Memoized: a job's comment never changes, and every autoscaler tick decodes every job's.
    if not comment.startswith(COMMENT_PREFIX):
        return None
    try:
        data = json.loads(comment[len(COMMENT_PREFIX):])
    except ValueError:
        return None
    return tuple((str(k), str(v)) for k, v in data.items()) if isinstance(data, dict) else None


def slurm_resources(ncfg: NodeConfig, resources: Mapping[str, int],
                    object_store_fraction: float = 0.3) -> dict[str, Any]:
    """CPUs, memory and GRES to ask Slurm for, from node_config or else Ray's resources.

    Ray's `memory` excludes the object store, so the job asks for both.
    """
    # A node that offers Ray no CPUs (a head with `CPU: 0`) still runs on one: Slurm's default.
    cpus = ncfg.cpus if ncfg.cpus is not None else (resources.get("CPU") or None)
    gpus = ncfg.gpus if ncfg.gpus is not None else resources.get("GPU")
    mem = ncfg.mem
    if mem is None and resources.get("memory"):
        total = resources["memory"] / (1 - object_store_fraction)
        mem = f"{math.ceil(total / MIB)}M"
    gres = None
    if gpus:
        gres = f"gpu:{ncfg.gpu_type}:{gpus}" if ncfg.gpu_type else f"gpu:{gpus}"
    return {"cpus_per_task": cpus, "mem": mem, "gres": gres}


def build_job(
    provider: ProviderConfig,
    cluster_name: str,
    nt: NodeType,
    *,
    kind: str,
    python: str,
    resources: Mapping[str, int] | None = None,
    labels: Mapping[str, str] | None = None,
) -> JobSpec:
    """The Slurm job of one Ray node of type `nt`. `resources`/`labels` are what the
    autoscaler asked for (default: the node type's)."""
    pcfg, ncfg, commands = provider, nt.node_config, nt.commands
    resources = dict(nt.resources if resources is None else resources)
    labels = dict(nt.labels if labels is None else labels)
    cdir = ClusterDir(pcfg.state_dir, cluster_name)
    spec = NodeSpec(
        kind=kind,
        node_type=nt.name,
        cluster_name=cluster_name,
        state_dir=pcfg.state_dir,
        ports_base=port_block(cluster_name, pcfg.ports.base).base,
        ports_pinned=pcfg.ports.base is not None,
        group_size=ncfg.nodes,
        start_commands=commands.start if kind == "worker" else [],
        resources=dict(resources),
        labels=dict(labels),
        auth_mode=pcfg.auth.mode,
        temp_dir_root=pcfg.temp_dir_root,
        node_ip_interface=pcfg.node_ip_interface,
        drain_timeout_s=pcfg.drain_timeout_s,
        drain_before_limit_s=ncfg.drain_before_limit_s,
        ray_logs_max_mb=pcfg.ray_logs_max_mb,
        attempts=pcfg.ray_start_attempts,
        head_start_timeout_s=pcfg.head_start_timeout_s,
        object_store_memory=ncfg.object_store_memory,
        object_store_fraction=pcfg.object_store_fraction,
        container=asdict(ncfg.container) if ncfg.container.runtime != "none" else {},
        env_names=sorted({*pcfg.environment, *ncfg.environment}),
        slurm_api=pcfg.slurm_api,
        rest=asdict(pcfg.rest),
    )
    # Worker jobs run the YAML's initialization and setup commands themselves; the head's
    # are run by `ray up` through the command runner, as on any other provider.
    node_setup = [*commands.initialization, *commands.setup] if kind == "worker" else []
    sizes = slurm_resources(ncfg, resources, pcfg.object_store_fraction)
    agent = [python, "-m", "ray_slurm_provider.agent", "--spec", spec.to_json()]
    n, lead = ncfg.nodes, ncfg.drain_before_limit_s
    gang = n > 1
    return JobSpec(
        job_name=job_name(cluster_name),
        command=gang_step(n, sizes["cpus_per_task"], node_setup, agent) if gang else agent,
        nodes=n,
        ntasks=n,
        partition=ncfg.partition,
        account=ncfg.account,
        qos=ncfg.qos,
        time=ncfg.time,
        constraint=ncfg.constraint,
        exclusive=ncfg.exclusive,
        reservation=ncfg.reservation,
        nodelist=ncfg.nodelist,
        exclude=ncfg.exclude,
        # Before the time limit, SIGTERM to the agent: Ray drains and leaves, and the
        # autoscaler replaces the node while demand remains. The agent is the batch step's
        # main process (B:), or in a gang job the step's tasks (srun, the batch step's main
        # process, would kill them at once on a TERM of its own).
        signal=(f"TERM@{lead}" if gang else f"B:TERM@{lead}") if lead > 0 else None,
        output=str(cdir.logs / "%j.out"),
        open_mode="append",
        requeue=False,  # a preempted node must not come back silently under the same id
        sbatch_options=dict(ncfg.sbatch_options),
        extra_directives=list(ncfg.extra_directives),
        environment={**pcfg.environment, **ncfg.environment, "PYTHONUNBUFFERED": "1"},
        # The prologue sets the environment, which srun hands to a gang's tasks; the node
        # setup runs on every node of a gang (gang_step).
        setup=[*ncfg.prologue, *([] if gang else node_setup)],
        **sizes,
    )


def gang_step(n: int, cpus: int | None, setup: list[str], agent: list[str]) -> list[str]:
    """A gang job's last line: one task (one node agent) per node, each with its node's share
    and after the node setup on that node; a task's error ends all of them, so no group lives
    on with a node missing, while a task ending with 0 (a released member) ends none of the
    others (`--wait=0`, whatever the site's WaitTime). See provider/gangs.py."""
    argv = ["srun", f"--nodes={n}", f"--ntasks={n}", "--ntasks-per-node=1",
            "--kill-on-bad-exit=1", "--wait=0"]
    if cpus:  # srun does not inherit the job's --cpus-per-task (Slurm 22.05 and later)
        argv.append(f"--cpus-per-task={cpus}")
    if setup:  # as in a batch script: a failing line ends the node's task, and so the job
        argv += ["bash", "-c", "set -eo pipefail\n" + "\n".join(setup) + '\nexec "$@"', "bash"]
    return [*argv, *agent]
