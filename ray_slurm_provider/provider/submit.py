"""Submitting a launch: one sbatch (an array) where it can, through the type's back-off
(guard.py), and stray submissions.

A submission that raised a transient error (timeout, lost answer; on a rate-limited
controller sbatch backs off by itself and can run past its timeout, issue 29) may still have
queued a job. Each submission carries a nonce in its job comment: before trying again, the
cluster's jobs are listed and a job carrying that nonce is adopted (the submission
succeeded). One not listed is a stray: should it show up later, it is cancelled on sight
(`Strays`), and the next try has a nonce of its own. So a submission never leaves two jobs.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import replace

from ray_slurm_provider import rayapi
from ray_slurm_provider.jobs import decode_tags, encode_tags
from ray_slurm_provider.provider.guard import CATEGORY, HeldBack, LaunchGuard
from ray_slurm_provider.retry import exponential, retry
from ray_slurm_provider.slurm.client import (
    ArraySubmitter,
    PermanentSlurmError,
    SlurmClient,
    SlurmError,
    TransientSlurmError,
)
from ray_slurm_provider.slurm.script import JobSpec

logger = logging.getLogger(__name__)

#: Job-comment tag of one submission (stripped from the tags Ray sees).
SUBMIT_TAG = "ray-slurm-submit"
#: Tries of one submission that Slurm did not answer, and the back-off between them
#: (jittered: the provider and a head's autoscaler may be throttled together).
SUBMIT_ATTEMPTS = 3
SUBMIT_DELAY = exponential(2.0, cap_s=30.0, jitter=0.2)


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
    "Error: ..." line and exits non-zero; the autoscalers record a NodeLaunchException. v1
    shows its category and description in `ray status` (`-v`) and prints them on the driver;
    v2 marks the request ALLOCATION_FAILED, shown by `ray status`, with the words only
    through rayapi.explain_launch_errors (installed here, before v2 polls the error)."""
    if head:
        import click

        return click.ClickException(description)
    from ray.autoscaler.node_launch_exception import NodeLaunchException

    rayapi.explain_launch_errors()
    # v1 puts the description into a str.format template (its event summary): a brace from
    # a job's log line would raise there.
    words = description.replace("{", "(").replace("}", ")")
    return NodeLaunchException(category, words, None)


class ArraysRefused(PermanentSlurmError):
    """The site refuses job arrays (MaxArraySize, a submit plugin): submit single jobs."""


class ArrayNotTaken(PermanentSlurmError):
    """Slurm refused a job array for another reason (a job-count limit counts every task):
    its nodes are tried one job at a time. Nothing was queued."""


def queued_anyway(slurm: SlurmClient, job_name: str, nonce: str) -> list[str]:
    """The ids of the jobs a submission that raised queued after all (their comment carries
    its `nonce`; every task of an array does), in task order; [] when none is listed or the
    listing itself fails (the nonce then stays a stray)."""
    try:
        jobs = slurm.list_jobs(job_name)
    except SlurmError as e:
        logger.info("listing %s to find a submission that got no answer failed: %s",
                    job_name, e.slurm_message)
        return []
    ids = [j.job_id for j in jobs if (decode_tags(j.comment) or {}).get(SUBMIT_TAG) == nonce]

    def order(job_id: str) -> tuple[int, int]:
        base, _, task = job_id.partition("_")
        return int(base) if base.isdigit() else 0, int(task) if task.isdigit() else -1

    return sorted(ids, key=order)


def guarded_submit(slurm: SlurmClient, guard: LaunchGuard, strays: Strays, spec: JobSpec,
                   tags: dict[str, str], node_type: str, head: bool,
                   count: int = 1, queued: int = 0, wanted: int = 1,
                   sleep: Callable[[float], None] | None = None) -> list[str]:
    """One sbatch (a job array of `count` tasks when count > 1: the caller checks that the
    back end is an `ArraySubmitter`): a held-back type fails at once, a failure holds the
    type back. A submission Slurm did not answer is looked for by its nonce and adopted when
    listed, else tried again (SUBMIT_ATTEMPTS in all, backing off) with a new nonce, the old
    one a stray. A refused array raises ArraysRefused or ArrayNotTaken without holding the
    type back. `queued` of `wanted` nodes were queued before this call (for the error's
    words)."""
    try:
        guard.check(node_type)
    except HeldBack as e:
        raise launch_error(head, e.category, str(e)) from None

    def attempt(n: int) -> list[str]:
        nonce = uuid.uuid4().hex[:16]
        comment = encode_tags({**tags, SUBMIT_TAG: nonce})
        try:
            if count > 1 and isinstance(slurm, ArraySubmitter):
                return slurm.submit_array(spec, count, comment=comment)
            return [slurm.submit(spec, comment=comment)]
        except TransientSlurmError as e:
            found = queued_anyway(slurm, spec.job_name, nonce)
            if len(found) == count:
                logger.info("Slurm queued %s of node type %s although the submission got no "
                            "answer (%s)", ",".join(found), node_type, e.slurm_message)
                return found
            strays.add(nonce)
            raise

    def note(n: int, err: BaseException | None, wait: float) -> None:
        logger.warning("submitting node type %s (try %d of %d): %s; trying again in %.0fs",
                       node_type, n, SUBMIT_ATTEMPTS, err, wait)

    try:
        job_ids = retry(attempt, delay=SUBMIT_DELAY, attempts=SUBMIT_ATTEMPTS,
                        retry_on=(TransientSlurmError,), on_retry=note, sleep=sleep)
    except SlurmError as e:
        if count > 1 and isinstance(e, PermanentSlurmError):  # nothing queued
            refused = ArraysRefused if "array" in e.slurm_message.lower() else ArrayNotTaken
            raise refused(str(e), e.slurm_message, e.command) from e
        kind = "unavailable" if isinstance(e, TransientSlurmError) else "rejected"
        guard.failed(node_type, e.slurm_message, kind)
        what = (f"Slurm queued {queued} of {wanted} nodes of type {node_type} and refused "
                "the rest" if queued else f"Slurm did not take the job of node type {node_type}")
        raise launch_error(head, CATEGORY[kind], f"{what}: {e.slurm_message}") from e
    guard.succeeded(node_type)
    return job_ids


def submit_nodes(slurm: SlurmClient, guard: LaunchGuard, strays: Strays, spec: JobSpec,
                 tags: dict[str, str], node_type: str, head: bool,
                 count: int, sleep: Callable[[float], None] | None = None,
                 ) -> tuple[list[str], Exception | None]:
    """`count` nodes of one type. On a back end that submits arrays (the CLI), ONE
    `sbatch --array` for all of them: each task is a node of its own, id `<array>_<task>`,
    logging to `<array>_<task>.out`. An array Slurm refuses (larger than the site's
    MaxArraySize) is halved until it is taken, and later arrays keep that size; one refused
    for another reason (a QOS or association job-count limit counts every task) is tried
    one job per node, until Slurm refuses one: the launch then fails with Slurm's words,
    keeping what was queued. Elsewhere (REST, pyslurm), and on a site that refuses even an
    array of 2, one job per node. A single node is always a plain job.

    Returns the ids queued and, when Slurm did not take them all, the launch error to raise
    once the caller has recorded them (nothing queued: the error is raised here)."""
    ids: list[str] = []
    if count > 1 and isinstance(slurm, ArraySubmitter) and not guard.arrays_refused:
        aspec = replace(spec, output=spec.output.replace("%j", "%A_%a") if spec.output else None)
        while count - len(ids) > 1 and not guard.arrays_refused:
            n = min(count - len(ids), guard.max_array)
            try:
                ids += guarded_submit(slurm, guard, strays, aspec, tags, node_type, head, n,
                                      sleep=sleep)
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
        try:
            ids += guarded_submit(slurm, guard, strays, spec, tags, node_type, head,
                                  queued=len(ids), wanted=count, sleep=sleep)
        except Exception as e:  # a launch error (guarded_submit): Slurm took only some
            if not ids:
                raise
            return ids, e
    return ids, None
