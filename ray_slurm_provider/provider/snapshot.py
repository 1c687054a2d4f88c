"""The provider's per-tick view of its nodes, kept cheap at scale (bench/p4_listing_cpu.py).

Every autoscaler tick lists the whole cluster. At thousands of jobs, re-deriving every node's
record from scratch (decode the comment, read `tags.json`, look for `ray.json`) costs more than
the tick may; most jobs have not changed since the last tick, so their records are kept:

* a job listed last tick in the same state with the same comment is the same node with the
  same tags, unless a tags file was written (`tags.gen`), a stray submission was found since,
  or it is a worker whose Ray may have come up meanwhile (status `setting-up`);
* a worker's Ray, once seen up, stays up until its job ends (node.py), so it is not looked
  for again, and a job that is not running cannot have come up.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ray.autoscaler.tags import (
    STATUS_SETTING_UP,
    STATUS_UNINITIALIZED,
    STATUS_UP_TO_DATE,
    TAG_RAY_NODE_STATUS,
)

from ray_slurm_provider.slurm.client import Job


@dataclass
class NodeRecord:
    job: Job
    tags: dict[str, str]


def unchanged(rec: NodeRecord | None, job: Job) -> bool:
    """`rec` (from the last tick) still describes `job`; the caller checks the files."""
    return (rec is not None and rec.job.state == job.state and rec.job.comment == job.comment
            and rec.tags.get(TAG_RAY_NODE_STATUS) != STATUS_SETTING_UP)


def worker_status(job: Job, seen: set[str], ray_up: Callable[[str], bool]) -> tuple[str, bool]:
    """A worker's status tag (its agent starts Ray, not a node updater), and whether its Ray
    has just been seen up for the first time (then it is added to `seen`)."""
    if job.job_id in seen:
        return STATUS_UP_TO_DATE, False
    if job.running and ray_up(job.job_id):
        seen.add(job.job_id)
        return STATUS_UP_TO_DATE, True
    return (STATUS_SETTING_UP if job.running else STATUS_UNINITIALIZED), False
