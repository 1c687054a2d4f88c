"""proc.adopt_orphans and proc.end_descendants with real processes: the workers of a raylet
that was SIGKILLed are orphans, and the agent (the job's subreaper) still finds and ends
them before it removes the temp dir. The subreaper is a process-wide setting, so a child
Python plays the agent; it waits in real time, bounded."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys

import psutil

#: The agent: optionally a subreaper; a shell (the raylet) leaves a sleep (a worker) behind
#: and exits; then it ends what is below it and says what it found.
AGENT = """
import json, subprocess, sys
from ray_slurm_provider import proc
adopted = proc.adopt_orphans() if sys.argv[1] == "adopt" else False
raylet = subprocess.run(["bash", "-c", "sleep 60 >/dev/null 2>&1 & echo $!"],
                        capture_output=True, text=True)
worker = int(raylet.stdout)
print(json.dumps({"adopted": adopted, "worker": worker, "ended": proc.end_descendants()}))
"""


def run_agent(mode: str) -> dict[str, object]:
    out = subprocess.run([sys.executable, "-c", AGENT, mode], capture_output=True, text=True,
                         timeout=60, check=True)
    return dict(json.loads(out.stdout))


def stop(pid: int) -> None:
    """End a sleep the test started, by pid, if it still runs."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def test_a_subreaper_ends_the_orphans_below_it() -> None:
    got = run_agent("adopt")
    worker = int(str(got["worker"]))
    try:
        assert got["adopted"] is True
        assert got["ended"] == [worker]
        assert not psutil.pid_exists(worker)  # reaped by the agent, not a zombie left
    finally:
        stop(worker)


def test_without_it_the_orphan_is_out_of_reach() -> None:
    """Why the agent adopts: an orphan goes to init (or a subreaper above) and is missed."""
    got = run_agent("plain")
    worker = int(str(got["worker"]))
    try:
        assert got["adopted"] is False and got["ended"] == []
        assert psutil.pid_exists(worker)
    finally:
        stop(worker)
