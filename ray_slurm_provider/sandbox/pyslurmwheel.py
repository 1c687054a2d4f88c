"""pyslurm for the sandbox (``sandbox up --slurm 25.11 --pyslurm``): a wheel built once from
PyPI's sdist against a Slurm built from source, cached, and installed into the Python that
runs ``ray-slurm``.

Findings on this machine (testbed.md, "Slurm 25.11 from source and pyslurm 25.11") that
shaped it:

- PyPI has pyslurm 25.11.x only, and its setup refuses a Slurm whose ``slurm_version.h`` is
  not 25.11: any other release is refused here first, with that reason.
- The wheel links libslurm by rpath (``SLURM_LIB_DIR``): it belongs to one Slurm install
  dir, so the cache is keyed by that dir, and no LD_LIBRARY_PATH is needed.
- ``import pyslurm`` reads the Slurm config at once and exits the process ("Could not
  establish a configuration source") when no slurm.conf is reachable; ``env.sh`` sets
  SLURM_CONF, and the provider's pyslurm back end imports it in a child process first.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from importlib import metadata

import filelock

from ray_slurm_provider import proc
from ray_slurm_provider.sandbox.procs import SandboxError
from ray_slurm_provider.sandbox.source import Install, log_text, logged_step

#: Slurm release -> the pyslurm release built against it (PyPI has no other).
VERSIONS: dict[str, str] = {"25.11": "25.11.2"}
BUILD_TIMEOUT_S = 1800
LOCK_TIMEOUT_S = 2 * BUILD_TIMEOUT_S


def check_release(release: str) -> str:
    """The pyslurm version for `release`; ValueError saying why there is none."""
    if release not in VERSIONS:
        raise ValueError(f"--pyslurm: pyslurm X.Y builds only against Slurm X.Y, and PyPI has "
                         f"pyslurm {', '.join(VERSIONS.values())} only; choose --slurm "
                         f"{' or '.join(VERSIONS)} (this sandbox runs Slurm {release})")
    return VERSIONS[release]


@dataclass(frozen=True)
class Wheel:
    """Where the wheel built against one Slurm install dir is cached."""

    install: Install

    @property
    def version(self) -> str:
        return check_release(self.install.release)

    @property
    def dir(self) -> str:
        # Keyed by the install dir it links by rpath, and by the Python it was built for.
        key = hashlib.sha256(self.install.prefix.encode()).hexdigest()[:12]
        tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
        return os.path.join(self.install.cache, "pyslurm", self.version, f"{key}-{tag}")

    @property
    def lock(self) -> str:
        return self.dir + ".lock"

    @property
    def log(self) -> str:
        return self.dir + ".log"

    def path(self) -> str | None:
        """The cached wheel file, or None before it is built."""
        found = sorted(glob.glob(os.path.join(self.dir, "pyslurm-*.whl")))
        return found[0] if found else None


def ensure_installed(install: Install) -> str:
    """Build the wheel unless cached, install it into this Python unless it is the one
    installed; return the wheel's path."""
    wheel = Wheel(install)
    path = wheel.path() or _build_locked(wheel)
    if _installed_from() != path:
        _pip(wheel, ["install", "--no-deps", "--force-reinstall", path])
    return path


def _installed_from() -> str:
    """The wheel file the installed pyslurm came from ("" if none, or another source)."""
    try:
        text = metadata.distribution("pyslurm").read_text("direct_url.json") or "{}"
    except metadata.PackageNotFoundError:
        return ""
    url = str(json.loads(text).get("url", ""))
    return url.removeprefix("file://")


def _build_locked(wheel: Wheel) -> str:
    os.makedirs(os.path.dirname(wheel.dir), exist_ok=True)
    try:
        with filelock.FileLock(wheel.lock, timeout=LOCK_TIMEOUT_S):
            return wheel.path() or _build(wheel)
    except filelock.Timeout as e:
        raise SandboxError(f"another pyslurm build holds {wheel.lock} for over "
                           f"{LOCK_TIMEOUT_S}s") from e


def _build(wheel: Wheel) -> str:
    """``pip wheel pyslurm==X`` against the install's headers and libslurm, in a temporary
    dir renamed into place: a killed build leaves nothing."""
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="rsp-pyslurm-",
                                     dir=os.path.dirname(wheel.dir)) as tmp:
        out = os.path.join(tmp, "wheel")
        _pip(wheel, ["wheel", "--no-deps", "--no-binary", "pyslurm", "-w", out,
                     f"pyslurm=={wheel.version}"])
        shutil.rmtree(wheel.dir, ignore_errors=True)
        os.replace(out, wheel.dir)
    path = wheel.path()
    if path is None:
        raise SandboxError(f"pip wheel pyslurm=={wheel.version} wrote no wheel; log: {wheel.log}")
    log_text(wheel.log, ["# built"], f"{path} in {time.monotonic() - t0:.0f}s")
    return path


def _pip(wheel: Wheel, args: list[str]) -> None:
    env = proc.clean_env(drop_prefixes=("SLURM_",),
                         extra={"SLURM_LIB_DIR": wheel.install.lib_dir,
                                "SLURM_INCLUDE_DIR": wheel.install.include_dir})
    logged_step([sys.executable, "-m", "pip", *args], wheel.log,
                f"pip {args[0]} pyslurm=={wheel.version}", env)
