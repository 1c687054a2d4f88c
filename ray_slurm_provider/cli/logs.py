"""`ray-slurm logs CONFIG [JOB|head] [--follow]`: a job's output from the cluster directory.
`ray-slurm logs CONFIG JOB --ray [FILE]`: the Ray session logs kept when that job ended
(agent/raylogs.py): the list, or one file.

`logs/<job id>.out` holds the node agent's and Ray's start-up output; `--follow` keeps printing
until the job is gone. `head` is the running head, or the last one after `ray down` or a
crash. Each `ray up` that creates a head moves the logs of the jobs Slurm no longer lists to
`logs/runs/<time>/` (provider/runs.py), so job ids that restart (a new sandbox) never mix two
runs in one file; a job's log is found by its id wherever it lives, the newest first.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from ray_slurm_provider.cli import oneshots
from ray_slurm_provider.cli.common import (
    CliError,
    Cluster,
    config_command,
    load_cluster,
    run_command,
    table,
)
from ray_slurm_provider.jobs import temp_dir
from ray_slurm_provider.nodespec import split
from ray_slurm_provider.provider.runs import (
    earlier_run,
    earlier_runs,
    find_log,
    last_head,
    ray_logs_of,
)
from ray_slurm_provider.slurm.client import JOB_ID_RE, SlurmError, TransientSlurmError


def resolve_job(cluster: Cluster, job: str | None) -> str | None:
    if job in (None, ""):
        return None
    if job == "head":
        head = cluster.cdir.read_head()
        if head and head.job_id:
            return head.job_id
        last = last_head(cluster.cdir)  # the head is gone: its last log is what is wanted
        if last is None:
            raise CliError(f"no head recorded in {cluster.cdir.root} (has `ray up` run?)")
        print(f"# the head is not running; its last job was {last}", file=sys.stderr)
        return last
    base, k = split(str(job))  # a gang member, `<job>.<k>`: its own Ray logs, its job's log
    if not JOB_ID_RE.match(base) or (k is None and base != str(job)):
        raise CliError(f"{job!r} is not a Slurm job id, a gang member's `<job id>.<k>` "
                       "(or `head`)")
    return str(job)


def list_logs(cluster: Cluster) -> list[str]:
    """This run's logs, then earlier runs' (kept apart: job ids may restart)."""
    def by_time(logs: Path) -> list[Path]:
        return sorted(logs.glob("*.out"), key=lambda p: p.stat().st_mtime)

    files = [f for run in [*earlier_runs(cluster.cdir), cluster.cdir.logs] for f in by_time(run)]
    if not files:
        return [f"no logs yet in {cluster.cdir.logs}"]
    rows = [[p.stem, f"{p.stat().st_size}",
             time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(p.stat().st_mtime)), str(p)]
            for p in files]
    return [*table(["JOB", "BYTES", "MODIFIED", "PATH"], rows),
            "show one: ray-slurm logs CONFIG <job id>|head [--follow]"]


def follow(path: Path, alive: Callable[[], bool], out: TextIO,
           sleep: Callable[[float], None] = time.sleep, every: float = 0.5,
           check_every: int = 10) -> None:
    """Print what is appended to `path` until `alive()` says the job is gone (asked every
    `check_every` polls), then print what is left."""
    pos = 0

    def drain() -> None:
        nonlocal pos
        if not path.exists():
            return
        with path.open("rb") as f:
            f.seek(pos)
            chunk = f.read()
        pos += len(chunk)
        if chunk:
            out.write(chunk.decode(errors="replace"))
            out.flush()

    polls = 0
    while True:
        drain()
        polls += 1
        if polls % check_every == 0 and not alive():
            drain()  # what the job wrote last
            return
        sleep(every)


def job_alive(cluster: Cluster, job_id: str) -> bool:
    """Whether Slurm lists job `job_id` as active. A listing Slurm did not answer in time
    (a throttled controller, issue 29) says nothing: the job counts as alive, `follow` asks
    again at its next check. A refusal raises."""
    try:
        jobs = cluster.client.list_jobs(cluster.job_name)
    except TransientSlurmError:
        return True
    return any(j.job_id == job_id and j.active for j in jobs)


def node_temp_dir(cluster: Cluster, job: str) -> str:
    """Node `job`'s Ray temp dir: as its agent recorded it, else (older agents) named by the
    numeric job id (agent.json's: an array task's own), with a gang member's `.<k>`."""
    agent = cluster.cdir.node(job).read_agent()
    if agent and agent.temp_dir:  # a fallback dir cannot be computed (agent/tempdir.py)
        return agent.temp_dir
    base, k = split(job)
    numeric = agent.job_id if agent and agent.job_id else base
    return temp_dir(cluster.pcfg.temp_dir_root, numeric if k is None else f"{numeric}.{k}")


def ray_logs(cluster: Cluster, job: str, name: str | None) -> list[str]:
    """The kept Ray logs of `job`: the file list, or the lines of file `name`."""
    root = ray_logs_of(cluster.cdir, job)
    if root is None:
        tmp = node_temp_dir(cluster, job)
        raise CliError(f"no Ray logs kept for job {job} in {cluster.cdir.ray_logs(job)}: they "
                       f"are copied there when the job ends (provider.ray_logs_max_mb); while "
                       f"it runs they are on its node in {tmp}/session_latest/logs/")
    if name is None:
        files = sorted(p for p in root.rglob("*") if p.is_file())
        rows = [[str(p.relative_to(root)), str(p.stat().st_size)] for p in files]
        return [*table(["FILE", "BYTES"], rows), f"in {root}",
                f"show one: ray-slurm logs CONFIG {job} --ray FILE"]
    path = (root / name).resolve()
    if not path.is_relative_to(root.resolve()) or not path.is_file():
        raise CliError(f"no file {name!r} in {root} (list them: ray-slurm logs CONFIG {job} "
                       "--ray)")
    return path.read_text(errors="replace").splitlines()


def job_log(cluster: Cluster, job: str, waiting: bool = False) -> Path:
    """The log file of node `job` (a gang member's is its job's), this run's or an earlier
    one's; CliError when there is none, unless `waiting` (then this run's, to be written)."""
    base = split(job)[0]
    path = find_log(cluster.cdir, base)
    if path is None and not waiting:
        raise CliError(f"no log for job {job} (none in {cluster.cdir.logs} nor in an "
                       "earlier run's logs/runs/*/)")
    return path or cluster.cdir.log(base)


def cmd_logs(args: argparse.Namespace) -> int:
    def body() -> int:
        cluster = load_cluster(args.config)
        if args.run:
            cluster = oneshots.find(cluster, args.run)
        job = resolve_job(cluster, args.job)
        if args.ray is not None:
            if job is None:
                raise CliError("--ray needs a job id (or `head`)")
            lines = ray_logs(cluster, job, args.ray or None)
            print("\n".join(lines[-args.lines:] if args.lines and args.ray else lines))
            return 0
        if job is None:
            print("\n".join(list_logs(cluster)))
            return 0
        base = split(job)[0]  # a gang's members share their job's log and Slurm job
        path = job_log(cluster, job, waiting=args.follow)
        if earlier_run(cluster.cdir, path):
            print(f"# job {base}: an earlier run's log ({path})", file=sys.stderr)
        if args.follow:
            try:
                follow(path, lambda: job_alive(cluster, base), sys.stdout)
            except SlurmError as e:
                raise CliError(f"cannot list the cluster's jobs: {e}") from e
        else:
            lines = path.read_text(errors="replace").splitlines()
            print("\n".join(lines[-args.lines:] if args.lines else lines))
        tmp = node_temp_dir(cluster, job)
        print(f"# Ray's own logs: on the node in {tmp}/session_latest/logs/ while the job "
              f"runs, then `ray-slurm logs CONFIG {job} --ray`", file=sys.stderr)
        return 0

    return run_command(body)


def register(sub: Any) -> None:
    p = config_command(sub, "logs", "a node's job log (or the list of logs)", cmd_logs)
    p.add_argument("job", nargs="?", help="Slurm job id, or `head`; omit to list the logs")
    p.add_argument("--ray", nargs="?", const="", default=None, metavar="FILE",
                   help="the job's Ray session logs, kept when it ended: the list, or FILE")
    p.add_argument("--follow", "-f", action="store_true", help="keep printing until the job ends")
    p.add_argument("--lines", "-n", type=int, default=0, help="only the last N lines")
    p.add_argument("--run", metavar="ID", help="a `ray-slurm sbatch` run of the config (its run "
                   "id, or its cluster name)")
