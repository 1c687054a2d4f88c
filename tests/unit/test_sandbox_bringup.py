"""The sandbox's wait for its slurmds (sandbox/bringup.py), with a real child process standing
in for a slurmd this process started, stopped by its pid."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from ray_slurm_provider import proc
from ray_slurm_provider.sandbox import bringup, daemons, probes
from ray_slurm_provider.sandbox.layout import Layout
from ray_slurm_provider.sandbox.procs import Entry, SandboxError


@pytest.fixture
def child(tmp_path: Path) -> Iterator[int]:
    pid = proc.spawn(["sleep", "60"], log_path=str(tmp_path / "child.log"))
    try:
        yield pid
    finally:
        with contextlib.suppress(ProcessLookupError, ChildProcessError):  # a test ended it
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)


@pytest.fixture
def layout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Layout:
    monkeypatch.setattr(daemons, "client_env", lambda layout: {})
    monkeypatch.setattr(probes, "node_states", lambda env: {"n1": "idle"})
    return Layout(str(tmp_path / "sb"))


def test_a_slurmd_this_process_started_counts_while_it_runs(child: int, layout: Layout) -> None:
    """Its pid is ours until we reap it, so its command line (which a slurmd starting up
    once failed to show as recorded) is not asked; a recorded one of an earlier `up` is."""
    entry = Entry(child, ("slurmd", "-D", "-N", "n1"))
    bringup.wait_nodes(layout, {"slurmd:n1": entry}, children={"slurmd:n1"})
    with pytest.raises(SandboxError, match=r"slurmd:n1 .* exited during startup \(seen: "
                                           r"\('sleep', '60'\)\)"):
        bringup.wait_nodes(layout, {"slurmd:n1": entry})


def test_a_slurmd_that_ended_fails_the_wait_at_once(child: int, layout: Layout) -> None:
    os.kill(child, signal.SIGKILL)
    os.waitpid(child, 0)
    with pytest.raises(SandboxError, match="exited during startup"):
        bringup.wait_nodes(layout, {"slurmd:n1": Entry(child, ("sleep", "60"))},
                           children={"slurmd:n1"})
