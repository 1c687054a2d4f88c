"""Fast in-process stand-ins: a controllable clock and a Slurm that keeps jobs in a dict.

The messages FakeSlurm raises are the ones real Slurm 22.05 printed in the sandbox (see
tests/fixtures/slurm-22.05/), so code that matches on Slurm's words is tested against them.
FakeSlurm keeps the JobSpec each job was submitted with (`submitted`, `FakeJob.spec`); a test
about the script text renders it with `script.render`, as the CLI back end does.
"""

from __future__ import annotations

import threading
from collections import Counter, defaultdict, deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from datetime import datetime, timezone

from ray_slurm_provider.slurm.client import (
    ACTIVE_STATES,
    ClusterInfo,
    EndedJob,
    Job,
    Node,
    Partition,
    SlurmError,
    classify,
)
from ray_slurm_provider.slurm.parse import expand_hostlist, parse_gres_gpus
from ray_slurm_provider.slurm.sacct import NoAccounting
from ray_slurm_provider.slurm.script import JobSpec, validate
from ray_slurm_provider.units import parse_duration

#: Real Slurm 22.05 messages (tests/fixtures/slurm-22.05/*.txt).
OUTAGE_MESSAGES = {
    "submit": "sbatch: error: Batch job submission failed: "
              "Unable to contact slurm controller (connect failure)",
    "submit_array": "sbatch: error: Batch job submission failed: "
                    "Unable to contact slurm controller (connect failure)",
    "list_jobs": "slurm_load_jobs error: Unable to contact slurm controller (connect failure)",
    "cancel": "scancel: error: Kill job error on job id {id}: "
              "Unable to contact slurm controller (connect failure)",
    "cluster_info": "slurm_load_node error: Unable to contact slurm controller (connect failure)",
    "node_addresses": "slurm_load_node error: Unable to contact slurm controller "
                      "(connect failure)",
    "node_address": "slurm_load_node error: Unable to contact slurm controller "
                    "(connect failure)",
    "user_job_ids": "slurm_load_jobs error: Unable to contact slurm controller "
                    "(connect failure)",
    "ended_job": "slurm_load_jobs error: Unable to contact slurm controller (connect failure)",
}
#: sacct's words on a cluster without accounting (slurm-22.05/sacct_disabled.txt).
NO_ACCOUNTING = "Slurm accounting storage is disabled"
BAD_PARTITION = "sbatch: error: Batch job submission failed: Invalid partition name specified"
#: The Slurm command behind each method, as the CLI client names it in its errors.
COMMANDS = {"submit": "sbatch", "submit_array": "sbatch", "list_jobs": "squeue",
            "cancel": "scancel", "cluster_info": "scontrol", "node_addresses": "scontrol",
            "node_address": "scontrol", "user_job_ids": "squeue", "ended_job": "scontrol"}

_FINAL = frozenset({"COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "PREEMPTED",
                    "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"})


class FakeClock:
    """A clock that moves only when told to."""

    def __init__(self, start: float = 1_800_000_000.0) -> None:
        self._t = start
        self._lock = threading.Lock()

    def now(self) -> float:
        with self._lock:
            return self._t

    def advance(self, seconds: float) -> None:
        with self._lock:
            self._t += seconds

    __call__ = now


def _default_nodes() -> tuple[Node, ...]:
    return tuple(Node(f"n{i}", f"127.0.0.{i + 1}", "IDLE", 2, 4000, "gpu:2") for i in (1, 2, 3))


@dataclass
class FakeJob:
    job: Job
    spec: JobSpec
    submitted_at: float
    started_at: float | None = None


class FakeSlurm:
    """A `SlurmClient` with scriptable failures; jobs start PENDING until `start()`."""

    def __init__(self, clock: FakeClock | None = None, *, nodes: Iterable[Node] | None = None,
                 partitions: Mapping[str, Mapping[str, object]] | None = None,
                 version: str = "22.05.8", first_id: int = 1000) -> None:
        self.clock = clock or FakeClock()
        self.nodes = {n.name: n for n in (nodes if nodes is not None else _default_nodes())}
        #: name -> {"nodes": [...], "default": bool, "max_time_s": int|None, ...}
        self.partitions: dict[str, dict[str, object]] = (
            {k: dict(v) for k, v in partitions.items()} if partitions is not None else
            {"cpu": {"default": True}, "gpu": {}})
        self.version = version
        self.jobs: dict[str, FakeJob] = {}
        self.calls: Counter[str] = Counter()
        self.submitted: list[JobSpec] = []  # every spec taken, in order (an array once)
        self.cancelled: list[list[str]] = []
        self._next_id = first_id
        self._failures: defaultdict[str, deque[BaseException]] = defaultdict(deque)
        self._outage = False
        self._lock = threading.RLock()

    # --- test controls ----------------------------------------------------------------------

    def fail_next(self, method: str, exc: BaseException) -> None:
        """The next call of `method` raises `exc` (queued; one per call)."""
        with self._lock:
            self._failures[method].append(exc)

    def set_outage(self, down: bool) -> None:
        """While down, every call raises TransientSlurmError as a dead slurmctld does."""
        with self._lock:
            self._outage = down

    def start(self, job_id: str, node: str = "n1") -> None:
        with self._lock:
            fj = self.jobs[job_id]
            fj.started_at = self.clock.now()
            numeric = fj.job.slurm_job_id
            if "_" in job_id:  # an array task starts as a job of its own
                numeric = str(self._next_id)
                self._next_id += 1
            # `node` may be a node list ("n[1-2]": a gang job); the batch host is its first.
            fj.job = replace(fj.job, state="RUNNING", reason="", nodes=node,
                             batch_host=expand_hostlist(node)[0],
                             start_time=_iso(fj.started_at), slurm_job_id=numeric)

    def finish(self, job_id: str, state: str = "COMPLETED") -> None:
        with self._lock:
            fj = self.jobs[job_id]
            fj.job = replace(fj.job, state=state, reason="")

    def set_state(self, job_id: str, state: str, reason: str = "") -> None:
        with self._lock:
            fj = self.jobs[job_id]
            fj.job = replace(fj.job, state=state, reason=reason)

    def job(self, job_id: str) -> Job:
        with self._lock:
            return self._view(self.jobs[job_id])

    # --- SlurmClient --------------------------------------------------------------------------

    def submit(self, spec: JobSpec, *, comment: str = "") -> str:
        with self._lock:
            self._enter("submit")
            return self._queue(spec, comment, None)[0]

    def submit_array(self, spec: JobSpec, count: int, *, comment: str = "") -> list[str]:
        """`sbatch --array=0-<count-1>`: tasks `<array id>_<i>`, which share the array's
        numeric id until `start()` gives each its own (as Slurm splits a task off)."""
        if count < 1:
            raise ValueError(f"an array needs at least one task, got {count}")
        with self._lock:
            self._enter("submit_array")
            return self._queue(spec, comment, count)

    def _queue(self, spec: JobSpec, comment: str, tasks: int | None) -> list[str]:
        validate(spec)  # every real back end renders (CLI) or validates it first
        partition = spec.partition or self._default_partition()
        if partition not in self.partitions:
            # sbatch prints both lines; the CLI client keeps both.
            raise classify(f"sbatch: error: invalid partition specified: {partition}\n"
                           f"{BAD_PARTITION}", "sbatch")
        limit = spec.time
        numeric = str(self._next_id)
        self._next_id += 1
        now = self.clock.now()
        ids = [numeric] if tasks is None else [f"{numeric}_{i}" for i in range(tasks)]
        for job_id in ids:
            job = Job(job_id=job_id, name=spec.job_name,
                      state="PENDING", reason="", partition=partition, comment=comment,
                      time_limit_s=parse_duration(limit) if limit else
                      self._part_limit(partition), submit_time=_iso(now),
                      slurm_job_id=numeric)
            self.jobs[job_id] = FakeJob(job, spec, now)
        self.submitted.append(spec)
        return ids

    def list_jobs(self, job_name: str) -> list[Job]:
        with self._lock:
            self._enter("list_jobs")
            return [self._view(fj) for fj in self.jobs.values()
                    if fj.job.name == job_name
                    and (fj.job.state in ACTIVE_STATES or fj.job.state == "COMPLETING")]

    def user_job_ids(self) -> set[str]:
        """Every job still here, in any state (as Slurm lists ended jobs for a while)."""
        with self._lock:
            self._enter("user_job_ids")
            return {i for fj in self.jobs.values()
                    for i in (fj.job.job_id, fj.job.numeric_id)}

    def ended_job(self, job_id: str) -> EndedJob | None:
        """How a job ended, as the CLI back end tells it: slurmctld's record (None while the
        job is active or COMPLETING); a job this fake never had is one slurmctld forgot, on a
        cluster without accounting."""
        with self._lock:
            self._enter("ended_job", job_id)
            fj = self.jobs.get(job_id)
            if fj is None:
                raise NoAccounting(f"sacct: no accounting: {NO_ACCOUNTING}", NO_ACCOUNTING,
                                   "sacct")
            if fj.job.state not in _FINAL:
                return None
            code = "1:0" if fj.job.state == "FAILED" else "0:0"
            return EndedJob(job_id, fj.job.state, code, node=fj.job.nodes)

    def cancel(self, job_ids: Iterable[str]) -> None:
        ids = sorted({str(j) for j in job_ids})
        if not ids:
            return
        with self._lock:
            self._enter("cancel", ids[0])
            self.cancelled.append(ids)
            for j in ids:
                # `123` is a plain job or a whole array; `123_4` one task of an array.
                hits = [self.jobs[j]] if j in self.jobs else [
                    fj for k, fj in self.jobs.items() if k.partition("_")[0] == j]
                for fj in hits:
                    if fj.job.state not in _FINAL:
                        fj.job = replace(fj.job, state="CANCELLED", reason="")

    def cluster_info(self) -> ClusterInfo:
        with self._lock:
            self._enter("cluster_info")
            return ClusterInfo(self.version, tuple(self._partition(p) for p in self.partitions))

    def node_addresses(self) -> Mapping[str, str]:
        with self._lock:
            self._enter("node_addresses")
            return {n.name: n.addr for n in self.nodes.values()}

    def node_address(self, name: str) -> str | None:
        with self._lock:
            self._enter("node_address")
            node = self.nodes.get(name)
            return node.addr if node else None

    # --- internals ------------------------------------------------------------------------------

    def _enter(self, method: str, job_id: str = "") -> None:
        self.calls[method] += 1
        if self._failures[method]:
            raise self._failures[method].popleft()
        if self._outage:
            raise classify(OUTAGE_MESSAGES[method].format(id=job_id), COMMANDS[method])

    def _default_partition(self) -> str:
        for name, p in self.partitions.items():
            if p.get("default"):
                return name
        return next(iter(self.partitions), "")

    def _part_limit(self, name: str) -> int | None:
        return _opt_int(self.partitions[name].get("max_time_s"))

    def _partition(self, name: str) -> Partition:
        p = self.partitions[name]
        names = p.get("nodes")
        members = [self.nodes[n] for n in (names if isinstance(names, list) else self.nodes)]
        gpus = min((parse_gres_gpus(n.gres) for n in members), default=0)
        return Partition(
            name=name, nodes=tuple(members),
            cpus_per_node=min((n.cpus for n in members), default=0),
            memory_mb_per_node=min((n.memory_mb for n in members), default=0),
            gpus_per_node=gpus, gres=members[0].gres if members else "",
            max_time_s=self._part_limit(name),
            default_time_s=_opt_int(p.get("default_time_s")),
            default=bool(p.get("default")), state=str(p.get("state", "UP")))

    def _view(self, fj: FakeJob) -> Job:
        j = fj.job
        node = self.nodes.get(j.batch_host)
        left = j.time_limit_s
        if fj.started_at is not None and j.time_limit_s is not None:
            left = max(0, int(j.time_limit_s - (self.clock.now() - fj.started_at)))
        return replace(j, node_addr=node.addr if node else "", time_left_s=left)


def _opt_int(value: object) -> int | None:
    return value if isinstance(value, int) else None


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%S")


__all__ = ["BAD_PARTITION", "OUTAGE_MESSAGES", "FakeClock", "FakeSlurm", "SlurmError"]
