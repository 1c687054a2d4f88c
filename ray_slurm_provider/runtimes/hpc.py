"""Apptainer, Enroot and Pyxis: daemonless HPC runtimes.

Their containers are plain child processes of the job, so Slurm's own signals and process
tracking already tie them to the job's life; nothing needs stopping or sweeping.

* Apptainer: `apptainer exec --nv <binds> image.sif ray start ...`. `ray exec` starts a second
  `apptainer exec` of the same image: with the host network and the same binds it sees the
  same Ray (there is no daemon to attach to).
* Enroot: the `.sqsh` is unpacked once per job (`enroot create`), then `enroot start`.
  Slurm's CUDA_VISIBLE_DEVICES is what enroot's NVIDIA hook passes in.
* Pyxis: `srun --container-image=...` runs the step inside the container (Slurm's SPANK
  plugin); the agent waits on that step, so Ray still lives and dies with the job.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from ray_slurm_provider.runtimes.base import RunContext, Runtime, container_name


class Apptainer(Runtime):
    name = "apptainer"

    def common(self, ctx: RunContext) -> list[str]:
        out: list[str] = []
        if ctx.cfg.gpus and ctx.gpu_ids:
            out.append("--nv")  # binds the driver; CUDA_VISIBLE_DEVICES from Slurm selects
        if ctx.path:  # Apptainer passes everything but PATH through
            out += ["--env", f"PATH={ctx.path}"]
        for m in ctx.mounts():
            out += ["--bind", m]
        return out

    def run(self, ctx: RunContext, argv: Sequence[str], env: Mapping[str, str]) -> list[str]:
        # Apptainer passes the host environment through by default, so `env` needs no flags.
        return [self.binary(ctx.cfg), *ctx.cfg.runtime_args, "exec", *self.common(ctx),
                *ctx.cfg.run_options, ctx.cfg.image or "", *argv]

    def exec(self, ctx: RunContext, argv: Sequence[str], interactive: bool = False) -> list[str]:
        return [self.binary(ctx.cfg), *ctx.cfg.runtime_args, "exec", *self.common(ctx),
                ctx.cfg.image or "", *argv]


#: What a second `enroot start` (`ray exec`, the head's Slurm probe) passes in when the
#: caller has it: enroot sets a name the caller lacks to "" (measured: `--env NOPE`).
EXEC_ENV = ("PATH", "PYTHONPATH", "SLURM_CONF", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH")
#: ... and always: it runs in a step of the node's job (its argv is built before, outside).
STEP_ENV = ("SLURM_JOB_ID",)


class Enroot(Runtime):
    name = "enroot"

    def prepare(self, ctx: RunContext) -> list[list[str]]:
        return [[self.binary(ctx.cfg), *ctx.cfg.runtime_args, "create", "--force", "--name",
                 ctx.name, ctx.cfg.image or ""]]

    def common(self, ctx: RunContext) -> list[str]:
        out = ["--rw"]
        for m in ctx.mounts():
            out += ["--mount", enroot_mount(m)]
        return out

    def run(self, ctx: RunContext, argv: Sequence[str], env: Mapping[str, str]) -> list[str]:
        out = [self.binary(ctx.cfg), *ctx.cfg.runtime_args, "start", *self.common(ctx)]
        for k in sorted({**env, **ctx.cfg.environment}):
            out += ["--env", k]  # by name
        return [*out, *ctx.cfg.run_options, ctx.name, *argv]

    def exec(self, ctx: RunContext, argv: Sequence[str], interactive: bool = False) -> list[str]:
        # A second `enroot start` begins from the image's environment: the names it needs
        # come by name from the caller's (an `srun` step's), and PATH as the node has it.
        out = [self.binary(ctx.cfg), *ctx.cfg.runtime_args, "start", *self.common(ctx)]
        if ctx.path:
            out += ["--env", f"PATH={ctx.path}"]
        names = {*STEP_ENV, *(k for k in EXEC_ENV if k in os.environ), *ctx.cfg.environment}
        for k in sorted(names - {"PATH"} if ctx.path else names):
            out += ["--env", k]
        return [*out, ctx.name, *argv]

    def remove(self, ctx: RunContext) -> list[str] | None:
        return [self.binary(ctx.cfg), *ctx.cfg.runtime_args, "remove", "--force", ctx.name]

    def gpu_env(self, ctx: RunContext) -> dict[str, str]:
        # Enroot's NVIDIA hook mounts the devices NVIDIA_VISIBLE_DEVICES names (host ids);
        # unset, the image's value decides (NGC images: all of the node's GPUs).
        if ctx.cfg.gpus and ctx.gpu_ids:
            return {"NVIDIA_VISIBLE_DEVICES": ",".join(ctx.gpu_ids)}
        return {}

    def clear(self, ctx: RunContext) -> list[str] | None:
        # `start` runs the root filesystem `prepare` created: removing it would leave
        # nothing to start ("[ERROR] No such file or directory: <data path>/<name>").
        return None

    # Enroot keeps container roots per user (ENROOT_DATA_PATH): `list` shows only the caller's.
    def list_cluster(self, ctx: RunContext) -> list[str] | None:
        return [self.binary(ctx.cfg), *ctx.cfg.runtime_args, "list"]

    def remove_names(self, ctx: RunContext, names: Sequence[str]) -> list[str] | None:
        return [self.binary(ctx.cfg), *ctx.cfg.runtime_args, "remove", "--force", *names] \
            if names else None

    def parse_listing(self, ctx: RunContext, stdout: str) -> list[tuple[str, str]]:
        """Names only: this cluster's are `rsp-<cluster>-<job id>` (container_name)."""
        prefix = container_name(ctx.cluster_name, "")
        return [(n, n[len(prefix):]) for n in stdout.split()
                if n.startswith(prefix) and n[len(prefix):].isdigit()]


def enroot_mount(mount: str) -> str:
    """`src:dst[:ro|rw]` as enroot's `--mount` takes it: an fstab line with ':' for blanks,
    whose third field is the filesystem type (`/usr:/usr:ro` fails with "No such device")."""
    src, _, rest = mount.partition(":")
    dst, _, mode = rest.partition(":")
    options = ["x-create=auto", "rbind", *([mode] if mode else [])]
    return f"{src}:{dst or src}:none:{','.join(options)}"


class Pyxis(Runtime):
    name = "pyxis"

    def common(self, ctx: RunContext) -> list[str]:
        out = [f"--container-image={ctx.cfg.image or ''}", f"--container-name={ctx.name}"]
        mounts = ctx.mounts()
        if mounts:
            out.append("--container-mounts=" + ",".join(mounts))
        return out

    def run(self, ctx: RunContext, argv: Sequence[str], env: Mapping[str, str]) -> list[str]:
        # One task on this node, all of the job's CPUs and GPUs, inside the container. The
        # image's PATH wins over the step's unless named (measured: `ray` not found).
        path = ["--container-env=PATH"] if ctx.path else []
        return ["srun", "--nodes=1", "--ntasks=1", "--overlap", "--kill-on-bad-exit=1",
                *self.common(ctx), *path, *ctx.cfg.run_options, *argv]

    def exec(self, ctx: RunContext, argv: Sequence[str], interactive: bool = False) -> list[str]:
        # The step's PATH is the login node's, and the image's wins anyway: the node's PATH.
        return ["env", f"PATH={ctx.path}", *argv] if ctx.path else list(argv)

    def step_options(self, ctx: RunContext) -> list[str]:
        # `ray exec` is already an `srun --jobid` step: it enters the named container itself,
        # with the node's mounts again: pyxis mounts per step, and the image may need them
        # (the sandbox's has no /bin/sh without the host's /usr).
        mounts = ctx.mounts()
        return [f"--container-name={ctx.name}",
                *(["--container-mounts=" + ",".join(mounts)] if mounts else [])]
