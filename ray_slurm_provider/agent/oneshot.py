"""One entrypoint as a Ray job: follow it to its end, and its exit code.

Used in two places: `ray-slurm run` on the login node follows the job from there; the head of
a `ray-slurm sbatch` cluster runs it itself (`run_entrypoint`), writes its output into the
head job's log, ends the cluster's workers and ends its own job with the entrypoint's code.
"""

from __future__ import annotations

import asyncio
import shlex
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from ray_slurm_provider import auth
from ray_slurm_provider.retry import retry
from ray_slurm_provider.state import ClusterDir, HeadInfo, StartRequest

#: The exit code when Ray, not the entrypoint, failed (`docker run` uses it the same way).
CLUSTER_FAILED = 125
POLL_S = 1.0
CONNECT_S = 120.0  # the dashboard answers a little after `ray start` returns


def exit_code(info: Any) -> int | None:
    """The entrypoint's own exit code from Ray's JobInfo; None when Ray ended the job without
    one (stopped, or the runtime env or the driver could not start)."""
    status = str(getattr(info.status, "value", info.status))
    if status == "SUCCEEDED":
        return 0
    code = info.driver_exit_code
    if status != "FAILED" or code is None:
        return None
    return int(code) if 0 < code < 256 else 128 + abs(int(code)) % 128


def follow(client: Any, job_id: str, out: TextIO, *, sleep: Callable[[float], None] = time.sleep,
           check: Callable[[bool], None] = lambda answered: None,
           say: Callable[[str], None] = print) -> Any:
    """Stream the job's output to `out` until it ends; return its final JobInfo. After each
    poll `check(answered)` runs (it raises to stop following)."""
    def tail() -> None:
        async def lines() -> None:
            async for chunk in client.tail_job_logs(job_id):
                out.write(chunk)
                out.flush()

        try:
            asyncio.run(lines())
        except Exception as e:  # the job's status decides the outcome, not the stream
            say(f"log stream of {job_id} ended: {e}")

    t = threading.Thread(target=tail, daemon=True, name="job-logs")
    t.start()
    while True:
        sleep(POLL_S)
        try:
            info = client.get_job_info(job_id)
        except Exception:  # the dashboard did not answer: the caller decides what that means
            info = None
        if info is not None and info.status.is_terminal():
            t.join(10)
            return info
        check(info is not None)


def job_client(cdir: ClusterDir, head: HeadInfo, auth_mode: str) -> Any:
    """Ray's job client for the cluster's dashboard, with the cluster's token. The token goes
    in the client's own header: Ray reads RAY_AUTH_MODE once, when it is first imported, so
    setting the variable here would come too late."""
    token = (cdir.root / auth.TOKEN_FILE).read_text().strip() if auth_mode == "token" else None
    return client_at(f"http://{head.ip}:{head.dashboard_port}", token)


def client_at(url: str, token: str | None) -> Any:
    """Ray's job client for the dashboard at `url`, with `token` in its header if given."""
    from ray.job_submission import JobSubmissionClient

    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return JobSubmissionClient(url, headers=headers)


def run_entrypoint(cdir: ClusterDir, head: HeadInfo, auth_mode: str, req: StartRequest,
                   out: TextIO, say: Callable[[str], None],
                   stopping: Callable[[], bool]) -> int:
    """On the head: submit the request's entrypoint, stream its output into `out` (the head
    job's log) and return its exit code, CLUSTER_FAILED when Ray could not run it."""
    try:
        client = retry(lambda _: job_client(cdir, head, auth_mode), retry_on=(Exception,),
                       delay=lambda n, waited: 2.0, deadline_s=CONNECT_S, stop=stopping,
                       clock=time.monotonic)
    except Exception as e:
        say(f"ERROR: the head's dashboard did not answer: {e}")
        return CLUSTER_FAILED
    entry = shlex.join(req.entrypoint)
    job_id = client.submit_job(entrypoint=entry, runtime_env=req.runtime_env or None)
    say(f"one-shot: Ray job {job_id} runs: {entry}")

    def check(answered: bool) -> None:
        if stopping():
            client.stop_job(job_id)
            raise InterruptedError("the head job is ending")

    try:
        info = follow(client, job_id, out, check=check, say=say)
    except InterruptedError:
        return CLUSTER_FAILED
    code = exit_code(info)
    if code is None:
        say(f"ERROR: Ray job {job_id} {info.status}: {info.message}")
        return CLUSTER_FAILED
    say(f"one-shot: the entrypoint exited with {code}")
    return code


def staged_dir(cdir: ClusterDir, name: str) -> Path:
    """Where `ray-slurm sbatch` stages a working dir (on the shared filesystem)."""
    return cdir.root / "oneshot" / name


def remove_staged(cdir: ClusterDir, req: StartRequest) -> None:
    wd = str(req.runtime_env.get("working_dir", ""))
    if wd and Path(wd).parent == staged_dir(cdir, "x").parent:
        shutil.rmtree(wd, ignore_errors=True)
