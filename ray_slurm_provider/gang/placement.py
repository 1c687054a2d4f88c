"""The gang's placement group: one group, one bundle per node, STRICT_SPREAD.

Why one group with per-node bundles rather than the seed's one STRICT_PACK group per node:

* **All or nothing.** Ray reserves a group's bundles together. Separate per-node groups are
  reserved one by one: with 1 of 2 nodes free, the first group holds its node while the
  second waits, and two gangs that each hold half a cluster wait on each other for ever.
* **Distinct nodes, guaranteed.** STRICT_SPREAD puts every bundle on its own Ray node.
  Separate STRICT_PACK groups may land on the same node whenever it has room for two (a
  16-GPU node, or ranks_per_node smaller than the node), which breaks LOCAL_RANK and
  "node" semantics. Each Slurm job is one Ray node here, so a bundle is one Slurm job.
* **One thing to wait on, report on and remove.**

Every rank actor is placed in its node's bundle and takes its own share of it (one GPU, its
CPUs), so Ray still hands out distinct GPUs and sets a per-GPU mask that the CVD policy then
rewrites. The group is always removed in the launcher's `finally`.

On a cluster whose worker type is a gang node type (`node_config.nodes: N`: one Slurm job of
N nodes, provider/gangs.py), `--placement group` keeps the whole gang in ONE such group: Ray
2.60's `topology_strategy` packs the bundles by the members' `ray-slurm.io/group` label while
still spreading them over distinct nodes, so the ranks share one allocation that Slurm
started (and ends) as a whole. Placed by plain STRICT_SPREAD, the bundles could straddle two
groups that each have a node free.

When the group is not ready in time, `shortfall_report` says what was asked and what the
cluster has, per node, instead of waiting for ever as the seed did.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from ray_slurm_provider import rayapi
from ray_slurm_provider.nodespec import GROUP_LABEL

STRATEGY = "STRICT_SPREAD"


class PlacementTimeout(RuntimeError):
    """The gang's placement group was not ready in time; the message says what is missing."""


def node_bundle(ranks_per_node: int, per_rank: Mapping[str, float]) -> dict[str, float]:
    """Resources of one node's bundle: `ranks_per_node` times one rank's share."""
    return {k: float(v) * ranks_per_node for k, v in per_rank.items() if v}


def fits(bundle: Mapping[str, float], resources: Mapping[str, float]) -> bool:
    return all(resources.get(k, 0.0) + 1e-9 >= v for k, v in bundle.items())


def _fmt(res: Mapping[str, float], keys: Sequence[str]) -> str:
    return "{" + ", ".join(f"{k}: {res.get(k, 0.0):g}" for k in keys) + "}"


def shortfall_report(bundle: Mapping[str, float], nodes: int, waited_s: float,
                     available: Mapping[str, float], total: Mapping[str, float],
                     per_node_available: Mapping[str, Mapping[str, float]] | None = None,
                     per_node_total: Mapping[str, Mapping[str, float]] | None = None) -> str:
    """Why `nodes` bundles of `bundle` (on distinct nodes) are not placed."""
    keys = sorted(bundle)
    need = {k: v * nodes for k, v in bundle.items()}
    lines = [
        f"placement group not ready after {waited_s:.0f}s: need {nodes} node(s) x "
        f"{_fmt(bundle, keys)} on distinct Ray nodes ({STRATEGY}), "
        f"{_fmt(need, keys)} in all",
        f"cluster available {_fmt(available, keys)} of total {_fmt(total, keys)}",
    ]
    short = {k: need[k] - available.get(k, 0.0) for k in keys
             if available.get(k, 0.0) + 1e-9 < need[k]}
    if short:
        lines.append("missing in all: " + _fmt(short, sorted(short)))
    if per_node_total is not None:
        able = [n for n, res in per_node_total.items() if fits(bundle, res)]
        lines.append(f"alive nodes big enough for one bundle: {len(able)} of {nodes} needed")
        if per_node_available is not None:
            free = [n for n in able if fits(bundle, per_node_available.get(n, {}))]
            lines.append(f"of those, free right now: {len(free)}")
            for n in able:
                if n not in free:
                    lines.append(f"  node {n[:8]} busy: available "
                                 f"{_fmt(per_node_available.get(n, {}), keys)}")
        if len(able) < nodes:
            lines.append("the cluster is too small or still scaling up: the autoscaler adds "
                         "nodes for a pending group when a node type fits the bundle; "
                         "otherwise add nodes or lower --nodes/--ranks-per-node")
    return "\n".join(lines)


def create(nodes: int, bundle: Mapping[str, float], name: str, one_group: bool = False) -> Any:
    """Create (asynchronously) the gang's group: `nodes` copies of `bundle`, on distinct
    nodes; with `one_group`, all of them in one gang node group."""
    from ray.util.placement_group import placement_group

    bundles = [dict(bundle) for _ in range(nodes)]
    if one_group:
        return placement_group(bundles, name=name, topology_strategy=topology())
    return placement_group(bundles, strategy=STRATEGY, name=name)


def topology() -> dict[str, str]:
    """Distinct nodes (Ray's node-id level), all in one gang group (the provider's label)."""
    return {"ray.io/node-id": STRATEGY, GROUP_LABEL: "STRICT_PACK"}


def wait_ready(pg: Any, bundle: Mapping[str, float], nodes: int, timeout_s: float) -> float:
    """Wait for the group; raise `PlacementTimeout` with a report. Returns seconds waited."""
    import ray

    t0 = time.monotonic()
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    waited = time.monotonic() - t0
    if ready:
        return waited
    per_avail: Mapping[str, Mapping[str, float]] | None
    per_total: Mapping[str, Mapping[str, float]] | None
    try:  # per-node views are not public API; the report works without them
        per_avail, per_total = rayapi.resources_per_node()
    except Exception:
        per_avail = per_total = None
    available = ray.available_resources()  # type: ignore[no-untyped-call]
    total = ray.cluster_resources()  # type: ignore[no-untyped-call]
    raise PlacementTimeout(shortfall_report(bundle, nodes, waited, available, total,
                                            per_avail, per_total))


def remove(pg: Any) -> None:
    """Remove the group; never raises (it runs in `finally`)."""
    try:
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(pg)
    except Exception as e:  # the cluster may already be gone
        print(f"[launch] could not remove placement group: {e}", flush=True)
