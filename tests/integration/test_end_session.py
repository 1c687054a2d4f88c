"""proc.end_session with real processes: the workers of a raylet that was SIGKILLed are
orphans (init adopts them), and only the session of the agent's `ray start` still ties them
to the job; the agent ends them by it before it removes the temp dir. The test starts and
stops its processes by pid and waits for them in real time, bounded."""

from __future__ import annotations

import contextlib
import os
import signal
import time

import psutil

from ray_slurm_provider import proc

#: `ray start`: leaves a worker (a sleep) behind and exits, printing the worker's pid.
LEAVES_A_WORKER = ["bash", "-c", "sleep 60 >/dev/null 2>&1 & echo $!"]
#: A worker that keeps forking while it is ended (new ones must be ended too).
FORKS = ["bash", "-c", "(while :; do sleep 60 & sleep 0.01; done) >/dev/null 2>&1 & echo $!"]


def left_behind(argv: list[str], new_session: bool) -> tuple[int, int]:
    """Run `argv` to its end; (its pid, the pid it printed)."""
    child = proc.start(argv, new_session=new_session)
    assert child.stdout is not None
    printed = int(child.stdout.readline())
    child.wait(timeout=30)
    child.stdout.close()
    return child.pid, printed


def stop(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def alive(pid: int) -> bool:
    try:
        return bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False


def test_what_a_child_left_in_its_session_is_ended() -> None:
    sid, worker = left_behind(LEAVES_A_WORKER, new_session=True)
    try:
        assert os.getsid(worker) == sid and psutil.Process(worker).ppid() != os.getpid()
        assert proc.end_session(sid) == [worker]
        deadline = time.monotonic() + 10  # SIGKILL is delivered, not waited for
        while alive(worker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(worker)
    finally:
        if alive(worker):
            stop(worker)


def test_processes_forked_while_the_session_ends_are_ended_too() -> None:
    sid, forker = left_behind(FORKS, new_session=True)
    try:
        ended = proc.end_session(sid)
        assert forker in ended and len(ended) > 1
        assert proc.end_session(sid, grace_s=0) == []  # nothing of the session is left
    finally:
        if alive(forker):
            stop(forker)


def test_without_a_session_of_its_own_the_orphan_is_out_of_reach() -> None:
    """Why `ray start` leads its own session: otherwise nothing ties the orphan to it."""
    pid, worker = left_behind(LEAVES_A_WORKER, new_session=False)
    try:
        assert proc.end_session(pid) == [] and alive(worker)
    finally:
        stop(worker)


def test_no_session_that_a_child_cannot_lead_is_ended() -> None:
    assert proc.end_session(0) == [] and proc.end_session(1) == []
