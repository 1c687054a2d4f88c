"""Driving Ray clusters as the sandbox's throwaway Unix users (``sandbox up --users N``).

The test process is root; every command of a `UserCluster` runs as its user, from the user's
home, with a login-like environment (no root variables) and the user's groups. The users
cannot run root's Python (it may live under a 0700 home), so `user_venv` installs this
checkout and the same Ray into the sandbox's shared software dir with Debian's Python.
Installing Ray takes about a minute: `prepare_user_venv` starts it in the background when the
session's sandbox starts, so the tests that need it find it ready.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import ray
import yaml

from ray_slurm_provider.sandbox import Sandbox
from ray_slurm_provider.sandbox.users import SandboxUser
from tests.e2e.harness import ROOT, RayCluster


def _pip(venv: Path, *args: str) -> None:
    cp = subprocess.run([str(venv / "bin" / "pip"), "install", "-q",
                         "--disable-pip-version-check", *args],
                        capture_output=True, text=True, timeout=900, check=False)
    if cp.returncode != 0:
        raise AssertionError(f"pip install {' '.join(args)} failed:\n{cp.stderr[-3000:]}")


#: The users' Ray install, started at most once per venv path (a session may see one sandbox).
_BUILDS: dict[Path, Future[None]] = {}
_POOL = ThreadPoolExecutor(max_workers=1, thread_name_prefix="user-venv")


def _venv_path(sb: Sandbox) -> Path:
    return Path(sb.layout.shared_dir) / "venv"


def _with_ray(venv: Path) -> None:
    """Debian's python3.X (the test's minor version) with the test's Ray version, built once
    per Ray version."""
    python = f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}"
    if not os.access(python, os.X_OK):
        raise AssertionError(f"{python} is missing: the sandbox users need a Python of the "
                             "test's version outside root's home (apt-get install python3)")
    stamp = venv / "ray-version"
    if not stamp.is_file() or stamp.read_text() != ray.__version__:
        shutil.rmtree(venv, ignore_errors=True)
        subprocess.run([python, "-m", "venv", str(venv)], check=True, timeout=300)
        _pip(venv, f"ray[default]=={ray.__version__}")
        stamp.write_text(ray.__version__)


def prepare_user_venv(sb: Sandbox) -> None:
    """Start installing Ray for the users in the background; `user_venv` waits for it."""
    venv = _venv_path(sb)
    if venv not in _BUILDS:
        _BUILDS[venv] = _POOL.submit(_with_ray, venv)


def user_venv(sb: Sandbox) -> Path:
    """A Python environment every sandbox user can run: Debian's python3.X, the test's Ray
    version, and this checkout's package (reinstalled every call, so the users run the code
    under test)."""
    prepare_user_venv(sb)
    venv = _venv_path(sb)
    _BUILDS[venv].result()  # an error of the background build is raised here, in the test
    _pip(venv, "--no-deps", "--force-reinstall", str(ROOT))
    # The package's own requirements (psutil, filelock, ...) as the test's environment has
    # them installed: the checkout may need more than the venv was built with.
    deps = [d for d in importlib.metadata.requires("ray-slurm-provider") or []
            if "extra ==" not in d and not d.startswith("ray[")]
    _pip(venv, *deps)
    return venv


def chown_tree(path: Path, user: SandboxUser) -> None:
    for p in [path, *path.rglob("*")]:
        os.chown(p, user.uid, user.gid)


class UserCluster(RayCluster):
    """A `RayCluster` whose commands run as `user`, with its state in the user's default
    ``~/.ray_slurm``."""

    def __init__(self, user: SandboxUser, venv: Path, name: str, config: dict[str, Any],
                 sandbox_env: dict[str, str]) -> None:
        self.user = user
        self.venv = venv
        self.sandbox_env = sandbox_env
        home = Path(user.home)
        work = home / f"work-{name}"
        super().__init__(work, name, config, state_dir=home / ".ray_slurm")
        self.ray_bin = str(venv / "bin" / "ray")
        chown_tree(work, user)

    def base_env(self) -> dict[str, str]:
        """What a login shell of the user has, plus the sandbox's SLURM_CONF and DOCKER_HOST
        (never root's token or variables)."""
        path = f"{self.venv / 'bin'}:/usr/local/bin:/usr/bin:/bin"
        if "PATH" in self.sandbox_env:  # a release in a root: its client wrappers first
            path = f"{self.sandbox_env['PATH'].split(os.pathsep)[0]}:{path}"
        env = {"HOME": self.user.home, "USER": self.user.name, "LOGNAME": self.user.name,
               "PATH": path, "LANG": "C.UTF-8", "SLURM_CONF": self.sandbox_env["SLURM_CONF"]}
        if "DOCKER_HOST" in self.sandbox_env:
            env["DOCKER_HOST"] = self.sandbox_env["DOCKER_HOST"]
        return env

    def run_as(self) -> dict[str, Any]:
        return {"cwd": self.user.home, "user": self.user.uid, "group": self.user.gid,
                "extra_groups": os.getgrouplist(self.user.name, self.user.gid)}

    def run(self, argv: list[str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """Any command as the user, in the cluster's environment."""
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                              env=self.env(), stdin=subprocess.DEVNULL, check=False,
                              **self.run_as())

    def python(self, code: str, timeout: float = 120) -> Any:
        """Run `code` with the user's Python; it prints one JSON value, which is returned."""
        cp = self.run([str(self.venv / "bin" / "python"), "-c", code], timeout)
        if cp.returncode != 0:
            raise AssertionError(f"as {self.user.name}: {cp.stderr[-3000:]}")
        return json.loads(cp.stdout.strip().splitlines()[-1])

    def jobs(self) -> list[tuple[str, str]]:
        """(job id, state) of this user's jobs of the cluster: both users' clusters share the
        job name."""
        out = subprocess.run(["squeue", "--noheader", f"--name={self.job_name}",
                              f"--user={self.user.name}", "--format=%i %T"],
                             capture_output=True, text=True, timeout=30, check=True,
                             env={**os.environ, **self.sandbox_env}).stdout
        return [(ln.split()[0], ln.split()[1]) for ln in out.splitlines() if ln.strip()]


def load_config(path: Path, **overrides: Any) -> dict[str, Any]:
    config: dict[str, Any] = yaml.safe_load(path.read_text())
    config.update(overrides)
    return config
