"""The head job's remaining time, from the listing the provider already does every tick.

Every Ray node is a Slurm job with a time limit. Workers are drained before theirs
(`--signal=B:TERM@<s>`, see jobs.py) and replaced; the head's end is the cluster's end. So the
provider logs the head's time left (in the autoscaler's log on the head, and in `ray up`),
warns as the end nears, and keeps `<cluster dir>/walltime.json` up to date for
`ray-slurm status`. It costs no scheduler query: squeue already reports the time left.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

from ray_slurm_provider.slurm.client import Job
from ray_slurm_provider.state import write_json
from ray_slurm_provider.units import fmt_duration

logger = logging.getLogger(__name__)

INFO_EVERY_S = 600.0
WARN_EVERY_S = 60.0
WRITE_EVERY_S = 60.0


def warn_below_s(limit_s: int | None) -> int:
    """When to start warning: 10 % of the limit, at least 5 and at most 30 minutes."""
    if limit_s is None:
        return 300
    return int(max(300, min(1800, limit_s // 10)))


class HeadWalltime:
    """Watches the head job's time left; `clock` is injectable for tests (epoch seconds)."""

    def __init__(self, path: Path | None, clock: Callable[[], float] = time.time) -> None:
        self._path = path
        self._clock = clock
        self._next_log = 0.0
        self._next_write = 0.0
        self._warned = False
        self._job = ""

    def observe(self, job: Job) -> bool:
        """Note one listing of the head job; return True when it is in its warning window."""
        if not job.running:
            return False
        now = self._clock()
        if job.job_id != self._job:
            self._job = job.job_id
            self._next_log = 0.0
            self._next_write = 0.0
            self._warned = False
        left, limit = job.left_s(), job.time_limit_s
        warn = left is not None and left <= warn_below_s(limit)
        if warn != self._warned:  # entering or leaving the window (e.g. limit extended)
            self._next_log = self._next_write = 0.0
        self._warned = warn
        if now >= self._next_log:
            self._log(job, left, warn)
            self._next_log = now + (WARN_EVERY_S if warn else INFO_EVERY_S)
        if now >= self._next_write:
            self._write(job, left, warn, now)
            self._next_write = now + WRITE_EVERY_S
        return warn

    def _log(self, job: Job, left: int | None, warn: bool) -> None:
        limit = job.time_limit_s
        if left is None:
            logger.info("Head job %s has no time limit", job.job_id)
            return
        lim = fmt_duration(limit) if limit is not None else "?"
        if warn:
            logger.warning(
                "Head job %s ends in %s (time limit %s): the whole Ray cluster ends with it. "
                "Extend it where your site allows (scontrol update JobId=%s TimeLimit=...), "
                "or save your work and run `ray down` + `ray up`.",
                job.job_id, fmt_duration(left), lim, job.job_id)
        else:
            logger.info("Head job %s: %s left of its time limit %s", job.job_id,
                        fmt_duration(left), lim)

    def _write(self, job: Job, left: int | None, warn: bool, now: float) -> None:
        if self._path is None:
            return
        try:
            write_json(self._path, {
                "head_job_id": job.job_id,
                "time_limit_s": job.time_limit_s,
                "time_left_s": left,
                "observed_at": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(now)),
                "ends_at": None if left is None else time.strftime(
                    "%Y-%m-%dT%H:%M:%S", time.localtime(now + left)),
                "warning": warn,
            })
        except OSError as e:
            logger.warning("Could not write %s: %s", self._path, e)
