"""The job -> agent contract: what a job needs to start its Ray node (rendered as JSON into
the job script), and which node id the job is: its job id, or for a gang job of N nodes
(provider/gangs.py) one id per node, `<job>.<k>`."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

#: A worker's start line when the node type has no `worker_start_ray_commands`.
DEFAULT_WORKER_START = ["ray start --address=$RAY_HEAD_IP:$RAY_GCS_PORT"]


#: Ray node labels of a gang member: its group (the job's id) and its index in the group.
GROUP_LABEL = "ray-slurm.io/group"
INDEX_LABEL = "ray-slurm.io/group-index"


def node_id(env: dict[str, str], group_size: int = 1) -> str:
    """A job's node id as the provider lists it (squeue %i): `<array>_<task>` for a task of
    a job array (SLURM_JOB_ID is then the task's own numeric id), else the job id; in a gang
    job, `.<k>` after it, k being the node's index in the job (SLURM_NODEID)."""
    array, task = env.get("SLURM_ARRAY_JOB_ID"), env.get("SLURM_ARRAY_TASK_ID")
    job = f"{array}_{task}" if array and task else env["SLURM_JOB_ID"]
    return f"{job}.{env['SLURM_NODEID']}" if group_size > 1 else job


def member_ids(job_id: str, n: int) -> list[str]:
    """The node ids of a gang job's N members."""
    return [f"{job_id}.{k}" for k in range(n)]


def released_whole(job_id: str, n: int, released: Callable[[str], bool]) -> bool:
    """Whether every member of gang job `job_id` (N = n >= 2) is `released`."""
    return n > 1 and all(released(m) for m in member_ids(job_id, n))


def split(node_id: str) -> tuple[str, int | None]:
    """`12.1` -> ("12", 1); `12_3.0` -> ("12_3", 0); a one-node job's id -> (id, None)."""
    job, dot, k = node_id.rpartition(".")
    return (job, int(k)) if dot and k.isdigit() else (node_id, None)


@dataclass
class NodeSpec:
    """Everything a job needs to start its Ray node; rendered as JSON into the job script."""

    kind: str  # "head" | "worker"
    node_type: str
    cluster_name: str
    state_dir: str
    ports_base: int
    ports_pinned: bool = False  # provider.ports.base was set: the head never moves the block
    group_size: int = 1  # nodes per job: a gang job runs one agent per node
    start_commands: list[str] = field(default_factory=list)
    resources: dict[str, int] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)
    auth_mode: str = "token"
    temp_dir_root: str = "/tmp"
    node_ip_interface: str | None = None
    drain_timeout_s: int = 5
    drain_before_limit_s: int = 0  # node_config's: Slurm's TERM this long before the limit
    ray_logs_max_mb: int = 100  # 0: Ray's logs go with the node-local temp dir
    attempts: int = 3
    head_start_timeout_s: int = 1800
    object_store_memory: int | None = None
    object_store_fraction: float = 0.3
    container: dict[str, Any] = field(default_factory=dict)  # ContainerConfig as a dict
    env_names: list[str] = field(default_factory=list)  # user env for the container
    slurm_api: str = "cli"  # provider.slurm_api: the agent asks Slurm the same way
    rest: dict[str, Any] = field(default_factory=dict)  # RestConfig as a dict

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> NodeSpec:
        return cls(**json.loads(text))

