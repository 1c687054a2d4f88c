"""A run's records: what each node job of a `ray up` (or `ray-slurm sbatch`) run went through,
kept after `ray down` for `ray-slurm report`.

    <cluster dir>/history/<run id>.jsonl   one JSON event per line, appended
    <cluster dir>/history/current          the id of the run that appends now

A run starts when a head is created (provider/runs.py); its id is the time it started
(`20261203-194512`), the name its logs' dir takes once the next run moves them aside. The
provider appends on transitions only (nodes.py's events): a job submitted (its type and
resources), listed in a new Slurm state (with Slurm's submit and start times), its Ray seen up
(ray.json's time), cancelled (by the autoscaler, or `ray down`), gone from the queue. Several
processes append (`ray up`, `ray down` on the login node, the head's autoscaler), so each batch
is one write under the file's lock (state.update_json's).

Bounded: once the file passes COMPACT_BYTES, the writer rewrites it with one snapshot line per
job, and jobs that ended beyond the newest KEEP_JOBS are folded into one `totals` line.
A reader skips a line it cannot read and counts it (a corrupt file gives a partial report).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from ray.autoscaler.tags import TAG_RAY_NODE_KIND, TAG_RAY_USER_NODE_TYPE

from ray_slurm_provider.nodespec import split
from ray_slurm_provider.provider.nodes import Events
from ray_slurm_provider.slurm.spec import JobSpec
from ray_slurm_provider.state import ClusterDir, locked
from ray_slurm_provider.units import mem_mb

logger = logging.getLogger(__name__)

#: Full records kept per run; older ended jobs are folded into the totals.
KEEP_JOBS = 10_000
#: The file size past which an append compacts the file (6 lines of ~100 bytes per job).
COMPACT_BYTES = 8 * 1024 * 1024
_CURRENT = "current"
_RUN_ID = re.compile(r"^\d{8}-\d{6}(\.\d+)?$")

#: Who ended a job, as the report counts them.
BY_AUTOSCALER = "autoscaler"
BY_DOWN = "ray down"


@dataclass(slots=True)  # not frozen: its __init__ runs per line read (a compaction: 50,000)
class Event:
    """One line: `ev` is run | submitted | listed | ray_up | cancel | gone | end (a final
    state learned later) | job (a compacted record) | totals (folded jobs)."""

    ev: str
    t: float
    job: str = ""
    type: str = ""  # submitted, job: the node type
    kind: str = ""  # submitted, job: head | worker
    nodes: int = 0  # submitted: Slurm nodes per job (a gang's N)
    cpus: int = 0  # submitted: per node, 0: unknown
    gpus: int = 0  # submitted: per node
    mem_mb: int = 0  # submitted: per node
    state: str = ""  # listed, gone: Slurm's state
    reason: str = ""  # listed: Slurm's reason
    submit: str = ""  # listed: Slurm's submit time (local, as squeue prints it)
    start: str = ""  # listed: Slurm's start time
    by: str = ""  # cancel: autoscaler | ray down
    data: dict[str, Any] = field(default_factory=dict)  # job: a snapshot; totals

    def line(self) -> str:
        # No asdict (it deep-copies): a restarted provider's first listing writes one line
        # per job (bench/p4_listing_cpu.py's first call).
        d: dict[str, Any] = {"ev": self.ev, "t": round(self.t, 3)}
        for k in _OPTIONAL:
            v = getattr(self, k)
            if v:
                d[k] = v
        return json.dumps(d, separators=(",", ":")) + "\n"


_FIELDS = frozenset(f.name for f in fields(Event))
_OPTIONAL = tuple(f.name for f in fields(Event) if f.name not in ("ev", "t"))


@dataclass
class JobRecord:
    """One node job, folded from its events. Times are Unix seconds; 0.0: not known."""

    job: str
    type: str = ""
    kind: str = ""
    nodes: int = 1
    cpus: int = 0
    gpus: int = 0
    mem_mb: int = 0
    submitted: float = 0.0
    started: float = 0.0
    ray_up: float = 0.0
    ended: float = 0.0
    state: str = ""  # the last state seen (listed or, from sacct, the final one)
    reason: str = ""
    by: str = ""  # who ended it (the report fills in what Slurm says)
    billing: float = 0.0  # sacct's billing TRES, where accounting has it
    cancelled: float = 0.0  # when the provider's first cancel was sent
    slurm_end: float = 0.0  # when Slurm says the job ended (sacct, scontrol)


@dataclass
class Totals:
    """Jobs folded out of the full records, per node type."""

    jobs: int = 0
    node_s: float = 0.0
    gpu_s: float = 0.0
    by: dict[str, int] = field(default_factory=dict)


@dataclass
class RunRecords:
    run: str
    started: float = 0.0
    jobs: dict[str, JobRecord] = field(default_factory=dict)
    folded: dict[str, Totals] = field(default_factory=dict)  # by node type
    bad_lines: int = 0


_STAMP = re.compile(r"^(\d{4})-(\d\d)-(\d\d)T(\d\d):(\d\d):(\d\d)$")


def slurm_time(stamp: str) -> float:
    """Slurm's local "2026-12-01T19:03:08" as Unix seconds; 0.0 if it is none. (No strptime:
    a compaction reads one per job and line.)"""
    m = _STAMP.match(stamp)
    if m is None:
        return 0.0
    y, mo, d, h, mi, sec = (int(g) for g in m.groups())
    try:
        return time.mktime((y, mo, d, h, mi, sec, 0, 0, -1))
    except (OverflowError, ValueError):
        return 0.0


def apply(rec: JobRecord, e: Event) -> None:
    """Fold one event into a job's record (events may repeat: a new provider process lists
    every job afresh)."""
    if e.ev == "submitted":
        rec.type = e.type or rec.type
        rec.kind = e.kind or rec.kind
        rec.nodes = e.nodes or rec.nodes
        rec.cpus = e.cpus
        rec.gpus = e.gpus
        rec.mem_mb = e.mem_mb
        rec.submitted = rec.submitted or e.t
    elif e.ev == "listed":
        rec.type = e.type or rec.type
        rec.kind = e.kind or rec.kind
        rec.submitted = slurm_time(e.submit) or rec.submitted or e.t
        if e.state != "PENDING":
            rec.started = slurm_time(e.start) or rec.started or e.t
        rec.state = e.state
        rec.reason = e.reason
    elif e.ev == "ray_up":
        rec.ray_up = rec.ray_up or e.t
    elif e.ev == "cancel":
        rec.by = rec.by or e.by
        rec.cancelled = rec.cancelled or e.t
    elif e.ev == "end":  # its final state and end time, learned later (cli/report.py)
        rec.state = e.state
        rec.reason = e.reason
        rec.slurm_end = e.t
    elif e.ev == "gone":
        rec.ended = rec.ended or e.t
    elif e.ev == "job":
        for k, v in e.data.items():
            if k in _RECORD_TYPES and isinstance(v, _RECORD_TYPES[k]):
                setattr(rec, k, v)


def _kind(default: Any) -> tuple[type, ...]:
    return (int, float) if isinstance(default, float) else (type(default),)


#: Each field's type, from its default: a line of another type is unreadable.
_EVENT_TYPES = {f.name: _kind(f.default) if f.name not in ("ev", "t", "data") else
                {"ev": (str,), "t": (int, float), "data": (dict,)}[f.name]
                for f in fields(Event)}
_RECORD_TYPES = {f.name: _kind(f.default) for f in fields(JobRecord) if f.name != "job"}


def _event(d: Any) -> Event:
    """A line's event; ValueError when it is none (not an object, a field of a wrong type)."""
    if not isinstance(d, dict):
        raise ValueError("not an event")
    kept = {k: v for k, v in d.items() if k in _FIELDS}
    for k, v in kept.items():
        if isinstance(v, bool) or not isinstance(v, _EVENT_TYPES[k]):
            raise ValueError(f"{k}: {v!r}")
    if "ev" not in kept or "t" not in kept:
        raise ValueError("no ev or t")
    return Event(**kept)


class History:
    """The records of one cluster's runs (its dir's `history/`)."""

    def __init__(self, cluster_root: Path) -> None:
        self.dir = cluster_root / "history"

    def path(self, run: str) -> Path:
        return self.dir / f"{run}.jsonl"

    def current(self) -> str | None:
        try:
            run = (self.dir / _CURRENT).read_text().strip()
        except OSError:
            return None
        return run if _RUN_ID.match(run) else None

    def runs(self) -> list[str]:
        """Every run with records, oldest first."""
        if not self.dir.is_dir():
            return []
        return sorted(p.stem for p in self.dir.glob("*.jsonl") if _RUN_ID.match(p.stem))

    def start_run(self, now: float) -> str:
        """A new run from now on: its id (the start time; `.N` for a second in one second)."""
        run = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
        base = run
        n = 0
        while self.path(run).exists():
            n += 1
            run = f"{base}.{n}"
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.append([Event("run", now)], run)
        tmp = self.dir / f".{_CURRENT}.{os.getpid()}"
        tmp.write_text(run + "\n")
        os.replace(tmp, self.dir / _CURRENT)  # readers never see half an id
        return run

    def append(self, events: Iterable[Event], run: str | None = None) -> None:
        """One write of `events` to the run's file (the current run's by default); nothing
        without a run. Compacts the file once it passes COMPACT_BYTES."""
        run = run or self.current()
        text = "".join(e.line() for e in events) if run is not None else ""
        if not text or run is None:
            return
        path = self.path(run)
        with locked(path.with_name(f".{path.name}.lock")):
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            with open(fd, "a", encoding="utf-8") as f:  # writes it all, however long
                f.write(text)
                f.flush()
                size = os.fstat(fd).st_size
            if size > COMPACT_BYTES:
                _compact(path, run)

    def read(self, run: str) -> RunRecords:
        """The run's records, the newest KEEP_JOBS in full (a file not compacted yet may hold
        more); OSError when the file cannot be read."""
        recs = fold(run, _lines(self.path(run)))
        fold_old(recs)
        return recs


def _lines(path: Path) -> Iterator[str]:
    with open(path, encoding="utf-8", errors="replace") as f:
        yield from f


def fold(run: str, lines: Iterable[str]) -> RunRecords:
    """The records from a file's lines; unreadable lines are counted, not fatal."""
    out = RunRecords(run)
    for line in lines:
        if not line.strip():
            continue
        try:
            e = _event(json.loads(line))
        except (ValueError, TypeError):
            out.bad_lines += 1
            continue
        if e.ev == "run":
            out.started = out.started or float(e.t)
        elif e.ev == "totals":
            for node_type, d in e.data.items():
                with contextlib.suppress(TypeError, ValueError, AttributeError):
                    add = Totals(int(d["jobs"]), float(d["node_s"]), float(d["gpu_s"]),
                                 {str(k): int(v) for k, v in d["by"].items()})
                    _add(out.folded.setdefault(node_type, Totals()), add)
        elif e.job:
            rec = out.jobs.get(e.job)
            if rec is None:
                rec = JobRecord(e.job)
                out.jobs[e.job] = rec
            try:
                apply(rec, e)
            except (TypeError, ValueError):
                out.bad_lines += 1
    return out


def _add(into: Totals, t: Totals) -> None:
    into.jobs += t.jobs
    into.node_s += t.node_s
    into.gpu_s += t.gpu_s
    for k, v in t.by.items():
        into.by[k] = into.by.get(k, 0) + v


def held_s(rec: JobRecord, now: float) -> float:
    """How long the job held its allocation (start to end, or to now while it runs)."""
    if not rec.started:
        return 0.0
    return max(0.0, (rec.ended or now) - rec.started)


def fold_old(recs: RunRecords, keep: int | None = None, now: float | None = None) -> None:
    """Fold the oldest ended jobs beyond the newest `keep` (KEEP_JOBS) into the totals."""
    extra = len(recs.jobs) - (KEEP_JOBS if keep is None else keep)
    if extra <= 0:
        return
    ended = sorted((r for r in recs.jobs.values() if r.ended), key=lambda r: r.ended)
    for rec in ended[:extra]:
        t = recs.folded.setdefault(rec.type, Totals())
        held = held_s(rec, now or time.time())
        _add(t, Totals(1, held * rec.nodes, held * rec.nodes * rec.gpus,
                       {rec.by or rec.state or "unknown": 1}))
        del recs.jobs[rec.job]


def snapshot(recs: RunRecords, now: float) -> list[Event]:
    """The records as events again: a run line, a totals line, one line per job."""
    out = [Event("run", recs.started or now)]
    if recs.folded:
        out.append(Event("totals", now, data={k: asdict(v) for k, v in recs.folded.items()}))
    for rec in recs.jobs.values():
        d = {k: getattr(rec, k) for k in _RECORD_TYPES if getattr(rec, k)}
        out.append(Event("job", now, job=rec.job, data=d))
    return out


def _compact(path: Path, run: str) -> None:
    """Rewrite the file as a snapshot (under its lock, which the caller holds)."""
    now = time.time()
    recs = fold(run, _lines(path))
    fold_old(recs, now=now)
    tmp = path.with_name(f".{path.name}.compact")
    tmp.write_text("".join(e.line() for e in snapshot(recs, now)), encoding="utf-8")
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)


def gpus_of(spec: JobSpec) -> int:
    """GPUs per node a job asks for (`gpu:2`, `gpu:h100:2`, `h100:2`, `2`); 0: none."""
    for ask in (spec.gpus_per_node, spec.gres):
        if ask:
            last = ask.split(",")[0].rsplit(":", 1)[-1]
            if last.isdigit():
                return int(last)
    return 0


def mem_of(spec: JobSpec) -> int:
    try:
        return mem_mb(spec.mem) if spec.mem else 0
    except ValueError:
        return 0


class Recorder:
    """The provider's side: appends on transitions, one write per call. A failed write is
    logged once and never fails the provider (the records are a report, not state)."""

    def __init__(self, history: History, cdir: ClusterDir,
                 clock: Callable[[], float] = time.time) -> None:
        self.history = history
        self.cdir = cdir
        self.clock = clock
        self._warned = False

    def _write(self, events: list[Event], run: str | None = None) -> None:
        if not events:
            return
        try:
            self.history.append(events, run)
        except OSError as e:
            if not self._warned:
                logger.warning("cannot append to the run's records in %s: %s",
                               self.history.dir, e)
            self._warned = True

    def new_run(self) -> None:
        try:
            self.history.start_run(self.clock())
        except OSError as e:
            logger.warning("cannot start the run's records in %s: %s", self.history.dir, e)

    def submitted(self, ids: Sequence[str], spec: JobSpec, node_type: str, head: bool) -> None:
        now = self.clock()
        self._write([Event("submitted", now, job=i, type=node_type,
                           kind="head" if head else "worker", nodes=spec.nodes,
                           cpus=spec.cpus_per_task or 0, gpus=gpus_of(spec),
                           mem_mb=mem_of(spec)) for i in ids])

    def listing(self, events: Events) -> None:
        """What one listing moved on: jobs in a new state, Ray seen up, jobs gone."""
        if not (events.listed or events.ray_up or events.gone):
            return
        run = self.history.current()
        if run is None:  # a cluster started before records (an older release's `ray up`)
            return
        now = self.clock()
        out = [Event("listed", now, job=job_id, type=tags.get(TAG_RAY_USER_NODE_TYPE, ""),
                     kind=tags.get(TAG_RAY_NODE_KIND, ""), state=job.state,
                     reason="" if job.reason == "None" else job.reason,
                     submit=job.submit_time, start=job.start_time)
               for job_id, job, tags in events.listed]
        for node_id in events.ray_up:
            out.append(Event("ray_up", self.cdir.ray_up_time(node_id) or now,
                             job=split(node_id)[0]))
        gone = {rec.job_id: rec.job.state for rec in events.gone}
        out.extend(Event("gone", now, job=j, state=state) for j, state in gone.items())
        self._write(out, run)

    def cancelled(self, jobs: Sequence[str], down: bool, at: float | None = None) -> None:
        """`at`: when the cancel was sent (the records' clock), else now."""
        now = self.clock() if at is None else at
        by = BY_DOWN if down else BY_AUTOSCALER
        self._write([Event("cancel", now, job=j, by=by) for j in jobs])
