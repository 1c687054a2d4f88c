"""Per-node-type launch back-off and the record of each type's last launch error.

A node type whose submissions Slurm refuses (bad partition, account, QOS, a job-count or GRES
limit) or whose jobs die before Ray starts (of their own doing: provider/ends.py) must not be
resubmitted on every autoscaler tick (5 s): that floods the controller, crash-loops jobs
through the queue and buries the reason. After a failure the type is held back, for longer
after each further failure (refusals start longer than "controller unreachable"); its first
successful submission clears it. While a type is held back, a launch fails at once without
asking Slurm.

The last error of each node type is kept in `<cluster dir>/errors.json`, which the
`ray-slurm status` command shows (a hold-back whose time has passed as past). The file
outlives the autoscaler that wrote it: when a later one (the next head's) first sees a job of
a type queued, or Ray come up on one, it clears the earlier entry of the kind that clears.
`ray status` shows the failed launches themselves (with their words: provider/submit.py), and
the autoscaler's event stream, which Ray prints on the driver, hears of each failure and, at
most once a minute, of a type still held back (rayapi.autoscaler_event).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ray_slurm_provider import rayapi
from ray_slurm_provider.retry import exponential
from ray_slurm_provider.state import update_json

logger = logging.getLogger(__name__)

#: First backoff per kind of failure, seconds; it doubles per failure up to MAX_DELAY_S.
BASE_DELAY_S = {"rejected": 60.0, "crashed": 60.0, "unavailable": 5.0}
MAX_DELAY_S = 600.0
#: Failures in a row that cost no backoff: one job that could not start Ray (a busy node:
#: "timed out during startup", after its own retries) is bad luck; two in a row are a pattern.
FREE_FAILURES = {"crashed": 1}
#: How often the autoscaler's event stream is told again that a type is still held back.
TELL_EVERY_S = 60.0
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

    def __init__(self, errors_path: Path | None, clock: Callable[[], float] = time.time,
                 tell: Callable[[str], object] = rayapi.autoscaler_event) -> None:
        self.arrays_refused = False  # the site said no to a job array: single jobs
        self.max_array = 1 << 30  # the largest array to try: halved when Slurm refuses one
        self._path = errors_path
        self._clock = clock
        self._lock = threading.Lock()
        self._errors: dict[str, TypeFailure] = {}
        self._tell = tell  # the driver's autoscaler events (rayapi.autoscaler_event)
        self._told: dict[str, float] = {}  # type -> when the events last heard of it
        #: (type, kinds) whose earlier entry in the file is dealt with (`_clear`).
        self._cleared: set[tuple[str, tuple[str, ...]]] = set()

    def check(self, node_type: str) -> None:
        """Raise HeldBack while `node_type` backs off."""
        with self._lock:
            err = self._errors.get(node_type)
            now = self._clock()
            if err is None or now >= err.retry_after:
                return
            err.held_back += 1
            snapshot = err.view()
            remind = now - self._told.get(node_type, float("-inf")) >= TELL_EVERY_S
            if remind:
                self._told[node_type] = now
        self._write(node_type, snapshot)  # `ray-slurm status` shows the refusals as they come
        held = HeldBack(node_type, err, now)
        if remind:  # Ray prints its own "Adding N node(s)" every tick, never why they fail
            self._tell(f"{held}; see `ray-slurm status`")
        raise held

    def failed(self, node_type: str, message: str, kind: str) -> float:
        """Record a failure; return how long the type is now held back."""
        with self._lock:
            now = self._clock()
            old = self._errors.get(node_type)
            n = old.failures + 1 if old else 1
            free = FREE_FAILURES.get(kind, 0)
            backoff = exponential(BASE_DELAY_S.get(kind, 60.0), cap_s=MAX_DELAY_S)
            delay = 0.0 if n <= free else backoff(n - free, 0.0)
            self._errors[node_type] = TypeFailure(
                kind, message.strip(), n, old.first_failed if old else now, now, now + delay,
                old.held_back if old else 0)
            snapshot = self._errors[node_type].view()
            self._told[node_type] = now
        logger.warning("Launch of node type %s failed (%s, %d in a row); holding it back for "
                       "%.0fs: %s", node_type, kind, n, delay, message.strip())
        self._write(node_type, snapshot)
        until = f"held back until {time.strftime('%H:%M:%S', time.localtime(now + delay))}"
        self._tell(f"Launch of node type {node_type} failed ({kind}, {n} in a row); "
                   f"{until if delay else 'tried again'}: {message.strip()}")
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
            # errors.json may hold an earlier autoscaler's entry (the head before this one):
            # the first success of each kind per type here clears that too.
            unseen = (node_type, kinds) not in self._cleared
            self._cleared.add((node_type, kinds))
            if err is None or err.kind not in kinds:
                err = None
            else:
                del self._errors[node_type]
        if err is None:
            if unseen:
                self._drop_earlier(node_type, kinds)
            return
        logger.info("Node type %s launches again", node_type)
        self._write(node_type, None)

    def _drop_earlier(self, node_type: str, kinds: tuple[str, ...]) -> None:
        """Remove an earlier process's entry of `node_type` of one of `kinds` from the file."""
        if self._path is None or not self._path.exists():
            return

        def drop(old: Any) -> dict[str, Any]:
            data: dict[str, Any] = dict(old) if isinstance(old, dict) else {}
            entry = data.get(node_type)
            if isinstance(entry, dict) and entry.get("kind") in kinds:
                del data[node_type]
                logger.info("Node type %s launches again (an earlier autoscaler's error is "
                            "cleared)", node_type)
            return data

        try:
            update_json(self._path, drop)
        except (OSError, ValueError) as e:
            logger.warning("Could not update %s: %s", self._path, e)

    def error(self, node_type: str) -> TypeFailure | None:
        with self._lock:
            return self._errors.get(node_type)

    def _write(self, node_type: str, entry: dict[str, Any] | None) -> None:
        """Merge one type's entry into errors.json (other processes own other types)."""
        if self._path is None:
            return

        def merge(old: Any) -> dict[str, Any]:
            data: dict[str, Any] = dict(old) if isinstance(old, dict) else {}
            if entry is None:
                data.pop(node_type, None)
            else:
                data[node_type] = entry
            return data

        try:
            update_json(self._path, merge)
        except (OSError, ValueError) as e:
            logger.warning("Could not update %s: %s", self._path, e)


def log_tail(log: Path, max_bytes: int = 8192) -> list[str]:
    """The last lines of a job's output (at most `max_bytes` of it), blank ones left out."""
    try:
        with log.open("rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - max_bytes))
            tail = f.read().decode(errors="replace")
    except OSError:
        return []
    return [ln.strip() for ln in tail.splitlines() if ln.strip()]


def last_log_line(log: Path) -> str:
    """What a job's output says last: the node agent's last line (`[ray-slurm HH:MM:SS] ...`),
    else the last line at all (a prologue or module load that failed before the agent ran)."""
    lines = log_tail(log)
    agent = [ln for ln in lines if ln.startswith("[ray-slurm ")]
    return (agent or lines or [""])[-1]
