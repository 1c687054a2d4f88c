"""`ray down`: it returns once Slurm has ended the cluster's jobs, not 5 s later.

Ray's teardown loop (`ray down`) calls `terminate_nodes` with every node, sleeps its
`POLL_INTERVAL` (5 s) and lists again until nothing is left. Here, when the head is among the
nodes, `terminate_nodes` returns only once Slurm lists none of the cancelled jobs and none of
the cluster's jobs is COMPLETING (their agents have stopped Ray and removed their containers),
or after `END_WAIT_S`. Ray's sleep would then only delay the exit, so it is shortened for this
process.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable

from ray_slurm_provider import rayapi
from ray_slurm_provider.slurm.client import Job, SlurmClient, SlurmError, ask
from ray_slurm_provider.state import ClusterDir

logger = logging.getLogger(__name__)

SHORT_POLL_S = 0.1
END_WAIT_S = 60.0  # more than Slurm's KillWait (30 s by default) plus an epilog
LIST_EVERY_S = 0.5


def cancel_jobs(slurm: SlurmClient, jobs: list[str],
           sleep: Callable[[float], None] | None = None) -> None:
    """One cancel call for all `jobs`, asked again on a transient error; the last error
    raises. scancel sends one RPC per job, so on a rate-limited controller (issue 29) a long
    list can outlive the command's timeout; jobs the first try cancelled are "already gone"
    to the next (Slurm's words, not an error)."""
    ask(f"cancelling Slurm jobs {', '.join(jobs)}", lambda: slurm.cancel(jobs),
        say=logger.warning, sleep=sleep)


def shorten_ray_down_poll() -> bool:
    """Make Ray's `ray down` loop list again after SHORT_POLL_S; whether it did (rayapi)."""
    return rayapi.shorten_ray_down_poll(SHORT_POLL_S)


def wait_ended(list_jobs: Callable[[], list[Job]], ids: Iterable[str], *,
               timeout: float = END_WAIT_S, clock: Callable[[], float] = time.monotonic,
               sleep: Callable[[float], None] = time.sleep) -> list[str]:
    """Wait until Slurm lists none of `ids` and none of the cluster's jobs is COMPLETING (a
    worker that ended on its own when the head's Ray stopped, the first step of `ray down`,
    was never handed to terminate_nodes); return those still listed at `timeout`. A listing
    Slurm cannot answer says nothing: the wait goes on, within the timeout."""
    wanted = set(ids)
    left = set(wanted)
    deadline = clock() + timeout
    while True:  # at least one listing, also with no ids (`ray down`'s cleanup)
        try:
            left = {j.job_id for j in list_jobs() if j.job_id in wanted or not j.active}
        except SlurmError as e:
            logger.info("Slurm did not answer while the jobs end (%s)", e.slurm_message)
        if not left or clock() >= deadline:
            break
        sleep(LIST_EVERY_S)
    if left:
        logger.warning("Slurm jobs %s are still ending after %.0f s", ", ".join(sorted(left)),
                       timeout)
    return sorted(left)


class Teardown:
    """What `ray down` needs beyond cancelling: sparing the job this process runs in, and
    waiting until Slurm has ended the cluster's jobs. `list_jobs` lists the cluster."""

    def __init__(self, cluster_dir: ClusterDir, list_jobs: Callable[[], list[Job]]) -> None:
        self._cluster_dir = cluster_dir
        self._list_jobs = list_jobs

    @staticmethod
    def spare_own_job(ids: list[str]) -> list[str]:
        """`ids` without the job this process runs in. The head's own autoscaler (its Ray
        carries RAY_CLOUD_INSTANCE_ID, agent/raystart.py) must never cancel the head: a
        `ray up` that restarts Ray on it stops the head's Ray node, which autoscaler v2 then
        terminates (seen on the sandbox); `ray down` runs on the login node."""
        own = os.environ.get("RAY_CLOUD_INSTANCE_ID")
        if own not in ids:
            return ids
        logger.warning("Not cancelling Slurm job %s: this autoscaler runs in it (its Ray "
                       "stopped, e.g. for `ray up`); `ray down` ends the cluster", own)
        return [i for i in ids if i != own]

    def wait_for_jobs_to_end(self, ids: Iterable[str], clock: Callable[[], float],
                             sleep: Callable[[float], None]) -> list[str]:
        return wait_ended(self._list_jobs, ids, clock=clock, sleep=sleep)

    def cleanup(self, clock: Callable[[], float], sleep: Callable[[float], None]) -> None:
        """After `ray down`: wait until no job of the cluster is COMPLETING (one whose head
        was cancelled before Ray's teardown listed it, as seen with a container head, was
        never waited for in terminate_nodes), then forget every node's state and the head's
        address (the token and logs stay); a head.json its agent could not remove would name
        a dead head."""
        self.wait_for_jobs_to_end([], clock, sleep)
        self._cluster_dir.forget(self._cluster_dir.known_nodes())
        self._cluster_dir.clear_head()
