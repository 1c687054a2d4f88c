"""Which address a node's Ray binds: Slurm's NodeAddr, or a configured interface.

The hostname is no good on HPC nodes (it may resolve to a management network, or not at all:
the sandbox's nodes share one hostname), so the default is the NodeAddr Slurm itself uses to
reach the node.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

from ray_slurm_provider import proc
from ray_slurm_provider.retry import exponential, retry
from ray_slurm_provider.slurm.client import SlurmClient, TransientSlurmError


def interface_ip(name: str) -> str:
    """The first IPv4 address of interface `name`."""
    out = proc.run(["ip", "-4", "-o", "addr", "show", "dev", name], timeout=10).stdout
    for line in out.splitlines():
        parts = line.split()
        if "inet" in parts:
            return parts[parts.index("inet") + 1].split("/")[0]
    raise RuntimeError(f"interface {name!r} has no IPv4 address")


def node_ip(env: Mapping[str, str], interface: str | None, slurm: SlurmClient, *,
            pause: Callable[[float], None] = time.sleep, deadline_s: float = 300.0) -> str:
    """This job's node address: `interface`'s, else the NodeAddr Slurm knows this job's node
    (SLURMD_NODENAME) by. A controller that does not answer (a stall, a restart) is waited
    for up to `deadline_s`, so every node starting meanwhile does not die of it."""
    if interface:
        return interface_ip(interface)
    name = env.get("SLURMD_NODENAME", "")
    if not name:
        raise RuntimeError("SLURMD_NODENAME is not set: not running inside a Slurm job?")
    # Jitter: every node of a large allocation asks the same recovering controller.
    addr = retry(lambda _: slurm.node_address(name), retry_on=(TransientSlurmError,),
                 delay=exponential(2.0, cap_s=30.0, jitter=0.2), deadline_s=deadline_s,
                 sleep=pause)
    if not addr:
        raise RuntimeError(f"Slurm does not know the address of node {name!r}")
    return addr
