"""Gang node types (`node_config.nodes: N`, N >= 2): one Slurm job of N nodes is N Ray nodes.

The one home of the group rules; the provider and its records (nodes.py) only call them.

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
from collections.abc import Callable, Iterable

from ray_slurm_provider.nodespec import member_ids, split
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


class Gangs:
    """The provider's gang collaborator: the ids of a new gang job's members, a member's
    release marker, and members' NodeAddrs (each host's looked up once)."""

    def __init__(self, cluster_dir: ClusterDir, slurm: Callable[[], SlurmClient]) -> None:
        self._cluster_dir = cluster_dir
        self._slurm = slurm  # the provider's client, made on first use
        self._addrs: dict[str, str] = {}

    def node_ids(self, job_id: str, n: int) -> list[str]:
        """The node ids of a job just created: its own, or its N members' (whose dirs a job
        of the same id, Slurm's ids having started again, may have left: forgotten)."""
        if n == 1:
            return [job_id]
        ids = member_ids(job_id, n)
        self._cluster_dir.forget(ids)
        return ids

    def released(self, node_id: str) -> bool:
        """Whether a member's release marker is there (written by any process)."""
        return self._cluster_dir.released(node_id)

    def release(self, member: str) -> None:
        """Its agent stops Ray and ends its task with exit 0 (state.NodeDir.release)."""
        ndir = self._cluster_dir.node(member)
        ndir.path.mkdir(parents=True, exist_ok=True)  # a member whose agent never ran
        ndir.release()

    def member_ip(self, node_id: str, job: Job | None) -> str | None:
        """A node's NodeAddr (its address until its Ray is up: nodes.py): its job's batch
        host's; for a gang member, the k-th host of its job's node list (k = 0 is the batch
        host), looked up once per host. None while the job is pending (no node yet), as
        Ray's cloud providers do."""
        if job is None:
            return None
        k = split(node_id)[1]
        if not k:
            return job.node_addr or None
        hosts = expand_hostlist(job.nodes) if job.nodes else []
        if k >= len(hosts):
            return None
        if hosts[k] not in self._addrs:
            addr = self._slurm().node_address(hosts[k])
            if addr is None:
                return None
            self._addrs[hosts[k]] = addr
        return self._addrs[hosts[k]]
