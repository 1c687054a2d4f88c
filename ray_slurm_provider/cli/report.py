"""`ray-slurm report CONFIG [--run RUN] [--json] [--html FILE]`: a run's life at a glance.

Reads the run's records (provider/history.py), which outlive `ray down`, so it works while the
cluster runs and after. Per node type: jobs, queue wait (submit -> start), start-up (start ->
Ray up), node-hours and GPU-hours allocated (start -> end, or now), billing where accounting
has it, and who ended the jobs. How a job the provider did not cancel ended comes from
accounting (one `sacct` for the run), else from the controller (`scontrol`, while it keeps the
job: MinJobAge); what it says is appended to the records, so it outlives both. Nothing that is
missing (accounting, records, a readable line) stops the report: it says what is missing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from ray_slurm_provider.cli import oneshots
from ray_slurm_provider.cli.common import (
    CliError,
    Cluster,
    config_command,
    load_cluster,
    run_command,
    table,
)
from ray_slurm_provider.cli.report_html import render
from ray_slurm_provider.provider.history import (
    BY_AUTOSCALER,
    BY_DOWN,
    Event,
    History,
    JobRecord,
    RunRecords,
    held_s,
    slurm_time,
)
from ray_slurm_provider.slurm.client import FINAL_STATES, EndReader, SlurmError
from ray_slurm_provider.slurm.sacct import Accounting, Usage
from ray_slurm_provider.units import fmt_duration

#: Slurm's final states as the report counts who ended a job.
END_OF = {"CANCELLED": "scancel", "TIMEOUT": "walltime", "DEADLINE": "walltime",
          "PREEMPTED": "preemption", "NODE_FAIL": "node failure", "BOOT_FAIL": "node failure",
          "FAILED": "failure", "OUT_OF_MEMORY": "failure", "COMPLETED": "completed"}
#: How long before our cancel a clean end still counts as our stop: a worker's head watch
#: (agent/headwatch.py) sees the head gone within seconds of `ray stop` on the head.
OUR_STOP_S = 30.0
#: Final states a stop of ours can cause too: a cancel, or a node agent that ended its job
#: with an error code while it was being stopped (Slurm then says FAILED).
BY_ANYONE = frozenset({"CANCELLED", "COMPLETED", "FAILED", "OUT_OF_MEMORY"})
#: The columns of the ended-by counts, in order.
ENDS = (BY_AUTOSCALER, BY_DOWN, "scancel", "walltime", "preemption", "node failure",
        "failure", "completed", "unknown")
#: At most this many jobs are asked about one by one (scontrol) where there is no sacct.
ASK_AT_MOST = 200


def down_at(recs: RunRecords) -> float:
    """When `ray down` sent its first cancel in the run (0: it did not)."""
    return min((r.cancelled for r in recs.jobs.values() if r.by == BY_DOWN and r.cancelled),
               default=0.0)


def end_of(rec: JobRecord, down: float = 0.0) -> str:
    """Who ended the job: Slurm, where its final state says only Slurm could (the time
    limit, a preemption, a node failure: a cancel of ours after that changed nothing); else
    the provider's cancel, or `ray down` (`down`: down_at) for a clean end in the moments
    before it; else Slurm's final state; "" while active."""
    if rec.state in END_OF and rec.state not in BY_ANYONE:
        return END_OF[rec.state]
    # Our cancel counts unless Slurm had ended the job before it was sent (Ray's terminate
    # call for a node whose job a user had just scancelled, or that had failed). A clean end
    # (COMPLETED) in the moments before it was our stop too: at `ray down` the head's Ray
    # stops first, and each worker's agent ends its job when it sees its head gone.
    before = OUR_STOP_S if rec.state == "COMPLETED" else 1.0
    if rec.by and not (rec.slurm_end and rec.slurm_end < rec.cancelled - before):
        return rec.by
    # `ray down` stops the head's Ray first: each worker's agent ends its job within
    # seconds, often before the provider lists it for a cancel of its own.
    if not rec.by and rec.state == "COMPLETED" and down and rec.slurm_end \
            and down - OUR_STOP_S <= rec.slurm_end <= down + 1.0:
        return BY_DOWN
    if rec.state in END_OF:
        return END_OF[rec.state]
    return "unknown" if rec.ended else ""


def resolve_ends(recs: RunRecords, cluster: Cluster, notes: list[str],
                 acct: Accounting | None = None) -> list[Event]:
    """Final states, start and end times and billing of the run's jobs, from sacct, else
    scontrol; the events to append so the next report needs neither."""
    since = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(recs.started or time.time()))
    try:
        usage = (acct or Accounting()).usage(cluster.job_name, since)
    except SlurmError as e:
        notes.append(f"no accounting ({e.slurm_message.strip().splitlines()[0]}): how jobs "
                     "ended from the controller while it keeps them; no billing")
        return _ask_controller(recs, cluster, notes)
    by_id = {u.job_id: u for u in usage}
    for rec in recs.jobs.values():
        u = by_id.get(rec.job)
        if u is not None:
            _apply_usage(rec, u)
    return []


def _apply_usage(rec: JobRecord, u: Usage) -> None:
    if u.state in FINAL_STATES:
        rec.state = u.state
        rec.slurm_end = slurm_time(u.end)
        rec.ended = rec.slurm_end or rec.ended
    rec.started = slurm_time(u.start) or rec.started
    try:
        rec.billing = float(u.tres.get("billing", "0"))
        rec.gpus = int(u.tres.get("gres/gpu", "0")) // max(1, rec.nodes) or rec.gpus
    except ValueError:
        pass


def _ask_controller(recs: RunRecords, cluster: Cluster, notes: list[str]) -> list[Event]:
    todo = [r for r in recs.jobs.values() if r.ended and r.state not in FINAL_STATES]
    out: list[Event] = []
    reader = cluster.client
    if not isinstance(reader, EndReader):  # pyslurm: no way to ask
        return out
    for rec in todo[-ASK_AT_MOST:]:
        try:
            end = reader.ended_job(rec.job)
        except SlurmError:
            continue
        if end is not None and end.state in FINAL_STATES:
            rec.state = end.state
            rec.slurm_end = slurm_time(end.end)
            out.append(Event("end", rec.slurm_end or rec.ended, job=rec.job, state=end.state,
                             reason=end.reason))
    unknown = sum(1 for r in recs.jobs.values() if end_of(r, down_at(recs)) == "unknown")
    if unknown:
        notes.append(f"{unknown} jobs ended in ways the controller no longer knows")
    return out


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def summary(recs: RunRecords, now: float, notes: Iterable[str] = ()) -> dict[str, Any]:
    """The report's data (`--json`), at `now`."""
    jobs = sorted(recs.jobs.values(), key=lambda r: (r.submitted or r.started, r.job))
    down = down_at(recs)
    types: dict[str, dict[str, Any]] = {}
    billed = any(r.billing for r in jobs)
    heads = {r.type for r in jobs if r.kind == "head"}
    for node_type in sorted({r.type for r in jobs} | set(recs.folded),
                            key=lambda t: (t not in heads, t)):  # the head's type first
        mine = [r for r in jobs if r.type == node_type]
        folded = recs.folded.get(node_type)
        waits = [r.started - r.submitted for r in mine if r.started and r.submitted]
        ups = [r.ray_up - r.started for r in mine if r.ray_up and r.started]
        ends = {k: 0 for k in ENDS}
        for r in mine:
            by = end_of(r, down)
            if by:
                ends[by] = ends.get(by, 0) + 1
        node_s = sum(held_s(r, now) * r.nodes for r in mine)
        gpu_s = sum(held_s(r, now) * r.nodes * r.gpus for r in mine)
        if folded is not None:
            node_s += folded.node_s
            gpu_s += folded.gpu_s
            for k, v in folded.by.items():
                ends[k] = ends.get(k, 0) + v
        types[node_type or "?"] = {
            "jobs": len(mine) + (folded.jobs if folded else 0),
            "folded": folded.jobs if folded else 0,
            "active": sum(1 for r in mine if not r.ended),
            "queue_wait_median_s": _median(waits), "queue_wait_max_s": max(waits, default=None),
            "startup_median_s": _median(ups),
            "node_hours": node_s / 3600, "gpu_hours": gpu_s / 3600,
            "billing_hours": sum(held_s(r, now) * r.billing for r in mine) / 3600
            if billed else None,
            "ended_by": {k: v for k, v in ends.items() if v}}
    times = [t for r in jobs for t in (r.submitted, r.ended) if t]
    start = recs.started or min(times, default=now)
    active = any(not r.ended for r in jobs)
    end = now if active or not times else max(times)
    return {"run": recs.run, "started": start, "ended": None if active else end,
            "wall_s": max(0.0, end - start), "now": now,
            "folded_jobs": sum(t.jobs for t in recs.folded.values()),
            "bad_lines": recs.bad_lines, "notes": list(notes), "types": types,
            "jobs": [{"job": r.job, "type": r.type or "?", "kind": r.kind, "nodes": r.nodes,
                      "gpus": r.gpus, "submitted": r.submitted or None,
                      "started": r.started or None, "ray_up": r.ray_up or None,
                      "ended": r.ended or None, "state": r.state,
                      "end": end_of(r, down) or "active",
                      "billing": r.billing or None} for r in jobs]}


def _d(s: float | None) -> str:
    return "-" if s is None else fmt_duration(round(s))


def text_lines(data: dict[str, Any]) -> list[str]:
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(data["started"]))
    state = "running" if not data["ended"] else "ended " + time.strftime(
        "%Y-%m-%d %H:%M:%S", time.localtime(data["ended"]))
    out = [f"run {data['run']}: started {when}, {state}, wall time {_d(data['wall_s'])}"]
    rows = []
    for node_type, t in data["types"].items():
        billing = "-" if t["billing_hours"] is None else f"{t['billing_hours']:.1f}"
        ends = ", ".join(f"{k} {v}" for k, v in t["ended_by"].items()) or "-"
        rows.append([node_type, str(t["jobs"]), _d(t["queue_wait_median_s"]),
                     _d(t["queue_wait_max_s"]), _d(t["startup_median_s"]),
                     f"{t['node_hours']:.2f}", f"{t['gpu_hours']:.2f}", billing, ends])
    out += table(["TYPE", "JOBS", "WAIT MED", "WAIT MAX", "START-UP MED", "NODE-H", "GPU-H",
                  "BILLING-H", "ENDED BY"], rows) if rows else ["no node jobs recorded"]
    if data["folded_jobs"]:
        out.append(f"{data['folded_jobs']} older jobs are folded into the totals (node-, "
                   "GPU-hours and ended-by); waits and start-ups are of the newest ones")
    if data["bad_lines"]:
        out.append(f"{data['bad_lines']} unreadable lines of the records were skipped")
    if len(data.get("runs", [])) > 1:
        out.append(f"runs with records (--run RUN): {', '.join(data['runs'][-10:])}")
    return [*out, *(f"note: {n}" for n in data["notes"])]


def pick_run(cluster: Cluster, run: str | None) -> tuple[Cluster, History, str]:
    """The cluster (a one-shot run's own), its records and the run to report."""
    history = History(cluster.cdir.root)
    if run and run not in history.runs():
        try:
            cluster = oneshots.find(cluster, run)
        except CliError:
            known = ", ".join(history.runs()[-10:]) or "none"
            raise CliError(f"no run {run!r} of {cluster.name!r} (its runs: {known}; "
                           "`ray-slurm sbatch` runs by their run id)") from None
        history = History(cluster.cdir.root)
        run = None
    runs = history.runs()
    chosen = run or history.current() or (runs[-1] if runs else None)
    if chosen is None:
        raise CliError(f"no records of {cluster.name!r} in {history.dir} (a cluster started "
                       "by an older ray-slurm has none; the next `ray up` starts them)")
    return cluster, history, chosen


def build(cluster: Cluster, run: str | None, now: Callable[[], float] = time.time,
          acct: Accounting | None = None) -> dict[str, Any]:
    cluster, history, chosen = pick_run(cluster, run)
    notes: list[str] = []
    try:
        recs = history.read(chosen)
    except OSError as e:
        notes.append(f"cannot read {history.path(chosen)}: {e.strerror or e}")
        recs = RunRecords(chosen)
    if not recs.jobs:
        notes.append("the run has no node jobs recorded")
    else:  # accounting's final states and billing; else the controller's ends
        learned = resolve_ends(recs, cluster, notes, acct)
        try:
            history.append(learned, chosen)
        except OSError:
            pass  # a read-only view (another user's dir): the report stands without
    data = summary(recs, now(), notes)
    data["cluster"] = cluster.name
    data["runs"] = history.runs()
    return data


def cmd_report(args: argparse.Namespace) -> int:
    def body() -> int:
        cluster = load_cluster(args.config)
        data = build(cluster, args.run)
        if args.html:
            try:
                Path(args.html).write_text(render(data), encoding="utf-8")
            except OSError as e:
                raise CliError(f"cannot write {args.html}: {e.strerror or e}") from e
            print(f"wrote {args.html}", file=sys.stderr)
        if args.json:
            print(json.dumps(data, indent=2, sort_keys=True))
        elif not args.html:
            print("\n".join(text_lines(data)))
        return 0

    return run_command(body)


def register(sub: Any) -> None:
    p = config_command(sub, "report", "a run's node jobs: queue waits, start-up, node- and "
                       "GPU-hours, who ended them (also after `ray down`)", cmd_report)
    p.add_argument("--run", metavar="RUN", help="a run of the config: its id (its start time, "
                   "as `ray-slurm report` lists them), or a `ray-slurm sbatch` run's id "
                   "(default: the latest)")
    p.add_argument("--json", action="store_true", help="the same data, machine-readable")
    p.add_argument("--html", metavar="FILE", help="write one self-contained page with a "
                   "timeline of every node job")
