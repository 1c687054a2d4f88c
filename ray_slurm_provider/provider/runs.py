"""Runs of a cluster: each `ray up` (or `ray-slurm sbatch`) that creates a head starts one.

Job ids are not unique over time (a new sandbox starts again at 1, a controller whose state
was reset, sites that wrap around), so before a new head is submitted the logs of the jobs
Slurm no longer lists move to `logs/runs/<run id>/` (the ended run's start time, history.py;
the time of the move for a run without records): a new job can never write into an ended
job's file. The log of a job Slurm still lists stays where that job writes it (Slurm opened
`logs/<id>.out` when the job started; a moved file would leave `logs/<id>.out` missing while
the job runs on): its id cannot be given to a new job while it is listed, and it moves with
a later run once the job has ended. A log is found by its job id wherever it lives: this
run's first, else the newest earlier run's with that id (`find_log`). The head's job id is
recorded (`last_head`) so that its log can be found after the head is gone.

The node dirs (`nodes/<id>/`) of those jobs go too: a job killed outright (SIGKILL, a lost
node) leaves its hand-off files, and a new job given its id would find them (ray.json: Ray
up, at the old job's address; an orphan or release marker; a start request). Ids restart
where the controller's state was lost, which ends every job: the cluster then needs a new
head, and so a new run.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable
from pathlib import Path

from ray_slurm_provider.nodespec import split
from ray_slurm_provider.provider.history import History
from ray_slurm_provider.state import ClusterDir

_LAST_HEAD = "last_head"


def new_run(cdir: ClusterDir, listed: Iterable[str]) -> Path | None:
    """Move the logs (job logs and kept Ray logs) of jobs not in `listed` (the ids Slurm
    lists for the cluster now) aside and remove their node dirs; return where the logs went,
    if there were any."""
    live = set(listed)
    cdir.forget([n for n in cdir.known_nodes() if split(n)[0] not in live])
    ray_logs = cdir.ray_logs("x").parent
    old = [f for f in sorted(cdir.logs.glob("*.out")) if f.stem not in live]
    kept = [d for d in sorted(ray_logs.glob("*")) if split(d.name)[0] not in live]
    if not old and not kept:
        return None
    # Named by the run they belong to (history.py: its start time), where it has records.
    dest = cdir.logs / "runs" / (History(cdir.root).current() or time.strftime("%Y%m%d-%H%M%S"))
    n = 0
    while dest.exists():  # two runs in one second
        n += 1
        dest = dest.with_name(f"{dest.name.split('.')[0]}.{n}")
    dest.mkdir(parents=True, mode=0o700)
    for f in old:
        f.rename(dest / f.name)
    if kept:
        (dest / ray_logs.name).mkdir()
    for d in kept:
        d.rename(dest / ray_logs.name / d.name)
    return dest


def find_log(cdir: ClusterDir, job_id: str) -> Path | None:
    """Job `job_id`'s log: the newest file of that name, this run's or an earlier run's."""
    found = [p for p in (cdir.log(job_id), *cdir.logs.glob(f"runs/*/{job_id}.out"))
             if p.is_file()]
    return max(found, key=lambda p: p.stat().st_mtime, default=None)


def earlier_run(cdir: ClusterDir, path: Path) -> bool:
    """Whether a log found by `find_log` is an earlier run's."""
    return path.parent != cdir.logs


def earlier_runs(cdir: ClusterDir) -> list[Path]:
    """The earlier runs' dirs, oldest first: by time, then `<time>.1`, `.2` ... `.10`."""
    def order(run: Path) -> tuple[str, int]:
        stamp, _, n = run.name.partition(".")
        return stamp, int(n) if n.isdigit() else 0

    return sorted((p for p in cdir.logs.glob("runs/*") if p.is_dir()), key=order)


def ray_logs_of(cdir: ClusterDir, job_id: str) -> Path | None:
    """Where job `job_id`'s Ray logs were kept: this run's, else the newest earlier run's."""
    here = cdir.ray_logs(job_id)
    if here.is_dir():
        return here
    name = here.parent.name
    for run in reversed(earlier_runs(cdir)):
        if (run / name / job_id).is_dir():
            return run / name / job_id
    return None


def record_head(cdir: ClusterDir, job_id: str) -> None:
    with contextlib.suppress(OSError):  # a convenience for `ray-slurm logs`, never a failure
        (cdir.root / _LAST_HEAD).write_text(job_id + "\n")


def last_head(cdir: ClusterDir) -> str | None:
    """The job id of the cluster's most recent head, running or not."""
    try:
        return (cdir.root / _LAST_HEAD).read_text().strip() or None
    except FileNotFoundError:
        return None
