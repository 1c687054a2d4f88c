"""What Slurm's accounting database knows: why a job that left the queue ended (`sacct`), and
which accounts and QOSes a user may submit with (`sacctmgr`).

Accounting is optional at a site. Without it (no slurmdbd, or slurmdbd unreachable) every
call raises `NoAccounting` with Slurm's words, and callers fall back to what squeue and the
job logs say. These are command-line tools on purpose: the REST and pyslurm back ends reach
slurmdbd only when the site serves its endpoints, so every transport asks through them.
"""

from __future__ import annotations

import os
import pwd
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from ray_slurm_provider import proc
from ray_slurm_provider.slurm.client import (
    FINAL_STATES,
    KEEP_VARS,
    SCRUB_PREFIXES,
    EndedJob,
    PermanentSlurmError,
    SlurmError,
    classify,
    unreachable,
)
from ray_slurm_provider.slurm.parse import parse_scontrol_records
from ray_slurm_provider.slurm.ssh import SshError

T = TypeVar("T")
DELIM = "\x1f"
#: sacct -o fields, in order (Reason is last: free text).
SACCT_FIELDS = ("JobID", "JobIDRaw", "State", "ExitCode", "End", "NodeList", "Reason")
#: sacct's -s names of FINAL_STATES.
_SHORT = {"BOOT_FAIL": "BF", "CANCELLED": "CA", "COMPLETED": "CD", "DEADLINE": "DL",
          "FAILED": "F", "NODE_FAIL": "NF", "OUT_OF_MEMORY": "OOM", "PREEMPTED": "PR",
          "TIMEOUT": "TO"}
#: The final states, as sacct's --state takes them.
ENDED_STATES = ",".join(sorted(_SHORT[s] for s in FINAL_STATES))
#: Slurm's words when there is no accounting to ask, or it cannot be reached.
_NO_ACCOUNTING = re.compile(
    r"accounting storage is disabled|not running a supported accounting_storage plugin|"
    r"problem talking to the database|connection refused|slurmdbd.*(down|not responding)|"
    r"unable to connect to database", re.IGNORECASE)


class NoAccounting(PermanentSlurmError):
    """The cluster keeps no accounting (or slurmdbd cannot be reached): Slurm's words."""


@dataclass(frozen=True)
class Association:
    """One association of a user: an account (on a partition, or all) and its QOSes."""

    account: str
    partition: str
    qos: tuple[str, ...]
    default_qos: str


#: sacct -o fields of `Accounting.usage`, in order.
USAGE_FIELDS = ("JobID", "State", "Start", "End", "AllocTRES")


@dataclass(frozen=True)
class Usage:
    """What accounting recorded of one job: its state, when it held its allocation (Slurm's
    local times, "" when none) and the TRES it was allocated (`{"billing": "4", "cpu": "4",
    "gres/gpu": "1", "node": "1"}`)."""

    job_id: str
    state: str
    start: str
    end: str
    tres: Mapping[str, str]


def parse_usage(stdout: str) -> list[Usage]:
    """Jobs from `sacct -X -n -P --delimiter=DELIM -o USAGE_FIELDS`; ValueError on a bad line."""
    out = []
    n = len(USAGE_FIELDS)
    for line in stdout.splitlines():
        if not line.strip():
            continue
        parts = [p.strip() for p in line.split(DELIM)]
        if len(parts) != n:
            raise ValueError(f"sacct line has {len(parts)} fields, expected {n}: {line!r}")
        job_id, state, start, end, tres = parts
        pairs = (kv.partition("=") for kv in tres.split(",") if "=" in kv)
        out.append(Usage(job_id=job_id, state=state.split()[0] if state else "",
                         start="" if start in ("Unknown", "None") else start,
                         end="" if end in ("Unknown", "None") else end,
                         tres={k: v for k, _, v in pairs}))
    return out


def parse_sacct(stdout: str) -> list[EndedJob]:
    """Jobs from `sacct -X -n -P --delimiter=DELIM -o SACCT_FIELDS`; ValueError on a bad line."""
    out = []
    n = len(SACCT_FIELDS)
    for line in stdout.splitlines():
        if not line.strip():
            continue
        parts = line.split(DELIM, n - 1)
        if len(parts) != n:
            raise ValueError(f"sacct line has {len(parts)} fields, expected {n}: {line!r}")
        job_id, _raw, state, code, end, node, reason = (p.strip() for p in parts)
        # "CANCELLED by 0": the uid that cancelled it is not the state.
        out.append(EndedJob(job_id=job_id, state=state.split()[0] if state else "",
                            exit_code=code, end="" if end == "Unknown" else end,
                            node="" if node in ("None assigned", "(null)") else node,
                            reason="" if reason == "None" else reason))
    return out


def controller_end(scontrol_out: str) -> EndedJob | None:
    """How a job ended, from `scontrol show job -o ID`; None while its state is not one of
    FINAL_STATES (active, COMPLETING, STAGE_OUT: its end is not final yet)."""
    for rec in parse_scontrol_records(scontrol_out, "JobId"):
        state = rec.get("JobState", "").split()[0] if rec.get("JobState") else ""
        if state not in FINAL_STATES:
            return None
        array = rec.get("ArrayJobId")
        job_id = f"{array}_{rec['ArrayTaskId']}" if array and rec.get("ArrayTaskId") \
            else rec["JobId"]
        return EndedJob(job_id=job_id, state=state, exit_code=rec.get("ExitCode", ""),
                        end=rec.get("EndTime", ""), node=rec.get("NodeList", ""),
                        reason="" if rec.get("Reason") == "None" else rec.get("Reason", ""))
    return None


def parse_associations(stdout: str) -> list[Association]:
    """From `sacctmgr -n -P show assoc ... format=Account,Partition,QOS,DefaultQOS`."""
    out = []
    for line in stdout.splitlines():
        if not line.strip():
            continue
        account, partition, qos, default, *_ = [*line.split("|"), "", "", "", ""]
        out.append(Association(account.strip(), partition.strip(),
                               tuple(q for q in qos.strip().split(",") if q), default.strip()))
    return out


class Accounting:
    """Asks Slurm's accounting through sacct and sacctmgr; constructing it runs nothing."""

    def __init__(self, *, timeout: float = 30.0, env: Mapping[str, str] | None = None,
                 remote: proc.Remote | None = None) -> None:
        self._timeout = timeout
        self._env = dict(env) if env is not None else None
        self._remote = remote  # provider.ssh: sacct runs on the login node

    def _parsed(self, parse: Callable[[str], T], argv: Sequence[str]) -> T:
        """`parse` of what `argv` printed; output it cannot read is a SlurmError too."""
        out = self._run(argv)
        try:
            return parse(out)
        except ValueError as e:
            raise PermanentSlurmError(f"{argv[0]}: unexpected output: {e}", str(e),
                                      argv[0]) from e

    def _run(self, argv: Sequence[str]) -> str:
        env = proc.clean_env(self._env if self._env is not None else os.environ,
                             drop_prefixes=SCRUB_PREFIXES, keep=KEEP_VARS,
                             extra={"SLURM_TIME_FORMAT": "standard"})
        try:
            if self._remote is not None:
                res = self._remote.run(argv, timeout=self._timeout, check=False,
                                       env={"SLURM_TIME_FORMAT": "standard"})
            else:
                res = proc.run(list(argv), timeout=self._timeout, env=env, check=False)
        except SshError as e:
            raise unreachable(str(e), e.transient, argv[0]) from e
        except proc.CommandError as e:
            raise classify(str(e), argv[0]) from e
        said = (res.stderr + "\n" + res.stdout).strip()
        # Both tools print "accounting is disabled" on stdout, sometimes with exit code 0.
        if _NO_ACCOUNTING.search(said) and (res.returncode != 0 or not res.stdout.strip()
                                            or _NO_ACCOUNTING.search(res.stdout)):
            raise NoAccounting(f"{argv[0]}: no accounting: {said}", said, argv[0])
        if res.returncode != 0:
            raise classify(said or f"exit code {res.returncode}", argv[0])
        return res.stdout

    def ended_jobs(self, job_name: str, since: str = "now-7days",
                   user: str | None = None) -> list[EndedJob]:
        """This user's jobs named `job_name` that ended since `since`, oldest first."""
        return self._parsed(parse_sacct, [
            "sacct", "-X", "-n", "-P", f"--delimiter={DELIM}", f"--name={job_name}",
            f"--user={user or self._me()}", f"--starttime={since}", "--endtime=now",
            f"--state={ENDED_STATES}", f"--format={','.join(SACCT_FIELDS)}"])

    def usage(self, job_name: str, since: str, user: str | None = None) -> list[Usage]:
        """This user's jobs named `job_name` that were active since `since` (any state)."""
        return self._parsed(parse_usage, [
            "sacct", "-X", "-n", "-P", f"--delimiter={DELIM}", f"--name={job_name}",
            f"--user={user or _me()}", f"--starttime={since}", "--endtime=now",
            f"--format={','.join(USAGE_FIELDS)}"])

    def ended_job(self, job_id: str) -> EndedJob | None:
        """How job `job_id` (123 or 123_4) ended; None while accounting has no end for it
        (slurmdbd records it a moment after the job leaves the queue)."""
        jobs = self._parsed(parse_sacct, [
            "sacct", "-X", "-n", "-P", f"--delimiter={DELIM}", f"--jobs={job_id}",
            f"--state={ENDED_STATES}", f"--format={','.join(SACCT_FIELDS)}"])
        return next((j for j in reversed(jobs) if j.job_id == job_id), None)

    def associations(self, user: str | None = None) -> list[Association]:
        """The accounts (and their QOSes) `user` may submit with on this cluster (one
        slurmdbd may serve several: its ClusterName, from `scontrol show config`, narrows
        them; without it, every cluster's)."""
        where = ["where", f"user={user or self._me()}"]
        try:
            m = re.search(r"^ClusterName\s*=\s*(\S+)", self._run(["scontrol", "show", "config"]),
                          re.MULTILINE)
        except SlurmError:
            m = None
        if m:
            where.append(f"cluster={m.group(1)}")
        return parse_associations(self._run([
            "sacctmgr", "-n", "-P", "show", "associations", *where,
            "format=Account,Partition,QOS,DefaultQOS"]))

    def _me(self) -> str:
        """The user whose jobs these are: the login node's with provider.ssh."""
        if self._remote is None:
            return _me()
        return self._run(["id", "-un"]).strip()

    def qos_names(self) -> list[str]:
        """Every QOS the cluster has."""
        return [q.strip() for q in self._run(
            ["sacctmgr", "-n", "-P", "show", "qos", "format=Name"]).splitlines() if q.strip()]


def _me() -> str:
    return pwd.getpwuid(os.getuid()).pw_name
