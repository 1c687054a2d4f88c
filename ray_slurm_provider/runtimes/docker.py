"""Docker and Podman: a daemon-managed container, so the job must bind its life explicitly.

`docker run` in the foreground with `--rm --init`: the CLI forwards SIGTERM (sig-proxy) and
`--init` reaps Ray's processes. Because the container's processes are the daemon's children,
not the job's, Slurm cannot kill them itself: the agent runs `docker stop -t <n>` on SIGTERM
(n < KillWait) and `docker rm -f` when it exits, every container carries `slurm.job_id` so a
site epilog can remove leftovers, and each agent sweeps containers of its cluster whose job is
gone. Only the GPUs Slurm allocated are passed (`--gpus device=<SLURM_JOB_GPUS>`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from ray_slurm_provider.runtimes.base import RunContext, Runtime

CLUSTER_LABEL = "ray-slurm.cluster"
#: The uid of the job's user: on a daemon shared by the node's users, clusters of the same
#: name belong to different people, and a sweep may only ever list its own user's.
OWNER_LABEL = "ray-slurm.uid"
JOB_LABEL = "slurm.job_id"
TAR_SUFFIXES = (".tar", ".tar.gz", ".tgz")


def _mine(ctx: RunContext) -> list[str]:
    """`ps` filters (ANDed) for this user's containers of this cluster."""
    return ["--filter", f"label={CLUSTER_LABEL}={ctx.cluster_name}",
            "--filter", f"label={OWNER_LABEL}={ctx.owner}"]


def is_tar(image: str) -> bool:
    return image.endswith(TAR_SUFFIXES)


class Docker(Runtime):
    name = "docker"

    def cli(self, ctx: RunContext) -> list[str]:
        return [self.binary(ctx.cfg), *ctx.cfg.runtime_args]

    def prepare(self, ctx: RunContext) -> list[list[str]]:
        image = ctx.cfg.image or ""
        if is_tar(image):
            # The agent skips this when `image_tag` is already present on the node.
            return [[*self.cli(ctx), "load", "--input", image]]
        return []

    def image_ref(self, ctx: RunContext) -> str:
        image = ctx.cfg.image or ""
        if is_tar(image):
            if not ctx.cfg.image_tag:
                raise ValueError("container.image_tag is required for a .tar image")
            return ctx.cfg.image_tag
        return image

    def gpu_options(self, ctx: RunContext) -> list[str]:
        if not (ctx.cfg.gpus and ctx.gpu_ids):
            return []
        # The value is CSV to docker's CLI: without its own quotes "device=0,1" would read
        # as device 0 plus a count, which the daemon refuses.
        return ["--gpus", f'"device={",".join(ctx.gpu_ids)}"']

    def run(self, ctx: RunContext, argv: Sequence[str], env: Mapping[str, str]) -> list[str]:
        cfg = ctx.cfg
        out = [*self.cli(ctx), "run", "--rm", "--init", "--name", ctx.name,
               "--label", f"{JOB_LABEL}={ctx.job_id}",
               "--label", f"{CLUSTER_LABEL}={ctx.cluster_name}",
               "--label", f"{OWNER_LABEL}={ctx.owner}",
               "--net=host", "--stop-timeout", str(ctx.drain_timeout_s + 2)]
        if cfg.run_as_user:
            # The job's own user, not root: Ray's files stay the user's, and the head's
            # sbatch reaches munge as the user.
            out += ["--user", f"{os.getuid()}:{os.getgid()}"]
        if cfg.ipc_host:
            out.append("--ipc=host")
        if cfg.shm_size:
            out += ["--shm-size", cfg.shm_size]
        for name, limit in sorted(cfg.ulimits.items()):
            out += ["--ulimit", f"{name}={limit}"]
        if cfg.privileged:
            out.append("--privileged")
        for dev in cfg.devices:
            out += ["--device", dev]
        out += self.gpu_options(ctx)
        for m in ctx.mounts():
            out += ["-v", m]
        for k in sorted({**env, **cfg.environment}):
            out += ["-e", k]  # by name: the value comes from our environment, not argv
        out += cfg.run_options
        return [*out, self.image_ref(ctx), *argv]

    def exec(self, ctx: RunContext, argv: Sequence[str], interactive: bool = False) -> list[str]:
        flags = ["-it"] if interactive else ["-i"]
        return [*self.cli(ctx), "exec", *flags, ctx.name, *argv]

    def stop(self, ctx: RunContext) -> list[str] | None:
        return [*self.cli(ctx), "stop", "-t", str(ctx.drain_timeout_s + 2), ctx.name]

    def remove(self, ctx: RunContext) -> list[str] | None:
        return [*self.cli(ctx), "rm", "-f", ctx.name]

    def list_cluster(self, ctx: RunContext) -> list[str] | None:
        return [*self.cli(ctx), "ps", "-a", *_mine(ctx),
                "--format", f'{{{{.Names}}}} {{{{.Label "{JOB_LABEL}"}}}}']

    def remove_names(self, ctx: RunContext, names: Sequence[str]) -> list[str] | None:
        return [*self.cli(ctx), "rm", "-f", *names] if names else None


class Podman(Docker):
    """Podman: Docker's command line, rootless-friendly; GPUs through CDI device names."""

    name = "podman"

    def list_cluster(self, ctx: RunContext) -> list[str] | None:
        # Podman's .Labels is a map (Docker's is a string): index it.
        return [*self.cli(ctx), "ps", "-a", *_mine(ctx),
                "--format", f'{{{{.Names}}}} {{{{index .Labels "{JOB_LABEL}"}}}}']

    def gpu_options(self, ctx: RunContext) -> list[str]:
        if not (ctx.cfg.gpus and ctx.gpu_ids):
            return []
        out: list[str] = []
        for g in ctx.gpu_ids:
            out += ["--device", f"nvidia.com/gpu={g}"]
        return out
