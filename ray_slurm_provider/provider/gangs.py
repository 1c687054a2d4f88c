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
  task with exit 0 (the `stop` file of its node dir, which its agent watches); the member
  leaves the listing at once, and the job is cancelled when its last member is released. So
  a group's allocation ends only when all its nodes were idle.
* Lost: a member whose Ray dies ends its agent with an error; `srun --kill-on-bad-exit`
  then ends every other member and the job, and all N leave the same listing. A node that
  fails ends the job in Slurm. Either way the group is replaced as one.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterable

from ray_slurm_provider.jobs import GROUP_TAG, decode_tags
from ray_slurm_provider.nodespec import split
from ray_slurm_provider.provider.snapshot import NodeRecord
from ray_slurm_provider.slurm.client import Job, SlurmClient
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
            released: Callable[[str], bool], mark: Callable[[str], None]) -> list[str]:
    """Release the members among `node_ids` (`mark` each); return the jobs every member of
    which is now released: those are to be cancelled. `size(job)` is the job's N (0: not
    known any more, cancel), `released(node id)` whether a member was released before."""
    done = []
    for job, ks in by_job(node_ids).items():
        for k in ks:
            mark(f"{job}.{k}")
        n = size(job)
        if all(k in ks or released(f"{job}.{k}") for k in range(n)):
            done.append(job)
    return done


class GangHooks:
    """The provider's side of the rules above (SlurmNodeProvider inherits it)."""

    cluster_dir: ClusterDir
    _lock: threading.RLock
    _nodes: dict[str, NodeRecord]
    _addrs: dict[str, str]

    @property
    def slurm(self) -> SlurmClient:
        raise NotImplementedError

    def released(self, node_id: str) -> bool:
        return self.cluster_dir.node(node_id).stop_requested()

    def _release(self, member: str) -> None:
        ndir = self.cluster_dir.node(member)
        ndir.path.mkdir(parents=True, exist_ok=True)  # a member whose agent never ran
        ndir.request_stop()

    def _size(self, job_id: str) -> int:
        """The job's N from a record of any member still listed (0: none is)."""
        for node_id, rec in list(self._nodes.items()):
            if split(node_id)[0] == job_id:
                return int((decode_tags(rec.job.comment) or {}).get(GROUP_TAG, "0"))
        return 0

    def to_cancel(self, ids: list[str]) -> list[str]:
        """`ids` as jobs to cancel: one-node jobs as they are; gang members released (they
        leave the listing now), and a gang job only once its last member is released."""
        members = [i for i in ids if split(i)[1] is not None]
        if not members:
            return ids
        jobs = release(members, self._size, self.released, self._release)
        with self._lock:
            for member in members:
                self._nodes.pop(member, None)
        return [i for i in ids if split(i)[1] is None] + jobs

    def node_dirs(self, job_ids: list[str]) -> list[str]:
        """The node dirs of cancelled jobs: their own, and their gang members'."""
        wanted = set(job_ids)
        return [*job_ids, *(m for m in self.cluster_dir.known_nodes()
                            if m not in wanted and split(m)[0] in wanted)]

    def members(self, job_id: str) -> list[str]:
        """The node ids listed for a job: itself, or its gang's members."""
        return [i for i in list(self._nodes) if i == job_id or split(i)[0] == job_id]

    def member_ip(self, node_id: str, job: Job) -> str | None:
        """A member's address: the k-th host of its job's node list (k = 0 is the batch
        host, whose address the listing has); looked up once per host."""
        k = split(node_id)[1]
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
