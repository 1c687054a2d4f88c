"""`ray-slurm status CONFIG [--json] [--ended N] [--watch [S]]`.

Asks the controller ONE question (the cluster's job list, as the provider does) and reads the
rest from the cluster directory: which node's Ray is up and the address it bound (its ray.json;
before, Slurm's NodeAddr, none for a gang member: the listing has each job's batch host's
NodeAddr only), the tags Ray set, the head's addresses. Pending jobs show Slurm's reason and
its estimated start time. Then one question to accounting (sacct): how the last N nodes that
left the queue ended; without accounting it says so. Last, each node type's last launch
error (errors.json, provider/guard.py): "launch failing" while the type is held back, "last
launch error" once its hold-back has run out.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

from ray.autoscaler.tags import TAG_RAY_NODE_KIND, TAG_RAY_NODE_STATUS, TAG_RAY_USER_NODE_TYPE

from ray_slurm_provider.cli import oneshots
from ray_slurm_provider.cli.common import (
    CliError,
    Cluster,
    config_command,
    load_cluster,
    run_command,
    table,
)
from ray_slurm_provider.config import ConfigError
from ray_slurm_provider.jobs import GROUP_TAG, decode_tags
from ray_slurm_provider.nodespec import member_ids
from ray_slurm_provider.slurm.client import Job, SlurmError
from ray_slurm_provider.slurm.parse import expand_hostlist
from ray_slurm_provider.slurm.sacct import Accounting
from ray_slurm_provider.state import read_json
from ray_slurm_provider.units import fmt_duration

KIND, NODE_TYPE, STATUS = TAG_RAY_NODE_KIND, TAG_RAY_USER_NODE_TYPE, TAG_RAY_NODE_STATUS


def _resources(cluster: Cluster, node_type: str) -> str:
    try:
        res = cluster.parsed.node_type(node_type).resources
    except ConfigError:
        res = {}
    return ",".join(f"{k}={v}" for k, v in res.items()) or "(from partition)"


def _order(j: Job) -> tuple[int, ...]:
    """By job id, array tasks (`<array>_<task>`) by array, then task."""
    return tuple(int(p) if p.isdigit() else 0 for p in j.job_id.split("_"))


def node_rows(cluster: Cluster, jobs: list[Job]) -> list[dict[str, Any]]:
    """One record per node of the cluster (jobs whose comment carries our tags)."""
    rows = []
    for j in sorted(jobs, key=_order):
        tags = decode_tags(j.comment)
        if tags is None:
            continue
        size = int(tags.pop(GROUP_TAG, "1"))
        tags = {**tags, **cluster.cdir.tags(j.job_id)}
        pending = j.state == "PENDING"
        ip = cluster.cdir.ray_ip(j.job_id)  # the address its Ray bound, once up
        row: dict[str, Any] = {
            "node_type": tags.get(NODE_TYPE, "?"), "kind": tags.get(KIND, "?"),
            "job_id": j.job_id, "state": j.state, "node": j.batch_host or j.nodes,
            "address": ip or j.node_addr, "ray_up": ip is not None,
            "ray_status": tags.get(STATUS, ""), "resources": _resources(
                cluster, tags.get(NODE_TYPE, "")),
            "time_left_s": j.left_s(), "time_limit_s": j.time_limit_s,
            "reason": j.reason if pending else "",
            "expected_start": j.start_time if pending else "",
            "partition": j.partition,
        }
        if size > 1:  # a gang job: its members beneath it, each with its own address
            row["node"] = j.nodes
            row["address"] = ""
            row["members"] = member_rows(cluster, j, size)
            row["ray_up"] = all(m["ray_up"] for m in row["members"] if not m["released"])
        rows.append(row)
    return rows


def member_rows(cluster: Cluster, job: Job, size: int) -> list[dict[str, Any]]:
    """A gang job's members: where each runs, whether its Ray is up (and the address it
    bound) or it was released."""
    hosts = expand_hostlist(job.nodes) if job.nodes and job.state != "PENDING" else []
    out = []
    for k, node_id in enumerate(member_ids(job.job_id, size)):
        ip = cluster.cdir.ray_ip(node_id)
        out.append({"node_id": node_id, "node": hosts[k] if k < len(hosts) else "",
                    "address": ip or "", "ray_up": ip is not None,
                    "released": cluster.cdir.node(node_id).released()})
    return out


def ended_data(cluster: Cluster, limit: int, acct: Accounting | None = None) -> dict[str, Any]:
    """How the cluster's last `limit` nodes that left the queue ended (sacct); without
    accounting, Slurm's words for why not."""
    if limit <= 0:
        return {"known": False, "why_not": "not asked (--ended 0)", "nodes": []}
    try:
        ended = (acct or Accounting()).ended_jobs(cluster.job_name)
    except SlurmError as e:
        return {"known": False, "why_not": e.slurm_message.strip(), "nodes": []}
    return {"known": True, "why_not": "", "nodes": [
        {"job_id": j.job_id, "state": j.state, "exit_code": j.exit_code, "why": j.why,
         "end": j.end, "node": j.node, "reason": j.reason} for j in ended[-limit:]]}


def status_data(cluster: Cluster, ended: int = 0) -> dict[str, Any]:
    jobs = cluster.ask("listing the cluster's jobs",  # the one question to the controller
                       lambda: cluster.client.list_jobs(cluster.job_name))
    rows = node_rows(cluster, jobs)
    head = cluster.cdir.read_head()
    errors = read_json(cluster.cdir.root / "errors.json")  # provider/guard.py
    errors = errors if isinstance(errors, dict) else {}
    now = time.time()
    for entry in errors.values():  # for --json: a hold-back that ran out is past
        if isinstance(entry, dict):
            entry["held_back_now"] = held_back(entry, now)
    return {"cluster": cluster.name, "job_name": cluster.job_name, "nodes": rows,
            "other_jobs": len(jobs) - len(rows),
            "head": head.to_dict() if head else None,
            "launch_errors": errors,
            "ended": ended_data(cluster, ended)}


def ended_lines(data: dict[str, Any]) -> list[str]:
    """The ended nodes' table, or why there is none."""
    ended = data.get("ended") or {}
    if not ended.get("known"):
        why = ended.get("why_not")
        return [f"ended nodes: unknown ({why}); `ray-slurm logs CONFIG JOB` shows what a "
                "job printed"] if why and not why.startswith("not asked") else []
    rows = ended["nodes"]
    if not rows:
        return ["ended nodes: none in the last 7 days (sacct)"]
    body = [[r["job_id"], r["why"], r["end"] or "-", r["node"] or "-", r["reason"] or ""]
            for r in rows]
    return [f"ended nodes (last {len(rows)}, from sacct):",
            *table(["JOB", "ENDED", "AT", "NODE", "REASON"], body)]


def held_back(entry: dict[str, Any], now: float) -> bool:
    """Whether an errors.json entry's hold-back lasts at `now` (epoch seconds)."""
    return float(entry.get("retry_after_ts") or 0.0) > now


def error_lines(data: dict[str, Any], now: float | None = None) -> list[str]:
    """The last launch error of each node type: as current while the type is held back, as
    past once its hold-back has run out (its launches are tried again)."""
    now = time.time() if now is None else now
    out = []
    for t, e in sorted(data.get("launch_errors", {}).items()):
        what = f"{e.get('kind')}, {e.get('failures')} in a row"
        if held_back(e, now):
            out.append(f"{t}: launch failing ({what}; held back until {e.get('retry_after')}): "
                       f"{e.get('message')}")
        else:
            out.append(f"{t}: last launch error at {e.get('last_failed')} ({what}; no longer "
                       f"held back since {e.get('retry_after')}): {e.get('message')}")
    return out


def status_lines(data: dict[str, Any], now: float | None = None) -> list[str]:
    rows = data["nodes"]
    if not rows:
        return [f"cluster {data['cluster']!r}: no Slurm jobs named {data['job_name']} "
                "(the cluster is down; `ray up CONFIG` starts it)", *error_lines(data, now),
                *ended_lines(data)]
    headers = ["TYPE", "KIND", "JOB", "STATE", "NODE", "ADDRESS", "RAY", "RESOURCES",
               "TIME LEFT", "PENDING REASON (EST. START)"]
    body = []
    for r in rows:
        why = f"{r['reason']} ({r['expected_start'] or 'start unknown'})" if r["reason"] else ""
        ray = "up" if r["ray_up"] else (r["ray_status"] or "-")
        job = f"{r['job_id']} (gang of {len(r['members'])})" if "members" in r else r["job_id"]
        body.append([r["node_type"], r["kind"], job, r["state"], r["node"] or "-",
                     r["address"] or "-", ray, r["resources"], fmt_duration(r["time_left_s"]),
                     why])
        for m in r.get("members", []):
            mray = "released" if m["released"] else ("up" if m["ray_up"] else "-")
            body.append(["", "", f"\u2514 {m['node_id']}", "", m["node"] or "-",
                         m["address"] or "-", mray, "", "", ""])
    out = table(headers, body)
    head = data["head"]
    if head:
        out.append(f"dashboard: http://{head.get('ip')}:{head.get('dashboard_port')}   "
                   f"GCS: {head.get('ip')}:{head.get('gcs_port')}")
    if data["other_jobs"]:
        out.append(f"({data['other_jobs']} other jobs named {data['job_name']} were not "
                   "created by ray-slurm)")
    return [*out, *error_lines(data, now), *ended_lines(data)]


def watch(lines: Callable[[], list[str]], out: TextIO, every: float,
          sleep: Callable[[float], None] = time.sleep, rounds: int | None = None) -> None:
    """Print `lines()` every `every` seconds until interrupted: in place on a terminal (the
    screen cleared), else one block after another under a time stamp (a log, a pipe)."""
    n = 0
    tty = out.isatty()
    while rounds is None or n < rounds:
        body = lines()
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        if tty:
            out.write("\x1b[H\x1b[2J" + f"{stamp} (every {every:g} s; Ctrl-C ends)\n")
        else:
            out.write(f"# {stamp}\n")
        out.write("\n".join(body) + "\n")
        out.flush()
        n += 1
        if rounds is None or n < rounds:
            sleep(every)


def cmd_status(args: argparse.Namespace) -> int:
    def body() -> int:
        cluster = load_cluster(args.config)
        try:
            oneshots.sweep(cluster)  # ended `sbatch` runs' leftovers
            if args.run:
                cluster = oneshots.find(cluster, args.run)
            data = status_data(cluster, args.ended)
        except SlurmError as e:
            raise CliError(f"cannot list the cluster's jobs: {e}") from e
        if args.json:
            print(json.dumps(data, indent=2, sort_keys=True))
        elif args.watch:
            try:
                watch(lambda: _lines_now(cluster, args.ended), sys.stdout, args.watch)
            except KeyboardInterrupt:
                pass
        else:
            print("\n".join(status_lines(data)))
        return 0

    return run_command(body)


def _lines_now(cluster: Cluster, ended: int) -> list[str]:
    """One refresh: a failed listing is a line, not the end of the watch."""
    try:
        return status_lines(status_data(cluster, ended))
    except SlurmError as e:
        return [f"cannot list the cluster's jobs: {e}"]


def register(sub: Any) -> None:
    p = config_command(sub, "status", "table of the cluster's nodes (one Slurm query)", cmd_status)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--run", metavar="ID", help="a `ray-slurm sbatch` run of the config (its run "
                   "id, or its cluster name)")
    p.add_argument("--ended", type=int, default=5, metavar="N",
                   help="also show how the last N nodes that left the queue ended, from "
                   "Slurm's accounting (sacct; default 5, 0: do not ask)")
    p.add_argument("--watch", type=float, nargs="?", const=5.0, default=None, metavar="S",
                   help="refresh every S seconds (default 5) until Ctrl-C: in place on a "
                   "terminal, one block after another otherwise")
