"""`ray start` and `ray stop` on a node: handed to its agent, never run as a job step.

A step's processes belong to the step: `ray start` run as one would be orphaned by it or
killed with it, so the runner writes the start program into the node's `start.json` and the
agent in the batch step starts Ray and answers in `result.json` (agent/head.py). `ray stop`
would kill every Ray process of the user on the node, other clusters' included; it becomes
the node's `ray-stop` marker: "stop this job's Ray" (state.py).
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ray_slurm_provider import rayapi, shellcmd
from ray_slurm_provider.jobs import temp_dir
from ray_slurm_provider.retry import retry
from ray_slurm_provider.state import ClusterDir, NodeDir, StartRequest, poll_interval

QUERY_EVERY_S = 5.0  # how often a waiting `ray up` asks whether the job still exists


def runner_error(msg: str, code: int | None, cmd: str) -> Exception:
    """The error Ray's NodeUpdater expects from a runner whose command failed."""
    return rayapi.runner_error(msg, code, cmd)


def request_start(ndir: NodeDir, prog: shellcmd.Program,
                  env: Mapping[str, object] | None, *, entrypoint: list[str] | None = None,
                  runtime_env: dict[str, Any] | None = None) -> str:
    """Hand `prog` (which has a `ray start`) to the node's agent; the request's id. With an
    `entrypoint` (`ray-slurm sbatch`), the head runs it once Ray is up and ends with it."""
    assert prog.ray_start is not None
    req = StartRequest(
        id=uuid.uuid4().hex, ray_start=prog.ray_start, exports=prog.exports,
        env={k: v if isinstance(v, str) else json.dumps(v, separators=(",", ":"))
             for k, v in (env or {}).items()},
        before=prog.before, prefix=prog.prefix, entrypoint=list(entrypoint or []),
        runtime_env=dict(runtime_env or {}))
    ndir.write_start(req)
    return req.id


def wait_started(ndir: NodeDir, req_id: str, *, timeout: float, node_id: str, log: Path,
                 job_gone: Callable[[], bool]) -> None:
    """Wait for the agent's answer to `req_id`; raise the runner's error if Ray failed or did
    not come up. `job_gone` (asks Slurm) is called every QUERY_EVERY_S."""
    next_query = time.monotonic() + QUERY_EVERY_S

    def look(_: int) -> bool | None:
        """True: Ray is up; False: the job is gone; None: no answer yet."""
        nonlocal next_query
        res = ndir.read_result()
        if res and res.id == req_id:
            if res.ok:
                return True
            raise runner_error(f"ray start failed in job {node_id}: {res.error} (log: {log})",
                               1, "ray start")
        if time.monotonic() >= next_query:
            next_query = time.monotonic() + QUERY_EVERY_S
            if job_gone():
                return False
        return None

    up = retry(look, retry_if=lambda r: r is None, deadline_s=timeout, clock=time.monotonic,
               delay=lambda n, waited: poll_interval(waited))
    if not up:
        raise runner_error(f"Ray did not come up in job {node_id} (log: {log})", 1, "ray start")


def stop_ray(ndir: NodeDir, timeout: float = 60.0) -> None:
    """`ray stop`, scoped to this job: the agent stops its own Ray and nothing else."""
    if not ndir.ray_up():
        return
    ndir.request_ray_stop()
    retry(lambda _: ndir.ray_up(), retry_if=bool, deadline_s=timeout, clock=time.monotonic,
          delay=lambda n, waited: 0.2)


def config_path() -> str:
    """The cluster YAML of the `ray` command this runs in (`ray up CONFIG`, ...)."""
    for arg in sys.argv[1:]:
        if arg.endswith((".yaml", ".yml")) and os.path.isfile(arg):
            return arg
    return "CLUSTER.yaml"


def announce(cdir: ClusterDir, node_id: str, temp_dir_root: str, log_prefix: str) -> None:
    """`ray up`'s closing lines: where the head is, and how to reach it and its logs."""
    head = cdir.read_head()
    if not head:
        return
    config = shlex.quote(config_path())
    logs = f"{temp_dir(temp_dir_root, head.job_id)}/session_latest/logs"
    print(f"{log_prefix}Ray is up in Slurm job {node_id} on {head.ip}.\n"
          f"  Dashboard:   http://{head.ip}:{head.dashboard_port}\n"
          f"  GCS address: {head.ip}:{head.gcs_port}\n"
          f"  Use it from this shell: eval \"$(ray-slurm env {config})\"\n"
          f"  The head job's log:     ray-slurm logs {config} head\n"
          f"  Ray's logs on the head: {logs} (not /tmp/ray: each job has its own)")
