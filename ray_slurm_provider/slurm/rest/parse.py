"""slurmrestd answers -> the back-end-neutral records of client.py (pure; fixture-tested).

Two families of shapes are read:

* v0.0.38 (Slurm 22.05-23.11, the legacy openapi plugin): plain numbers, `null` for unset,
  -1 for INFINITE; `job_state` and node `state` are strings; a partition's `flags` list holds
  "default".
* v0.0.40 and later (data_parser, Slurm 23.11+): numbers are `{set, infinite, number}`;
  `job_state` and node `state` are lists of flags (["RUNNING", "COMPLETING"]); partitions
  nest (`nodes.configured`, `maximums.time`) and no longer say which one is the default
  (data_parser skips partition flags), so the default is known only when there is one
  partition.

Times come as epoch seconds; they are turned into the local "YYYY-MM-DDTHH:MM:SS" that squeue
prints with SLURM_TIME_FORMAT=standard, so both back ends fill `Job` the same way.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from ray_slurm_provider.slurm import parse
from ray_slurm_provider.slurm.client import (
    FINAL_STATES,
    EndedJob,
    Job,
    Node,
    Partition,
)

#: When a job's state is a list of flags, the first of these present names it, as squeue's
#: %T does (Slurm's job_state_string checks the flags in this order before the base state).
_STATE_FLAGS = ("COMPLETING", "STAGE_OUT", "CONFIGURING", "RESIZING", "REQUEUED", "REQUEUE_FED",
                "REQUEUE_HOLD", "SPECIAL_EXIT", "STOPPED", "REVOKED", "RESV_DEL_HOLD",
                "SIGNALING")
_NO_VAL = 0xFFFFFFFE  # NO_VAL/INFINITE as unsigned 32-bit numbers


def number(value: Any) -> int | None:
    """An integer field in either shape; None when unset, infinite or negative (v0.0.38 -1)."""
    if isinstance(value, Mapping):
        if value.get("infinite") or not value.get("set", False):
            return None
        value = value.get("number")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    n = int(value)
    return None if n < 0 or n >= _NO_VAL else n


def state_of(value: Any) -> str:
    """A job's state as squeue prints it, from a string or a list of flags."""
    if isinstance(value, str):
        return value.strip().upper()
    flags = [str(f).upper() for f in value] if isinstance(value, Sequence) else []
    for f in _STATE_FLAGS:
        if f in flags:
            return f
    return flags[0] if flags else ""


def node_state(value: Any) -> str:
    """A node's state as scontrol prints it ("MIXED", "IDLE+DRAIN")."""
    if isinstance(value, str):
        return value.strip().upper()
    return "+".join(str(f).upper() for f in value) if isinstance(value, Sequence) else ""


def stamp(epoch: int | None) -> str:
    """Epoch seconds -> local "YYYY-MM-DDTHH:MM:SS" ("" for 0/unset)."""
    if not epoch:
        return ""
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(epoch))


def _text(value: Any) -> str:
    v = "" if value is None else str(value).strip()
    return "" if v in ("(null)", "None", "N/A") else v


def job(d: Mapping[str, Any], now: float) -> Job:
    """One job record; raises ValueError without an id or a state (a shorter list would make
    the caller believe jobs are gone)."""
    job_id = d.get("job_id")
    state = state_of(d.get("job_state"))
    if job_id is None or not state:
        raise ValueError(f"job record without job_id or job_state: {dict(d)!r:.200}")
    limit_min = number(d.get("time_limit"))
    limit_s = None if limit_min is None else limit_min * 60
    start = number(d.get("start_time")) or 0
    left = limit_s
    if limit_s is not None and start and state not in ("PENDING", "SUSPENDED") \
            and start <= now:
        left = max(0, int(start + limit_s - now))
    # An array task is listed as squeue and scancel name it (`<array>_<task>`), as the CLI
    # back end does; its own numeric id is what srun and SLURM_JOB_ID use.
    array_id, task = number(d.get("array_job_id")), number(d.get("array_task_id"))
    node_id = f"{array_id}_{task}" if array_id and task is not None else str(job_id)
    return Job(
        job_id=node_id,
        slurm_job_id=str(job_id),
        name=str(d.get("name") or ""),
        state=state,
        reason=_text(d.get("state_reason")),
        nodes=_text(d.get("nodes")),
        batch_host=_text(d.get("batch_host")),
        time_limit_s=limit_s,
        time_left_s=left,
        submit_time=stamp(number(d.get("submit_time"))),
        start_time=stamp(start),
        partition=_text(d.get("partition")),
        comment=str(d.get("comment") or ""),
    )


def exit_code(value: Any) -> str:
    """A job's exit code as sacct and scontrol print it ("1:0", "0:15"): v0.0.38 gives the
    wait status as a number, v0.0.40+ its return code and signal apart."""
    if isinstance(value, Mapping):
        signal = value.get("signal") or {}
        return f"{number(value.get('return_code')) or 0}:{number(signal.get('id')) or 0}"
    status = number(value) or 0
    return f"{status >> 8}:{status & 0x7F}"


def ended(records: Sequence[Mapping[str, Any]], job_id: str, now: float) -> EndedJob | None:
    """How job `job_id` (123 or 123_4) ended, from GET job/<id>'s records; None while its
    state is not one of FINAL_STATES (its end is not final yet)."""
    for d in records:
        found = job(d, now)
        if found.job_id != job_id:
            continue
        if found.state not in FINAL_STATES:
            return None
        return EndedJob(job_id=job_id, state=found.state, exit_code=exit_code(d.get("exit_code")),
                        end=stamp(number(d.get("end_time"))), node=found.nodes,
                        reason=found.reason)
    return None


def node(d: Mapping[str, Any]) -> tuple[Node, list[str]]:
    """One node record and the partitions it belongs to."""
    name = str(d.get("name") or "")
    if not name:
        raise ValueError(f"node record without a name: {dict(d)!r:.200}")
    parts = d.get("partitions") or []
    if isinstance(parts, str):
        parts = [p for p in parts.split(",") if p]
    return (Node(name=name, addr=_text(d.get("address")) or name,
                 state=node_state(d.get("state")), cpus=number(d.get("cpus")) or 0,
                 memory_mb=number(d.get("real_memory")) or 0, gres=_text(d.get("gres"))),
            [str(p) for p in parts])


def partition_fields(d: Mapping[str, Any]) -> dict[str, Any]:
    """Name, host list, limits (seconds), default flag (None: not reported) and state."""
    nodes = d.get("nodes")
    if isinstance(nodes, Mapping):  # v0.0.40+
        maximums, defaults = d.get("maximums") or {}, d.get("defaults") or {}
        flags = d.get("flags")
        state = node_state((d.get("partition") or {}).get("state")) or "UP"
        return {"name": str(d.get("name") or ""), "hosts": _text(nodes.get("configured")),
                "max_time_s": _minutes(maximums.get("time")),
                "default_time_s": _minutes(defaults.get("time")),
                "default": None if flags is None else _has_default(flags), "state": state}
    return {"name": str(d.get("name") or ""), "hosts": _text(nodes),
            "max_time_s": _minutes(d.get("max_time_limit")),
            "default_time_s": _minutes(d.get("default_time_limit")),
            "default": _has_default(d.get("flags") or []),
            "state": node_state(d.get("state")) or "UP"}


def build_partition(name: str, hosts: str, nodes: Sequence[tuple[Node, Sequence[str]]], *,
                    max_time_s: int | None, default_time_s: int | None, default: bool,
                    state: str) -> Partition:
    """A Partition from its fields and the node table (the same reduction as the CLI back
    end: members by the nodes' partition lists, else by the host list; per-node sizes are
    the smallest member's, so a job asking for that much fits on every node)."""
    members = [n for n, parts in nodes if name in parts]
    if not members and hosts:
        wanted = set(parse.expand_hostlist(hosts))
        members = [n for n, _ in nodes if n.name in wanted]
    smallest = min(members, key=lambda n: (parse.parse_gres_gpus(n.gres), n.cpus, n.memory_mb),
                   default=None)
    return Partition(
        name=name, nodes=tuple(members),
        cpus_per_node=min((n.cpus for n in members), default=0),
        memory_mb_per_node=min((n.memory_mb for n in members), default=0),
        gpus_per_node=parse.parse_gres_gpus(smallest.gres) if smallest else 0,
        gres=smallest.gres if smallest else "",
        max_time_s=max_time_s, default_time_s=default_time_s, default=default, state=state)


def partitions(records: Sequence[Mapping[str, Any]],
               nodes: Sequence[tuple[Node, Sequence[str]]]) -> tuple[Partition, ...]:
    fields = [partition_fields(r) for r in records]
    if any(not f["name"] for f in fields):
        raise ValueError("partition record without a name")
    unknown = all(f["default"] is None for f in fields)
    out = []
    for f in fields:
        default = bool(f["default"]) if not unknown else len(fields) == 1
        out.append(build_partition(f["name"], f["hosts"], nodes, max_time_s=f["max_time_s"],
                                   default_time_s=f["default_time_s"], default=default,
                                   state=f["state"]))
    return tuple(out)


def version(data: Mapping[str, Any]) -> str:
    """Slurm's release from a response's meta ("22.05.8"); "" when absent."""
    meta = data.get("meta") or {}
    slurm = meta.get("Slurm") or meta.get("slurm") or {}
    return str(slurm.get("release") or "")


def _minutes(value: Any) -> int | None:
    n = number(value)
    return None if n is None else n * 60


def _has_default(flags: Any) -> bool:
    return any(str(f).upper() == "DEFAULT" for f in flags) if isinstance(flags, list) else False
