"""Per-node-type launch backoff, the record of the last launch error, and stray submissions.

A node type whose submissions Slurm refuses (bad partition, account, QOS, a job-count or GRES
limit) or whose jobs die before Ray starts must not be resubmitted on every autoscaler tick
(5 s): that floods the controller, crash-loops jobs through the queue and buries the reason.
After a failure the type is held back, for longer after each further failure (refusals start
longer than "controller unreachable"); its first successful submission clears it. While a type
is held back, a launch fails at once without asking Slurm.

The last error of each node type is kept in `<cluster dir>/errors.json`, which the
`ray-slurm status` command shows; `ray status` shows the failed launches themselves.

A submission that raised a transient error (timeout, lost answer) may still have queued a
job. Ray was told the launch failed and will launch again, so such a job would be a
duplicate: each submission carries a nonce in its job comment, and a listed job whose nonce
belongs to a failed submission is cancelled on sight (`Strays`).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from ray_slurm_provider.jobs import encode_tags
from ray_slurm_provider.slurm.client import (
    ArraySubmitter,
    PermanentSlurmError,
    SlurmClient,
    SlurmError,
    TransientSlurmError,
)
from ray_slurm_provider.slurm.script import JobSpec
from ray_slurm_provider.state import read_json, write_json

logger = logging.getLogger(__name__)

#: Job-comment tag of one submission (stripped from the tags Ray sees).
SUBMIT_TAG = "ray-slurm-submit"
#: First backoff per kind of failure, seconds; it doubles per failure up to MAX_DELAY_S.
BASE_DELAY_S = {"rejected": 60.0, "crashed": 60.0, "unavailable": 5.0}
MAX_DELAY_S = 600.0
#: Failures in a row that cost no backoff: one job that could not start Ray (a busy node:
#: "timed out during startup", after its own retries) is bad luck; two in a row are a pattern.
FREE_FAILURES = {"crashed": 1}
#: What Ray shows as the category of a failed launch (NodeLaunchException, < 20 chars).
CATEGORY = {"rejected": "SlurmRejected", "crashed": "JobDiedAtStart",
            "unavailable": "SlurmUnavailable"}


def _iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(t))


@dataclass
class TypeFailure:
    """The last launch error of one node type."""

    kind: str  # rejected | crashed | unavailable
    message: str  # Slurm's own words (or what the job's log said)
    failures: int
    first_failed: float
    last_failed: float
    retry_after: float
    held_back: int = 0  # launches refused without asking Slurm

    def view(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(first_failed=_iso(self.first_failed), last_failed=_iso(self.last_failed),
                 retry_after=_iso(self.retry_after), retry_after_ts=self.retry_after)
        return d


class HeldBack(Exception):
    """A launch of a node type refused locally while it backs off."""

    def __init__(self, node_type: str, err: TypeFailure, now: float) -> None:
        super().__init__(
            f"node type {node_type} is held back for {err.retry_after - now:.0f}s more after "
            f"{err.failures} failed launch(es); last error: {err.message}")
        self.category = CATEGORY.get(err.kind, "LaunchFailed")


class LaunchGuard:
    """Thread-safe per-type backoff; `clock` is injectable for tests (epoch seconds)."""

    def __init__(self, errors_path: Path | None, clock: Callable[[], float] = time.time) -> None:
        self.arrays_refused = False  # the site said no to a job array: single jobs
        self.max_array = 1 << 30  # the largest array to try: halved when Slurm refuses one
        self._path = errors_path
        self._clock = clock
        self._lock = threading.Lock()
        self._errors: dict[str, TypeFailure] = {}

    def check(self, node_type: str) -> None:
        """Raise HeldBack while `node_type` backs off."""
        with self._lock:
            err = self._errors.get(node_type)
            now = self._clock()
            if err is None or now >= err.retry_after:
                return
            err.held_back += 1
            snapshot = err.view()
        self._write(node_type, snapshot)  # `ray-slurm status` shows the refusals as they come
        raise HeldBack(node_type, err, now)

    def failed(self, node_type: str, message: str, kind: str) -> float:
        """Record a failure; return how long the type is now held back."""
        with self._lock:
            now = self._clock()
            old = self._errors.get(node_type)
            n = old.failures + 1 if old else 1
            free = FREE_FAILURES.get(kind, 0)
            delay = 0.0 if n <= free else min(
                MAX_DELAY_S, BASE_DELAY_S.get(kind, 60.0) * 2.0 ** min(n - 1 - free, 20))
            self._errors[node_type] = TypeFailure(
                kind, message.strip(), n, old.first_failed if old else now, now, now + delay,
                old.held_back if old else 0)
            snapshot = self._errors[node_type].view()
        logger.warning("Launch of node type %s failed (%s, %d in a row); holding it back for "
                       "%.0fs: %s", node_type, kind, n, delay, message.strip())
        self._write(node_type, snapshot)
        return delay

    def succeeded(self, node_type: str) -> None:
        """A job of the type was queued (a crash at start is cleared by `ray_started`)."""
        self._clear(node_type, ("rejected", "unavailable"))

    def ray_started(self, node_type: str) -> None:
        """Ray came up on a node of the type."""
        self._clear(node_type, ("crashed",))

    def _clear(self, node_type: str, kinds: tuple[str, ...]) -> None:
        with self._lock:
            err = self._errors.get(node_type)
            if err is None or err.kind not in kinds:
                return
            del self._errors[node_type]
        logger.info("Node type %s launches again", node_type)
        self._write(node_type, None)

    def error(self, node_type: str) -> TypeFailure | None:
        with self._lock:
            return self._errors.get(node_type)

    def _write(self, node_type: str, entry: dict[str, Any] | None) -> None:
        """Merge one type's entry into errors.json (other processes own other types)."""
        if self._path is None:
            return
        try:
            data = read_json(self._path)
            data = dict(data) if isinstance(data, dict) else {}
            if entry is None:
                data.pop(node_type, None)
            else:
                data[node_type] = entry
            write_json(self._path, data)
        except (OSError, ValueError) as e:
            logger.warning("Could not update %s: %s", self._path, e)


class Strays:
    """Nonces of submissions that raised; jobs carrying one must not live on."""

    def __init__(self, clock: Callable[[], float] = time.time, keep_s: float = 3600.0) -> None:
        self._clock = clock
        self._keep_s = keep_s
        self._lock = threading.Lock()
        self._failed: dict[str, float] = {}
        self.generation = 0  # grows with every add

    def add(self, nonce: str) -> None:
        with self._lock:
            self.generation += 1
            now = self._clock()
            self._failed = {k: t for k, t in self._failed.items() if now - t < self._keep_s}
            self._failed[nonce] = now

    def __contains__(self, nonce: object) -> bool:
        with self._lock:
            return nonce in self._failed


def launch_error(head: bool, category: str, description: str) -> Exception:
    """What to raise for a failed launch: `ray up` prints a ClickException as one clean
    "Error: ..." line and exits non-zero; the autoscalers record a NodeLaunchException (v1's
    availability tracker; v2 marks the request ALLOCATION_FAILED, shown by `ray status`)."""
    if head:
        import click

        return click.ClickException(description)
    from ray.autoscaler.node_launch_exception import NodeLaunchException

    return NodeLaunchException(category, description, None)


def last_log_line(log: Path, max_bytes: int = 8192) -> str:
    """What a job's output says last: the node agent's last line (`[ray-slurm HH:MM:SS] ...`),
    else the last line at all (a prologue or module load that failed before the agent ran)."""
    try:
        with log.open("rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - max_bytes))
            tail = f.read().decode(errors="replace")
    except OSError:
        return ""
    lines = [ln.strip() for ln in tail.splitlines() if ln.strip()]
    agent = [ln for ln in lines if ln.startswith("[ray-slurm ")]
    return (agent or lines or [""])[-1]


class ArraysRefused(PermanentSlurmError):
    """The site refuses job arrays (MaxArraySize, a submit plugin): submit single jobs."""


class ArrayNotTaken(PermanentSlurmError):
    """Slurm refused a job array for another reason (a job-count limit counts every task):
    its nodes are tried one job at a time. Nothing was queued."""


def guarded_submit(slurm: SlurmClient, guard: LaunchGuard, strays: Strays, spec: JobSpec,
                   tags: dict[str, str], node_type: str, head: bool,
                   count: int = 1, queued: int = 0, wanted: int = 1) -> list[str]:
    """One sbatch (a job array of `count` tasks when count > 1: the caller checks that the
    back end is an `ArraySubmitter`): a held-back type fails at once, a failure holds the
    type back, and a job of a submission that raised never lives on (its nonce, shared by
    every task of an array, goes to `strays`). A refused array raises ArraysRefused or
    ArrayNotTaken without holding the type back. `queued` of `wanted` nodes were queued
    before this call (for the error's words)."""
    nonce = uuid.uuid4().hex[:16]
    try:
        guard.check(node_type)
        comment = encode_tags({**tags, SUBMIT_TAG: nonce})
        if count > 1 and isinstance(slurm, ArraySubmitter):
            job_ids = slurm.submit_array(spec, count, comment=comment)
        else:
            job_ids = [slurm.submit(spec, comment=comment)]
    except HeldBack as e:
        raise launch_error(head, e.category, str(e)) from None
    except SlurmError as e:
        if count > 1 and isinstance(e, PermanentSlurmError):  # nothing queued
            refused = ArraysRefused if "array" in e.slurm_message.lower() else ArrayNotTaken
            raise refused(str(e), e.slurm_message, e.command) from e
        kind = "unavailable" if isinstance(e, TransientSlurmError) else "rejected"
        if kind == "unavailable":
            strays.add(nonce)
        guard.failed(node_type, e.slurm_message, kind)
        what = (f"Slurm queued {queued} of {wanted} nodes of type {node_type} and refused "
                "the rest" if queued else f"Slurm did not take the job of node type {node_type}")
        raise launch_error(head, CATEGORY[kind], f"{what}: {e.slurm_message}") from e
    guard.succeeded(node_type)
    return job_ids


def submit_nodes(slurm: SlurmClient, guard: LaunchGuard, strays: Strays, spec: JobSpec,
                 tags: dict[str, str], node_type: str, head: bool, count: int) -> list[str]:
    """`count` nodes of one type. On a back end that submits arrays (the CLI), ONE
    `sbatch --array` for all of them: each task is a node of its own, id `<array>_<task>`,
    logging to `<array>_<task>.out`. An array Slurm refuses (larger than the site's
    MaxArraySize) is halved until it is taken, and later arrays keep that size; one refused
    for another reason (a QOS or association job-count limit counts every task) is tried
    one job per node, until Slurm refuses one: the launch then fails with Slurm's words,
    keeping what was queued. Elsewhere (REST, pyslurm), and on a site that refuses even an
    array of 2, one job per node. A single node is always a plain job."""
    ids: list[str] = []
    if count > 1 and isinstance(slurm, ArraySubmitter) and not guard.arrays_refused:
        aspec = replace(spec, output=spec.output.replace("%j", "%A_%a") if spec.output else None)
        while count - len(ids) > 1 and not guard.arrays_refused:
            n = min(count - len(ids), guard.max_array)
            try:
                ids += guarded_submit(slurm, guard, strays, aspec, tags, node_type, head, n)
            except ArraysRefused as e:
                if n > 2:  # bigger than the site's MaxArraySize, say: halve, keep that size
                    guard.max_array = (n + 1) // 2
                    continue
                guard.arrays_refused = True
                logger.warning("Slurm refuses job arrays (%s): submitting one job per node",
                               e.slurm_message)
            except ArrayNotTaken as e:
                logger.info("Slurm refused an array of %d nodes of type %s (%s); trying one "
                            "job per node", n, node_type, e.slurm_message)
                break
    while len(ids) < count:
        ids += guarded_submit(slurm, guard, strays, spec, tags, node_type, head,
                              queued=len(ids), wanted=count)
    return ids
