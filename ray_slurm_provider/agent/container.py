"""The node agent's side of containers: load the image, wrap `ray start`, stop and sweep.

Kept apart from agent.py so the agent reads the same with or without a container.
"""

from __future__ import annotations

import fcntl
import glob
import os
import re
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path

from ray_slurm_provider import proc, shellcmd
from ray_slurm_provider.config import ContainerConfig
from ray_slurm_provider.runtimes import RunContext, get_runtime, images
from ray_slurm_provider.runtimes.docker import is_tar
from ray_slurm_provider.schema import load
from ray_slurm_provider.state import AgentInfo

#: Ray's own settings and the usual GPU-networking families reach the container by name.
PASS_PREFIXES = ("RAY_", "NCCL_", "FI_", "UCX_", "OMP_", "PYTHON")
#: The runtime's own socket variables too: the head's autoscaler submits worker jobs from
#: inside its container, and those jobs must reach the same container engine.
PASS_NAMES = ("AUTOSCALER_METRIC_PORT", "DASHBOARD_METRIC_PORT", "SLURM_JOB_ID",
              "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID", "SLURM_CONF", "HOME", "USER",
              "DOCKER_HOST", "CONTAINER_HOST")

Log = Callable[[str], None]


def gpu_ids(env: Mapping[str, str]) -> tuple[str, ...]:
    """The GPUs Slurm gave the job, as global ids (what `docker --gpus device=` wants)."""
    raw = env.get("SLURM_JOB_GPUS") or env.get("SLURM_STEP_GPUS") or ""
    return tuple(g for g in raw.split(",") if g.strip())


def slurm_mounts(env: Mapping[str, str]) -> tuple[str, ...]:
    """Slurm's config directory and the munge socket's directory, for a head whose
    autoscaler must call Slurm from inside its container."""
    conf = env.get("SLURM_CONF", "/etc/slurm/slurm.conf")
    conf_dir = str(Path(conf).parent)
    sock_dir = "/run/munge"
    try:
        text = Path(conf).read_text()
    except OSError:
        text = ""
    m = re.search(r"^\s*AuthInfo\s*=.*\bsocket=([^,\s]+)", text, re.MULTILINE | re.IGNORECASE)
    if m:
        sock_dir = str(Path(m.group(1)).parent)
    mounts = [f"{conf_dir}:{conf_dir}:ro"]
    if sock_dir != conf_dir and not sock_dir.startswith(conf_dir + "/"):
        mounts.append(f"{sock_dir}:{sock_dir}")
    mounts += [f"{p}:{p}:ro" for p in spank_files(Path(conf), text)
               if not p.startswith(conf_dir + "/")]
    return tuple(mounts)


#: How deep plugstack.conf's `include`s are followed (a loop ends there too).
_MAX_INCLUDE_DEPTH = 8


def spank_files(conf: Path, text: str) -> list[str]:
    """The SPANK stack the Slurm commands load (pyxis, say), from slurm.conf `conf`'s `text`:
    its PlugStackConfig (default plugstack.conf beside it), the files that includes, and the
    plugins they name by absolute path, those that exist. sbatch inside a container loads
    them too, and a `required` plugin it cannot open stops it. A relative plugin is found in
    PluginDir."""
    stack = conf.parent / "plugstack.conf"
    m = re.search(r"^\s*PlugStackConfig\s*=\s*(\S+)", text, re.MULTILINE | re.IGNORECASE)
    if m:
        stack = conf.parent / m.group(1)  # an absolute value replaces the dir
    found: list[str] = []
    _read_stack(stack, found, 0)
    return found


def _read_stack(path: Path, found: list[str], depth: int) -> None:
    if depth > _MAX_INCLUDE_DEPTH or str(path) in found:
        return
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return
    found.append(str(path))
    for line in lines:
        words = line.split("#", 1)[0].split()
        if len(words) < 2:
            continue
        if words[0] in ("required", "optional") and words[1].startswith("/"):
            if Path(words[1]).is_file() and words[1] not in found:
                found.append(words[1])
        elif words[0] == "include":
            for name in sorted(glob.glob(str(path.parent / words[1]))):
                _read_stack(Path(name), found, depth + 1)


def python_mounts() -> tuple[str, ...]:
    """The agent's Python (base prefix, venv) and this package's source, read-only. Debian's
    own Python (base prefix /usr, never bound whole) brings its interpreter and standard
    library instead: an image's /usr, or a Slurm root's, has neither."""
    import ray_slurm_provider

    paths = {os.path.realpath(sys.prefix),
             str(Path(ray_slurm_provider.__file__).resolve().parents[1])}
    base = os.path.realpath(sys.base_prefix)
    if base in ("/", "/usr"):
        ver = f"python{sys.version_info[0]}.{sys.version_info[1]}"
        paths |= {os.path.realpath(sys.executable), f"/usr/lib/{ver}"}
    else:
        paths.add(base)
    keep = sorted(p for p in paths
                  if not any(p != q and p.startswith(q + "/") for q in paths))
    return tuple(f"{p}:{p}:ro" for p in keep if p not in ("/", "/usr"))


class NodeContainer:
    def __init__(self, cfg: ContainerConfig, *, cluster_name: str, job_id: str, temp_dir: str,
                 cluster_dir: str, env: Mapping[str, str], drain_timeout_s: int, head: bool,
                 env_names: list[str], log: Log, member: str = "") -> None:
        self.cfg = cfg
        self.rt = get_runtime(cfg.runtime)
        extra = slurm_mounts(env) if head and cfg.slurm_access == "mount" else ()
        path = ""
        if cfg.host_python:
            extra = (*extra, *python_mounts())
            cfg = replace(cfg, ray_command=str(Path(sys.executable).with_name("ray")),
                          python_command=sys.executable)
            # `python` and `ray` of the bound environment first, as on the host.
            path = f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin"
        self.cfg = cfg
        self.ctx = RunContext(cluster_name, job_id, cfg, temp_dir, cluster_dir, gpu_ids(env),
                              drain_timeout_s, extra, path=path, member=member)
        self.env_names = env_names
        self.log = log

    def recorded(self, info: AgentInfo) -> AgentInfo:
        """`info` with this container's binds, GPUs and PATH: `ray exec` enters it alike."""
        return replace(info, container_mounts=list(self.ctx.extra_mounts),
                       container_gpus=list(self.ctx.gpu_ids), container_path=self.ctx.path)

    @classmethod
    def from_spec(cls, data: Mapping[str, object] | None, **kw: object) -> NodeContainer | None:
        cfg = load(ContainerConfig, dict(data or {}), "container")
        return None if cfg.runtime == "none" else cls(cfg, **kw)  # type: ignore[arg-type]

    def _run(self, argv: list[str], timeout: float = 600) -> proc.Result:
        return proc.run(argv, timeout=timeout, check=False)

    def prepare(self) -> None:
        """Create the mount points and load the image (once per node for a `.tar`)."""
        Path(self.ctx.temp_dir).mkdir(parents=True, exist_ok=True)
        image = self.cfg.image or ""
        if not image:
            raise RuntimeError("container.image is not set")
        if is_tar(image) or image.endswith((".sif", ".sqsh")):
            if not Path(image).is_file():
                raise RuntimeError(f"container image file {image} does not exist or is not a "
                                   "file (it must be on a filesystem this node can read)")
        why = images.problem(self.cfg.runtime, image)  # what `ray up` checks where it can
        if why:
            raise RuntimeError(f"container.image: {why}")
        cmds = self.rt.prepare(self.ctx)
        if not cmds:
            return
        # One loader per node at a time; a second job on the node waits, then skips. The
        # lock file (empty, one per node, user and runtime) stays: removing a file others
        # may be waiting on would let two loaders in.
        lock = Path(self.ctx.temp_dir).parent / f".rsp-image-{self.cfg.runtime}.lock"
        with open(lock, "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            if is_tar(image) and self.cfg.image_tag and self._has_image(self.cfg.image_tag):
                self.log(f"image {self.cfg.image_tag} already on this node; not loading")
                return
            for argv in cmds:
                self.log("preparing image: " + " ".join(argv))
                res = self._run(argv)
                if res.returncode != 0:
                    raise RuntimeError(f"{argv[0]} {argv[1] if len(argv) > 1 else ''} failed "
                                       f"for {image}: {(res.stderr or res.stdout).strip()}")

    def _has_image(self, tag: str) -> bool:
        cli = [self.cfg.binary or self.cfg.runtime, *self.cfg.runtime_args]
        return self._run([*cli, "image", "inspect", tag], timeout=60).returncode == 0

    def container_env(self, env: Mapping[str, str]) -> dict[str, str]:
        """What the container gets: Ray's settings, the configured names and the
        container's own environment (GPU masks stay out: the runtime maps GPUs itself)."""
        out = {k: v for k, v in env.items()
               if (k.startswith(PASS_PREFIXES) or k in PASS_NAMES or k in self.env_names)}
        if not (self.cfg.gpus and self.ctx.gpu_ids) and "CUDA_VISIBLE_DEVICES" in env:
            out["CUDA_VISIBLE_DEVICES"] = env["CUDA_VISIBLE_DEVICES"]
        if self.ctx.path:
            out["PATH"] = self.ctx.path
        out.update(self.rt.gpu_env(self.ctx))
        out.update(self.cfg.environment)
        return out

    def wrap(self, argv: list[str], env: dict[str, str],
             prefix: str = "") -> tuple[list[str], dict[str, str]]:
        """`ray start ...` as run inside the container (after `prefix`, in Ray's own shell
        there); the env the runtime's CLI needs."""
        inner = shellcmd.in_shell(prefix, [self.cfg.ray_command, *argv[1:]])
        cenv = self.container_env(env)
        return self.rt.run(self.ctx, inner, cenv), {**env, **cenv}

    def sweep(self, active_job_ids: Callable[[], set[str]]) -> None:
        """Remove this cluster's containers on this node whose job is gone."""
        argv = self.rt.list_cluster(self.ctx)
        if argv is None:
            return
        res = self._run(argv, timeout=60)
        rows = self.rt.parse_listing(self.ctx, res.stdout)
        others = [r for r in rows if r[1] != self.ctx.job_id]
        if not others:
            return
        alive = active_job_ids()
        stale = [name for name, job in others if job not in alive]
        rm = self.rt.remove_names(self.ctx, stale)
        if rm:
            self.log(f"removing containers of ended jobs: {', '.join(stale)}")
            self._run(rm, timeout=120)

    def stop_async(self) -> None:
        argv = self.rt.stop(self.ctx)
        if argv:
            threading.Thread(target=self._run, args=(argv, 60), daemon=True).start()

    def remove(self) -> None:
        argv = self.rt.remove(self.ctx)
        if argv:
            self._run(argv, timeout=60)

    def clear(self) -> None:
        """Remove an earlier start's container of this job, where the runtime keeps one."""
        argv = self.rt.clear(self.ctx)
        if argv:
            self._run(argv, timeout=60)

    def check_slurm(self, cluster_dir: str, cluster_name: str) -> None:
        """From inside the head's container: can the autoscaler reach Slurm?"""
        probe = self.rt.exec(self.ctx, [self.cfg.python_command, "-m",
                                        "ray_slurm_provider.agent.probe", cluster_dir,
                                        cluster_name])
        res = self._run(probe, timeout=120)
        text = (res.stdout + res.stderr).strip()
        if res.returncode == 0:
            self.log(f"Slurm is reachable from inside the head's container: {text}")
        else:
            self.log("ERROR: the head's autoscaler cannot reach Slurm from inside its "
                     f"container, so the cluster cannot scale: {text[-800:]}. Fix: set "
                     "container.slurm_access: mount with an image that has the Slurm client "
                     "(and mount its binaries), or use provider.slurm_api: rest.")

