"""The provider's state: one record per Ray node, and how one listing moves the records on.

`advance` asks nothing of Slurm and reads files only through the readers it is given, so
every rule is tested on recorded listings without Slurm. It updates unchanged records in place
(their job, a GHOST's phase) rather than copying 10,000 of them per tick, so the provider calls
it under its lock and acts on its events afterwards.

| state      | event                                                  | next        | who       |
|------------|--------------------------------------------------------|-------------|-----------|
| -          | sbatch returned                                        | CREATED     | create    |
| CREATED    | the listing shows the job active                       | LISTED      | advance   |
| CREATED    | not shown by a listing started before sbatch returned  | CREATED     | advance   |
| CREATED    | not shown by a listing started after (a worker)        | GHOST       | advance   |
| CREATED    | not shown by a listing started after (a head)          | gone        | advance   |
| GHOST      | the next listing                                       | gone: ended | advance   |
| -          | a listed job of ours this process has no record of     | LISTED      | advance   |
| LISTED     | a running node's agent wrote ray.json                  | RAY_UP      | advance   |
| LISTED     | the job left Slurm's active list                       | gone: ended | advance   |
| RAY_UP     | the job left Slurm's active list                       | gone: ended | advance   |
| shown      | terminated, a gang member whose group lives on         | RELEASED    | terminate |
| -          | a listed member with a `released` marker (any process) | RELEASED    | advance   |
| RELEASED   | the job is listed, some member not released            | RELEASED    | advance   |
| RELEASED   | every member released, job still listed (no scancel)   | LISTED      | advance   |
| RELEASED   | the job is no longer listed                            | gone        | advance   |
| shown      | scancel sent (gang job: before it; one-node: after)    | CANCELLING  | terminate |
| CANCELLING | the scancel failed                                     | as before   | terminate |
| CANCELLING | the job is still listed, within GONE_TTL_S             | CANCELLING  | advance   |
| CANCELLING | the job is no longer listed                            | gone        | advance   |
| CANCELLING | GONE_TTL_S passed and Slurm still lists it active      | LISTED      | advance   |

Shown states (CREATED, LISTED, RAY_UP, GHOST) are what `non_terminated_nodes` lists; RELEASED
and CANCELLING records are hidden. "gone" is no record. A shown worker gone without our
scancel or release ("gone: ended") is an event: `orphans` when its ray.json is still there
(its agent must stop Ray), else `crashed` unless it was RAY_UP (it died before Ray started;
one per job; provider/ends.py judges it once its end is final). A GHOST is a worker no
listing showed: autoscaler v2 matches launch requests to listed nodes, so it is listed once
more. A running node not yet RAY_UP is looked at by every listing (its record is never
reused, no tick is quiet). Once RAY_UP, the node's address is the one its Ray bound
(ray.json: `node_ip_interface`'s where set), which the provider's internal_ip reads onto the
record (`ip`, under the provider's lock, once it names one), kept while the record is
rebuilt; Slurm's NodeAddr before. RAY_UP and a worker's `came_up` event (it clears its type's
crash hold-back, as `crashed` sets it: both with or without disable_node_updaters) follow
ray.json, which the agent writes either way; only a worker's status tag waits for that
setting (`watch_workers`, which bootstrap forces: workers start Ray themselves). "create" and
"terminate" are the provider's create_node and terminate_nodes, under its lock. For the run's
records (history.py), a listing also reports each job listed in a new Slurm state, each node
first seen up, and each record it dropped: transitions only, nothing on an unchanged job.
"""

from __future__ import annotations

import enum
import operator
from collections.abc import Callable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Protocol

from ray.autoscaler.tags import (
    NODE_KIND_HEAD,
    NODE_KIND_WORKER,
    STATUS_SETTING_UP,
    STATUS_UNINITIALIZED,
    STATUS_UP_TO_DATE,
    TAG_RAY_NODE_KIND,
    TAG_RAY_NODE_STATUS,
    TAG_RAY_USER_NODE_TYPE,
)

from ray_slurm_provider.jobs import GROUP_TAG, decode_tags
from ray_slurm_provider.nodespec import member_ids, released_whole, split
from ray_slurm_provider.slurm.client import Job


class Phase(enum.Enum):
    CREATED = "created"
    LISTED = "listed"
    RAY_UP = "ray-up"
    GHOST = "ghost"
    RELEASED = "released"
    CANCELLING = "cancelling"


#: A tuple, not a set: identity tests, as Enum's hash runs in Python (per node per tick).
HIDDEN = (Phase.RELEASED, Phase.CANCELLING)
_PENDING = (Phase.CREATED, Phase.GHOST, Phase.CANCELLING)
# Module names for the members: `Phase.X` is a descriptor call (~0.1 us), and the loops
# below run over every record of every listing (bench/p4_listing_cpu.py).
_CREATED = Phase.CREATED
_LISTED = Phase.LISTED
_RAY_UP = Phase.RAY_UP
_GHOST = Phase.GHOST
_RELEASED = Phase.RELEASED
_CANCELLING = Phase.CANCELLING


@dataclass(frozen=True)
class Group:
    """A gang member's group: its Slurm job, the job's N and the member's index."""

    job_id: str
    size: int
    index: int


@dataclass(slots=True)
class Node:
    """One Ray node: its Slurm job (as last listed), its tags and where it stands."""

    job: Job
    tags: dict[str, str]
    phase: Phase = _LISTED
    group: Group | None = None
    born: int = 0  # CREATED: how many listings had started when sbatch returned
    since: float = 0.0  # CANCELLING: when the scancel was sent
    #: RAY_UP: the address its Ray bound, read from ray.json by internal_ip (not by the
    #: listing: autoscaler v2 never asks); None: not read yet, or ray.json named none.
    ip: str | None = None

    @property
    def job_id(self) -> str:
        return self.group.job_id if self.group is not None else self.job.job_id


class Files(Protocol):
    """What the cluster directory says of a node (state.ClusterDir)."""

    def tags(self, job_id: str) -> dict[str, str]: ...

    def ray_up(self, job_id: str) -> bool: ...

    def released(self, node_id: str) -> bool: ...


@dataclass(frozen=True)
class Rules:
    submit_tag: str  # the job comment's submission nonce (submit.py)
    watch_workers: bool  # workers start Ray themselves: their status follows ray.json
    gone_ttl_s: float  # how long a cancelled job stays hidden while Slurm still lists it


@dataclass
class Events:
    """What a listing tells the provider to do."""

    strays: list[str] = field(default_factory=list)  # jobs of failed submissions: cancel
    came_up: list[str] = field(default_factory=list)  # node types whose worker's Ray came up
    orphans: list[str] = field(default_factory=list)  # node ids: ended, Ray still up
    crashed: list[tuple[str, Node]] = field(default_factory=list)  # (job id, record)
    heads: list[Node] = field(default_factory=list)
    # For the run's records (history.py), each once per job: listed in a new Slurm state,
    # its Ray seen up (node ids), gone from the active list.
    listed: list[tuple[str, Job, dict[str, str]]] = field(default_factory=list)
    ray_up: list[str] = field(default_factory=list)
    gone: list[Node] = field(default_factory=list)


@dataclass
class Tick:
    """One listing's outcome: every record (hidden ones too), the shown ids in order."""

    nodes: dict[str, Node]
    shown: list[str]
    events: Events
    #: Nothing may change before the listing does (no creation or cancellation pending, no
    #: node running before its Ray is up): the next tick may reuse this one (the provider's
    #: steady tick).
    quiet: bool
    ghosts: bool  # a GHOST was kept: the next tick re-reads every record's files
    jobs: Sequence[Job] = ()  # the listing it came from
    #: The ids of every job the listing showed, COMPLETING ones too (provider/ends.py waits
    #: while a job that left the active list is still there).
    listed: AbstractSet[str] = frozenset()
    #: The tags generation it was made at (the provider's; None: reuse no record next tick).
    key: tuple[str, int] | None = None


def unchanged(rec: Node, job: Job) -> bool:
    """`rec` (from the last tick) still describes `job`; the caller checks the files. A
    running node whose Ray is not up yet is looked at again (ray.json)."""
    return (rec.phase is _RAY_UP or (rec.phase is _LISTED and not job.running)) and (
        rec.job.state == job.state and rec.job.comment == job.comment
        and rec.tags.get(TAG_RAY_NODE_STATUS) != STATUS_SETTING_UP)


def worker_status(job: Job, up: bool) -> str:
    """A worker's status tag (its agent starts Ray, not a node updater)."""
    if up:
        return STATUS_UP_TO_DATE
    return STATUS_SETTING_UP if job.running else STATUS_UNINITIALIZED


def same_listing(jobs: Sequence[Job], last: Sequence[Job]) -> bool:
    """This listing is the last one, Job object for Job object (the CLI client gives back the
    same objects, even the same list, for an unchanged listing: slurm/parse.SqueueCache)."""
    return jobs is last or (len(jobs) == len(last) and all(map(operator.is_, jobs, last)))


class _Listing:
    """The state of one `advance` call."""

    def __init__(self, prev: Mapping[str, Node], files: Files, rules: Rules,
                 reuse: bool) -> None:
        self.prev = prev
        self.files = files
        self.rules = rules
        self.reuse = reuse
        self.nodes: dict[str, Node] = {}
        self.events = Events()
        self.crashed: set[str] = set()  # jobs

    def released(self, node_id: str) -> bool:
        rec = self.prev.get(node_id)
        return (rec is not None and rec.phase is _RELEASED) or self.files.released(node_id)

    def record(self, node_id: str, job: Job, created: dict[str, str],
               group: Group | None) -> None:
        """Last tick's record of an unchanged job (most of them, at scale), else a new one
        from the comment's creation tags and the node's files."""
        rec = self.prev.get(node_id)
        if self.reuse and rec is not None and unchanged(rec, job):
            rec.job = job
            self.nodes[node_id] = rec
            return
        tags = {**created, **self.files.tags(node_id)}
        # Once seen up, a node is not looked at again: a worker's Ray stays up until its job
        # ends (agent/); a head's may be stopped and started again in its job (`ray stop`,
        # `ray up`: handoff.py), on the same node, so with the same address. A job that is
        # not running cannot have come up.
        seen = rec if rec is not None and rec.phase is _RAY_UP else None
        up = seen is not None or (job.running and self.files.ray_up(node_id))
        worker = tags.get(TAG_RAY_NODE_KIND) == NODE_KIND_WORKER
        if worker and self.rules.watch_workers:
            tags[TAG_RAY_NODE_STATUS] = worker_status(job, up)
        if worker and up and seen is None:
            self.events.came_up.append(tags.get(TAG_RAY_USER_NODE_TYPE, ""))
        first = group is None or group.index == 0
        if first and (rec is None or rec.phase in _PENDING or rec.job.state != job.state):
            self.events.listed.append((group.job_id if group else node_id, job, tags))
        if first and up and seen is None:
            self.events.ray_up.append(node_id)
        phase = _RAY_UP if up else _LISTED
        ip = seen.ip if seen is not None else None
        self.nodes[node_id] = Node(job, tags, phase, group, ip=ip)

    def ended(self, node_id: str, rec: Node) -> None:
        """A record the listing dropped. A worker shown before (pending or running: a job
        whose prologue fails goes from PENDING to gone between two ticks) that left the queue
        without our scancel or release: an orphan if its Ray is up, else a crash before Ray
        (a gang job's members count once)."""
        if rec.group is None or rec.group.index == 0:
            self.events.gone.append(rec)
        if rec.phase in HIDDEN or not rec.job.active:
            return
        if rec.tags.get(TAG_RAY_NODE_KIND) != NODE_KIND_WORKER or self.released(node_id):
            return
        job_id = split(node_id)[0]
        if self.files.ray_up(node_id):
            self.events.orphans.append(node_id)
        elif rec.phase is not _RAY_UP and job_id not in self.crashed:
            self.crashed.add(job_id)
            self.events.crashed.append((job_id, rec))

    def job(self, job: Job, cancelling: set[str], stray: Callable[[str | None], bool]) -> None:
        """The records of one listed job: none for a job not ours, not active or being
        cancelled; a gang job's released members stay hidden unless all are released (a
        job released whole but still listed was not cancelled: shown, to cancel again)."""
        rec = self.prev.get(job.job_id)
        if self.reuse and rec is not None and unchanged(rec, job):  # most jobs, at scale
            rec.job = job
            self.nodes[job.job_id] = rec
            return
        created = decode_tags(job.comment)
        if created is None or not job.active or job.job_id in cancelling:
            return
        if stray(created.pop(self.rules.submit_tag, None)):
            self.events.strays.append(job.job_id)
            return
        size = int(created.pop(GROUP_TAG, "1"))
        if size == 1:
            self.record(job.job_id, job, created, None)
            return
        ids = member_ids(job.job_id, size)
        whole = released_whole(job.job_id, size, self.released)
        for k, node_id in enumerate(ids):
            group = Group(job.job_id, size, k)
            if not whole and self.released(node_id):
                self.nodes[node_id] = Node(job, {}, _RELEASED, group)
            else:
                self.record(node_id, job, dict(created), group)


def advance(prev: Mapping[str, Node], jobs: Sequence[Job], *, listing: int, now: float,
            reuse: bool, files: Files, rules: Rules,
            stray: Callable[[str | None], bool]) -> Tick:
    """The records after listing number `listing` (`jobs`, taken at `now`), from the records
    before it. `reuse`: no tags file changed since, so an unchanged job's record is kept."""
    cancelling = {r.job_id for r in prev.values()
                  if r.phase is _CANCELLING and now - r.since < rules.gone_ttl_s}
    run = _Listing(prev, files, rules, reuse)
    for job in jobs:
        run.job(job, cancelling, stray)
    nodes = run.nodes
    listed = {j.job_id for j in jobs}
    ghosts = False
    for node_id, rec in prev.items():
        if node_id in nodes:
            continue
        if _kept(rec, listing, listed, cancelling):
            nodes[node_id] = rec
            ghosts = ghosts or rec.phase is _GHOST
        else:
            run.ended(node_id, rec)
    # One pass (10,000 records at scale): the shown ids, the heads, and whether the tick is
    # quiet: no record waits for a listing to move it on (none CREATED, GHOST or CANCELLING,
    # none running before its Ray is up: it may come up, so ray.json is looked for next tick).
    shown: list[str] = []
    quiet = True
    for node_id, rec in nodes.items():
        if rec.phase in _PENDING:
            quiet = False
        if rec.phase in HIDDEN:
            continue
        shown.append(node_id)
        if rec.tags.get(TAG_RAY_NODE_KIND) == NODE_KIND_HEAD:
            run.events.heads.append(rec)
        if rec.phase is _LISTED and rec.job.running:
            quiet = False
        elif rec.tags.get(TAG_RAY_NODE_STATUS) == STATUS_SETTING_UP:
            quiet = False
    return Tick(nodes, shown, run.events, quiet, ghosts, jobs, listed=listed)


def _kept(rec: Node, listing: int, listed: set[str], cancelling: set[str]) -> bool:
    """Whether a record the listing did not show stays (a settled CREATED worker as a GHOST).
    A CREATED record is shown until a listing started after sbatch returned settles it: one
    in flight before could not know the job."""
    if rec.phase is _CREATED:
        if rec.born >= listing:
            return True
        if rec.tags.get(TAG_RAY_NODE_KIND) != NODE_KIND_WORKER:
            return False
        rec.phase = _GHOST
        return True
    if rec.phase is _RELEASED:
        return rec.job_id in listed
    if rec.phase is _CANCELLING:
        return rec.job_id in cancelling and rec.job_id in listed
    return False


def of_job(nodes: Mapping[str, Node], job_id: str) -> list[str]:
    """The node ids of a job: itself, or its gang's members."""
    return [i for i in list(nodes) if i == job_id or split(i)[0] == job_id]


def group_size(nodes: Mapping[str, Node], job_id: str) -> int:
    """A gang job's N from any record of its members (0: none is known any more)."""
    first = nodes.get(f"{job_id}.0")
    if first is not None and first.group is not None:  # no scan of every record
        return first.group.size
    for node_id in of_job(nodes, job_id):
        group = nodes[node_id].group
        if group is not None:
            return group.size
    return 0


def describe(node_id: str, rec: Node | None) -> str:
    """One line on where a node's job stands, in Slurm's words."""
    if rec is None:
        return f"Slurm job {node_id} is gone"
    j = rec.job
    where = f" on {j.batch_host}" if j.batch_host else ""
    why = f", reason: {j.reason}" if j.reason and j.reason != "None" else ""
    # A pending job's %S is the scheduler's estimate (what `squeue --start` shows), once the
    # backfill scheduler has one.
    if j.state == "PENDING" and j.start_time:
        why += f", estimated start {j.start_time} (Slurm's estimate)"
    return f"Slurm job {node_id} is {j.state}{where}{why}"
