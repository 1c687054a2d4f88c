"""Per-cluster Ray port blocks.

Several Ray heads can land on one Slurm node (two users, or two clusters of one user). Ray's
fixed defaults (GCS 6379, dashboard 8265, client 10001, metrics 44217/44227) then clash, and
some clashes are silent (a dashboard that never binds). Each cluster therefore gets its own
block of 10 ports, derived from the user and cluster name so that every process of the
cluster (login node CLI, head job, the head's autoscaler) computes the same block without
sharing state. Per-node ports (agent, workers) are left to the OS (port 0).
"""

from __future__ import annotations

import getpass
import zlib
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
