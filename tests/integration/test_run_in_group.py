"""proc.run_in_group (issue 26.19): `ray-slurm run`'s `ray up` runs in its own process group,
and a signal while it runs ends the whole group, TERM first and KILL after the grace. Real
processes (a child and its grandchild, started and stopped by pid), so the test waits for
them in real time, bounded by a deadline; no Slurm needed."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator

import psutil
import pytest

from ray_slurm_provider import proc
from ray_slurm_provider.cli import run

#: The child: starts a grandchild (`ray up`'s own children), prints both pids, waits.
GROUP = ("import os, subprocess, sys, time\n"
         "g = subprocess.Popen(['sleep', '60'])\n"
         "print(os.getpid(), g.pid, flush=True)\n"
         "time.sleep(60)\n")
IGNORE_TERM = "import signal\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"


def ended(p: psutil.Process, within_s: float = 5.0) -> bool:
    """Whether `p` has exited (a zombie no one has reaped yet counts) within `within_s`."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            if not p.is_running() or p.status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.005)  # a poll of the condition, bounded by the deadline


@contextlib.contextmanager
def interrupted_group(script: str, grace_s: float) -> Iterator[tuple[list[psutil.Process],
                                                                      float]]:
    """Run `script` under run_in_group with `ray-slurm run`'s own TERM handler; once the child
    and its grandchild run, TERM this (main) thread. Yields the two processes and how long
    run_in_group took (it must raise the handler's Interrupted); kills what is left after."""
    r, w = os.pipe()
    procs: list[psutil.Process] = []

    def signal_once_both_run() -> None:
        with os.fdopen(r) as f:
            procs.extend(psutil.Process(int(pid)) for pid in f.readline().split())
        if procs:
            signal.pthread_kill(main, signal.SIGTERM)

    main = threading.main_thread().ident or 0
    old = signal.signal(signal.SIGTERM, run.Runner._raise)
    threading.Thread(target=signal_once_both_run, daemon=True).start()
    start = time.monotonic()
    try:
        with pytest.raises(run.Interrupted):
            proc.run_in_group([sys.executable, "-c", script], timeout=30, stdout=w,
                              grace_s=grace_s)
        yield procs, time.monotonic() - start
    finally:
        signal.signal(signal.SIGTERM, old)
        os.close(w)
        for p in procs:  # what a failed test left
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()


def test_run_in_group_terms_the_whole_group_when_a_signal_interrupts_it() -> None:
    """A signal handler's exception while waiting ends the child and its grandchild (TERM to
    the group), long before the grace period's KILL would."""
    with interrupted_group(GROUP, grace_s=30) as ((child, grandchild), took):
        assert ended(child) and ended(grandchild)
        assert took < 10  # the TERM did it, not the KILL after 30 s


def test_run_in_group_kills_a_group_that_ignores_term_after_the_grace() -> None:
    with interrupted_group(IGNORE_TERM + GROUP, grace_s=0.2) as ((child, grandchild), _):
        assert ended(child) and ended(grandchild)
