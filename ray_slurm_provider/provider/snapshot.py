"""The provider's per-tick view of its nodes: one listing + last tick's records -> records.

Pure apart from the callbacks it is given (tags from the cluster directory), so the rules are
tested on recorded listings without Slurm. Kept cheap at scale (bench/p4_listing_cpu.py).

Every autoscaler tick lists the whole cluster. At thousands of jobs, re-deriving every node's
record from scratch (decode the comment, read `tags.json`, look for `ray.json`) costs more than
the tick may; most jobs have not changed since the last tick, so their records are kept:

* a job listed last tick in the same state with the same comment is the same node with the
  same tags, unless a tags file was written (`tags.gen`), a stray submission was found since,
  or it is a worker whose Ray may have come up meanwhile (status `setting-up`);
* a worker's Ray, once seen up, stays up until its job ends (agent/), so it is not looked
  for again, and a job that is not running cannot have come up.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Container, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from ray.autoscaler.tags import (
    NODE_KIND_WORKER,
    STATUS_SETTING_UP,
    STATUS_UNINITIALIZED,
    STATUS_UP_TO_DATE,
    TAG_RAY_NODE_KIND,
    TAG_RAY_NODE_STATUS,
)

from ray_slurm_provider.jobs import GROUP_TAG, decode_tags
from ray_slurm_provider.nodespec import member_ids, released_whole, split
from ray_slurm_provider.slurm.client import Job


@dataclass
class NodeRecord:
    job: Job
    tags: dict[str, str]


def unchanged(rec: NodeRecord | None, job: Job) -> bool:
    """`rec` (from the last tick) still describes `job`; the caller checks the files."""
    return (rec is not None and rec.job.state == job.state and rec.job.comment == job.comment
            and rec.tags.get(TAG_RAY_NODE_STATUS) != STATUS_SETTING_UP)


def worker_status(node_id: str, job: Job, seen: set[str],
                  ray_up: Callable[[str], bool]) -> tuple[str, bool]:
    """A worker's status tag (its agent starts Ray, not a node updater), and whether its Ray
    has just been seen up for the first time (then it is added to `seen`)."""
    if node_id in seen:
        return STATUS_UP_TO_DATE, False
    if job.running and ray_up(node_id):
        seen.add(node_id)
        return STATUS_UP_TO_DATE, True
    return (STATUS_SETTING_UP if job.running else STATUS_UNINITIALIZED), False


@dataclass
class Snapshot:
    """What one listing says: the cluster's nodes, and the jobs of submissions Ray was told
    had failed (strays: Ray launched again, so they must be cancelled)."""

    nodes: dict[str, NodeRecord] = field(default_factory=dict)
    strays: list[str] = field(default_factory=list)


def take(jobs: Iterable[Job], prev: Mapping[str, NodeRecord], *, gone: Container[str],
         stray: Callable[[str | None], bool], submit_tag: str,
         tags: Callable[[str, Job, dict[str, str]], dict[str, str]],
         released: Callable[[str], bool] = lambda _: False) -> Snapshot:
    """The records of this listing's jobs: last tick's record for an unchanged job, else a
    new one from the job comment's creation tags (`tags` adds what the cluster directory
    holds). Jobs that are not ours, not active, or cancelled by us (`gone`) are left out.
    A gang job is a record per member (`<job>.<k>`, all in the job's state), but for the
    members already `released` (gangs.py) of a job not released whole."""
    snap = Snapshot()
    for job in jobs:
        rec = prev.get(job.job_id)
        if rec is not None and unchanged(rec, job):
            rec.job = job
            snap.nodes[job.job_id] = rec
            continue
        created = decode_tags(job.comment)
        if created is None or not job.active or job.job_id in gone:
            continue
        if stray(created.pop(submit_tag, None)):
            snap.strays.append(job.job_id)
            continue
        size = int(created.pop(GROUP_TAG, "1"))
        ids = member_ids(job.job_id, size) if size > 1 else [job.job_id]
        # Released members leave; a job released whole but still listed was not cancelled.
        whole = released_whole(job.job_id, size, released)
        for node_id in ids:
            rec = prev.get(node_id) if size > 1 else None
            if size > 1 and not whole and released(node_id):
                continue
            if rec is not None and unchanged(rec, job):
                rec.job = job
                snap.nodes[node_id] = rec
            else:
                snap.nodes[node_id] = NodeRecord(job, tags(node_id, job, dict(created)))
    return snap


def same_listing(jobs: Sequence[Job], last: Sequence[Job]) -> bool:
    """This listing is the last one, Job object for Job object (the CLI client gives back the
    same objects, even the same list, for an unchanged listing: slurm/parse.SqueueCache)."""
    return jobs is last or (len(jobs) == len(last) and all(map(operator.is_, jobs, last)))


def settling(records: Iterable[NodeRecord]) -> bool:
    """Whether a worker's Ray may come up (status `setting-up`): its record must be looked at
    again next tick, even when the listing has not changed."""
    return any(r.tags.get(TAG_RAY_NODE_STATUS) == STATUS_SETTING_UP for r in records)


def vanished_workers(before: Mapping[str, NodeRecord], now: Mapping[str, NodeRecord],
                     gone: Container[str], released: Callable[[str], bool] = lambda _: False,
                     ) -> list[tuple[str, NodeRecord]]:
    """Workers listed last tick (pending or running: a job whose prologue fails goes from
    PENDING to gone between two ticks) that left the queue without us cancelling them (or
    releasing them: gangs.py)."""
    return [(job_id, rec) for job_id, rec in before.items()
            if job_id not in now and split(job_id)[0] not in gone and rec.job.active
            and rec.tags.get(TAG_RAY_NODE_KIND) == NODE_KIND_WORKER and not released(job_id)]


def keep_created(nodes: dict[str, NodeRecord], current: Mapping[str, NodeRecord],
                 born: dict[str, int], gone: Container[str], listing: int) -> bool:
    """Add to listing number `listing`'s `nodes` the ones created while it was in flight (it
    cannot know them; `born[id]` = how many listings had started at creation), and forget the
    creations a listing started later has settled either way (listed, or gone).

    A worker the first later listing does not show active (gone, or COMPLETING: preempted or
    failed within a tick) stays in that listing once more: autoscaler v2 matches its launch
    requests to listed nodes, and one it never sees keeps its request waiting until a
    timeout (120 s). Returns True when it kept such a node."""
    ghost = False
    for job_id, when in list(born.items()):
        settled = job_id in nodes or when < listing
        if settled:
            del born[job_id]
        if job_id in nodes or job_id not in current or job_id in gone:
            continue
        if not settled or current[job_id].tags.get(TAG_RAY_NODE_KIND) == NODE_KIND_WORKER:
            nodes[job_id] = current[job_id]
            ghost = ghost or settled
    return ghost


def describe(node_id: str, rec: NodeRecord | None) -> str:
    """One line on where a node's job stands, in Slurm's words."""
    if rec is None:
        return f"Slurm job {node_id} is gone"
    j = rec.job
    where = f" on {j.batch_host}" if j.batch_host else ""
    why = f", reason: {j.reason}" if j.reason and j.reason != "None" else ""
    return f"Slurm job {node_id} is {j.state}{where}{why}"
