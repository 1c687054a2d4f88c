"""Driving real `ray up` / `ray down` / `ray job submit` against the sandbox from tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from ray_slurm_provider.ports import port_block
from ray_slurm_provider.state import ClusterDir

ROOT = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
RAY = str(VENV_BIN / "ray")


def wait_for(cond: Callable[[], Any], timeout: float, what: str, every: float = 1.0) -> Any:
    """Poll `cond` until it returns something truthy; fail with `what` after `timeout`."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = cond()
        if last:
            return last
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what} (last: {last!r})")


def squeue(name: str) -> list[tuple[str, str]]:
    """(job id, state) of every job named `name`, straight from squeue."""
    out = subprocess.run(["squeue", "--noheader", f"--name={name}", "--format=%i %T"],
                         capture_output=True, text=True, timeout=30, check=True).stdout
    return [tuple(line.split()[:2]) for line in out.splitlines() if line.strip()]  # type: ignore[misc]


class RayCluster:
    """One cluster config on disk plus the commands a user would run against it."""

    def __init__(self, tmp: Path, name: str, config: dict[str, Any]) -> None:
        self.name = name
        self.state_dir = tmp / "state"
        config = json.loads(json.dumps(config))
        config["cluster_name"] = name
        config["provider"]["state_dir"] = str(self.state_dir)
        self.path = tmp / f"{name}.yaml"
        self.path.write_text(yaml.safe_dump(config))
        self.cdir = ClusterDir(str(self.state_dir), name)
        self.ports = port_block(name, config["provider"].get("ports", {}).get("base"))
        self.log = tmp / f"{name}.log"

    @staticmethod
    def from_file(tmp: Path, name: str, path: Path, **overrides: Any) -> RayCluster:
        config = yaml.safe_load(path.read_text())
        for k, v in overrides.items():
            config[k] = v
        return RayCluster(tmp, name, config)

    def env(self, **extra: str) -> dict[str, str]:
        env = dict(os.environ)
        env["PATH"] = f"{VENV_BIN}:{env.get('PATH', '')}"
        env["RAY_AUTH_MODE"] = "token"
        env["RAY_AUTH_TOKEN_PATH"] = str(self.cdir.root / "auth_token")
        env.update(extra)
        return env

    def ray(self, *args: str, timeout: float = 600, check: bool = True,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        cp = subprocess.run([RAY, *args], capture_output=True, text=True, timeout=timeout,
                            env=env or self.env(), stdin=subprocess.DEVNULL, cwd=ROOT)
        with self.log.open("a") as f:
            f.write(f"$ ray {' '.join(args)}\n{cp.stdout}\n{cp.stderr}\nexit {cp.returncode}\n")
        if check and cp.returncode != 0:
            raise AssertionError(
                f"ray {' '.join(args)} failed ({cp.returncode}):\n{cp.stdout[-3000:]}\n"
                f"{cp.stderr[-3000:]}\n{self.job_logs()}")
        return cp

    def up(self, **env: str) -> float:
        t0 = time.monotonic()
        self.ray("up", "-y", "--no-config-cache", str(self.path), env=self.env(**env))
        return time.monotonic() - t0

    def down(self) -> float:
        t0 = time.monotonic()
        self.ray("down", "-y", str(self.path), check=False)
        return time.monotonic() - t0

    def head(self) -> dict[str, Any]:
        info = self.cdir.read_head()
        assert info, f"no head info in {self.cdir.head_file}"
        return info.to_dict()

    @property
    def dashboard(self) -> str:
        h = self.head()
        return f"http://{h['ip']}:{h['dashboard_port']}"

    def submit(self, script: str, timeout: float = 300) -> str:
        """`ray job submit` a Python snippet; return its output."""
        cp = self.ray("job", "submit", "--address", self.dashboard, "--", "python", "-c",
                      script, timeout=timeout)
        assert "succeeded" in cp.stdout, cp.stdout
        return cp.stdout

    def jobs(self) -> list[tuple[str, str]]:
        return squeue(f"ray-{self.name}")

    def job_logs(self) -> str:
        out = []
        for p in sorted(self.cdir.logs.glob("*.out")) if self.cdir.logs.is_dir() else []:
            out.append(f"--- {p.name}\n{p.read_text()[-2500:]}")
        return "\n".join(out)

    def cleanup(self) -> None:
        """Last resort after a failed test: cancel whatever the cluster still has."""
        ids = [j for j, _ in self.jobs()]
        if ids:
            subprocess.run(["scancel", *ids], timeout=30, check=False)
