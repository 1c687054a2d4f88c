"""proc's process trees and pipe holders, on psutil (issue 25.6), with real short-lived
children this test starts and stops by pid. run_in_group's process group, which must be
waited for in real time, is in tests/integration/test_run_in_group.py."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import psutil
import pytest

from ray_slurm_provider import proc


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


def test_a_command_never_reads_the_callers_stdin() -> None:
    """ssh (and any command) run without `input` gets an empty stdin: keystrokes typed at
    `ray up` are not its to take."""
    read_end, write_end = os.pipe()
    saved = os.dup(0)
    try:
        os.write(write_end, b"typed at the terminal\n")
        os.close(write_end)
        os.dup2(read_end, 0)
        assert proc.run(["cat"], timeout=10).stdout == ""
    finally:
        os.dup2(saved, 0)
        os.close(saved)
        os.close(read_end)


def test_output_that_is_not_utf8_is_replaced_not_fatal() -> None:
    script = "import sys; sys.stdout.buffer.write(b'job-\\xe9t\\xe9\\n')"
    res = proc.run([sys.executable, "-c", script], timeout=30)
    assert res.stdout == "job-\ufffdt\ufffd\n"
    assert proc._text(b"\xff") == "\ufffd"  # what a timed-out command printed
