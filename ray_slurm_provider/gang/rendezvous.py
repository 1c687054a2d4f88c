"""MASTER_ADDR and a fresh MASTER_PORT for every attempt.

The seed used a fixed 29500: a second job on the same head collides, and a relaunch can even
reach the TCPStore of the attempt that just crashed. Here the rank-0 actor asks its own OS for
a free port (bind to port 0 on all interfaces, as the TCPStore will), and the driver refuses
ports used by earlier attempts of this run, so an attempt never meets a stale store.

The port is free when probed and taken by rank 0's TCPStore a few seconds later, when torch
initialises; a process that grabs it in between makes that attempt fail to bind, and the
launcher restarts with another port. (The race-free alternative, a `TCPStore(port=0)` in rank 0
whose port is then published, does not fit Megatron's `env://` initialisation.)
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from ray_slurm_provider.gang.topology import Assignment

#: Ports a rendezvous must never use: the privileged range and the seed's well-known default,
#: which other jobs on a shared node are likely to hold.
AVOID = frozenset({29500})


class RendezvousError(RuntimeError):
    pass


@dataclass(frozen=True)
class Rendezvous:
    master_addr: str
    master_port: int


def probe_free_port(host: str = "") -> int:
    """A port the OS considers free on `host` ("" = all interfaces) right now."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def fresh_port(probe: Callable[[], int], used: Collection[int], tries: int = 32) -> int:
    """Probe until the port is new to this run (and not in `AVOID`)."""
    seen = []
    for _ in range(tries):
        port = probe()
        if port not in used and port not in AVOID and port >= 1024:
            return port
        seen.append(port)
    raise RendezvousError(f"no fresh port after {tries} probes (got {seen})")


def master_of(assignments: Sequence[Assignment]) -> str:
    """MASTER_ADDR: the IP of the node that holds rank 0."""
    for a in assignments:
        if a.rank == 0:
            return a.member.node_ip
    raise RendezvousError("no rank 0")
