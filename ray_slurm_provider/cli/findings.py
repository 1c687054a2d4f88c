"""`validate`'s report of the validation pipeline (provider/validation.py), per node type.

The rules are `ray up`'s own; `validate` shows every node type's problem, not just the first,
says which partition each type lands on, and adds what passed.
"""

from __future__ import annotations

from collections.abc import Sequence

from ray_slurm_provider.cli.common import Finding
from ray_slurm_provider.cluster import ClusterConfig
from ray_slurm_provider.provider import validation
from ray_slurm_provider.slurm.client import ClusterInfo
from ray_slurm_provider.slurm.sacct import Accounting
from ray_slurm_provider.units import fmt_duration

REFUSED = "`ray up` refuses this; use a value from the valid range named above"


def shown(f: validation.Finding, fix: str) -> Finding:
    """A pipeline finding as a report line."""
    return Finding("fail" if f.level == "error" else "warn", f.key, f.message, fix)


def node_type_findings(cluster: ClusterConfig, t: str, info: ClusterInfo,
                       found: Sequence[validation.Finding] | None = None) -> list[Finding]:
    """What is wrong (or fine) with node type `t` on this cluster; `found`: the pipeline's
    live findings of `t` (default: its stage 4 run for `t` alone)."""
    nt = cluster.node_type(t)
    ncfg = nt.node_config
    where = f"available_node_types.{t}"
    names = ", ".join(sorted(p.name for p in info.partitions))
    part = info.partition(ncfg.partition)
    if part is None:
        if ncfg.partition is None:
            return [Finding("fail", where, "no partition is set and the cluster reports no "
                            "default partition", f"set {where}.node_config.partition to one of: "
                            f"{names}")]
        return [Finding("fail", f"{where}.node_config.partition",
                        f"{ncfg.partition!r} is not a partition of this cluster",
                        f"use one of: {names}")]
    out = [Finding("ok", where, f"partition {part.name}: {len(part.nodes)} nodes, "
                   f"{part.cpus_per_node} CPUs, {part.memory_mb_per_node}M, "
                   f"{part.gpus_per_node} GPUs per node, MaxTime {fmt_duration(part.max_time_s)}")]
    if part.state.upper() != "UP":
        out.append(Finding("warn", where, f"partition {part.name} is {part.state}",
                           "jobs pend until an admin sets it UP; pick another partition"))
    if not nt.has_resources:
        out.append(Finding("info", where, "no `resources`: `ray up` takes them from partition "
                           f"{part.name}'s smallest node"))
    if found is None:
        found = validation.node_type_live(cluster, info, t)
    errors = [f for f in found if f.level == "error"]
    if errors:
        return [*out, shown(errors[0], REFUSED)]
    out += [Finding("warn", where, str(f), "set node_config.time") for f in found]
    if not found:
        out.append(Finding("ok", where, "time limit, CPUs, memory and GPUs fit the partition"))
    return out


def accounting_findings(cluster: ClusterConfig, acct: Accounting | None = None,
                        found: Sequence[validation.Finding] | None = None) -> list[Finding]:
    """Each node type's `account` and `qos`: the pipeline's `accounting` findings (`found`,
    default: its rule run against `acct`), and what passed."""
    if found is None:
        found = validation.check_accounts(cluster, (acct or Accounting()).associations)
    if any(f.key == "accounting" for f in found):
        return [shown(f, "Slurm checks them when the job is submitted") for f in found]
    bad = {f.key.rsplit(".", 1)[0] for f in found}
    out = []
    for t, nt in cluster.node_types.items():
        ncfg, where = nt.node_config, f"available_node_types.{t}.node_config"
        if (ncfg.account is not None or ncfg.qos is not None) and where not in bad:
            out.append(Finding("ok", where, f"account {ncfg.account or '(default)'}, qos "
                               f"{ncfg.qos or '(default)'}: allowed by your associations"))
    return out + [shown(f, "Slurm refuses such jobs; use one of the valid choices named")
                  for f in found]
