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
* `non_terminated_nodes` is the only call that asks Slurm: under a lock, one listing moves
  the provider's records on (nodes.py: one record per Ray node, with its lifecycle), and
  every other query (`node_tags`, `is_running`, `internal_ip`, ...) is answered from them.
  A failed listing raises -- an empty or partial list would make the autoscaler launch
  duplicates and strand live nodes. A created node is listed at once, a terminated one
  leaves at once.
* PENDING/CONFIGURING/RUNNING/SUSPENDED jobs are nodes; COMPLETING and final states are not.
* Workers start Ray themselves in their batch step (agent/) and report it through the
  cluster directory; a worker reads `up-to-date` only once its Ray is up (so v1's liveness
  check never kills a node that is still starting).
* A node's address (`internal_ip`) is the one its Ray bound (ray.json: `node_ip_interface`'s
  where set), read once per node after the listing has seen its Ray up (again while ray.json
  names none); Slurm's NodeAddr until then. Autoscaler v1 matches a node to its raylet's
  heartbeats by this address alone.
* The provider holds its collaborators and calls them through narrow interfaces: the
  launch guard, the early ends (ends.py: which jobs that died before Ray count against
  their type), the gangs (gangs.py), the teardown (teardown.py), the head's walltime.
* The constructor never raises and never calls Slurm (a raising one would take the head's
  autoscaler down): config errors surface on first use.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import threading
import time
from typing import Any, cast

from ray.autoscaler.node_provider import NodeProvider
from ray.autoscaler.tags import (
    NODE_KIND_HEAD,
    NODE_KIND_WORKER,
    TAG_RAY_NODE_KIND,
    TAG_RAY_USER_NODE_TYPE,
)

from ray_slurm_provider import auth
from ray_slurm_provider.cluster import ClusterConfig
from ray_slurm_provider.config import ConfigError, NodeConfig, ProviderConfig, parse_node_config
from ray_slurm_provider.jobs import GROUP_TAG, build_job, job_name
from ray_slurm_provider.nodespec import member_ids, split
from ray_slurm_provider.provider import bootstrap, runs, validation
from ray_slurm_provider.provider.ends import EarlyEnds
from ray_slurm_provider.provider.gangs import Gangs, groups, release
from ray_slurm_provider.provider.guard import LaunchGuard
from ray_slurm_provider.provider.history import History, Recorder
from ray_slurm_provider.provider.nodes import (
    HIDDEN,
    Events,
    Group,
    Node,
    Phase,
    Rules,
    Tick,
    advance,
    describe,
    group_size,
    of_job,
    same_listing,
)
from ray_slurm_provider.provider.submit import SUBMIT_TAG, Strays, submit_nodes
from ray_slurm_provider.provider.teardown import Teardown, cancel_jobs, shorten_ray_down_poll
from ray_slurm_provider.provider.walltime import HeadWalltime
from ray_slurm_provider.slurm.client import Job, SlurmClient, SlurmError, ask
from ray_slurm_provider.slurm.factory import make_client
from ray_slurm_provider.state import ClusterDir

logger = logging.getLogger(__name__)


class SlurmNodeProvider(NodeProvider):
    #: Longer than Slurm takes to end a cancelled job (KillWait, 30 s by default, plus epilog).
    GONE_TTL_S = 120.0

    def __new__(cls, provider_config: dict[str, Any], cluster_name: str) -> SlurmNodeProvider:
        # With provider.ssh this process is a laptop: every call must run on the login node
        # (laptop.py). Ray loads the class the YAML names, also in commands that never
        # bootstrap the config (`ray get-head-ip`), so the choice is made here. The login node
        # (serve.py) and the head get the config without `ssh`.
        if cls is SlurmNodeProvider and isinstance(provider_config, dict) \
                and provider_config.get("ssh") is not None:
            from ray_slurm_provider.provider.laptop import LaptopNodeProvider

            return cast(SlurmNodeProvider, LaptopNodeProvider(provider_config, cluster_name))
        return super().__new__(cls)

    def __init__(self, provider_config: dict[str, Any], cluster_name: str) -> None:
        super().__init__(provider_config, cluster_name)
        self._lock = threading.RLock()
        self._nodes: dict[str, Node] = {}  # every record, hidden ones too (nodes.py)
        self._listings = 0  # listings started: a creation is settled by a later one
        self._last: Tick | None = None  # the last listing's outcome, for the steady tick
        self._clock = time.monotonic
        self._sleep = time.sleep
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
        self.ends = EarlyEnds()
        self.strays = Strays()
        self.head_time = HeadWalltime(self.cluster_dir.root / "walltime.json")
        self.gangs = Gangs(self.cluster_dir, lambda: self.slurm)
        self.teardown = Teardown(self.cluster_dir, self._list_jobs)
        self.records = Recorder(History(self.cluster_dir.root), self.cluster_dir)

    # --- Slurm access ------------------------------------------------------------------
    @property
    def slurm(self) -> SlurmClient:
        if self._config_error is not None:
            raise self._config_error
        if self._client is None:
            self._client = make_client(self.pcfg)
        return self._client

    def _list_jobs(self) -> list[Job]:
        return self.slurm.list_jobs(job_name(self.cluster_name))

    def _list_jobs_patiently(self) -> list[Job]:
        """`_list_jobs` for a one-off listing that must not fail on a slow controller (the
        head's launch: which logs are an earlier run's), asked again while Slurm does not
        answer in time. The autoscaler's own listings are not: a tick that raises is skipped,
        and the next tick lists anew."""
        return ask("listing the cluster's jobs", self._list_jobs, say=logger.warning,
                   sleep=self._sleep)

    def describe_job(self, node_id: str) -> str:
        """One line on where a node's job stands, in Slurm's words."""
        return describe(node_id, self._record(node_id))

    # --- the cluster config (Ray calls these on the login node) --------------------------
    def node_config(self, node_type: str) -> NodeConfig:
        """A node type's Slurm job settings (the command runner builds its steps from them)."""
        return self.cluster.node_type(node_type).node_config

    @staticmethod
    def bootstrap_config(cluster_config: dict[str, Any]) -> dict[str, Any]:
        return bootstrap.bootstrap_config(copy.deepcopy(cluster_config))

    @staticmethod
    def fillout_available_node_types_resources(config: dict[str, Any]) -> dict[str, Any]:
        return bootstrap.fillout_resources(config)

    def prepare_for_head_node(self, cluster_config: dict[str, Any]) -> dict[str, Any]:
        return cluster_config

    # --- listing -----------------------------------------------------------------------
    def non_terminated_nodes(self, tag_filters: dict[str, str]) -> list[str]:
        with self._lock:
            self._listings += 1
            listing = self._listings
            now = self._clock()
        jobs = self._list_jobs()  # raises on any error
        # Tags files other processes write, and strays found since, change records too.
        key = (self.cluster_dir.tags_generation(), self.strays.generation)
        with self._lock:
            last = self._last
            reuse = last is not None and last.key == key
            # The steady tick: the same listing, Job object for Job object (the CLI client's
            # cache), and nothing since that may change a record (no tags file written, no
            # creation, release or cancellation, no node running before its Ray is up, whose
            # ray.json may come: `quiet`). Then every record is last tick's and no event can
            # come of it: skip the pass over 10,000 jobs (bench/p4_listing_cpu.py). Anything
            # that changes a record drops `quiet`.
            steady = last is not None and reuse and last.quiet and same_listing(jobs, last.jobs)
            if last is not None and steady:
                tick = last
            else:
                tick = advance(self._nodes, jobs, listing=listing, now=now, reuse=reuse,
                               files=self.cluster_dir, rules=self._rules(),
                               stray=self.strays.__contains__)
                tick.key = None if tick.ghosts else key  # a ghost gone: re-read every record
                self._nodes = tick.nodes
                self._last = tick
            ids = [i for i in tick.shown
                   if all(self._nodes[i].tags.get(k) == v for k, v in tag_filters.items())
                   ] if tag_filters else list(tick.shown)
        if steady:  # nothing vanished, nothing new: only the head's time left moves
            for rec in tick.events.heads:
                self.head_time.observe(rec.job)
        else:
            self._act(tick.events, now)
        # Jobs that died before Ray, judged once their end is final (no Slurm call without).
        for node_type, why in self.ends.settle(self.slurm, tick.jobs, tick.listed, now):
            self.guard.failed(node_type, why, "crashed")
        return ids

    def _rules(self) -> Rules:
        return Rules(submit_tag=SUBMIT_TAG, watch_workers=self.pcfg.disable_node_updaters,
                     gone_ttl_s=self.GONE_TTL_S)

    def _act(self, events: Events, now: float) -> None:
        """What the listing just told, at no further scheduler cost."""
        for node_type in events.came_up:
            self.guard.ray_started(node_type)
        if events.strays:
            logger.warning("Cancelling Slurm jobs %s: their submission was reported to Ray as "
                           "failed, so Ray has launched again", ", ".join(events.strays))
            try:
                self.terminate_nodes(events.strays)
            except SlurmError as e:
                logger.warning("Could not cancel %s yet: %s", events.strays, e.slurm_message)
        for node_id in events.orphans:
            # Slurm ended the job (e.g. its node was set DOWN) but its Ray still runs as an
            # orphan: its agent stops it (agent/headwatch.py), so Ray sees the node leave.
            logger.warning("Slurm job %s has ended but its Ray still runs: stopping it",
                           split(node_id)[0])
            with contextlib.suppress(OSError):
                self.cluster_dir.node(node_id).mark_orphan()
        for job_id, rec in events.crashed:  # before Ray came up: judged by `settle`
            self.ends.left(job_id, rec.tags.get(TAG_RAY_USER_NODE_TYPE, ""), rec.job.state,
                           self.cluster_dir.log(job_id), now)
        for rec in events.heads:
            self.head_time.observe(rec.job)
        self.records.listing(events)

    def _record(self, node_id: str) -> Node | None:
        """A shown node's record (atomic; called per node per tick, so no lock)."""
        rec = self._nodes.get(node_id)
        return rec if rec is not None and rec.phase not in HIDDEN else None

    def _changed(self) -> None:
        """A record changed outside a listing: the next tick is no steady one."""
        if self._last is not None:
            self._last.quiet = False

    def is_running(self, node_id: str) -> bool:
        rec = self._record(node_id)
        return rec is not None and rec.job.running

    def is_terminated(self, node_id: str) -> bool:
        return self._record(node_id) is None

    def node_tags(self, node_id: str) -> dict[str, str]:
        rec = self._record(node_id)
        return dict(rec.tags) if rec else {}

    def internal_ip(self, node_id: str) -> str | None:  # type: ignore[override]
        """The address the node's Ray bound once it is up (what v1's heartbeats carry),
        Slurm's NodeAddr before and while ray.json names none."""
        rec = self._record(node_id)
        if rec is not None and rec.phase is Phase.RAY_UP:
            ip = rec.ip if rec.ip is not None else self._ray_ip(node_id)
            if ip:
                return ip
        return self.gangs.member_ip(node_id, rec.job if rec else None)

    def _ray_ip(self, node_id: str) -> str | None:
        """ray.json's address, kept on the node's record once it names one (a node's Ray
        keeps its address: one read per node); while it names none, nothing is kept and the
        next call reads again. Under the lock, as records change (nodes.py): a listing that
        rebuilds the record meanwhile waits, then copies the address."""
        with self._lock:
            ip = self.cluster_dir.ray_ip(node_id)
            rec = self._record(node_id)
            if ip and rec is not None and rec.phase is Phase.RAY_UP:
                rec.ip = ip
        return ip

    def external_ip(self, node_id: str) -> str | None:  # type: ignore[override]
        return self.internal_ip(node_id)

    def set_node_tags(self, node_id: str, tags: dict[str, str]) -> None:
        self.cluster_dir.set_tags(node_id, tags)
        with self._lock:
            rec = self._record(node_id)
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
            listed = self._list_jobs_patiently()  # their logs stay
            runs.new_run(self.cluster_dir, [j.job_id for j in listed])  # ids may restart
            self.records.new_run()
        n = nt.node_config.nodes  # a gang type: whole groups of n nodes, one job each
        ids, refused = submit_nodes(self.slurm, self.guard, self.strays, spec,
                                    {**tags, GROUP_TAG: str(n)} if n > 1 else tags, node_type,
                                    head, groups(count, n),  # one sbatch (an array) if it can
                                    sleep=self._sleep)
        if head:
            runs.record_head(self.cluster_dir, ids[0])
        self.records.submitted(ids, spec, node_type, head)
        logger.info("Submitted Slurm job(s) %s for %s node type %s", ", ".join(ids),
                    "the head of" if head else "workers of", node_type)
        created: dict[str, Any] = {}
        for job_id in ids:
            job = Job(job_id=job_id, name=spec.job_name, state="PENDING",
                      partition=nt.node_config.partition or "")
            for k, node_id in enumerate(self.gangs.node_ids(job_id, n)):
                group = Group(job_id, n, k) if n > 1 else None
                with self._lock:
                    self._nodes[node_id] = Node(job, dict(tags), Phase.CREATED, group,
                                                born=self._listings)
                    self._changed()
                created[node_id] = job
        if refused is not None:  # Slurm took only these: they are recorded, the launch failed
            raise refused
        return created

    # --- terminating -------------------------------------------------------------------
    def terminate_node(self, node_id: str) -> dict[str, Any] | None:
        return self.terminate_nodes([node_id])

    def terminate_nodes(self, node_ids: list[str]) -> dict[str, Any] | None:
        ids = self.teardown.spare_own_job([str(i) for i in node_ids])
        jobs, dirs, undo = self._to_cancel(ids)
        if not jobs:  # nothing, or gang members whose groups live on (gangs.py)
            return None
        down = any(self.node_tags(i).get(TAG_RAY_NODE_KIND) == NODE_KIND_HEAD for i in jobs)
        # Jobs we still list: a job Slurm already ended (a user's scancel, then Ray's
        # terminate call for its dead node) was not ended by this cancel (history.py).
        live = [j for j in jobs if j in self._nodes or f"{j}.0" in self._nodes]
        if down:
            self.cluster_dir.mark_teardown()  # the head goes: its workers skip Ray's drain
        # When it was sent: Slurm stamps the end when it takes the cancel, and a throttled
        # scancel returns seconds later (the report compares the two).
        sent = self.records.clock()
        try:
            # One call, tried again if Slurm does not answer; jobs already gone are fine.
            cancel_jobs(self.slurm, jobs, self._sleep)
        except Exception:
            with self._lock:
                self._cancel_failed(jobs, undo)
            raise
        with self._lock:
            now = self._clock()
            for job_id in jobs:
                self._cancelling(job_id, now)
        self.cluster_dir.forget(dirs)
        self.records.cancelled(live, down or self.cluster_dir.teardown_marked(), at=sent)
        logger.info("Cancelled Slurm jobs %s", ", ".join(jobs))
        if down:  # `ray down`: done once Slurm has ended them (teardown.py)
            self.teardown.wait_for_jobs_to_end(jobs, self._clock, self._sleep)
        return None

    def _released(self, node_id: str) -> bool:
        rec = self._nodes.get(node_id)
        return (rec is not None and rec.phase is Phase.RELEASED) or self.gangs.released(node_id)

    def _to_cancel(self, ids: list[str]) -> tuple[list[str], list[str], dict[str, Phase | None]]:
        """`ids` as (jobs to cancel, node dirs to forget with them, each hidden record's phase
        before, to restore if the scancel fails): one-node jobs as they are; gang members
        released, and a gang job only once its last member is released."""
        members = [i for i in ids if split(i)[1] is not None]
        if not members:
            return ids, ids, {}
        undo: dict[str, Phase | None] = {}
        with self._lock:
            done = release(members, lambda j: group_size(self._nodes, j), self._released,
                           self.gangs.release)
            for member in members:  # it leaves the listing now; its group lives on
                rec = self._nodes.get(member)
                if split(member)[0] not in done and rec is not None:
                    rec.phase = Phase.RELEASED
            now = self._clock()
            for job_id in done:  # cancelled from now: a listing meanwhile shows no member
                undo.update(self._cancelling(job_id, now))
            self._changed()
        singles = [i for i in ids if split(i)[1] is None]
        dirs = [*singles, *(m for j, n in done.items() for m in member_ids(j, n))]
        return [*singles, *done], dirs, undo

    def _cancelling(self, job_id: str, now: float) -> dict[str, Phase | None]:
        """Hide a job's records (one for a job this process never listed); their phases."""
        before: dict[str, Phase | None] = {}
        for node_id in of_job(self._nodes, job_id):
            rec = self._nodes[node_id]
            before[node_id] = rec.phase
            rec.phase = Phase.CANCELLING
            rec.since = now
        if not before:
            stub = Job(job_id=job_id, name=job_name(self.cluster_name), state="CANCELLED")
            self._nodes[job_id] = Node(stub, {}, Phase.CANCELLING, since=now)
            before[job_id] = None
        self._changed()
        return before

    def _cancel_failed(self, jobs: list[str], undo: dict[str, Phase | None]) -> None:
        """None counts as cancelled: a group released whole is listed whole again, from a
        fresh listing (no record reused), so the next terminate call cancels it."""
        for node_id, phase in undo.items():
            if phase is None:
                self._nodes.pop(node_id, None)
            elif node_id in self._nodes:
                self._nodes[node_id].phase = phase
        for job_id in jobs:  # one cancelled before: listed again, as if never cancelled
            for node_id in of_job(self._nodes, job_id):
                if node_id not in undo and self._nodes[node_id].phase is Phase.CANCELLING:
                    del self._nodes[node_id]
        self._last = None

    # --- `ray down` ----------------------------------------------------------------------
    def nodes_for_teardown(self, tag_filters: dict[str, str]) -> list[str]:
        """Slurm lists every job of the cluster, so this is the listing; called by `ray down`
        alone, it is where Ray's 5 s sleep after each terminate call is shortened."""
        shorten_ray_down_poll()
        return self.non_terminated_nodes(tag_filters)

    def cleanup_cluster_resources(self) -> Any:
        self.teardown.cleanup(self._clock, self._sleep)

    def get_command_runner(self, log_prefix: str, node_id: str, auth_config: dict[str, Any],
                           cluster_name: str, process_runner: Any, use_internal_ip: bool,
                           docker_config: dict[str, Any] | None = None) -> Any:
        from ray_slurm_provider.provider.runner import SrunCommandRunner

        return SrunCommandRunner(self, node_id, log_prefix)
