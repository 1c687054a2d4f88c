"""A gang job's step on the real sandbox: the drain signal before the time limit
(`--signal=TERM@<s>`, jobs.py) reaches every node's agent, and srun lets them drain.

The agents are stand-ins (a bash trap); the step is the one jobs.gang_step renders. A
`B:TERM@` (what one-node jobs use) would reach only the batch shell, which is srun here: it
ends the step at once, and no agent hears a TERM (the second test).

Both jobs are submitted together when the module starts and do not disturb each other (2 CPUs
of the cpu partition each). Each has a 1-minute limit and asks for its signal 60 s before it,
so the signal is due at once and comes with slurmctld's next time-limit pass (every 30 s).
"""

from __future__ import annotations

import shlex
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from ray_slurm_provider.jobs import gang_step
from ray_slurm_provider.sandbox import Sandbox
from ray_slurm_provider.slurm.cli import CliSlurmClient
from ray_slurm_provider.slurm.spec import JobSpec
from tests.integration.test_slurm_cli_sandbox import wait_for

pytestmark = pytest.mark.integration

DRAIN_S = 3


def _events(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def _gang_job(tmp_path: Path, signal: str) -> tuple[CliSlurmClient, str, str]:
    """Submit a 2-node gang job with a stand-in agent per node; (client, name, job id)."""
    client = CliSlurmClient(timeout=60)
    name = f"rsp-it-{uuid.uuid4().hex[:10]}"
    out = shlex.quote(str(tmp_path / "events"))
    # Each "agent" drains for DRAIN_S after the TERM, then ends with 0, as a drained Ray does.
    agent = ["bash", "-c",
             f"trap 'echo TERM $SLURM_NODEID >> {out}; sleep {DRAIN_S}; "
             f"echo drained $SLURM_NODEID >> {out}; exit 0' TERM; "
             f"echo up $SLURM_NODEID >> {out}; while :; do sleep 1; done"]
    setup = [f"echo setup $SLURMD_NODENAME >> {out}"]
    spec = JobSpec(name, gang_step(2, 1, setup, agent), nodes=2, ntasks=2, cpus_per_task=1,
                   mem="100", time="1", signal=signal, output=str(tmp_path / "log"))
    return client, name, client.submit(spec)


@pytest.fixture(scope="module")
def jobs(sandbox: Sandbox, tmp_path_factory: pytest.TempPathFactory,
         ) -> Iterator[dict[str, tuple[CliSlurmClient, str, str, Path]]]:
    """Signal -> (client, name, job id, its dir): both jobs, submitted together."""
    made = {}
    for sig in ("TERM@60", "B:TERM@60"):
        d = tmp_path_factory.mktemp("gang-signal")
        made[sig] = (*_gang_job(d, sig), d)
    yield made
    for client, _, job_id, _ in made.values():
        client.cancel([job_id])  # gone by now, unless a test failed


def test_the_drain_signal_reaches_every_nodes_agent_and_lets_it_drain(
        jobs: dict[str, tuple[CliSlurmClient, str, str, Path]]) -> None:
    client, name, _, tmp_path = jobs["TERM@60"]
    running = wait_for(client, name, lambda js: bool(js) and all(j.running for j in js),
                       timeout=90)
    assert running and all(j.running for j in running), running
    started = time.monotonic()
    # Due at the start; Slurm sends it at its next time-limit pass (every 30 s).
    wait_for(client, name, lambda _: sum(e.startswith("drained") for e in
                                         _events(tmp_path / "events")) == 2, timeout=150)
    took = time.monotonic() - started
    # Every task exited 0, so the job ends on its own, before its time limit.
    left = wait_for(client, name, lambda js: not any(j.active for j in js), timeout=30)
    events = _events(tmp_path / "events")
    log = (tmp_path / "log").read_text() if (tmp_path / "log").exists() else ""
    setups = {e for e in events if e.startswith("setup")}  # which 2 of the 3 nodes: Slurm's
    assert len(setups) == 2 and sorted(set(events) - setups) == [
        "TERM 0", "TERM 1", "drained 0", "drained 1", "up 0", "up 1"], (events, log)
    assert len(events) == 8, (events, log)
    assert took < 60, f"the drain ended {took:.0f}s after the start of a 1-minute job"
    assert not any(j.active for j in left), (left, log)


def test_a_batch_only_signal_would_kill_the_agents_without_a_drain(
        jobs: dict[str, tuple[CliSlurmClient, str, str, Path]]) -> None:
    """Why gang jobs do not use `B:TERM@` (one-node jobs do): srun, the batch step's main
    process, ends its step at once on a TERM of its own; no agent hears a TERM."""
    client, name, _, tmp_path = jobs["B:TERM@60"]
    # Listed from its submission on; it leaves the queue when srun has ended it.
    left = wait_for(client, name, lambda js: not any(j.active for j in js), timeout=180)
    events = _events(tmp_path / "events")
    log = (tmp_path / "log").read_text() if (tmp_path / "log").exists() else ""
    assert not any(j.active for j in left), (left, log)
    assert sorted(e for e in events if not e.startswith("setup")) == ["up 0", "up 1"], (
        events, log)
    assert "forcing job termination" in log, log
