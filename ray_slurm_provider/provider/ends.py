"""Workers that left the queue before Ray came up on them: which count against their node type
(the launch guard's back-off, guard.py).

Only an end the job caused itself counts: Slurm's FAILED or OUT_OF_MEMORY. A job taken away
(PREEMPTED, CANCELLED by someone, NODE_FAIL, TIMEOUT, BOOT_FAIL, DEADLINE) or one that ended
cleanly (COMPLETED: its agent was told to stop, or its head was gone) says nothing about the
type. A job the autoscaler cancelled itself is never judged (provider/nodes.py hides it).

A job is judged once, when its end is final. While Slurm still lists it (COMPLETING: a
preempted job's processes get KillWait, 30 s by default, to end) it waits, and nobody asks
Slurm anything about it. Once it has left the listing, the back end is asked how it ended
(`EndReader.ended_job`: slurmctld, which keeps an ended job for MinJobAge, else sacct), at
most once per RETRY_S until the end is final.

Any error of Slurm's other than missing accounting means "not yet". Where the end cannot be
known (no accounting and the controller has forgotten the job, a back end that cannot ask, or
still no final end SETTLE_S after the job left), the job's own log decides: it counts only when
the node agent's last line says the agent failed (it gave up on `ray start`, an ERROR ended it,
or Ray exited with an error), and never when slurmstepd wrote that Slurm cancelled the job (a
preemption, a cancel, the time limit). A setup line that fails before the agent runs leaves no
line of the agent, so such a job then does not count.
"""

from __future__ import annotations

import logging
import math
import re
import threading
from collections.abc import Container, Iterable
from dataclasses import dataclass
from pathlib import Path

from ray_slurm_provider.provider.guard import last_log_line, log_tail
from ray_slurm_provider.slurm.client import (
    EndedJob,
    EndReader,
    Job,
    SlurmClient,
    SlurmError,
)
from ray_slurm_provider.slurm.sacct import NoAccounting

logger = logging.getLogger(__name__)

#: The final states a job reaches by its own doing: they count against its node type. Not
#: BOOT_FAIL (its node did not boot) nor DEADLINE (Slurm's own deadline passed): like a
#: preemption, neither says anything about what the type runs.
ITS_OWN = frozenset({"FAILED", "OUT_OF_MEMORY"})
#: The longest wait for a final end after the job left the active list: past KillWait and a
#: slow epilog. A job stuck COMPLETING longer is judged by its log.
SETTLE_S = 300.0
#: Between two questions to Slurm about one job whose end is not known yet.
RETRY_S = 15.0
#: slurmstepd's line in the job's log when Slurm ends the job (preempted, cancelled, the time
#: limit, a node failure): `*** JOB 45 ON n3 CANCELLED AT 2026-12-02T00:27:30 DUE TO
#: PREEMPTION ***`. A STEP line is not: srun ends a gang's other members when one fails.
_TAKEN = re.compile(r"\*\*\* JOB \S+ ON \S+ CANCELLED AT ")
#: The node agent's lines that end its job with a failure of its own (agent/agent.py,
#: agent/worker.py): a stop it was told of ends with "told to stop" or "Ray stopped".
_FAILED = re.compile(r"^\[ray-slurm [^\]]*\] (?:ERROR: .*; the job ends$|giving up: |"
                     r"Ray exited with code [1-9]\d*(?:; the job ends$| on its own))")


@dataclass
class Early:
    """A job that left the active list before Ray came up on it, waiting to be judged."""

    job_id: str
    node_type: str
    last_state: str  # as the last listing that showed it active said
    log: Path
    since: float  # when it left the active list
    asked: float = -math.inf  # when Slurm was last asked how it ended


def log_says_failed(log: Path) -> bool:
    """Whether the job's log shows a failure of its own: the agent's last line is one of its
    failure lines, and slurmstepd did not write that Slurm cancelled the job."""
    lines = log_tail(log)
    if any(_TAKEN.search(ln) for ln in lines):
        return False
    agent = [ln for ln in lines if ln.startswith("[ray-slurm ")]
    return bool(agent) and _FAILED.match(agent[-1]) is not None


class EarlyEnds:
    """The jobs waiting for judgment; `left` adds one, `settle` (once per listing) judges those
    whose end is final and says which count. Thread-safe; asks Slurm outside its lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting: dict[str, Early] = {}

    def left(self, job_id: str, node_type: str, last_state: str, log: Path,
             now: float) -> None:
        """A worker job of `node_type` left the active list before Ray came up on it."""
        with self._lock:
            self._waiting[job_id] = Early(job_id, node_type, last_state, log, now)

    def settle(self, slurm: SlurmClient, jobs: Iterable[Job], listed: Container[str],
               now: float) -> list[tuple[str, str]]:
        """Judge each waiting job whose end is final, or whose wait is over; (node type, why)
        of each that counts against its type. `jobs`: the listing; `listed`: their ids."""
        if not self._waiting:  # the steady case; a job added meanwhile waits for the next
            return []
        with self._lock:  # taken out while judged: two ticks at once never judge one job twice
            for job in jobs:
                if job.active and job.job_id in self._waiting:
                    # Requeued (COMPLETING, then PENDING again): it did not end.
                    del self._waiting[job.job_id]
                    logger.debug("Slurm job %s is %s again; not judged", job.job_id, job.state)
            due = [e for e in self._waiting.values() if _due(e, listed, now)]
            for early in due:
                del self._waiting[early.job_id]
        counted = []
        later = []
        for early in due:
            early.asked = now
            try:
                verdict = _judge(early, slurm, early.job_id in listed, now)
            except Exception as e:  # one job's surprise must not lose the others nor the tick
                logger.exception("Cannot judge how Slurm job %s ended", early.job_id)
                late = now - early.since >= SETTLE_S
                verdict = _by_log(early, f"cannot judge its end: {e}") if late else None
            if verdict is None:
                later.append(early)
            elif verdict:
                counted.append((early.node_type, verdict))
        with self._lock:
            for early in later:  # unless the job came and left again meanwhile
                self._waiting.setdefault(early.job_id, early)
        return counted


def _judge(early: Early, slurm: SlurmClient, listed: bool, now: float) -> str | None:
    """None: not yet; "": judged, not the type's fault; else why it counts."""
    late = now - early.since >= SETTLE_S
    if listed:
        return _by_log(early, f"still listed {SETTLE_S:.0f}s after it left the active list")
    if not isinstance(slurm, EndReader):
        return _by_log(early, "this Slurm back end cannot ask how a job ended")
    try:
        end = slurm.ended_job(early.job_id)
    except NoAccounting as e:  # no accounting, and slurmctld forgot the job
        return _by_log(early, f"Slurm cannot say how it ended: {e.slurm_message or e}")
    except SlurmError as e:
        logger.debug("Cannot ask how Slurm job %s ended yet: %s", early.job_id, e)
        return _by_log(early, f"Slurm did not answer: {e}") if late else None
    if end is None:
        return _by_log(early, "Slurm has no final end for it") if late else None
    return _by_state(early, end)


def _due(early: Early, listed: Container[str], now: float) -> bool:
    """Whether to judge (or ask about) `early` now: it has left the listing and was not asked
    within RETRY_S, or its wait is over."""
    if now - early.since >= SETTLE_S:
        return True
    return early.job_id not in listed and now - early.asked >= RETRY_S


def _ended(early: Early) -> str:
    return (f"Slurm job {early.job_id} (last seen {early.last_state}) ended before Ray started "
            "on it")


def _by_state(early: Early, end: EndedJob) -> str:
    if end.state not in ITS_OWN:
        logger.info("Slurm job %s of node type %s ended %s before Ray started on it; not held "
                    "against the type", early.job_id, early.node_type, end.why)
        return ""
    return (f"{_ended(early)}; Slurm says {end.why}; {last_log_line(early.log) or 'see'} "
            f"({early.log})")


def _by_log(early: Early, unknown: str) -> str:
    if not log_says_failed(early.log):
        logger.info("Slurm job %s of node type %s ended before Ray started on it (%s) and its "
                    "log shows no failure of its own; not held against the type",
                    early.job_id, early.node_type, unknown)
        return ""
    return f"{_ended(early)} ({unknown}); {last_log_line(early.log)} ({early.log})"
