"""What every container runtime provides: the argv lists that run, enter and stop a node's
container. Runtimes only build argv lists; the node agent and the command runner run them.

A node's container lives exactly as long as its job: it runs in the foreground of the batch
step (never detached), is named after the job (`rsp-<cluster>-<job id>`, so two clusters on
one node never collide), carries the job id as a label, and is stopped by the agent on
SIGTERM well within Slurm's KillWait.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ray_slurm_provider.config import ContainerConfig


@dataclass(frozen=True)
class RunContext:
    """The job-specific facts a runtime needs."""

    cluster_name: str
    job_id: str
    cfg: ContainerConfig
    temp_dir: str
    cluster_dir: str
    gpu_ids: tuple[str, ...] = ()  # the GPUs Slurm allocated (global ids, SLURM_JOB_GPUS)
    drain_timeout_s: int = 5
    extra_mounts: tuple[str, ...] = field(default_factory=tuple)
    #: The job's user: containers carry it, and a sweep touches only its own user's.
    owner: int = field(default_factory=os.getuid)
    #: PATH inside the container where we set it (`host_python`: the bound Python's bin first).
    path: str = ""
    #: The node's index in a gang job (provider/gangs.py): members share the job id (and its
    #: label), and may share a container daemon (the sandbox's nodes do), so never a name.
    member: str = ""

    @property
    def name(self) -> str:
        job = f"{self.job_id}.{self.member}" if self.member else self.job_id
        return container_name(self.cluster_name, job)

    def mounts(self) -> list[str]:
        """Cluster dir and temp dir at the same path, then the runtime's and the user's
        (`~` is the job owner's home)."""
        base = [f"{self.cluster_dir}:{self.cluster_dir}", f"{self.temp_dir}:{self.temp_dir}"]
        user = [":".join(os.path.expanduser(p) for p in m.split(":")) for m in self.cfg.mounts]
        return [*base, *self.extra_mounts, *user]


def container_name(cluster_name: str, job_id: str) -> str:
    return f"rsp-{cluster_name}-{job_id}"


class Runtime:
    """Base class: no container at all (`runtime: none`)."""

    name = "none"

    def binary(self, cfg: ContainerConfig) -> str:
        return cfg.binary or self.name

    def prepare(self, ctx: RunContext) -> list[list[str]]:
        """Commands to run once before `run` (loading an image file, creating a rootfs)."""
        return []

    def run(self, ctx: RunContext, argv: Sequence[str], env: Mapping[str, str]) -> list[str]:
        """argv that runs `argv` in the node's container in the foreground. `env` is the
        environment the container needs; runtimes pass it by name where they can, so the
        values never appear on a command line."""
        return list(argv)

    def exec(self, ctx: RunContext, argv: Sequence[str], interactive: bool = False) -> list[str]:
        """argv that runs `argv` inside the running node's container (for `ray exec`)."""
        return list(argv)

    def stop(self, ctx: RunContext) -> list[str] | None:
        """argv that stops the container gracefully (None: signals reach it directly)."""
        return None

    def remove(self, ctx: RunContext) -> list[str] | None:
        """argv that removes the container whatever its state (last resort at job end)."""
        return None

    def clear(self, ctx: RunContext) -> list[str] | None:
        """argv that removes an earlier run's container of this job before a start."""
        return self.remove(ctx)

    def list_cluster(self, ctx: RunContext) -> list[str] | None:
        """argv listing `<name> <job id>` of this cluster's containers on this node."""
        return None

    def remove_names(self, ctx: RunContext, names: Sequence[str]) -> list[str] | None:
        return None

    def parse_listing(self, ctx: RunContext, stdout: str) -> list[tuple[str, str]]:
        """(container name, job id) from `list_cluster`'s output (`<name> <job id>` rows)."""
        rows = [line.split() for line in stdout.splitlines()]
        return [(r[0], r[1]) for r in rows if len(r) == 2]

    def gpu_env(self, ctx: RunContext) -> dict[str, str]:
        """Variables that give the container exactly the job's GPUs (where flags do not)."""
        return {}

    def step_options(self, ctx: RunContext) -> list[str]:
        """Extra `srun` options for a step that must run inside the container (pyxis)."""
        return []
