"""Shared plumbing of the benchmarks: the sandbox's environment, a Ray cluster driven through
the real `ray up` / `ray job submit` / `ray down`, Slurm and Ray probes, and result files.

Every external command is an argv list (never a shell). Nothing here stops anything it did not
start: clusters are named `bench-*` and live on the benchmark sandbox (default
/tmp/rsp-bench, see BENCHMARKS.md), never on someone else's.

What the e2e tests also need has its one home under tests/e2e/ and is imported from there
(the scripts run as `python -m bench.<name>` from the repository root): the cluster driver
(`RayCluster`, of which `Cluster` is the benchmark flavour), `wait_for`, Ray's log lines
(harness.py) and /proc (procfs.py).
"""

from __future__ import annotations

import json
import os
import platform
import re
import socket
import statistics
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

from tests.e2e import harness
from tests.e2e.harness import ROOT, TICK_MARK, VENV_BIN, RayCluster, log_lines
from tests.e2e.procfs import PROC, pids_with, pss_kb, stat_fields

SANDBOX_DIR = Path(os.environ.get("RSP_BENCH_SANDBOX", "/tmp/rsp-bench"))
WORK = Path(os.environ.get("RSP_BENCH_WORK", "/tmp/rsp-bench-work"))
RESULTS = ROOT / "bench" / "results"


# --- environment ------------------------------------------------------------------------

def sandbox_env() -> dict[str, str]:
    """os.environ for talking to the benchmark sandbox: its env.sh, the venv first on PATH,
    and none of the caller's SLURM_*/RAY_* variables."""
    env_sh = SANDBOX_DIR / "env.sh"
    if not env_sh.exists():
        raise SystemExit(f"no sandbox at {SANDBOX_DIR}: run `ray-slurm sandbox up --state-dir "
                         f"{SANDBOX_DIR} ...` first (see BENCHMARKS.md)")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "RAY_", "DOCKER_HOST"))}
    for line in env_sh.read_text().splitlines():
        m = re.match(r"^export ([A-Z_]+)='(.*)'$", line)
        if m:
            env[m.group(1)] = m.group(2).replace("'\\''", "'")
    env["PATH"] = f"{VENV_BIN}:{env.get('PATH', '/usr/bin:/bin')}:/usr/sbin:/sbin"
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    return env


def run(argv: Sequence[str], *, env: dict[str, str] | None = None, timeout: float = 120,
        check: bool = True, input: str | None = None) -> subprocess.CompletedProcess[str]:
    cp = subprocess.run([str(a) for a in argv], capture_output=True, text=True,
                        timeout=timeout, env=env or sandbox_env(), input=input,
                        stdin=None if input is not None else subprocess.DEVNULL, check=False)
    if check and cp.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, argv))} failed ({cp.returncode}): "
                           f"{cp.stderr.strip()[-2000:]}")
    return cp


def wait_for(cond: Callable[[], Any], timeout: float, what: str, every: float = 1.0) -> Any:
    """harness.wait_for, raising TimeoutError."""
    return harness.wait_for(cond, timeout, what, every, error=TimeoutError)


# --- Slurm probes --------------------------------------------------------------------------

def squeue(name: str | None = None, job_ids: Iterable[str] = ()) -> list[dict[str, str]]:
    """Jobs (id, state, node, num) by name or id, every state squeue still shows (CG
    included), every array task on its own line; `num` is the numeric job id (%A), which
    slurmstepd and SLURM_JOB_ID use."""
    args = ["squeue", "--array", "--noheader", "--format=%i|%T|%N|%A|%j"]
    if name:
        args.append(f"--name={name}")
    ids = list(job_ids)
    if ids:
        args.append(f"--jobs={','.join(ids)}")
    cp = run(args, timeout=30, check=False)
    if cp.returncode != 0:
        if "Invalid job id" in cp.stderr:
            return []
        raise RuntimeError(cp.stderr)
    out = []
    for line in cp.stdout.splitlines():
        if line.strip():
            i, st, node, num, nm = line.split("|", 4)
            out.append({"id": i, "state": st, "node": node, "num": num, "name": nm})
    return out


def node_ip(node: str) -> str:
    """The sandbox's node nK is 127.0.0.(K+1) (ray_slurm_provider.sandbox.config)."""
    from ray_slurm_provider.sandbox.config import node_addr

    return node_addr(int(node.removeprefix("n")))


def sbatch(script: str, *args: str) -> str:
    cp = run(["sbatch", "--parsable", *args], input=script, timeout=60)
    return cp.stdout.strip().split(";")[0]


def scancel(ids: Iterable[str]) -> None:
    ids = list(ids)
    if ids:
        run(["scancel", *ids], timeout=60, check=False)


def sdiag_reset() -> None:
    run(["sdiag", "--reset"], timeout=30)


_RPC = re.compile(r"^\s*([A-Z][A-Z0-9_]+)\s+\(\s*\d+\)\s+count:(\d+)")


def sdiag_counts() -> dict[str, int]:
    """RPC counts by message type since the last reset (sdiag's own section)."""
    out = run(["sdiag"], timeout=30).stdout
    counts: dict[str, int] = {}
    section = False
    for line in out.splitlines():
        if line.startswith("Remote Procedure Call statistics by message type"):
            section = True
            continue
        if section and line.startswith("Remote Procedure Call statistics by user"):
            break
        m = _RPC.match(line) if section else None
        if m:
            counts[m.group(1)] = int(m.group(2))
    return counts


#: RPCs that only read controller state (what a listing costs). REQUEST_STATS_INFO is sdiag
#: itself and is left out.
def is_query(rpc: str) -> bool:
    return (rpc.startswith("REQUEST_") and rpc.endswith("_INFO") and rpc != "REQUEST_STATS_INFO") \
        or rpc in ("REQUEST_JOB_INFO_SINGLE", "REQUEST_NODE_INFO_SINGLE")


def ctld_log() -> Path:
    return SANDBOX_DIR / "log" / "slurmctld.log"


_CTLD_TS = re.compile(r"^\[(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3})\] (.*)$")


def ctld_events(pattern: str, since: float = 0.0) -> list[tuple[float, str]]:
    """(epoch, line) of slurmctld log lines matching `pattern` at or after `since`."""
    rx = re.compile(pattern)
    out = []
    with ctld_log().open(errors="replace") as f:
        for line in f:
            m = _CTLD_TS.match(line)
            if not m or not rx.search(m.group(2)):
                continue
            t = datetime.strptime(m.group(1), "%Y-%m-%dT%H:%M:%S.%f").timestamp()
            if t >= since:
                out.append((t, m.group(2)))
    return out


# --- Ray probes ----------------------------------------------------------------------------

def gcs_ok(ip: str, port: int) -> bool:
    try:
        with socket.create_connection((ip, port), timeout=1.0):
            return True
    except OSError:
        return False


def http_ok(url: str, token: str | None) -> bool:
    req = urllib.request.Request(url)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=2.0) as r:
            return bool(r.status == 200)
    except (urllib.error.URLError, OSError, ValueError):
        return False


def monitor_ticks(log: Path, since: float = 0.0, until: float = float("inf")) -> list[float]:
    """Epoch times of the autoscaler ticks logged in `monitor.log` within [since, until]."""
    if not log.exists():
        return []
    return [t for t, _ in log_lines(log, since, TICK_MARK) if t <= until]


# --- memory --------------------------------------------------------------------------------

def _procs() -> dict[int, tuple[int, bytes, bytes]]:
    """pid -> (parent pid, cmdline, environ) of every process we may read."""
    out = {}
    for p in PROC.iterdir():
        if not p.name.isdigit():
            continue
        try:
            ppid = int(stat_fields(p.name)[1])
            out[int(p.name)] = (ppid, (p / "cmdline").read_bytes(), (p / "environ").read_bytes())
        except (OSError, IndexError, ValueError):
            continue
    return out


def job_processes(job_ids: Iterable[str]) -> dict[str, set[int]]:
    """The processes of each job: its slurmstepds and all their descendants, plus any process
    whose environment has the job's SLURM_JOB_ID and this sandbox's SLURM_CONF (orphans
    re-parented to init). The environment alone is not enough: Ray's agents rename themselves
    (setproctitle), which overwrites /proc/<pid>/environ."""
    wanted = {str(j) for j in job_ids}
    # Job ids repeat across sandboxes on one machine: only processes of this one count.
    conf = f"SLURM_CONF={SANDBOX_DIR}/etc/slurm.conf\0".encode()
    procs = _procs()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in procs.items():
        children.setdefault(ppid, []).append(pid)
    res: dict[str, set[int]] = {j: set() for j in wanted}
    for pid, (_, cmd, environ) in procs.items():
        m = re.match(rb"slurmstepd: \[(\d+)\.", cmd)
        job = m.group(1).decode() if m else None
        if job in wanted and conf in environ:
            stack = [pid]
            while stack:
                x = stack.pop()
                res[job].add(x)
                stack += children.get(x, [])
            continue
        m = re.search(rb"(?:^|\0)SLURM_JOB_ID=(\d+)\0", environ)
        if m and m.group(1).decode() in wanted and conf in environ:
            res[m.group(1).decode()].add(pid)
    return res


def job_pss_kb(job_ids: Iterable[str]) -> dict[str, dict[str, Any]]:
    """Per job: PSS (kB), process count and CPU seconds used so far (utime + stime of the live
    processes and of the children they waited for) of its processes (`job_processes`); and
    the RSS and PSS of its node agent (M1)."""
    hz = os.sysconf("SC_CLK_TCK")
    res: dict[str, dict[str, Any]] = {}
    for job, pids in job_processes(job_ids).items():
        r = res[job] = {"pss_kb": 0, "procs": len(pids), "cpu_s": 0.0}
        for pid in pids:
            r["pss_kb"] += pss_kb(pid)
            try:
                # The agent itself, not `python -m ray_slurm_provider.agent.probe`.
                cmd = (PROC / str(pid) / "cmdline").read_bytes()
                agent = b"-m\0ray_slurm_provider.agent\0" in cmd
            except OSError:
                agent = False
            if agent:
                r["agent_rss_kb"], r["agent_pss_kb"] = pss_kb(pid, "Rss"), pss_kb(pid)
            try:
                r["cpu_s"] += sum(int(x) for x in stat_fields(pid)[11:15]) / hz
            except (OSError, IndexError, ValueError):
                pass
    return res


def daemon_pss_kb(*patterns: str) -> list[int]:
    """PSS (kB) of each process whose command line contains every pattern."""
    return [pss_kb(pid) for pid in pids_with(*patterns)]


def mem_available_mb() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) // 1024
    return 0


def job_processes_left(job_ids: Iterable[str]) -> int:
    return sum(v["procs"] for v in job_pss_kb(job_ids).values())


# --- a cluster -----------------------------------------------------------------------------

def bench_config(name: str, *, workers: int = 32, upscaling_speed: float = 1.0,
                 idle_timeout_minutes: float = 1, container: bool = False,
                 rest: bool = False) -> dict[str, Any]:
    """cluster-configs/sandbox.yaml (or sandbox-docker.yaml) with one small worker type:
    1 Ray CPU, 500 MB Ray memory, 75 MB object store, one sandbox node (1 Slurm CPU) each."""
    src = "sandbox-docker.yaml" if container else "sandbox.yaml"
    cfg: dict[str, Any] = yaml.safe_load((ROOT / "cluster-configs" / src).read_text())
    cfg["cluster_name"] = name
    cfg["provider"]["state_dir"] = str(WORK / name / "state")
    if rest:  # slurmrestd of the sandbox (RAY_SLURM_REST_URL / RAY_SLURM_JWT_FILE)
        cfg["provider"]["slurm_api"] = "rest"
    cfg["max_workers"] = workers
    cfg["upscaling_speed"] = upscaling_speed
    cfg["idle_timeout_minutes"] = idle_timeout_minutes
    types = cfg["available_node_types"]
    head_cfg = types["head"]["node_config"]
    worker_cfg: dict[str, Any] = {"partition": "cpu", "cpus": 1, "mem": "800M",
                                  "time": "2:00:00", "object_store_memory": 78643200}
    if container:
        worker_cfg["container"] = head_cfg["container"]
    cfg["available_node_types"] = {
        "head": types["head"],
        "cpu_worker": {"resources": {"CPU": 1, "memory": 500_000_000},
                       "node_config": worker_cfg, "min_workers": 0, "max_workers": workers},
    }
    return cfg


class Cluster(RayCluster):
    """A cluster of the benchmark sandbox: config, state and `commands.log` under
    WORK/<name>; its commands run in `sandbox_env()`; a failure raises RuntimeError."""

    failure = RuntimeError
    ray_timeout = 900

    def __init__(self, config: dict[str, Any]) -> None:
        name = str(config["cluster_name"])
        self.dir = WORK / name
        super().__init__(self.dir, name, config)
        self.log = self.dir / "commands.log"

    def base_env(self) -> dict[str, str]:
        return sandbox_env()

    def squeue(self) -> list[dict[str, str]]:
        """The cluster's jobs as `squeue` rows (array tasks one by one)."""
        return squeue(self.job_name)


# --- results -------------------------------------------------------------------------------

def summary(values: Sequence[float]) -> dict[str, Any]:
    vals = [round(v, 3) for v in values]
    return {"n": len(vals), "median": round(statistics.median(vals), 3) if vals else None,
            "min": min(vals) if vals else None, "max": max(vals) if vals else None,
            "values": vals}


def machine() -> dict[str, Any]:
    import ray

    mem_kb = 0
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            mem_kb = int(line.split()[1])
    model = ""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            model = line.split(":", 1)[1].strip()
            break
    # P4 needs no sandbox: then there is no Slurm release to record.
    slurm = run(["sinfo", "--version"], timeout=30, check=False).stdout.strip() \
        if (SANDBOX_DIR / "env.sh").exists() else "(no sandbox)"
    return {"nproc": os.cpu_count(), "cpu": model, "mem_total_mb": mem_kb // 1024,
            "mem_available_mb": mem_available_mb(), "kernel": platform.release(),
            "loadavg": os.getloadavg(), "slurm": slurm, "ray": ray.__version__,
            "python": platform.python_version(), "when": time.strftime("%Y-%m-%dT%H:%M:%S")}


def save(name: str, data: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    data = {"benchmark": name, "machine": machine(), **data}
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    print(json.dumps(data, indent=2, sort_keys=True))
    print(f"-> {path}")
    return path


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)
