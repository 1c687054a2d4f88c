"""`validate`'s per-node-type findings against the live cluster.

The rules are `ray up`'s own (ray_slurm_provider.provider.checks.check_live: time limit within the
partition's MaxTime, GPUs, GPU type, CPUs and memory within its nodes); they are applied one
node type at a time, so `validate` reports every node type's problem, not just the first, and
says which partition each type lands on.
"""

from __future__ import annotations

from ray_slurm_provider.cli.common import Finding
from ray_slurm_provider.cluster import ClusterConfig
from ray_slurm_provider.config import ConfigError
from ray_slurm_provider.provider.checks import check_live
from ray_slurm_provider.slurm.client import ClusterInfo, SlurmError
from ray_slurm_provider.slurm.sacct import Accounting, NoAccounting, check_account_qos
from ray_slurm_provider.units import fmt_duration


def node_type_findings(cluster: ClusterConfig, t: str, info: ClusterInfo) -> list[Finding]:
    """What is wrong (or fine) with node type `t` on this cluster."""
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
    try:
        warnings = check_live(cluster, info, only=[t])
    except ConfigError as e:
        key, _, message = str(e).partition(": ")
        return [*out, Finding("fail", key, message, "`ray up` refuses this; use a value "
                              "from the valid range named above")]
    out += [Finding("warn", where, w, "set node_config.time") for w in warnings]
    if not warnings:
        out.append(Finding("ok", where, "time limit, CPUs, memory and GPUs fit the partition"))
    return out


def accounting_findings(cluster: ClusterConfig, acct: Accounting) -> list[Finding]:
    """Each node type's `account` and `qos` against the user's associations (sacctmgr);
    one warning, in Slurm's words, when the cluster keeps no accounting."""
    wanted = {t: nt.node_config for t, nt in cluster.node_types.items()
              if nt.node_config.account is not None or nt.node_config.qos is not None}
    if not wanted:
        return []
    try:
        assocs = acct.associations()
    except NoAccounting as e:
        return [Finding("warn", "accounting", f"account and qos not checked: {e.slurm_message}",
                        "Slurm checks them when the job is submitted")]
    except SlurmError as e:
        return [Finding("warn", "accounting", f"account and qos not checked: {e}",
                        "Slurm checks them when the job is submitted")]
    out = []
    for t, ncfg in wanted.items():
        where = f"available_node_types.{t}.node_config"
        problem = check_account_qos(assocs, ncfg.account, ncfg.qos, where)
        if problem is None:
            out.append(Finding("ok", where, f"account {ncfg.account or '(default)'}, qos "
                               f"{ncfg.qos or '(default)'}: allowed by your associations"))
        else:
            key, _, message = problem.partition(": ")
            out.append(Finding("fail", key, message, "Slurm refuses such jobs; use one of "
                               "the valid choices named"))
    return out
