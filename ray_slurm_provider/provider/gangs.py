"""Gang node types (`node_config.nodes: N`, N >= 2): one Slurm job of N nodes is N Ray nodes.

The one home of the group rules; the provider and its snapshot only call them.

* Ids: the members of job (or array task) `J` are `J.0` ... `J.<N-1>` (nodespec.py), `k`
  being Slurm's SLURM_NODEID of the member's node. The job comment carries N
  (`jobs.GROUP_TAG`), so a listing needs nothing else, and a changed config never re-sizes
  a running group.
* All or nothing: the job's one step runs one node agent per node (`srun`, one task per
  node), so no member's Ray exists before Slurm has started the whole job.
* A demand for k nodes launches ceil(k/N) jobs. Autoscaler v2 adopts the members it did not
  ask for as instances of the type (`_handle_extra_cloud_instances`); v1 counts them as
  workers of the type. Either scales them down like any other node once idle.
* Released: terminating a member (the autoscaler found it idle) stops its Ray and ends its
  task with exit 0 (the `released` marker of its node dir, which its agent watches); the member
  leaves the listing at once, and the job is cancelled when its last member is released. So
  a group's allocation ends only when all its nodes were idle. A job whose every member was
  released but which was not cancelled (scancel failed) is listed whole again, as a one-node
  job would be, so the next terminate call (or `ray down`) cancels it.
* Lost: a member whose Ray dies ends its agent with an error; `srun --kill-on-bad-exit`
  then ends every other member and the job, and all N leave the same listing. A node that
  fails ends the job in Slurm. Either way the group is replaced as one.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterable

from ray_slurm_provider.jobs import group_size
from ray_slurm_provider.nodespec import member_ids, released_whole, split
from ray_slurm_provider.provider.snapshot import NodeRecord
from ray_slurm_provider.slurm.client import SlurmClient
from ray_slurm_provider.slurm.parse import expand_hostlist
from ray_slurm_provider.state import ClusterDir


def groups(count: int, n: int) -> int:
    """Jobs that give `count` nodes of a type with N nodes per job."""
    return math.ceil(count / n)


def by_job(node_ids: Iterable[str]) -> dict[str, set[int]]:
    """The members among `node_ids`, grouped by job (one-node jobs left out)."""
    out: dict[str, set[int]] = {}
    for node_id in node_ids:
        job, k = split(node_id)
        if k is not None:
            out.setdefault(job, set()).add(k)
    return out


def release(node_ids: Iterable[str], size: Callable[[str], int],
            released: Callable[[str], bool], mark: Callable[[str], None]) -> dict[str, int]:
    """Release the members among `node_ids` (`mark` each); return the jobs every member of
    which is now released, with their N: those are to be cancelled. `size(job)` is the job's
    N (0: no member is known any more: cancel), `released(node id)` whether a member was
    released before."""
    done = {}
    for job, ks in by_job(node_ids).items():
        for k in ks:
            mark(f"{job}.{k}")
        n = size(job)
        if all(k in ks or released(f"{job}.{k}") for k in range(n)):
            done[job] = n
    return done


class GangHooks:
    """The provider's side of the rules above (SlurmNodeProvider inherits it)."""

    cluster_dir: ClusterDir
    _lock: threading.RLock
    _nodes: dict[str, NodeRecord]
    _addrs: dict[str, str]
    #: Members released by this process, and the N of the gang jobs it knows: a listing that
    #: was in flight while a member was released must not bring it back.
    _released: set[str]
    _sizes: dict[str, int]
    _born: dict[str, int]
    _gone: dict[str, float]
    _gen: tuple[str, int] | None
    _clock: Callable[[], float]

    @property
    def slurm(self) -> SlurmClient:
        raise NotImplementedError

    def released(self, node_id: str) -> bool:
        return node_id in self._released or self.cluster_dir.node(node_id).released()

    def _release(self, member: str) -> None:
        ndir = self.cluster_dir.node(member)
        ndir.path.mkdir(parents=True, exist_ok=True)  # a member whose agent never ran
        ndir.release()
        self._released.add(member)

    def _size(self, job_id: str) -> int:
        """The job's N: as created here, else from a listed member's job comment (0: no
        member is listed any more)."""
        if job_id in self._sizes:
            return self._sizes[job_id]
        for node_id, rec in list(self._nodes.items()):
            if split(node_id)[0] == job_id:
                return group_size(rec.job.comment, default=0)
        return 0

    def node_ids(self, job_id: str, n: int) -> list[str]:
        """The node ids of a job just created: its own, or its N members' (whose dirs a job
        of the same id, Slurm's ids having started again, may have left: forgotten)."""
        if n == 1:
            return [job_id]
        self._sizes[job_id] = n
        ids = member_ids(job_id, n)
        self.cluster_dir.forget(ids)
        return ids

    def to_cancel(self, ids: list[str]) -> tuple[list[str], list[str]]:
        """`ids` as (jobs to cancel, node dirs to forget with them): one-node jobs as they
        are; gang members released (they leave the listing now), and a gang job only once
        its last member is released."""
        members = [i for i in ids if split(i)[1] is not None]
        if not members:
            return ids, ids
        with self._lock:
            jobs = release(members, self._size, self.released, self._release)
            for member in members:  # a job to cancel keeps them until its scancel worked
                if split(member)[0] not in jobs:
                    self._nodes.pop(member, None)
            for job in jobs:  # cancelled from now: a listing meanwhile shows none of them
                self._gone[job] = self._clock()
        singles = [i for i in ids if split(i)[1] is None]
        return [*singles, *jobs], [*singles, *(m for j, n in jobs.items()
                                                for m in member_ids(j, n))]

    def cancel_jobs(self, ids: list[str]) -> None:
        """One scancel of `ids`. If it fails, none counts as cancelled: a group released
        whole is listed whole again, from a fresh listing (not last tick's records), so the
        next terminate call cancels it."""
        try:
            self.slurm.cancel(ids)
        except Exception:
            with self._lock:
                for i in ids:
                    self._gone.pop(i, None)
                self._gen = None
            raise

    def drop_released(self, nodes: dict[str, NodeRecord], listed: set[str]) -> None:
        """Leave this process's released members out of a listing (taken, maybe, before they
        were released); forget what it knew of gang jobs that are no longer `listed`."""
        for m in self._released & nodes.keys():
            job = split(m)[0]  # a job released whole but not cancelled shows: cancel again
            n = group_size(nodes[m].job.comment)
            if job in self._gone or not released_whole(job, n, self.released):
                del nodes[m]
        self._released = {m for m in self._released if split(m)[0] in listed}
        # A job created while this listing was in flight is not in it yet (`_born`).
        self._sizes = {j: n for j, n in self._sizes.items()
                       if j in listed or f"{j}.0" in self._born}

    def members(self, job_id: str) -> list[str]:
        """The node ids listed for a job: itself, or its gang's members."""
        return [i for i in list(self._nodes) if i == job_id or split(i)[0] == job_id]

    def member_ip(self, node_id: str, rec: NodeRecord | None) -> str | None:
        """A node's address: its job's batch host's; for a gang member, the k-th host of its
        job's node list (k = 0 is the batch host), looked up once per host. None while the
        job is pending (no node yet), as Ray's cloud providers do."""
        if rec is None:
            return None
        job, k = rec.job, split(node_id)[1]
        if not k:
            return job.node_addr or None
        hosts = expand_hostlist(job.nodes) if job.nodes else []
        if k >= len(hosts):
            return None
        if hosts[k] not in self._addrs:
            addr = self.slurm.node_address(hosts[k])
            if addr is None:
                return None
            self._addrs[hosts[k]] = addr
        return self._addrs[hosts[k]]
