"""Helpers for the hardening e2e tests: what a job is, when it was submitted, which process
is whose raylet, what the head's autoscaler logged, and Ray jobs that run in the background.

Reading /proc lives in `tests/e2e/procfs.py`, reading Ray's logs in `tests/e2e/harness.py`
(`log_lines`, `TICK_MARK`); both are shared with the benchmarks."""

from __future__ import annotations

import datetime as dt
import json
import os
import shlex
import shutil
import subprocess
import urllib.request
import uuid
from pathlib import Path
from typing import Any

from ray.autoscaler.tags import TAG_RAY_USER_NODE_TYPE

from ray_slurm_provider.jobs import decode_tags, temp_dir
from ray_slurm_provider.slurm.cli import CliSlurmClient
from ray_slurm_provider.slurm.client import Job
from ray_slurm_provider.slurm.parse import parse_kv_line
from ray_slurm_provider.units import parse_duration
from tests.e2e.harness import TICK_MARK, RayCluster, log_lines, wait_for
from tests.e2e.procfs import pids_with, stat_fields


def jobs(cluster: RayCluster) -> list[Job]:
    """The cluster's jobs as the provider sees them (one squeue)."""
    return CliSlurmClient().list_jobs(cluster.job_name)


def node_type(job: Job) -> str:
    return (decode_tags(job.comment) or {}).get(TAG_RAY_USER_NODE_TYPE, "")


def workers(cluster: RayCluster, ntype: str, *, ray_up: bool = False) -> list[Job]:
    """Active jobs of `ntype`, RUNNING with Ray up if `ray_up`."""
    out = [j for j in jobs(cluster) if j.active and node_type(j) == ntype]
    if ray_up:
        out = [j for j in out if j.running and cluster.cdir.ray_up(j.job_id)]
    return sorted(out, key=lambda j: [int(x) for x in j.job_id.split("_")])


def show_job(job_id: str) -> dict[str, str]:
    """`scontrol show job` (works for MinJobAge after the job ended)."""
    out = subprocess.run(["scontrol", "show", "job", "--oneliner", job_id], capture_output=True,
                         text=True, timeout=30, check=True).stdout
    return parse_kv_line(out.strip())


def epoch(stamp: str) -> float:
    return dt.datetime.fromisoformat(stamp).timestamp()


def submitted_at(job_id: str) -> float:
    return epoch(show_job(job_id)["SubmitTime"])


def run_time_s(info: dict[str, str]) -> int:
    return parse_duration(info["RunTime"]) or 0


def gone(job_id: str) -> bool:
    """The job no longer holds an allocation (ended, or ending)."""
    state = show_job(job_id).get("JobState", "")
    return state not in ("PENDING", "CONFIGURING", "RUNNING", "SUSPENDED")


def raylet_pid(job_id: str) -> int:  # the numeric id (Job.numeric_id)
    """The raylet of exactly this job (its temp dir is jobs.temp_dir's)."""
    (pid,) = [p for p in pids_with("raylet/raylet", temp_dir("/tmp", job_id) + "/")
              if Path(f"/proc/{p}/exe").resolve().name == "raylet"]
    return pid


def ray_node_id(job_id: str) -> str:
    """The Ray node id of this job's raylet (from its command line)."""
    cmd = Path(f"/proc/{raylet_pid(job_id)}/cmdline").read_bytes().decode().split("\0")
    return next(a.split("=", 1)[1] for a in cmd if a.startswith("--node_id="))


def api(cluster: RayCluster, path: str, body: dict[str, Any] | None = None,
        method: str = "GET") -> Any:
    """The head's dashboard HTTP API, with the cluster's token."""
    token = cluster.token_path.read_text().strip()
    req = urllib.request.Request(
        cluster.dashboard + path, method=method,
        data=json.dumps(body).encode() if body is not None else None,
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read() or b"null")


def node_dead_at(cluster: RayCluster, node_id: str) -> float | None:
    """When Ray (the GCS) marked the node dead, or None while it is alive."""
    nodes = api(cluster, "/api/v0/nodes?detail=1&limit=10000")["data"]["result"]["result"]
    node = next((n for n in nodes if n["node_id"] == node_id), None)
    if node is None or node["state"] != "DEAD" or not node.get("end_time_ms"):
        return None
    return float(node["end_time_ms"]) / 1000


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return stat_fields(pid)[0] != "Z"


def monitor_log(cluster: RayCluster) -> Path:
    return cluster.monitor_log()


def ticks(log: Path, t0: float, t1: float) -> int:
    """Autoscaler iterations that started in (t0, t1]."""
    return len([t for t, _ in log_lines(log, t0, TICK_MARK) if t0 < t <= t1])


#: How a worker the provider or Slurm's drain signal stopped ends: COMPLETED (its agent ended
#: the job, with 0) or CANCELLED (the provider's scancel came first); never FAILED.
ENDED_BY_US = ("COMPLETED", "CANCELLED")

#: The provider's log line for one submission (one sbatch: a job, or an array of tasks).
SUBMITTED = r"Submitted Slurm job\(?s?\)? "


def submit_logged_at(log: Path, job_id: str) -> float:
    """When the head's provider logged submitting `job_id` (ms resolution)."""
    (t, _), *_ = log_lines(log, 0, SUBMITTED + rf"(?:[\d_]+, )*{job_id}\b")
    return t


def keep_log(log: Path, name: str) -> Path:
    """A copy that outlives the head's temp dir (removed when its job ends)."""
    dst = Path(f"/tmp/rsp-hard-{name}-monitor.log")
    if log.exists():
        shutil.copyfile(log, dst)
    return dst


def walltime_jobs(d: Driver) -> list[str]:
    """The jobs the walltime driver's steps ran on, in submit order, once it succeeded: every
    step ran, in order, and at least two jobs (the first drained, a replacement took over)."""
    wait_for(d.done, 600, "the walltime driver", every=2)
    assert d.status() == "SUCCEEDED", d.why()
    res = json.loads(d.result("WALL_RESULT"))
    jobs: list[str] = sorted(res["jobs"], key=lambda j: [int(x) for x in j.split("_")])
    assert res["ids"] == list(range(len(res["ids"]))), res  # every step ran, in order
    assert len(jobs) >= 2, res  # the first node left, a replacement took over
    return jobs


class Driver:
    """A Ray job submitted through the jobs API (with the cluster's token), not waited for.

    The REST API answers in milliseconds, where each `ray job ...` command costs seconds of
    Python start-up on a loaded 2-core machine."""

    def __init__(self, cluster: RayCluster, script: str) -> None:
        self.cluster = cluster
        self.sid = f"hard-{uuid.uuid4().hex[:8]}"
        self._call("POST", "/api/jobs/", {"entrypoint": f"python -c {shlex.quote(script)}",
                                          "submission_id": self.sid})

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        return api(self.cluster, path, body, method)

    def status(self) -> str:
        return str(self._call("GET", f"/api/jobs/{self.sid}")["status"])

    def done(self) -> bool:
        return self.status() in ("SUCCEEDED", "FAILED", "STOPPED")

    def logs(self) -> str:
        return str(self._call("GET", f"/api/jobs/{self.sid}/logs")["logs"])

    def why(self) -> str:
        """Ray's message for the job and the end of its output (for assertion messages), the
        driver's last Python traceback first: Ray's own log lines can bury it."""
        info = self._call("GET", f"/api/jobs/{self.sid}")
        logs = self.logs()
        tb = logs.rfind("Traceback (most recent call last)")
        first = f"{logs[tb:tb + 3000]}\n---\n" if tb >= 0 else ""
        return f"{info.get('status')}: {info.get('message')}\n{first}{logs[-3000:]}"

    def result(self, tag: str) -> str:
        line = next((x for x in self.logs().splitlines() if x.startswith(tag + " ")), None)
        assert line is not None, self.logs()[-3000:]
        return line.split(" ", 1)[1]

    def stop(self) -> None:
        self._call("POST", f"/api/jobs/{self.sid}/stop")
