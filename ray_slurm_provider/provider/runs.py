"""Runs of a cluster: each `ray up` that creates a head starts one.

Job ids are not unique over time (a new sandbox starts again at 1, and sites wrap around), so
the logs of an earlier run move to `logs/runs/<time>/` before a new head is submitted, and the
head's job id is recorded (`last_head`) so that its log can be found after the head is gone.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

from ray_slurm_provider.state import ClusterDir

_LAST_HEAD = "last_head"


def new_run(cdir: ClusterDir) -> Path | None:
    """Move the earlier run's logs (job logs and kept Ray logs) aside (a file still being
    written follows the move); return where they went, if there were any."""
    old = sorted(cdir.logs.glob("*.out"))
    ray_logs = cdir.ray_logs("x").parent
    if not old and not ray_logs.is_dir():
        return None
    dest = cdir.logs / "runs" / time.strftime("%Y%m%d-%H%M%S")
    n = 0
    while dest.exists():  # two runs in one second
        n += 1
        dest = dest.with_name(f"{dest.name.split('.')[0]}.{n}")
    dest.mkdir(parents=True, mode=0o700)
    for f in old:
        f.rename(dest / f.name)
    if ray_logs.is_dir():
        ray_logs.rename(dest / ray_logs.name)
    return dest


def ray_logs_of(cdir: ClusterDir, job_id: str) -> Path | None:
    """Where job `job_id`'s Ray logs were kept: this run's, else the newest earlier run's."""
    here = cdir.ray_logs(job_id)
    if here.is_dir():
        return here
    name = here.parent.name
    for run in sorted(cdir.logs.glob("runs/*"), reverse=True):
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
