"""Per-cluster Ray port blocks.

Several Ray heads can land on one Slurm node (two users, or two clusters of one user). Ray's
fixed defaults (GCS 6379, dashboard 8265, client 10001, metrics 44217/44227) then clash, and
some clashes are silent (a dashboard that never binds). Each cluster therefore gets its own
block of 10 ports, derived from the user and cluster name so that every process of the
cluster computes the same first choice without sharing state. Hashed blocks collide (two
clusters out of 800 blocks, about even odds once ~34 clusters share a node), so the head checks
every port of its block on its node before Ray starts and takes the next free block when one
is taken; the ports it took are recorded in head.json, which is what workers, `ray-slurm env`
and `ray up`'s forwarding read. Per-node ports (agent, workers) are left to the OS (port 0).
"""

from __future__ import annotations

import errno
import getpass
import socket
import zlib
from collections.abc import Callable
from dataclasses import dataclass

BLOCK_SIZE = 10
#: 24000-31999: below Linux's ephemeral range (32768+), above Ray's worker ports (10002-19999)
#: and its client specific-server range (23000-24000).
RANGE_START = 24000
RANGE_BLOCKS = 800


@dataclass(frozen=True)
class PortBlock:
    base: int

    @property
    def gcs(self) -> int:
        return self.base

    @property
    def dashboard(self) -> int:
        return self.base + 1

    @property
    def client(self) -> int:
        return self.base + 2

    @property
    def autoscaler_metrics(self) -> int:
        return self.base + 3

    @property
    def dashboard_metrics(self) -> int:
        return self.base + 4


def port_block(cluster_name: str, base: int | None = None, user: str | None = None) -> PortBlock:
    """The cluster's block: `base` if configured, else a stable hash of user and name."""
    if base is not None:
        return PortBlock(base)
    who = user if user is not None else getpass.getuser()
    h = zlib.crc32(f"{who}:{cluster_name}".encode())
    return PortBlock(RANGE_START + (h % RANGE_BLOCKS) * BLOCK_SIZE)


def can_bind(host: str, port: int) -> bool:
    """Whether a listener could take host:port now (Ray binds the node's address). Like Ray's
    servers it sets SO_REUSEADDR, so a port the last head left in TIME_WAIT counts as free
    (without it a `ray up` right after `ray down` moved to another block); a listener still
    makes it taken."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno in (errno.EADDRINUSE, errno.EACCES):
                return False
            raise
    return True


def _ports(block: PortBlock) -> list[int]:
    return [block.gcs, block.dashboard, block.client, block.autoscaler_metrics,
            block.dashboard_metrics]


def free_block(host: str, first: PortBlock, *, pinned: bool,
               can_bind: Callable[[str, int], bool] = can_bind) -> PortBlock:
    """`first`, or the next block (wrapping around the range) whose every port is free on
    `host`. A block the user pinned (`provider.ports.base`) is never moved: a taken port of
    it is an error naming the ports."""
    busy = [p for p in _ports(first) if not can_bind(host, p)]
    if not busy:
        return first
    if pinned:
        raise RuntimeError(f"ports {', '.join(map(str, busy))} of this cluster's block (base "
                           f"{first.base}) are in use on {host}; choose another "
                           "provider.ports.base (a multiple of 10), or leave it unset")
    start = (first.base - RANGE_START) // BLOCK_SIZE
    for i in range(1, RANGE_BLOCKS):
        block = PortBlock(RANGE_START + (start + i) % RANGE_BLOCKS * BLOCK_SIZE)
        if all(can_bind(host, p) for p in _ports(block)):
            return block
    raise RuntimeError(f"no free block of {BLOCK_SIZE} ports in {RANGE_START}-"
                       f"{RANGE_START + RANGE_BLOCKS * BLOCK_SIZE - 1} on {host}")
