"""SlurmNodeProvider: Ray's cluster launcher and autoscaler, on Slurm.

Design
------
* A Ray node is a Slurm job, or one task of a job array (N nodes of a type in one sbatch);
  the node id is squeue's %i (`123`, `123_4`); a gang job of N nodes is N Ray nodes
  `<job>.<k>` (gangs.py). All jobs of cluster C are named `ray-C`: ONE
  `squeue --me --array --name=ray-C` lists the whole cluster, every task on its own.
* Slurm is the source of truth for which nodes exist. Creation tags (kind, node type, launch
  hash, launch request) ride in the job comment; tags Ray changes later (node status, runtime
  hashes) live in the cluster directory on the shared filesystem (state.py), read the same
  way by `ray up` and the head's autoscaler.
* `non_terminated_nodes` is the only call that asks Slurm: it refreshes a snapshot under a
  lock, and every other query (`node_tags`, `is_running`, `internal_ip`, ...) is answered from
  it. A failed listing raises -- an empty or partial list would make the autoscaler launch
  duplicates and strand live nodes. A created node joins the snapshot at once, a terminated
  one leaves it at once.
* PENDING/CONFIGURING/RUNNING/SUSPENDED jobs are nodes; COMPLETING and final states are not.
* Workers start Ray themselves in their batch step (agent/) and report it through the
  cluster directory; a worker reads `up-to-date` only once its Ray is up (so v1's liveness
  check never kills a node that is still starting).
* The constructor never raises and never calls Slurm (a raising one would take the head's
  autoscaler down): config errors surface on first use.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from typing import Any

from ray.autoscaler.node_provider import NodeProvider
from ray.autoscaler.tags import (
    NODE_KIND_HEAD,
    NODE_KIND_WORKER,
    TAG_RAY_NODE_KIND,
    TAG_RAY_NODE_STATUS,
    TAG_RAY_USER_NODE_TYPE,
)

from ray_slurm_provider import auth
from ray_slurm_provider.cluster import ClusterConfig
from ray_slurm_provider.config import ConfigError, ProviderConfig, parse_node_config
from ray_slurm_provider.jobs import GROUP_TAG, build_job, job_name
from ray_slurm_provider.nodespec import split
from ray_slurm_provider.provider import runs, validation
from ray_slurm_provider.provider.bootstrap import ConfigHooks
from ray_slurm_provider.provider.gangs import GangHooks, groups
from ray_slurm_provider.provider.guard import LaunchGuard, died_before_ray
from ray_slurm_provider.provider.snapshot import (
    NodeRecord,
    Snapshot,
    describe,
    keep_created,
    same_listing,
    settling,
    take,
    vanished_workers,
    worker_status,
)
from ray_slurm_provider.provider.submit import SUBMIT_TAG, Strays, submit_nodes
from ray_slurm_provider.provider.teardown import TeardownHooks
from ray_slurm_provider.provider.walltime import HeadWalltime
from ray_slurm_provider.slurm.client import Job, SlurmClient, SlurmError
from ray_slurm_provider.slurm.factory import make_client
from ray_slurm_provider.state import ClusterDir

logger = logging.getLogger(__name__)


class SlurmNodeProvider(ConfigHooks, TeardownHooks, GangHooks, NodeProvider):
    #: Longer than Slurm takes to end a cancelled job (KillWait, 30 s by default, plus epilog).
    GONE_TTL_S = 120.0

    def __init__(self, provider_config: dict[str, Any], cluster_name: str) -> None:
        super().__init__(provider_config, cluster_name)
        self._lock = threading.RLock()
        self._nodes: dict[str, NodeRecord] = {}
        # Cancelled -> when: hidden until Slurm drops them, at most GONE_TTL_S (one that
        # outlives its scancel must show up again). Created -> listings started by then.
        self._gone, self._born = dict[str, float](), dict[str, int]()
        self._addrs, self._released, self._sizes = dict[str, str](), set[str](), dict[str, int]()
        self._listings, self._clock, self._sleep = 0, time.monotonic, time.sleep
        self._client: SlurmClient | None = None
        self._config_error: ConfigError | None = None
        try:
            self.cluster = validation.check_section(provider_config, cluster_name)
        except ConfigError as e:
            self._config_error = e
            self.cluster = ClusterConfig(cluster_name, ProviderConfig(), "", {})
        self.pcfg = self.cluster.provider
        self.cluster_dir = ClusterDir(self.pcfg.state_dir, cluster_name)
        self.guard = LaunchGuard(self.cluster_dir.root / "errors.json")
        self.strays = Strays()
        self.head_time = HeadWalltime(self.cluster_dir.root / "walltime.json")
        self._ray_seen: set[str] = set()  # workers whose Ray was seen up
        self._gen: tuple[str, int] | None = None  # tags and strays as of the last listing
        self._jobs: list[Job] = []  # the last listing: the same one again is a steady tick
        self._heads: list[NodeRecord] = []  # and whether a worker's Ray may come up:
        self._settling = False

    # --- Slurm access ------------------------------------------------------------------
    @property
    def slurm(self) -> SlurmClient:
        if self._config_error is not None:
            raise self._config_error
        if self._client is None:
            self._client = make_client(self.pcfg)
        return self._client

    def describe_job(self, node_id: str) -> str:
        """One line on where a node's job stands, in Slurm's words."""
        return describe(node_id, self._record(node_id))

    # --- listing -----------------------------------------------------------------------
    def non_terminated_nodes(self, tag_filters: dict[str, str]) -> list[str]:
        with self._lock:
            self._listings += 1
            listing = self._listings
            now = self._clock()
            self._gone = {i: t for i, t in self._gone.items() if now - t < self.GONE_TTL_S}
        jobs = self.slurm.list_jobs(job_name(self.cluster_name))  # raises on any error
        # Last tick's records are reused only while no tags file or stray changed since.
        gen = (self.cluster_dir.tags_generation(), self.strays.generation)
        steady = (gen == self._gen and not self._gone and not self._born and not self._settling
                  and same_listing(jobs, self._jobs))  # then every record is last tick's
        prev, self._gen, self._jobs = (self._nodes if gen == self._gen else {}), gen, jobs
        snap = Snapshot(dict(prev)) if steady else take(
            jobs, prev, gone=self._gone, stray=self.strays.__contains__, submit_tag=SUBMIT_TAG,
            tags=self._tags, released=self.released)
        nodes, strays = snap.nodes, snap.strays
        with self._lock:
            if keep_created(nodes, self._nodes, self._born, self._gone, listing):
                self._gen = None  # next tick rebuilds its records: the kept one is gone
            listed = {j.job_id for j in jobs}
            self.drop_released(nodes, listed)  # gangs.py
            if self._gone:  # forget a cancelled job once Slurm no longer lists it
                self._gone = {i: t for i, t in self._gone.items() if i in listed}
            before, self._nodes = self._nodes, nodes
            ids = [i for i, r in nodes.items()
                   if all(r.tags.get(k) == v for k, v in tag_filters.items())
                   ] if tag_filters else list(nodes)
        if steady:  # nothing vanished, nothing new: only the head's time left moves
            for rec in self._heads:
                self.head_time.observe(rec.job)
        else:
            self._after_listing(before, nodes, strays)
        return ids

    def _after_listing(self, before: dict[str, NodeRecord], nodes: dict[str, NodeRecord],
                       strays: list[str]) -> None:
        """What the listing just made tells, at no further scheduler cost."""
        if strays:
            logger.warning("Cancelling Slurm jobs %s: their submission was reported to Ray as "
                           "failed, so Ray has launched again", ", ".join(strays))
            try:
                self.terminate_nodes(strays)
            except SlurmError as e:
                logger.warning("Could not cancel %s yet: %s", strays, e.slurm_message)
        crashed: set[str] = set()  # a gang job's members count once
        for node_id, rec in vanished_workers(before, nodes, self._gone, self.released):
            job_id = split(node_id)[0]
            if self.cluster_dir.ray_up(node_id):
                # Slurm ended the job (e.g. its node was set DOWN) but its Ray still runs as
                # an orphan: its agent stops it (agent/headwatch.py), so Ray sees the node leave.
                logger.warning("Slurm job %s has ended but its Ray still runs: stopping it",
                               job_id)
                with contextlib.suppress(OSError):
                    self.cluster_dir.node(node_id).request_stop()
            elif node_id not in self._ray_seen and job_id not in crashed:  # before Ray came up
                crashed.add(job_id)
                died_before_ray(self.guard, self.slurm, rec.tags.get(TAG_RAY_USER_NODE_TYPE, ""),
                                job_id, rec.job.state, self.cluster_dir.log(job_id))
        self._ray_seen &= nodes.keys()
        self._heads = [r for r in nodes.values()
                       if r.tags.get(TAG_RAY_NODE_KIND) == NODE_KIND_HEAD]
        self._settling = settling(nodes.values())
        for rec in self._heads:
            self.head_time.observe(rec.job)

    def _tags(self, node_id: str, job: Job, created: dict[str, str]) -> dict[str, str]:
        tags = {**created, **self.cluster_dir.tags(node_id)}
        if tags.get(TAG_RAY_NODE_KIND) == NODE_KIND_WORKER and self.pcfg.disable_node_updaters:
            status, came_up = worker_status(node_id, job, self._ray_seen,
                                            self.cluster_dir.ray_up)
            tags[TAG_RAY_NODE_STATUS] = status
            if came_up:
                self.guard.ray_started(tags.get(TAG_RAY_USER_NODE_TYPE, ""))
        return tags

    def _record(self, node_id: str) -> NodeRecord | None:
        return self._nodes.get(node_id)  # atomic; called per node per tick (no lock)

    def is_running(self, node_id: str) -> bool:
        rec = self._record(node_id)
        return rec is not None and rec.job.running

    def is_terminated(self, node_id: str) -> bool:
        return self._record(node_id) is None

    def node_tags(self, node_id: str) -> dict[str, str]:
        rec = self._record(node_id)
        return dict(rec.tags) if rec else {}

    def internal_ip(self, node_id: str) -> str | None:  # type: ignore[override]
        return self.member_ip(node_id, self._record(node_id))  # gangs.py

    def external_ip(self, node_id: str) -> str | None:  # type: ignore[override]
        return self.internal_ip(node_id)

    def set_node_tags(self, node_id: str, tags: dict[str, str]) -> None:
        self.cluster_dir.set_tags(node_id, tags)
        with self._lock:
            rec = self._nodes.get(node_id)
            if rec is not None:
                rec.tags.update(tags)

    # --- creating ----------------------------------------------------------------------
    def create_node(self, node_config: dict[str, Any], tags: dict[str, str],
                    count: int) -> dict[str, Any]:
        return self.create_node_with_resources_and_labels(node_config, tags, count, {}, {})

    def create_node_with_resources_and_labels(
        self, node_config: dict[str, Any], tags: dict[str, str], count: int,
        resources: dict[str, float], labels: dict[str, str],
    ) -> dict[str, Any]:
        node_type = tags.get(TAG_RAY_USER_NODE_TYPE, "")
        head = tags.get(TAG_RAY_NODE_KIND, NODE_KIND_WORKER) == NODE_KIND_HEAD
        if self._config_error is not None:
            raise self._config_error
        # Ray passes the node type's node_config; the rest of the type (commands, default
        # resources and labels) is in the provider section bootstrap wrote.
        nt = dataclasses.replace(self.cluster.node_type(node_type),
                                 node_config=parse_node_config(node_config, node_type))
        spec = build_job(
            self.pcfg, self.cluster_name, nt, kind="head" if head else "worker",
            python=self.cluster.agent_python(head=head),
            resources={k: int(v) for k, v in resources.items()} if resources else None,
            labels=dict(labels) if labels else None)
        self.cluster_dir.create()
        if self.pcfg.auth.mode == "token":
            auth.ensure_token(self.cluster_dir.root)
        if head:
            self.cluster_dir.clear_teardown()
            listed = self.slurm.list_jobs(job_name(self.cluster_name))  # their logs stay
            runs.new_run(self.cluster_dir, [j.job_id for j in listed])  # ids may restart
        n = nt.node_config.nodes  # a gang type: whole groups of n nodes, one job each
        ids, refused = submit_nodes(self.slurm, self.guard, self.strays, spec,
                                    {**tags, GROUP_TAG: str(n)} if n > 1 else tags, node_type,
                                    head, groups(count, n))  # one sbatch (an array) if it can
        if head:
            runs.record_head(self.cluster_dir, ids[0])
        logger.info("Submitted Slurm job(s) %s for %s node type %s", ", ".join(ids),
                    "the head of" if head else "workers of", node_type)
        created: dict[str, Any] = {}
        for job_id in ids:
            job = Job(job_id=job_id, name=spec.job_name, state="PENDING",
                      partition=nt.node_config.partition or "")
            for node_id in self.node_ids(job_id, n):
                with self._lock:
                    self._nodes[node_id] = NodeRecord(job, dict(tags))
                    self._born[node_id] = self._listings
                created[node_id] = job
        if refused is not None:  # Slurm took only these: they are recorded, the launch failed
            raise refused
        return created

    # --- terminating -------------------------------------------------------------------
    def terminate_node(self, node_id: str) -> dict[str, Any] | None:
        return self.terminate_nodes([node_id])

    def terminate_nodes(self, node_ids: list[str]) -> dict[str, Any] | None:
        ids, dirs = self.to_cancel(self.spare_own_job([str(i) for i in node_ids]))
        if not ids:  # nothing, or gang members whose groups live on (gangs.py)
            return None
        down = any(self.node_tags(i).get(TAG_RAY_NODE_KIND) == NODE_KIND_HEAD for i in ids)
        if down:
            self.cluster_dir.mark_teardown()  # the head goes: its workers skip Ray's drain
        self.cancel_jobs(ids)  # one call; jobs already gone are fine; errors raise
        with self._lock:
            now = self._clock()
            for i in ids:
                for node_id in self.members(i):
                    self._nodes.pop(node_id, None)
                self._gone[i] = now
        self.cluster_dir.forget(dirs)
        logger.info("Cancelled Slurm jobs %s", ", ".join(ids))
        if down:  # `ray down`: done once Slurm has ended them (teardown.py)
            self.wait_for_jobs_to_end(ids)
        return None

    def get_command_runner(self, log_prefix: str, node_id: str, auth_config: dict[str, Any],
                           cluster_name: str, process_runner: Any, use_internal_ip: bool,
                           docker_config: dict[str, Any] | None = None) -> Any:
        from ray_slurm_provider.provider.runner import SrunCommandRunner

        return SrunCommandRunner(self, node_id, log_prefix)
