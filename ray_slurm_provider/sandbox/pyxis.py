"""Enroot and Pyxis for the sandbox (``sandbox up --pyxis``): built once from the vendor
tarballs into the cache dir, then wired into one sandbox's state dir.

Neither is packaged by Debian or PyPI; their release sources (``git archive`` of the upstream
tags) sit in the vendor dir (``$RAY_SLURM_VENDOR_DIR``, default ``<project>/../shared/vendor``).
Findings on this machine (testbed.md, "Enroot and Pyxis, live") that shaped the build:

- Enroot's tarball has no submodules: it is built with the host's glibc (``FORCE_GLIBC=y``)
  and Debian's libbsd, with ``deps/dist`` made by hand and ``make -o deps``.
- The ``enroot`` script embeds its prefix at build time: it is built and installed with the
  same prefix, in the cache, and a build only counts once its marker file is written.
- Pyxis compiles in about a second against Debian's 22.05 ``spank.h`` (libslurm-dev).
- Pyxis runs enroot with no environment but PATH: enroot, its helpers and the per-user
  ``ENROOT_*`` paths must come from slurmd's PATH. The sandbox puts a wrapper there that sets
  the paths (under the state dir, per user) and runs the cached enroot.
- Pyxis's job epilog (it removes the job's containers with ``container_scope=job``) runs
  with ``PATH=/usr/local/bin:/usr/bin:/bin`` only: slurmd gives the epilog no PATH of its
  own ("pyxis: epilog: couldn't get list of existing containers", and the node drains).
  Each slurmd therefore runs in its own mount namespace where /usr/local/bin is a
  read-only overlay of the host's /usr/local/bin and the wrapper; the host is untouched.
- Every Slurm client loads the plugins plugstack.conf names, also sbatch inside a Ray
  node's container ("sbatch: error: plugin_load_from_file: dlopen(...spank_pyxis.so) ...
  No such file or directory", and no worker starts, before the agent bound the SPANK stack:
  agent/container.py). The sandbox keeps its copy in lib/, outside etc/, as a site would.
- Enroot's storage is node-local at a site; the sandbox's nodes share one disk. In each
  slurmd's namespace the node's own dir is bound over ``enroot/local``, so two nodes of one
  job can hold containers of the same name (pyxis names them ``pyxis_<job>_<name>``).
"""

from __future__ import annotations

import os
import shlex
import shutil
import tarfile
import tempfile
from dataclasses import dataclass

import filelock

from ray_slurm_provider import proc
from ray_slurm_provider.sandbox import roots
from ray_slurm_provider.sandbox.layout import Layout
from ray_slurm_provider.sandbox.procs import SandboxError

ENROOT_VERSION = "4.1.2"
PYXIS_VERSION = "0.24.0"
VENDOR_ENV = "RAY_SLURM_VENDOR_DIR"
#: Written last into a finished build: a build without it is redone.
MARKER = ".built"
BUILD_TIMEOUT_S = 900
LOCK_TIMEOUT_S = 2 * BUILD_TIMEOUT_S
#: What enroot's build needs beyond the host's gcc: the flags measured on Debian 12.
ENROOT_MAKE_ARGS = (
    "FORCE_GLIBC=y",
    "LDLIBS=-l:libbsd.a -lmd",
    "CPPFLAGS=-D_GNU_SOURCE -include bsd/string.h -include bsd/stdlib.h "
    "-include bsd/unistd.h -include bsd/err.h",
    "CFLAGS=-std=gnu99 -O2 -fPIE -w",
)
#: Pyxis's settings: job-scoped container names, so a job's epilog removes its containers.
PYXIS_OPTIONS = ("container_scope=job",)


def default_vendor_dir() -> str:
    """``<project>/../shared/vendor``: beside the checkout, where the tarballs are kept."""
    project = os.path.dirname(os.path.dirname(os.path.abspath(proc.__file__)))
    return os.path.join(os.path.dirname(project), "shared", "vendor")


def vendor_dir() -> str:
    return os.path.abspath(os.environ.get(VENDOR_ENV) or default_vendor_dir())


def tarballs(vendor: str | None = None) -> tuple[str, str]:
    """The enroot and pyxis tarballs; SandboxError naming every missing one."""
    where = vendor or vendor_dir()
    paths = (os.path.join(where, f"enroot-{ENROOT_VERSION}.tar.gz"),
             os.path.join(where, f"pyxis-{PYXIS_VERSION}.tar.gz"))
    missing = [p for p in paths if not os.path.isfile(p)]
    if missing:
        raise SandboxError(f"--pyxis builds enroot and pyxis from their release tarballs; "
                           f"missing: {', '.join(missing)} (set ${VENDOR_ENV} to the "
                           "directory that holds them)")
    return paths


@dataclass(frozen=True)
class Build:
    """Where the cached builds live."""

    cache: str
    release: str = roots.HOST_RELEASE

    @property
    def enroot_prefix(self) -> str:
        return os.path.join(self.cache, "enroot", ENROOT_VERSION)

    @property
    def enroot(self) -> str:
        return os.path.join(self.enroot_prefix, "bin", "enroot")

    @property
    def pyxis_dir(self) -> str:
        return os.path.join(self.cache, "pyxis", PYXIS_VERSION, f"slurm-{self.release}")

    @property
    def plugin(self) -> str:
        return os.path.join(self.pyxis_dir, "spank_pyxis.so")

    @property
    def lock(self) -> str:
        return os.path.join(self.cache, "enroot-pyxis.lock")

    @property
    def log(self) -> str:
        return os.path.join(self.cache, "enroot-pyxis.log")

    def built(self) -> bool:
        return all(os.path.exists(os.path.join(d, MARKER))
                   for d in (self.enroot_prefix, self.pyxis_dir))


def build_for(release: str) -> Build:
    if roots.in_root(release):
        raise ValueError(f"--pyxis runs only with the host's Slurm {roots.HOST_RELEASE} "
                         f"(pyxis would need Slurm {release}'s spank.h)")
    return Build(roots.cache_dir(), release)


def ensure_built(build: Build, vendor: str | None = None) -> Build:
    """Build enroot and pyxis into the cache unless they are there. Under a file lock: two
    first builds never collide, and the second finds the first's result."""
    if build.built():
        return build
    enroot_tar, pyxis_tar = tarballs(vendor)
    os.makedirs(build.cache, exist_ok=True)
    try:
        with filelock.FileLock(build.lock, timeout=LOCK_TIMEOUT_S):
            if not os.path.exists(os.path.join(build.enroot_prefix, MARKER)):
                _build_enroot(build, enroot_tar)
            if not os.path.exists(os.path.join(build.pyxis_dir, MARKER)):
                _build_pyxis(build, pyxis_tar)
    except filelock.Timeout as e:
        raise SandboxError(f"another enroot/pyxis build holds {build.lock} for over "
                           f"{LOCK_TIMEOUT_S}s") from e
    return build


def _unpack(tar_path: str, into: str) -> str:
    """Unpack a release tarball into `into`; return its one top directory."""
    with tarfile.open(tar_path) as tar:
        tar.extractall(into, filter="data")
    tops = os.listdir(into)
    if len(tops) != 1:
        raise SandboxError(f"{tar_path} does not hold one top directory: {tops}")
    return os.path.join(into, tops[0])


def _make(build: Build, argv: list[str], cwd: str) -> None:
    """Run one build step, its output appended to the build log."""
    try:
        res = proc.run(argv, cwd=cwd, timeout=BUILD_TIMEOUT_S,
                       env=proc.clean_env(drop_prefixes=("SLURM_", "MAKE")))
        _log(build, argv, res.stdout + res.stderr)
    except proc.CommandError as e:
        _log(build, argv, e.stdout + e.stderr)
        raise SandboxError(f"{' '.join(argv[:2])} failed: {str(e)[-2000:]}\n"
                           f"log: {build.log}") from e


def _log(build: Build, argv: list[str], text: str) -> None:
    with open(build.log, "a") as f:
        f.write(f"$ {' '.join(argv)}\n{text}\n")


def _build_enroot(build: Build, tar_path: str) -> None:
    """Enroot with the host's glibc, installed at its final prefix (the script embeds it)."""
    makeself = shutil.which("makeself")
    if makeself is None:
        raise SandboxError("makeself: command not found (apt-get install makeself)")
    shutil.rmtree(build.enroot_prefix, ignore_errors=True)
    with tempfile.TemporaryDirectory(prefix="rsp-enroot-", dir=build.cache) as tmp:
        src = _unpack(tar_path, tmp)
        dist = os.path.join(src, "deps", "dist")
        for d in ("makeself/bin", "libbsd", "linux/include"):
            os.makedirs(os.path.join(dist, d), exist_ok=True)
        os.symlink(makeself, os.path.join(dist, "makeself", "bin", "enroot-makeself"))
        _make(build, ["make", *ENROOT_MAKE_ARGS, "-o", "deps", "install",
                      f"prefix={build.enroot_prefix}"], src)
    _mark(build.enroot_prefix)


def _build_pyxis(build: Build, tar_path: str) -> None:
    """spank_pyxis.so against the host's spank.h."""
    os.makedirs(build.pyxis_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="rsp-pyxis-", dir=build.cache) as tmp:
        src = _unpack(tar_path, tmp)
        _make(build, ["make"], src)
        shutil.copy(os.path.join(src, "spank_pyxis.so"), build.plugin)
    os.chmod(build.plugin, 0o755)
    _mark(build.pyxis_dir)


def _mark(directory: str) -> None:
    with open(os.path.join(directory, MARKER), "w") as f:
        f.write("ok\n")


# -- one sandbox's wiring --------------------------------------------------------------------

def render_wrapper(layout: Layout, build: Build) -> str:
    """The ``enroot`` on slurmd's PATH and the users' (env.sh): the cached enroot with this
    sandbox's per-user paths. A path the caller set already wins."""
    lines = ["#!/bin/sh",
             "# Generated by ray_slurm_provider.sandbox: the cached enroot with the sandbox's",
             "# paths. Pyxis runs enroot with no environment but PATH, so they are set here.",
             f"base={shlex.quote(layout.enroot_local_dir)}",
             "u=$(/usr/bin/id -un)"]
    for key, sub in (("RUNTIME", "run"), ("CACHE", "cache"), ("DATA", "data")):
        lines.append(f': "${{ENROOT_{key}_PATH:=$base/{sub}/$u}}"')
    lines += ["export ENROOT_RUNTIME_PATH ENROOT_CACHE_PATH ENROOT_DATA_PATH",
              # Its own dir, where the helpers are linked (`helpers`), never the cache's:
              # PATH reaches the containers (and the worker jobs a head's sbatch submits),
              # where `enroot` must still be this wrapper.
              f'PATH={shlex.quote(layout.enroot_bin_dir)}:"${{PATH:-/usr/bin:/bin}}"',
              "export PATH",
              f'exec {shlex.quote(build.enroot)} "$@"']
    return "\n".join(lines) + "\n"


def helpers(build: Build) -> list[str]:
    """The cached enroot's helper programs (enroot-mount, ...), which it runs from PATH."""
    bindir = os.path.dirname(build.enroot)
    names = os.listdir(bindir) if os.path.isdir(bindir) else []
    return sorted(os.path.join(bindir, n) for n in names if n.startswith("enroot-"))


def render_node_entry(layout: Layout) -> str:
    """slurmd's entry script: ``unshare --mount --propagation private sh SCRIPT NODE
    SLURMD...`` shows the sandbox's enroot in /usr/local/bin and binds NODE's storage over
    ``enroot/local`` (see the module's docstring), then runs slurmd, whose jobs and epilogs
    inherit the namespace."""
    if any(c in layout.enroot_bin_dir for c in ":,"):
        raise SandboxError(f"--pyxis needs a state dir without ':' or ',' (an overlay "
                           f"option names it): {layout.root}")
    lower = shlex.quote(f"lowerdir={layout.enroot_bin_dir}:/usr/local/bin")
    nodes = shlex.quote(os.path.join(layout.enroot_dir, "nodes"))
    local = shlex.quote(layout.enroot_local_dir)
    return f"""#!/bin/sh
# Generated by ray_slurm_provider.sandbox: slurmd with the sandbox's enroot in /usr/local/bin,
# where pyxis's job epilog looks for it, and the node's own enroot storage, in slurmd's own
# mount namespace.
set -e
node=$1
shift
mount -t overlay rsp-enroot -o {lower} /usr/local/bin
mount --bind {nodes}/"$node" {local}
exec "$@"
"""


def render_plugstack(layout: Layout) -> str:
    """plugstack.conf: the state dir's copy of pyxis, its runtime dir in the state dir."""
    options = " ".join([f"runtime_path={layout.pyxis_runtime_dir}", *PYXIS_OPTIONS])
    return ("# Generated by ray_slurm_provider.sandbox.\n"
            f"required {layout.pyxis_plugin} {options}\n")
