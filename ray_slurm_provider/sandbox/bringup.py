"""The order in which `Sandbox.up` starts what is not running, and the waits between: dockerd
first (slowest), munged, the database and slurmdbd (then what they hold), slurmctld, the
slurmds (until sinfo calls every node ready), slurmrestd, sshd (the login node)."""

from __future__ import annotations

from collections.abc import Collection

from ray_slurm_provider.sandbox import accounting, daemons, probes
from ray_slurm_provider.sandbox.config import SandboxSpec
from ray_slurm_provider.sandbox.layout import Layout
from ray_slurm_provider.sandbox.procs import (
    Entry,
    Registry,
    SandboxError,
    cmdline,
    exists,
    is_ours,
)


def start_missing(layout: Layout, spec: SandboxSpec, registry: Registry,
                  alive: dict[str, Entry], user_names: list[str]) -> None:
    """Start every daemon of `spec` not in `alive`, each once the ones it needs are ready."""
    names = [n for n in daemons.daemon_names(spec) if n not in alive]
    started: dict[str, Entry] = {}
    if "dockerd" in names:  # slowest to start: let it come up while Slurm does
        started["dockerd"] = daemons.start("dockerd", layout, spec, registry)
    for name in ("munged", "mariadb", "slurmdbd", "slurmctld"):
        if name in names:
            started[name] = daemons.start(name, layout, spec, registry)
            daemons.wait_ready(name, layout, spec, started[name])
            if name in ("mariadb", "slurmdbd"):  # the database, then what it holds
                accounting.fill(name, layout, daemons.client_env(layout), user_names)
    for name in [n for n in names if n.startswith("slurmd:")]:
        started[name] = daemons.start(name, layout, spec, registry)
    wait_nodes(layout, {n: started.get(n) or alive[n] for n in daemons.daemon_names(spec)
                        if n.startswith("slurmd:")}, children=set(started))
    if "slurmrestd" in names:
        started["slurmrestd"] = daemons.start("slurmrestd", layout, spec, registry)
        daemons.wait_ready("slurmrestd", layout, spec, started["slurmrestd"])
    if "sshd" in names:  # the login node, once Slurm answers
        started["sshd"] = daemons.start("sshd", layout, spec, registry)
        daemons.wait_ready("sshd", layout, spec, started["sshd"])
    if "dockerd" in started:
        daemons.wait_ready("dockerd", layout, spec, started["dockerd"])


def wait_nodes(layout: Layout, slurmds: dict[str, Entry],
               children: Collection[str] = ()) -> None:
    """Wait until sinfo calls every node of `slurmds` ready; fail at once if one exits.
    `children`: the names this process started, whose pids no other process can have
    until they are reaped; for them only their end counts, not the command line (a slurmd
    starting up once failed that check while it ran)."""
    env = daemons.client_env(layout)
    states: dict[str, str] = {}

    def all_ready() -> bool:
        nonlocal states
        for name, entry in slurmds.items():
            running = exists(entry.pid) if name in children else is_ours(entry)
            if not running:
                raise SandboxError(f"{name} (pid {entry.pid}) exited during startup "
                                   f"(seen: {cmdline(entry.pid) or 'no process'})\n"
                                   + daemons.describe_failure(name, layout))
        states = probes.node_states(env)
        return all(probes.node_ready(states.get(n.split(":", 1)[1], "unk")) for n in slurmds)

    probes.wait_until(all_ready, max(60.0, 2.0 * len(slurmds)),
                      "the nodes to be idle in sinfo",
                      lambda: f"node states: {states}\n"
                      + daemons.describe_failure("slurmctld", layout))
