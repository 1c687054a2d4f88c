"""Slurm releases other than the host's: one cached Debian root per release, and how the
sandbox's daemons and client commands run inside it.

22.05 is the host's own packages (Debian 12); 25.11 is built from source into the cache and
runs on the host (sandbox/source.py). 24.11 (Debian 13, trixie) and 26.05 (Debian
sid) live in roots that ``debootstrap --variant=minbase`` builds once into the cache dir
(``$RAY_SLURM_SANDBOX_CACHE``, default /var/cache/ray-slurm-provider/roots/<release>); a root
is built into a temporary dir and renamed only once its slurmctld says the expected release,
so a half-built root is never used. Findings on this machine that shaped the entry script:

- Daemons enter their root with a private mount namespace and ``pivot_root`` (not chroot):
  their jobs, and apptainer in them, then run in a proper root ("weak chrooted environment"
  otherwise). Client commands, which start nothing, simply ``chroot``.
- The host paths jobs need (the state dir, /tmp, homes, the project, its venv and Python)
  are bind-mounted at the same paths, so the provider and Ray run unchanged inside.
- slurmd 24.11 refuses this machine's cgroup v1 layout unless ``CgroupPlugin=disabled``
  (`config.render_cgroup_conf`).
"""

from __future__ import annotations

import os
import re
import shutil
import sys

from ray_slurm_provider import proc
from ray_slurm_provider.sandbox.procs import SandboxError

HOST_RELEASE = "22.05"
#: Release -> (Debian suite, REST API version: the newest both it and the REST client know,
#: which the sandbox probes with and the client negotiates). The host release and the ones
#: built from source have no suite.
RELEASES: dict[str, tuple[str | None, str]] = {
    "22.05": (None, "v0.0.38"),
    "24.11": ("trixie", "v0.0.42"),
    "25.11": (None, "v0.0.44"),
    "26.05": ("sid", "v0.0.44"),
}
#: Releases built from source (sandbox/source.py) -> the patch release the vendor dir holds.
SOURCE: dict[str, str] = {"25.11": "25.11.7"}
PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge", "python3", "slurmrestd",
            "slurm-wlm-jwt-plugin", "util-linux", "mount")
EXTRA_PACKAGES: dict[str, tuple[str, ...]] = {"26.05": ("apptainer",)}
CACHE_ENV = "RAY_SLURM_SANDBOX_CACHE"
DEFAULT_CACHE = "/var/cache/ray-slurm-provider"
MIRROR_ENV = "RAY_SLURM_DEBIAN_MIRROR"
DEFAULT_MIRROR = "http://deb.debian.org/debian"
#: The client commands the sandbox puts first on PATH for a release in a root.
CLIENTS = ("sbatch", "squeue", "scancel", "scontrol", "srun", "sinfo", "sacct", "sacctmgr",
           "salloc", "sprio", "sshare")
#: Exists only inside a root: a wrapper called from a job (already inside) runs the command.
MARKER = "/.ray-slurm-sandbox-root"
BUILD_TIMEOUT_S = 1200
#: Host directories a root may not hide: the root brings its own.
_SYSTEM = frozenset({"/", "/usr", "/etc", "/var", "/lib", "/lib64", "/bin", "/sbin", "/proc",
                     "/sys", "/dev", "/run", "/boot"})


def check_release(release: str) -> str:
    """`release` if supported, else ValueError naming the choices."""
    if release not in RELEASES:
        raise ValueError(f"unsupported Slurm release {release!r}; choose one of "
                         f"{', '.join(RELEASES)}")
    return release


def in_root(release: str) -> bool:
    """True when `release` runs from a cached root rather than the host's packages."""
    return RELEASES[check_release(release)][0] is not None


def from_source(release: str) -> bool:
    """True when `release` is built from source into the cache (and runs on the host)."""
    return check_release(release) in SOURCE


def rest_version(release: str) -> str:
    return RELEASES[check_release(release)][1]


def cache_dir() -> str:
    return os.path.abspath(os.environ.get(CACHE_ENV) or DEFAULT_CACHE)


def root_dir(release: str) -> str:
    return os.path.join(cache_dir(), "roots", check_release(release))


APT_SOURCES = ("/etc/apt/sources.list.d/debian.sources", "/etc/apt/sources.list")


def mirror(sources: tuple[str, ...] = APT_SOURCES) -> str:
    """The Debian mirror: $RAY_SLURM_DEBIAN_MIRROR, else the one the host's apt uses."""
    if os.environ.get(MIRROR_ENV):
        return os.environ[MIRROR_ENV]
    for path in sources:
        try:
            with open(path) as f:
                text = f.read()
        except OSError:
            continue
        for url in re.findall(r"(https?://\S+/debian)/?(?:\s|$)", text):
            return str(url)
    return DEFAULT_MIRROR


def parse_release(version_output: str) -> str:
    """"slurm 24.11.5" -> "24.11"."""
    m = re.search(r"(\d+)\.(\d+)", version_output)
    if not m:
        raise SandboxError(f"no Slurm version in {version_output.strip()!r}")
    return f"{int(m.group(1)):02d}.{int(m.group(2)):02d}"


def root_release(root: str) -> str:
    """The release the slurmctld inside `root` reports."""
    try:
        res = proc.run(["chroot", root, "/usr/sbin/slurmctld", "-V"], timeout=60)
    except proc.CommandError as e:
        raise SandboxError(f"cannot run slurmctld in {root}: {e}") from e
    return parse_release(res.stdout)


def host_release() -> str:
    found = shutil.which("slurmctld", path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin")
    if found is None:
        raise SandboxError("slurmctld: command not found (is slurm-wlm installed?)")
    try:
        return parse_release(proc.run([found, "-V"], timeout=60).stdout)
    except proc.CommandError as e:
        raise SandboxError(f"slurmctld -V failed: {e}") from e


def ensure_root(release: str) -> str:
    """The root of `release`, built first if the cache has none; SandboxError (with the
    step and its log) when the build fails. A failed build leaves nothing in the cache."""
    suite = RELEASES[check_release(release)][0]
    if suite is None:
        raise ValueError(f"Slurm {release} is the host's; it has no root")
    root = root_dir(release)
    if os.path.exists(os.path.join(root, MARKER.lstrip("/"))):
        return root
    os.makedirs(os.path.dirname(root), exist_ok=True)
    log_path = os.path.join(cache_dir(), f"root-{release}.log")
    tmp = root + ".building"
    shutil.rmtree(tmp, ignore_errors=True)
    pkgs = ",".join(PACKAGES + EXTRA_PACKAGES.get(release, ()))
    argv = ["debootstrap", "--variant=minbase", f"--include={pkgs}", suite, tmp, mirror()]
    env = proc.clean_env(extra={"DEBIAN_FRONTEND": "noninteractive"})
    try:
        with open(log_path, "ab") as log:
            log.write(f"$ {' '.join(argv)}\n".encode())
        proc.run(["sh", "-c", 'exec "$@" >>"$0" 2>&1', log_path, *argv], env=env,
                 timeout=BUILD_TIMEOUT_S)
        got = root_release(tmp)
        if got != release:
            raise SandboxError(f"Debian {suite} now ships Slurm {got}, not {release}")
        with open(os.path.join(tmp, MARKER.lstrip("/")), "w") as f:
            f.write(f"{release}\n")
    except (proc.CommandError, SandboxError) as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise SandboxError(f"building the Slurm {release} root (debootstrap {suite} from "
                           f"{mirror()}) failed: {e}\nlog: {log_path}") from e
    os.replace(tmp, root)
    return root


def _python_paths() -> list[str]:
    """The running Python and its venv, which jobs inside the root run the agent with, and
    Debian's Python of the same version, which the throwaway users' venv runs (root's may
    live under a 0700 home)."""
    ver = f"python{sys.version_info.major}.{sys.version_info.minor}"
    paths = [sys.prefix, f"/usr/lib/{ver}", f"/usr/bin/{ver}"]
    base = os.path.realpath(sys.base_prefix)
    if base in _SYSTEM or base.startswith("/usr/"):  # Debian's own Python: just its files
        paths += [os.path.join(base, "lib", ver), os.path.realpath(sys.executable)]
    else:
        paths.append(base)
    return paths


def host_binds(state_dir: str) -> list[str]:
    """Host paths bound at the same path inside the root: the state dir, /tmp, homes, this
    project and its Python; users and hosts files. Nested and missing paths dropped."""
    project = os.path.dirname(os.path.dirname(os.path.abspath(proc.__file__)))
    wanted = ["/tmp", "/root", "/home", state_dir, project, *_python_paths(),
              "/etc/passwd", "/etc/group", "/etc/hosts"]
    real = [os.path.abspath(p) for p in wanted if os.path.exists(p)]
    out: list[str] = []
    for p in sorted(set(real), key=len):
        if p in _SYSTEM and not p.startswith("/etc/"):
            continue
        if any(p == q or p.startswith(q.rstrip("/") + "/") for q in out):
            continue
        out.append(p)
    return out


def _q(text: str) -> str:
    return "'" + text.replace("'", "'\\''") + "'"


def render_enter(root: str, binds: list[str]) -> str:
    """The entry script: ``enter.sh daemon|client CWD CMD...`` run under ``unshare -m``.

    daemon: pivot_root into the root (jobs inherit a proper root); client: chroot."""
    lines = []
    for p in binds:
        make = "touch" if os.path.isfile(p) else "mkdir -p"
        lines.append(f"[ -e \"$root\"{_q(p)} ] || {make} \"$root\"{_q(p)}; "
                     f"mount --bind {_q(p)} \"$root\"{_q(p)}")
    binds_sh = "\n".join(lines)
    return f"""#!/bin/sh
# Generated by ray_slurm_provider.sandbox: run CMD inside a Slurm root.
# usage: unshare --mount --propagation private sh enter.sh daemon|client CWD CMD [ARG...]
set -e
root={_q(root)}
mode=$1 cwd=$2
shift 2
mount --bind "$root" "$root"
if [ "$mode" = daemon ]; then
    mount -t proc proc "$root/proc"
else
    mount --rbind /proc "$root/proc"
fi
mount --rbind /sys "$root/sys"
mount --rbind /dev "$root/dev"
{binds_sh}
if [ "$mode" = daemon ]; then
    cd "$root"
    mkdir -p .oldroot
    pivot_root . .oldroot
    umount -l /.oldroot
    cd "$cwd" 2>/dev/null || cd /
    exec "$@"
fi
exec /usr/sbin/chroot "$root" \\
    /bin/sh -c 'cd "$1" 2>/dev/null || cd /; shift; exec "$@"' sh "$cwd" "$@"
"""


def render_client(enter: str, command: str) -> str:
    """A host wrapper for one client command: inside a root (a job) it is the root's own
    command; on the host it enters the root. Root does so in a mount namespace; any other
    user (the sandbox's throwaway users) in a user namespace that maps it to itself, whose
    capabilities (kept across exec) allow the mounts and the chroot. Slurm and munge still
    see the user's own uid: the mapping is the identity."""
    path = f"/usr/bin/{command}"
    return f"""#!/bin/sh
# Generated by ray_slurm_provider.sandbox: {command} of the sandbox's Slurm release.
if [ -e {MARKER} ]; then exec {path} "$@"; fi
if [ "$(id -u)" = 0 ]; then
    exec unshare --mount --propagation private /bin/sh {_q(enter)} client "$PWD" {path} "$@"
fi
exec unshare --map-user="$(id -u)" --map-group="$(id -g)" --keep-caps \\
    --mount --propagation private /bin/sh {_q(enter)} client "$PWD" {path} "$@"
"""
