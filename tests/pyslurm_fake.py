"""A stand-in for the part of pyslurm's API the pyslurm back end uses.

It follows pyslurm's sources (pyslurm/core/job/job.pyx, submission.pyx, node.pyx,
partition.pyx of the 23.x-25.x "core" API): attribute names and types, `RPCError`,
`Jobs.load()` returning a mapping with `.values()`, and what the real pyslurm 25.11.2 refused on
the sandbox's Slurm 25.11.7 (`sandbox up --slurm 25.11 --pyslurm`; tests/fixtures/pyslurm-25.11/
holds the attribute names and the records recorded there, and test_pyslurm_backend checks the
fake's fields, types and errors against them). The values are those the sandbox's Slurm 22.05
reported (see tests/fixtures/slurmrestd-22.05/), so results can be compared with the other back
ends.

What the records changed (the fake had guessed): a pending job's start_time is None and its
run_time_remaining its whole time limit; a partition without a default time says None, not
"UNLIMITED"; cancelling an unknown job, or one already cancelled, raises nothing; an unknown
submit attribute is an AttributeError in Cython's words.
"""

from __future__ import annotations

import os
import re
import signal
import types
from dataclasses import dataclass, field
from typing import Any

#: JobSubmitDescription's public attributes (pyslurm/core/job/submission.pxd, 25.x).
ATTRIBUTES = frozenset("""
    name account user_id group_id priority site_factor wckey array batch_constraints
    begin_time clusters cluster_constraints comment admin_comment requires_contiguous_nodes
    cores_reserved_for_system threads_reserved_for_system working_directory cpu_frequency
    nodes deadline delay_boot_time dependencies excluded_nodes required_nodes constraints
    kill_on_node_fail licenses mail_user mail_types mcs_label memory_per_cpu memory_per_node
    memory_per_gpu network nice log_files_open_mode overcommit partitions profile_types
    accounting_gather_frequency qos requires_node_reboot is_requeueable reservations script
    script_args environment resource_sharing distribution time_limit time_limit_min container
    container_id cpus_per_task cpus_per_gpu sockets_per_node cores_per_socket threads_per_core
    gpus gpus_per_socket gpus_per_task gres_per_node gpu_binding ntasks ntasks_per_node
    ntasks_per_socket ntasks_per_core ntasks_per_gpu switches signal standard_in
    standard_output standard_error kill_on_invalid_dependency spreads_over_nodes
    use_min_nodes gres_binding gres_tasks_per_sharing temporary_disk_per_node
    get_user_environment min_cpus_per_node wait_all_nodes selinux_context segment_size
    reserved_ports extra
""".split())


class RPCError(Exception):
    """pyslurm.RPCError: str() is Slurm's error string."""


@dataclass
class FakeJob:
    id: int
    name: str
    user_name: str = "root"
    state: str = "PENDING"
    state_reason: str | None = "None"
    allocated_nodes: str | None = None
    batch_host: str | None = None
    time_limit: int | None = None  # minutes; None: UNLIMITED
    run_time_remaining: int | None = None  # seconds; a pending job's: its whole limit
    submit_time: int | None = 1796000900
    start_time: int | None = None  # None while pending
    partition: str | None = "cpu"
    comment: str | None = None


@dataclass
class FakeNode:
    name: str
    address: str
    state: str = "IDLE"
    total_cpus: int = 2
    real_memory: int = 4000
    configured_gres: dict[str, int] = field(default_factory=lambda: {"gpu": 2})
    partitions: list[str] = field(default_factory=lambda: ["cpu", "gpu"])
    slurm_version: str = "22.05.8"


@dataclass
class FakePartition:
    name: str
    nodes: str = "n[1-3]"
    max_time: int | str = "UNLIMITED"
    default_time: int | str | None = None  # None: the partition sets none
    is_default: bool = False
    state: str = "UP"


class _Collection(dict[Any, Any]):
    pass


#: As in pyslurm/core/job/submission.pyx (`from os import environ as pyenviron`).
pyenviron = os.environ


def job_env(environment: Any) -> dict[str, str]:
    """The environment pyslurm's `_set_environment` gives a job whose `environment` is a
    dict: every SLURM_* variable of `pyenviron` first, then the dict's."""
    assert isinstance(environment, dict), environment
    return {**{k: v for k, v in pyenviron.items() if k.startswith("SLURM_")}, **environment}


def make_module(version: str = "22.5.1") -> types.ModuleType:
    """A fresh fake `pyslurm` module with the sandbox's cluster and no jobs."""
    mod = types.ModuleType("pyslurm")
    state: dict[str, Any] = {
        "jobs": {}, "next": 200, "cancelled": [], "submitted": [], "job_env": [],
        "nodes": [FakeNode("n1", "127.0.0.2"), FakeNode("n2", "127.0.0.3"),
                  FakeNode("n3", "127.0.0.4")],
        "parts": [FakePartition("cpu", is_default=True), FakePartition("gpu")],
        "fail": {},
    }

    def maybe_fail(what: str) -> None:
        err = state["fail"].pop(what, None)
        if err is not None:
            raise RPCError(err)

    class JobSubmitDescription:
        """Takes attributes as keywords (pyslurm refuses unknown ones); submit() records them
        in state["submitted"]. pyslurm's load_sbatch_options is left out: the back end sets
        every attribute itself."""

        def __init__(self, **kw: Any) -> None:
            unknown = sorted(set(kw) - ATTRIBUTES)
            if unknown:  # a cdef class: setattr of an unknown name raises
                raise AttributeError("'pyslurm.core.job.submission.JobSubmitDescription' object "
                                     f"has no attribute '{unknown[0]}'")
            self.kw = kw

        def _check(self) -> None:
            """pyslurm 25.11.2 takes time_limit as minutes only, and a signal as a number or
            a Python `signal.Signals` name ("SIGTERM"; "TERM" is refused) after sbatch's
            `[flags:]` and before its `@time` (measured on 25.11.7)."""
            limit = self.kw.get("time_limit")
            if limit is not None and not isinstance(limit, int):
                raise TypeError("an integer is required")
            sig = self.kw.get("signal")
            if sig is not None:
                name = re.split("[:@]+", str(sig))[1 if ":" in str(sig) else 0]
                if not name.isnumeric() and name not in signal.Signals.__members__:
                    raise ValueError(f"Invalid Signal: {name}.")

        def submit(self) -> int:
            self._check()
            maybe_fail("submit")
            part = self.kw.get("partitions") or "cpu"
            if part not in {p.name for p in state["parts"]}:
                raise RPCError("Invalid partition name specified")
            job_id = state["next"]
            state["next"] += 1
            state["submitted"].append(dict(self.kw))
            state["job_env"].append(job_env(self.kw.get("environment")))
            limit = self.kw.get("time_limit")
            state["jobs"][job_id] = FakeJob(
                job_id, self.kw.get("name", "sbatch"), comment=self.kw.get("comment"),
                partition=part, time_limit=limit,
                run_time_remaining=limit * 60 if limit is not None else None)
            return job_id

    class Jobs:
        @staticmethod
        def load() -> _Collection:
            maybe_fail("jobs")
            return _Collection(state["jobs"])

    class Job:
        def __init__(self, job_id: int) -> None:
            self.id = job_id

        def cancel(self) -> None:
            """Recorded: an unknown id, or a job already cancelled, raises nothing."""
            maybe_fail("cancel")
            job = state["jobs"].get(self.id)
            if job is None or job.state in ("COMPLETED", "CANCELLED"):
                return
            job.state = "CANCELLED"
            state["cancelled"].append(self.id)

    class Nodes:
        @staticmethod
        def load() -> _Collection:
            maybe_fail("nodes")
            return _Collection({n.name: n for n in state["nodes"]})

    class Partitions:
        @staticmethod
        def load() -> _Collection:
            maybe_fail("partitions")
            return _Collection({p.name: p for p in state["parts"]})

    def start(job_id: int, node: str, now: int = 1796000905) -> None:
        """The job runs on `node` (as slurmctld would have started it)."""
        job = state["jobs"][job_id]
        job.state, job.state_reason = "RUNNING", "None"
        job.allocated_nodes = job.batch_host = node
        job.start_time = now

    mod.start = start  # type: ignore[attr-defined]
    for obj in (RPCError, JobSubmitDescription, Jobs, Job, Nodes, Partitions):
        setattr(mod, obj.__name__, obj)
    mod.__version__ = version  # type: ignore[attr-defined]
    mod.state = state  # type: ignore[attr-defined]
    return mod
