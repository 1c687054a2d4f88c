"""Rank order for a gang: which node is node 0, which rank is rank 0.

Each rank actor reports where Ray put it (`Member`). `assign_ranks` then:

* orders nodes by **numeric** IP (10.0.0.9 before 10.0.0.10; the seed sorted strings), then
  by Ray node id, because two Ray nodes can share an IP (two Slurm jobs on one host);
* orders the ranks of a node by GPU id, numerically when every id is an integer, else as text
  (UUID and MIG ids), then by creation slot (CPU ranks have no GPU id);
* checks what the placement group promised: each bundle on one node, bundles on distinct
  nodes, no GPU handed to two ranks, `ranks_per_node` ranks per bundle.

Pure logic: no Ray, no torch.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass


class TopologyError(ValueError):
    """The ranks did not land the way the placement group promised."""


@dataclass(frozen=True)
class Member:
    """Where one rank actor landed (what its `describe()` returned)."""

    slot: int
    bundle: int
    node_ip: str
    node_id: str
    gpu_ids: tuple[str, ...] = ()
    hostname: str = ""
    pid: int = 0
    slurm_job_id: str = ""


@dataclass(frozen=True)
class Assignment:
    """A member's place in the gang."""

    member: Member
    rank: int
    node_rank: int
    local_index: int
    world_size: int
    local_world_size: int
    num_nodes: int


def ip_key(ip: str) -> tuple[int, int, str]:
    """Numeric order: IPv4 before IPv6; anything unparsable last, as text."""
    try:
        addr = ipaddress.ip_address(ip.strip())
    except ValueError:
        return (2, 0, ip)
    return (0 if addr.version == 4 else 1, int(addr), "")


def gpu_key(gpu_id: str) -> tuple[int, int, str]:
    """Integer ids in numeric order ("2" < "10"), other ids (UUID, MIG) after, as text."""
    s = gpu_id.strip()
    return (0, int(s), "") if s.isdigit() else (1, 0, s)


def node_key(m: Member) -> tuple[tuple[int, int, str], str]:
    return (ip_key(m.node_ip), m.node_id)


def member_key(m: Member) -> tuple[tuple[tuple[int, int, str], ...], int]:
    return (tuple(gpu_key(g) for g in m.gpu_ids), m.slot)


def group_by_node(members: Sequence[Member], *, nodes: int,
                  ranks_per_node: int) -> list[list[Member]]:
    """Members grouped per bundle, checked, nodes and ranks in rank order."""
    if len(members) != nodes * ranks_per_node:
        raise TopologyError(f"expected {nodes} x {ranks_per_node} ranks, got {len(members)}")
    by_bundle: dict[int, list[Member]] = {}
    for m in members:
        by_bundle.setdefault(m.bundle, []).append(m)
    if len(by_bundle) != nodes:
        raise TopologyError(f"expected {nodes} bundles, got {sorted(by_bundle)}")
    owner: dict[str, int] = {}
    groups = []
    for bundle, ms in sorted(by_bundle.items()):
        if len(ms) != ranks_per_node:
            raise TopologyError(f"bundle {bundle} has {len(ms)} ranks, not {ranks_per_node}")
        node_ids = {m.node_id for m in ms}
        if len(node_ids) != 1:
            raise TopologyError(f"bundle {bundle} spans several Ray nodes: {sorted(node_ids)}")
        node_id = ms[0].node_id
        if node_id in owner:
            raise TopologyError(
                f"bundles {owner[node_id]} and {bundle} share Ray node {node_id}; "
                "each gang node must be its own Ray node (STRICT_SPREAD)")
        owner[node_id] = bundle
        gpus = [g for m in ms for g in m.gpu_ids]
        if len(set(gpus)) != len(gpus):
            raise TopologyError(f"bundle {bundle}: a GPU is shared between ranks: {gpus}")
        groups.append(sorted(ms, key=member_key))
    groups.sort(key=lambda g: node_key(g[0]))
    return groups


def assign_ranks(members: Sequence[Member], *, nodes: int,
                 ranks_per_node: int) -> list[Assignment]:
    """Global rank order: node by (numeric IP, node id), then rank by (GPU id, slot)."""
    groups = group_by_node(members, nodes=nodes, ranks_per_node=ranks_per_node)
    world = nodes * ranks_per_node
    out = []
    for node_rank, group in enumerate(groups):
        for local, m in enumerate(group):
            out.append(Assignment(m, node_rank * ranks_per_node + local, node_rank, local,
                                  world, ranks_per_node, nodes))
    return out


def node_members(assignments: Sequence[Assignment], node_rank: int) -> list[Member]:
    """The members of one node, in local order."""
    return [a.member for a in assignments if a.node_rank == node_rank]


def describe_layout(assignments: Sequence[Assignment]) -> str:
    """One line per node: `node 0 10.0.0.9 (n1, 1a2b3c4d): ranks 0-7 gpus 0,1,...`."""
    lines = []
    for node_rank in sorted({a.node_rank for a in assignments}):
        ours = [a for a in assignments if a.node_rank == node_rank]
        m = ours[0].member
        gpus = ",".join(g for a in ours for g in a.member.gpu_ids) or "-"
        job = f", Slurm job {m.slurm_job_id}" if m.slurm_job_id else ""
        lines.append(f"node {node_rank} {m.node_ip} ({m.hostname or '?'}, Ray node "
                     f"{m.node_id[:8]}{job}): ranks {ours[0].rank}-{ours[-1].rank} gpus {gpus}")
    return "\n".join(lines)
