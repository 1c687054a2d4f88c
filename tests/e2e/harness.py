"""Driving real `ray up` / `ray down` / `ray job submit` against the sandbox from tests, and
reading what the cluster's Ray logged.

`bench/common.py` builds its `Cluster` on `RayCluster` (run as `python -m bench.<name>` from
the repository root, so `tests.e2e` imports there as it does under pytest).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import yaml

from ray_slurm_provider.jobs import job_name, temp_dir
from ray_slurm_provider.ports import port_block
from ray_slurm_provider.sandbox import Sandbox, SandboxError
from ray_slurm_provider.state import ClusterDir

ROOT = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
RAY = str(VENV_BIN / "ray")
#: Ray 2.60's v2 monitor re-reads the cluster config once per autoscaler iteration and warns
#: about these legacy fields each time: one line per tick (a regex and a plain substring).
TICK_MARK = "Dropping the empty legacy field head_node"
#: Ray's own autoscaler tick (tests/conftest.py makes the test clusters' faster), for the
#: clusters whose tests count ticks: `cluster.extra_env.update(RAY_DEFAULT_TICK)`.
RAY_DEFAULT_TICK = {"AUTOSCALER_UPDATE_INTERVAL_S": "5"}


def apis() -> list[str]:
    """The transports besides the CLI a cluster of this sandbox can use: rest; pyslurm too on
    a sandbox started with --pyslurm (known at collection: CI starts the sandbox before
    pytest, and a skip there is a failure)."""
    try:
        pyslurm = Sandbox.from_state_dir().spec.pyslurm
    except (SandboxError, ValueError, OSError):
        pyslurm = False
    return ["rest", *(["pyslurm"] if pyslurm else [])]


_LOG_TS = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3})")


def wait_for(cond: Callable[[], Any], timeout: float, what: str, every: float = 1.0,
             error: type[Exception] = AssertionError) -> Any:
    """Poll `cond` until it returns something truthy; raise `error` naming `what` after
    `timeout`."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = cond()
        if last:
            return last
        time.sleep(every)
    raise error(f"timed out after {timeout:.0f}s waiting for {what} (last: {last!r})")


def squeue(name: str, env: dict[str, str] | None = None) -> list[tuple[str, str]]:
    """(job id, state) of every job named `name`, straight from squeue."""
    out = subprocess.run(["squeue", "--noheader", f"--name={name}", "--format=%i %T"],
                         capture_output=True, text=True, timeout=30, check=True,
                         env=env).stdout
    return [tuple(line.split()[:2]) for line in out.splitlines() if line.strip()]  # type: ignore[misc]


def log_lines(path: Path, since: float, pattern: str = "") -> list[tuple[float, str]]:
    """Timestamped lines of a Ray log at or after `since` that match `pattern`."""
    out = []
    rx = re.compile(pattern)
    for line in path.read_text(errors="replace").splitlines():
        m = _LOG_TS.match(line)
        if not m:
            continue
        t = time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")) + int(m.group(2)) / 1e3
        if t >= since and rx.search(line):
            out.append((t, line))
    return out


class RayCluster:
    """One cluster config on disk (`tmp/<name>.yaml`, state in `tmp/state`) plus the commands
    a user would run against it. A failed command or a missing head raises `failure`."""

    failure: type[Exception] = AssertionError
    #: Seconds one `ray` command may take unless the call says otherwise.
    ray_timeout: float = 600
    #: The `ray` CLI the commands run (a subclass may use another Python environment).
    ray_bin: str = RAY

    def __init__(self, tmp: Path, name: str, config: dict[str, Any],
                 state_dir: Path | None = None) -> None:
        self.name = name
        self.state_dir = state_dir or tmp / "state"
        config = json.loads(json.dumps(config))
        config["cluster_name"] = name
        config["provider"]["state_dir"] = str(self.state_dir)
        tmp.mkdir(parents=True, exist_ok=True)
        self.path = tmp / f"{name}.yaml"
        self.path.write_text(yaml.safe_dump(config))
        self.cdir = ClusterDir(str(self.state_dir), name)
        self.ports = port_block(name, config["provider"].get("ports", {}).get("base"))
        self.log = tmp / f"{name}.log"
        self.auth_mode = config["provider"].get("auth", {}).get("mode", "token")
        #: Variables every command of the cluster gets on top of `base_env` (e.g. the
        #: defaults files, RAY_SLURM_DEFAULTS).
        self.extra_env: dict[str, str] = {}

    @staticmethod
    def from_file(tmp: Path, name: str, path: Path, **overrides: Any) -> RayCluster:
        config = yaml.safe_load(path.read_text())
        for k, v in overrides.items():
            config[k] = v
        return RayCluster(tmp, name, config)

    @property
    def job_name(self) -> str:
        return job_name(self.name)

    @property
    def token_path(self) -> Path:
        return self.cdir.root / "auth_token"

    def token(self) -> str | None:
        try:
            return self.token_path.read_text().strip()
        except OSError:
            return None

    def base_env(self) -> dict[str, str]:
        """The environment the cluster's commands start from: ours, the venv first on PATH."""
        env = dict(os.environ)
        env["PATH"] = f"{VENV_BIN}:{env.get('PATH', '')}"
        return env

    def env(self, **extra: str) -> dict[str, str]:
        """What `ray-slurm env` exports for the cluster's auth mode, on top of `base_env`."""
        env = self.base_env()
        env["RAY_AUTH_MODE"] = self.auth_mode
        if self.auth_mode == "token":
            env["RAY_AUTH_TOKEN_PATH"] = str(self.token_path)
        env.update(self.extra_env)
        env.update(extra)
        return env

    def ray(self, *args: str, timeout: float | None = None, check: bool = True,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        t0 = time.monotonic()
        cp = subprocess.run([self.ray_bin, *args], capture_output=True, text=True,
                            timeout=self.ray_timeout if timeout is None else timeout,
                            env=env or self.env(), stdin=subprocess.DEVNULL, check=False,
                            **self.run_as())
        with self.log.open("a") as f:
            f.write(f"$ ray {' '.join(args)}  # {time.monotonic() - t0:.1f}s exit "
                    f"{cp.returncode}\n{cp.stdout}\n{cp.stderr}\n")
        if check and cp.returncode != 0:
            raise self.failure(
                f"ray {' '.join(args)} failed ({cp.returncode}):\n{cp.stdout[-3000:]}\n"
                f"{cp.stderr[-3000:]}\n{self.job_logs()}")
        return cp

    def run_as(self) -> dict[str, Any]:
        """Extra `subprocess.run` arguments for the cluster's commands (who, where)."""
        return {"cwd": ROOT}

    def up_args(self) -> list[str]:
        return ["up", "-y", "--no-config-cache", str(self.path)]

    def up(self, **env: str) -> float:
        t0 = time.monotonic()
        self.ray(*self.up_args(), env=self.env(**env))
        return time.monotonic() - t0

    def down(self) -> float:
        t0 = time.monotonic()
        self.ray("down", "-y", str(self.path), check=False)
        return time.monotonic() - t0

    def head(self) -> dict[str, Any]:
        info = self.cdir.read_head()
        if not info:
            raise self.failure(f"no head info in {self.cdir.head_file}")
        return info.to_dict()

    @property
    def dashboard(self) -> str:
        h = self.head()
        return f"http://{h['ip']}:{h['dashboard_port']}"

    def monitor_log(self) -> Path:
        """The head autoscaler's log (in the head's temp dir, gone when its job ends)."""
        return Path(temp_dir("/tmp", str(self.head()["job_id"]))) / \
            "session_latest" / "logs" / "monitor.log"

    def submit(self, script: str, timeout: float = 300) -> str:
        """`ray job submit` a Python snippet; return its output."""
        cp = self.ray("job", "submit", "--address", self.dashboard, "--", "python", "-c",
                      script, timeout=timeout)
        assert "succeeded" in cp.stdout, cp.stdout
        return cp.stdout

    def jobs(self) -> list[tuple[str, str]]:
        return squeue(self.job_name, self.env())

    def job_logs(self) -> str:
        out = []
        for p in sorted(self.cdir.logs.glob("*.out")) if self.cdir.logs.is_dir() else []:
            out.append(f"--- {p.name}\n{p.read_text()[-2500:]}")
        return "\n".join(out)

    def cleanup(self) -> None:
        """Last resort after a failed run: cancel whatever the cluster still has."""
        ids = [j for j, _ in self.jobs()]
        if ids:
            subprocess.run(["scancel", *ids], timeout=30, check=False, env=self.env())


@contextlib.contextmanager
def brought_up(cluster: RayCluster) -> Iterator[float]:
    """`ray up` (yields the seconds it took); then, whatever the tests did, `ray down` and
    whatever the cluster still has cancelled."""
    try:
        yield cluster.up()
    finally:
        cluster.down()
        cluster.cleanup()


def printed(out: str, tag: str) -> list[str]:
    """The words after `tag` on the first line of `out` that starts with it (what a job's
    entrypoint printed, e.g. `print('NODES', a, b)`)."""
    line = next(x for x in out.splitlines() if x.startswith(tag + " "))
    return line.split()[1:]
