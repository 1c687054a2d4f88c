"""proc's process trees and pipe holders, on psutil (issue 25.6), and run_in_group's process
group (issue 26.19), with real short-lived children this test starts and stops by pid."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import psutil
import pytest

from ray_slurm_provider import proc
from ray_slurm_provider.cli import run


@contextlib.contextmanager
def children(*argvs: list[str], stdout: Any = None) -> Iterator[list[subprocess.Popen[str]]]:
    """Start each argv; kill and reap each by pid afterwards."""
    ps = [subprocess.Popen(a, stdout=stdout, text=True) for a in argvs]
    try:
        yield ps
    finally:
        for p in ps:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGKILL)
            p.wait(timeout=30)
            if p.stdout is not None:
                p.stdout.close()


def gone_process() -> psutil.Process:
    """A psutil handle on a child that has exited and been reaped since."""
    p = subprocess.Popen(["true"])
    handle = psutil.Process(p.pid)
    p.wait(timeout=30)
    return handle


def test_kill_tree_of_a_pid_that_is_gone_signals_nothing() -> None:
    assert proc.kill_tree(gone_process().pid) == 0


def test_kill_tree_skips_processes_that_end_while_it_walks(
        monkeypatch: pytest.MonkeyPatch) -> None:
    real = psutil.Process.children

    def with_a_dead_one(self: psutil.Process, recursive: bool = False) -> list[Any]:
        return [gone_process(), *real(self, recursive=recursive)]

    monkeypatch.setattr(psutil.Process, "children", with_a_dead_one)
    with children(["sleep", "30"]) as (p,):
        assert proc.kill_tree(p.pid) == 1
        assert p.wait(timeout=30) == -signal.SIGKILL


def test_kill_tree_skips_what_the_kernel_will_not_let_it_signal(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Another user's process (simulated: the tests may run as root) is left alone."""
    with children(["sleep", "30"], ["sleep", "30"]) as (mine, theirs):
        real = psutil.Process.send_signal

        def send(self: psutil.Process, sig: int) -> None:
            if self.pid == theirs.pid:
                raise psutil.AccessDenied(self.pid)
            real(self, sig)

        monkeypatch.setattr(psutil.Process, "send_signal", send)
        monkeypatch.setattr(psutil.Process, "children",
                            lambda self, recursive=False: [psutil.Process(theirs.pid)])
        assert proc.kill_tree(mine.pid, signal.SIGTERM) == 1
        assert mine.wait(timeout=30) == -signal.SIGTERM
        assert theirs.poll() is None


def test_pipe_holders_are_the_processes_with_the_pipe_open() -> None:
    """A child and the grandchild it left behind hold its output; a bystander does not."""
    with children(["bash", "-c", "sleep 30 & echo $!; exec sleep 30"],
                  stdout=subprocess.PIPE) as (p,), children(["sleep", "30"]) as (other,):
        assert p.stdout is not None
        grandchild = int(p.stdout.readline())
        try:
            holders = proc.pipe_holders(p.stdout.fileno())
            assert sorted(holders) == sorted([p.pid, grandchild])
            assert other.pid not in holders
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(grandchild, signal.SIGKILL)


def test_pipe_holders_tolerate_pids_that_are_gone(monkeypatch: pytest.MonkeyPatch) -> None:
    with children(["sleep", "30"], stdout=subprocess.PIPE) as (p,):
        assert p.stdout is not None
        gone = gone_process().pid
        monkeypatch.setattr(psutil, "pids", lambda: [gone, p.pid])
        assert proc.pipe_holders(p.stdout.fileno()) == [p.pid]


# --- run_in_group: `ray-slurm run`'s `ray up`, ended with its whole group on a signal -------
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
