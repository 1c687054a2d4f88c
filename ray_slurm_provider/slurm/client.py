"""The Slurm seam: one interface, typed records and typed errors, and the rules every back end
shares (which states are listed, which variables never reach Slurm or a job).

Back ends (CLI, REST, pyslurm) implement `SlurmClient`. Everything above this layer speaks
only these types (a job goes in as a `JobSpec`, never as script text), so a fake in the tests
can stand in for any of them.
"""

from __future__ import annotations

import functools
import re
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol, TypeVar, runtime_checkable

from ray_slurm_provider.retry import Delay, exponential, retry
from ray_slurm_provider.slurm.spec import JobSpec

#: Slurm's final job states: a job in one of these has ended for good. Any other state
#: (COMPLETING, STAGE_OUT, REVOKED, a name added later) is no end yet.
FINAL_STATES = frozenset({
    "BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL", "OUT_OF_MEMORY",
    "PREEMPTED", "TIMEOUT",
})

#: Job states in which a Ray node still exists or will exist. COMPLETING and every final
#: state count as terminated: a job in CG is already tearing its node down. Held, stopped and
#: special-exit jobs are nodes too: they hold or will regain an allocation, and `ray down`
#: must cancel them (22.05's squeue accepts every name here in --states).
ACTIVE_STATES = frozenset({
    "PENDING", "CONFIGURING", "RUNNING", "SUSPENDED", "REQUEUED", "RESIZING", "SIGNALING",
    "REQUEUE_HOLD", "REQUEUE_FED", "SPECIAL_EXIT", "STOPPED", "RESV_DEL_HOLD",
})

#: A job id as Slurm's tools name it: 123, an array task 123_4, a het component 123+1.
JOB_ID_RE = re.compile(r"^\d+(?:[_+]\d+)?$")

#: What `list_jobs` lists: every active state plus COMPLETING, so callers can see a node that
#: is going away (Job.active is False for it). squeue --states syntax.
LIST_STATES = ",".join(sorted(ACTIVE_STATES | {"COMPLETING"}))

#: Variables that change what Slurm commands do, or that would be copied into the jobs we
#: submit (the provider itself often runs inside a Slurm job). SLURM_CONF is kept: it says
#: which cluster to talk to. SRUN_/SALLOC_ are input variables of the job's own srun calls.
#: RAY_* and Ray's metrics ports: the head's autoscaler submits worker jobs, and its own Ray
#: settings (RAY_OVERRIDE_RESOURCES of the head, ...) must not become the workers'.
SCRUB_PREFIXES = ("SLURM_", "SBATCH_", "SQUEUE_", "SINFO_", "SCONTROL_", "SRUN_", "SALLOC_",
                  "RAY_", "AUTOSCALER_METRIC_PORT", "DASHBOARD_METRIC_PORT")
KEEP_VARS = ("SLURM_CONF",)


def job_environment(src: Mapping[str, str], drop: Iterable[str] = ()) -> dict[str, str]:
    """The environment a job submitted without sbatch (REST, pyslurm) is given: the
    submitting process's, scrubbed as the CLI back end scrubs sbatch's, without exported
    bash functions and the variables in `drop`."""
    gone = set(drop)
    return {k: v for k, v in src.items()
            if k not in gone and not k.startswith("BASH_FUNC_")
            and (k in KEEP_VARS or not k.startswith(SCRUB_PREFIXES))}


class SlurmError(Exception):
    """Slurm refused or failed a request; `slurm_message` holds Slurm's own words."""

    def __init__(self, message: str, slurm_message: str = "", command: str = "") -> None:
        super().__init__(message)
        self.slurm_message = slurm_message or message
        self.command = command


class TransientSlurmError(SlurmError):
    """Worth retrying: controller unreachable, timeouts, 'Resource temporarily unavailable'."""


class PermanentSlurmError(SlurmError):
    """Retrying will not help: invalid partition/account/QOS, limits, bad options."""


def unreachable(message: str, transient: bool, command: str) -> SlurmError:
    """Slurm's commands could not be reached (over SSH, `slurm.ssh.SshError`): worth asking
    again when the connection failed, not when the login was refused."""
    kind = TransientSlurmError if transient else PermanentSlurmError
    return kind(message, message, command)


@functools.lru_cache(maxsize=1024)
def _epoch(stamp: str) -> float | None:
    """Slurm's local "2026-12-01T19:03:08" as a Unix time (None if it is not one)."""
    try:
        return time.mktime(time.strptime(stamp, "%Y-%m-%dT%H:%M:%S"))
    except ValueError:
        return None


@dataclass(frozen=True)
class Job:
    """One Slurm job as the provider needs to see it. The CLI client hands out the same
    object for an unchanged job on every listing (parse.SqueueCache), so nothing in it may
    change by itself: the time left is `left_s()`, from the fixed end time."""

    job_id: str
    name: str
    state: str
    reason: str = ""
    nodes: str = ""  # node list as Slurm prints it ("n1", "n[1-2]", "" while pending)
    batch_host: str = ""
    node_addr: str = ""  # address of batch_host (filled from the node table)
    time_limit_s: int | None = None  # None: unlimited
    time_left_s: int | None = None  # as listed (REST, pyslurm); see `left_s`
    end_time: str = ""  # squeue's %e, local time: a running job's expected end
    submit_time: str = ""
    start_time: str = ""
    partition: str = ""
    comment: str = ""
    #: The numeric job id Slurm gives each job (SLURM_JOB_ID inside it; squeue %A). For a
    #: plain job it equals `job_id`. An array task's `job_id` is `<array id>_<task>` (stable
    #: for its whole life, the node id); its numeric id is its own once Slurm starts it, and
    #: the array's id while it is pending. "" when the back end does not report it.
    slurm_job_id: str = ""

    @property
    def numeric_id(self) -> str:
        """The id `srun --jobid` and SLURM_JOB_ID use (22.05's srun refuses `123_4`)."""
        return self.slurm_job_id or self.job_id

    @property
    def active(self) -> bool:
        return self.state in ACTIVE_STATES

    @property
    def running(self) -> bool:
        return self.state == "RUNNING"

    def left_s(self, now: float | None = None) -> int | None:
        """Seconds of its time limit left: a running job's from its end time, when the
        listing has one, as of `now` (default: the wall clock); a pending job has its whole
        limit; otherwise as listed. None: no limit."""
        if self.end_time and self.state == "RUNNING":
            end = _epoch(self.end_time)
            if end is not None:
                return max(0, int(end - (time.time() if now is None else now)))
        if self.time_left_s is None and self.state == "PENDING":
            return self.time_limit_s
        return self.time_left_s


@dataclass(frozen=True)
class Node:
    name: str
    addr: str
    state: str = ""
    cpus: int = 0
    memory_mb: int = 0
    gres: str = ""


@dataclass(frozen=True)
class Partition:
    name: str
    nodes: tuple[Node, ...] = ()
    cpus_per_node: int = 0
    memory_mb_per_node: int = 0
    gpus_per_node: int = 0
    gres: str = ""
    max_time_s: int | None = None  # None: unlimited
    default_time_s: int | None = None
    default: bool = False
    state: str = "UP"


@dataclass(frozen=True)
class ClusterInfo:
    version: str
    partitions: tuple[Partition, ...] = field(default_factory=tuple)

    def partition(self, name: str | None) -> Partition | None:
        for p in self.partitions:
            if (name is None and p.default) or p.name == name:
                return p
        return None


@runtime_checkable
class SlurmClient(Protocol):
    """What the provider asks of Slurm. Every method is one scheduler round trip."""

    def submit(self, spec: JobSpec, *, comment: str = "") -> str:
        """Submit one batch job named `spec.job_name`; return its id. An invalid `spec`
        raises ScriptError before Slurm is asked."""
        ...

    def list_jobs(self, job_name: str) -> list[Job]:
        """All of this user's active jobs named `job_name`, in ONE call; raise on any error."""
        ...

    def cancel(self, job_ids: Iterable[str]) -> None:
        """Cancel many jobs in ONE call; jobs already gone are not an error."""
        ...

    def cluster_info(self) -> ClusterInfo:
        """Partitions (CPUs, memory, GRES, time limits, nodes and addresses) and the version."""
        ...

    def node_addresses(self) -> Mapping[str, str]:
        """Node name -> NodeAddr for every node."""
        ...

    def node_address(self, name: str) -> str | None:
        """One node's NodeAddr (None: Slurm has no such node), asking for that node alone."""
        ...


@dataclass(frozen=True)
class EndedJob:
    """A job that left the queue, as accounting recorded it."""

    job_id: str  # as squeue names it: 123, or 123_4 for an array task
    state: str  # COMPLETED, CANCELLED, TIMEOUT, PREEMPTED, OUT_OF_MEMORY, NODE_FAIL, FAILED, ...
    exit_code: str  # sacct's "<exit status>:<signal>", e.g. "1:0", "0:15"
    end: str = ""
    node: str = ""
    reason: str = ""

    @property
    def why(self) -> str:
        """The end in a few words: "FAILED (exit 1)", "CANCELLED (signal 9)", "TIMEOUT"."""
        status, _, sig = self.exit_code.partition(":")
        if sig not in ("", "0"):
            return f"{self.state} (signal {sig})"
        if status not in ("", "0"):
            return f"{self.state} (exit {status})"
        return self.state


@runtime_checkable
class EndReader(Protocol):
    """A back end that asks Slurm how a job that left the queue ended (the CLI and REST back
    ends: slurmctld while it keeps the job, MinJobAge; then accounting, through sacct)."""

    def ended_job(self, job_id: str) -> EndedJob | None:
        """How `job_id` ended; None while its end is not final (the job is still COMPLETING,
        or accounting has not recorded it yet). Raises SlurmError: PermanentSlurmError when
        it cannot be known (sacct.NoAccounting: slurmctld forgot the job and the cluster
        keeps no accounting)."""
        ...


@runtime_checkable
class UserJobs(Protocol):
    """A back end that lists every job of this user that Slurm still knows, whatever its name
    (the agent's sweep of ended jobs' temp dirs, agent/tempdir.py)."""

    def user_job_ids(self) -> set[str]:
        """The ids of all this user's jobs Slurm lists, in any state: each as squeue names it
        (123, 123_4) and its numeric id; ONE call; raise on any error."""
        ...


@runtime_checkable
class ArraySubmitter(Protocol):
    """A back end that submits N identical jobs as ONE Slurm job array (one RPC)."""

    def submit_array(self, spec: JobSpec, count: int, *, comment: str = "") -> list[str]:
        """Submit `spec` as array tasks 0..count-1; return their ids `<array id>_<task>`."""
        ...


# --- error classification: shared by every back end ------------------------------------------

_TRANSIENT = re.compile(
    r"unable to contact slurm controller|connection refused|connect failure|"
    r"socket timed out|timed out|temporarily unavailable|try again|"
    r"slurm_receive_msg|zero bytes were transmitted|communication connection failure|"
    r"controller is busy|slurmctld.*(down|not responding)|service unavailable|"
    r"bad gateway|gateway timeout|standby mode|transport endpoint is not connected|"
    r"rate limit exceeded|too many requests",
    re.IGNORECASE,
)


def classify(message: str, command: str = "") -> SlurmError:
    """Turn Slurm's words into a typed error (transient vs permanent)."""
    msg = message.strip()
    cls: type[SlurmError] = TransientSlurmError if _TRANSIENT.search(msg) else PermanentSlurmError
    # "sbatch: error: ..." already names its command; don't say it twice.
    prefix = f"{command}: " if command and not msg.startswith(f"{command}:") else ""
    return cls(prefix + msg, msg, command)


_GONE = re.compile(
    r"invalid job id|already completing or completed|job has already finished|"
    r"job/step already", re.IGNORECASE
)


def is_job_gone(message: str) -> bool:
    """True when scancel/REST says the job no longer exists (cancel stays idempotent)."""
    return bool(_GONE.search(message))


#: Tries of one question to Slurm that must see a slow controller through (a rate-limited
#: one answers slowly, issue 29), and the back-off between them. A refusal is never asked
#: again.
ASK_ATTEMPTS = 3
ASK_DELAY = exponential(2.0, cap_s=30.0, jitter=0.2)

T = TypeVar("T")


def ask(what: str, question: Callable[[], T], *, say: Callable[[str], object] = print,
        sleep: Callable[[float], None] | None = None, attempts: int = ASK_ATTEMPTS,
        delay: Delay = ASK_DELAY) -> T:
    """`question()`, asked again while Slurm does not answer in time (a TransientSlurmError),
    backing off; a refusal, or the last try's error, raises: never an empty answer. Before
    each retry `say` gets one line naming `what` (a log, stderr). `sleep`: tests never
    sleep; the agent's wait ends early when its job is told to stop."""
    def note(n: int, err: BaseException | None, wait: float) -> None:
        say(f"{what} (try {n} of {attempts}): {err}; trying again in {wait:.0f}s")

    return retry(lambda _: question(), delay=delay, attempts=attempts,
                 retry_on=(TransientSlurmError,), on_retry=note, sleep=sleep)
