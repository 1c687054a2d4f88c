"""Slurm releases built from source (``sandbox up --slurm 25.11``): configured, built and
installed once into the cache dir, then run on the host like its own packages.

No Debian release ships 25.11 (and PyPI's pyslurm builds only against it). Its release source
(a ``git archive`` of SchedMD's tag) sits in the vendor dir (``$RAY_SLURM_VENDOR_DIR``, default
``<project>/../shared/vendor``). Findings on this machine (testbed.md, "Slurm 25.11 from
source") that shaped the build:

- It is a prefix install linking the host's libraries (munge, json-c, yaml, jwt, http-parser,
  mariadb): no Debian root and no ``pivot_root`` are needed; the daemons run on the host
  from ``<prefix>/sbin`` and ``env.sh`` puts ``<prefix>/bin`` first on PATH.
- The prefix is compiled in (plugin dir, rpath of libslurm), so the build installs with
  ``DESTDIR`` into a temporary dir beside the final one and is renamed into place only once
  its slurmctld says the expected release: a killed build leaves nothing half-made.
- With ``libjwt-dev`` and ``libhttp-parser-dev`` configure builds slurmrestd with JWT auth;
  with ``libmariadb-dev`` slurmdbd gets its MySQL storage plugin.
"""

from __future__ import annotations

import os
import shutil
import tarfile
import tempfile
import time
from dataclasses import dataclass

import filelock

from ray_slurm_provider import proc
from ray_slurm_provider.sandbox import pyxis, roots
from ray_slurm_provider.sandbox.procs import SandboxError

#: Release -> the patch release whose tarball the vendor dir holds.
VERSIONS = roots.SOURCE
#: Written last into a finished install: an install without it is never used.
MARKER = ".built"
BUILD_TIMEOUT_S = 1800
LOCK_TIMEOUT_S = 2 * BUILD_TIMEOUT_S
#: --enable-multiple-slurmd: the sandbox runs all its slurmd on one host (as Debian's packages
#: are built). Without it 25.11 keeps one node per NodeHostname in its address table
#: ("Duplicated NodeHostName localhost"): the first start works, as each slurmd registers
#: itself, but a restarted slurmctld cannot reach the others ("_fwd_tree_get_addr: can't find
#: address for host n2") and they stay "unk*".
CONFIGURE_ARGS = ("--disable-debug", "--without-hdf5", "--enable-multiple-slurmd")
#: Installed daemons the sandbox runs (the clients come from bin/).
DAEMONS = ("slurmctld", "slurmd", "slurmrestd", "slurmdbd", "slurmstepd")


def tarball(release: str, vendor: str | None = None) -> str:
    """The release tarball; SandboxError naming it when it is missing."""
    path = os.path.join(vendor or pyxis.vendor_dir(), f"slurm-{VERSIONS[release]}.tar.gz")
    if not os.path.isfile(path):
        raise SandboxError(f"--slurm {release} builds Slurm from its release tarball; "
                           f"missing: {path} (set ${pyxis.VENDOR_ENV} to the directory "
                           "that holds it)")
    return path


@dataclass(frozen=True)
class Install:
    """Where one release's cached install lives."""

    cache: str
    release: str

    @property
    def version(self) -> str:
        return VERSIONS[self.release]

    @property
    def prefix(self) -> str:
        return os.path.join(self.cache, "slurm", self.version)

    @property
    def bin_dir(self) -> str:
        return os.path.join(self.prefix, "bin")

    @property
    def lib_dir(self) -> str:
        return os.path.join(self.prefix, "lib")

    @property
    def include_dir(self) -> str:
        return os.path.join(self.prefix, "include")

    def sbin(self, name: str) -> str:
        return os.path.join(self.prefix, "sbin", name)

    @property
    def lock(self) -> str:
        return os.path.join(self.cache, f"slurm-{self.version}.lock")

    @property
    def log(self) -> str:
        return os.path.join(self.cache, f"slurm-{self.version}.log")

    def built(self) -> bool:
        """The marker is there and names this build's configure options (an install made
        with others is rebuilt)."""
        try:
            with open(os.path.join(self.prefix, MARKER)) as f:
                return f.readline().strip() == build_id(self.version)
        except OSError:
            return False


def build_id(version: str) -> str:
    return " ".join([version, *CONFIGURE_ARGS])


def install_for(release: str) -> Install:
    if not roots.from_source(release):
        raise ValueError(f"Slurm {release} is not built from source")
    return Install(roots.cache_dir(), release)


def ensure_built(install: Install, vendor: str | None = None) -> Install:
    """Build the release into the cache unless it is there. Under a file lock: two first
    builds never collide, and the second finds the first's result."""
    if install.built():
        return install
    tar_path = tarball(install.release, vendor)
    os.makedirs(os.path.dirname(install.prefix), exist_ok=True)
    try:
        with filelock.FileLock(install.lock, timeout=LOCK_TIMEOUT_S):
            if not install.built():
                _build(install, tar_path)
    except filelock.Timeout as e:
        raise SandboxError(f"another Slurm {install.version} build holds {install.lock} "
                           f"for over {LOCK_TIMEOUT_S}s") from e
    return install


def _build(install: Install, tar_path: str) -> None:
    """configure, make, make install into DESTDIR; checked, marked and renamed into place."""
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f"rsp-slurm-{install.version}-",
                                     dir=os.path.dirname(install.prefix)) as tmp:
        src = _unpack(tar_path, os.path.join(tmp, "src"))
        dest = os.path.join(tmp, "dest")
        jobs = str(max(1, os.cpu_count() or 1))
        _step(install, ["./configure", f"--prefix={install.prefix}",
                        f"--sysconfdir={install.prefix}/etc", *CONFIGURE_ARGS], src)
        _step(install, ["make", f"-j{jobs}"], src)
        _step(install, ["make", "install", f"DESTDIR={dest}"], src)
        staged = dest + install.prefix
        _check_installed(install, staged)
        with open(os.path.join(staged, MARKER), "w") as f:
            f.write(f"{build_id(install.version)}\nbuilt in {time.monotonic() - t0:.0f}s\n")
        shutil.rmtree(install.prefix, ignore_errors=True)  # an unmarked leftover
        os.replace(staged, install.prefix)
    log_text(install.log, ["# built"], f"in {time.monotonic() - t0:.0f}s")


def _check_installed(install: Install, staged: str) -> None:
    """Every daemon is there, and slurmctld reports the expected release."""
    missing = [d for d in DAEMONS if not os.path.exists(os.path.join(staged, "sbin", d))]
    if missing:
        raise SandboxError(f"Slurm {install.version} installed without {', '.join(missing)} "
                           f"(a missing build dependency? see {install.log})")
    # Its rpath names the final prefix, not yet there: libslurm and libslurmfull (in
    # lib/slurm) come from the staged copy.
    libs = [os.path.join(staged, "lib"), os.path.join(staged, "lib", "slurm")]
    env = proc.clean_env(extra={"LD_LIBRARY_PATH": ":".join(libs)})
    try:
        res = proc.run([os.path.join(staged, "sbin", "slurmctld"), "-V"], env=env, timeout=60)
    except proc.CommandError as e:
        raise SandboxError(f"the built slurmctld does not run: {e}") from e
    got = roots.parse_release(res.stdout)
    if got != install.release:
        raise SandboxError(f"{install.version}'s slurmctld says {res.stdout.strip()!r}")


def _unpack(tar_path: str, into: str) -> str:
    """Unpack the tarball into `into`; return its one top directory."""
    with tarfile.open(tar_path) as tar:
        tar.extractall(into, filter="data")
    tops = os.listdir(into)
    if len(tops) != 1:
        raise SandboxError(f"{tar_path} does not hold one top directory: {tops}")
    return os.path.join(into, tops[0])


def _step(install: Install, argv: list[str], cwd: str) -> None:
    """Run one build step, its output appended to the build log."""
    env = proc.clean_env(drop_prefixes=("SLURM_", "MAKE"))
    logged_step(argv, install.log, f"building Slurm {install.version}: {' '.join(argv[:2])}",
                env, cwd=cwd)


def logged_step(argv: list[str], log: str, what: str, env: dict[str, str],
                cwd: str | None = None) -> None:
    """Run one step of a cache build with its output appended to `log`; a failure is a
    SandboxError naming `what` and the log."""
    try:
        res = proc.run(argv, cwd=cwd, timeout=BUILD_TIMEOUT_S, env=env)
        log_text(log, argv, res.stdout[-20000:] + res.stderr[-20000:])
    except proc.CommandError as e:
        log_text(log, argv, e.stdout[-20000:] + e.stderr[-20000:])
        raise SandboxError(f"{what} failed: {str(e)[-2000:]}\nlog: {log}") from e


def log_text(log: str, argv: list[str], text: str) -> None:
    with open(log, "a") as f:
        f.write(f"$ {' '.join(argv)}\n{text}\n")
