"""proc.stream: a command's output handed over line by line as it comes, with real child
processes (a remote `logs --follow` and `ray exec` from a laptop read through it)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from ray_slurm_provider import proc


def test_lines_come_while_the_command_runs_and_all_come_back(tmp_path: Path) -> None:
    """The command blocks on a FIFO that the handler of its first line opens and writes:
    were the lines handed over only at the end, it would block until its timeout."""
    go = tmp_path / "go"
    os.mkfifo(go)
    seen: list[str] = []
    errs: list[str] = []

    def on_line(line: str) -> None:
        seen.append(line)
        if len(seen) == 1:
            go.write_text("go")  # opening blocks until the command opens its end

    res = proc.stream([sys.executable, "-c",
                       "import sys\n"
                       "print('first', flush=True)\n"
                       "print('to stderr', file=sys.stderr, flush=True)\n"
                       f"open({str(go)!r}).read()\n"
                       "print(sys.stdin.read().upper(), end='')\n"
                       "sys.exit(3)"],
                      on_line=on_line, on_err=errs.append, input="given\n", timeout=30)
    assert seen == ["first\n", "GIVEN\n"]
    assert errs == ["to stderr\n"]
    assert (res.returncode, res.stdout, res.stderr) == (3, "first\nGIVEN\n", "to stderr\n")


def test_a_command_past_its_time_is_killed_with_what_it_said() -> None:
    seen: list[str] = []
    with pytest.raises(proc.CommandTimeout, match=r"timed out after 0\.5s") as ei:
        proc.stream([sys.executable, "-c",
                     "import signal; print('up', flush=True); signal.pause()"],
                    on_line=seen.append, on_err=seen.append, timeout=0.5)
    assert seen == ["up\n"] and ei.value.stdout == "up\n"


def test_an_error_of_the_caller_ends_the_command() -> None:
    class Stop(Exception):
        pass

    def stop(line: str) -> None:
        raise Stop(line)

    t0 = time.monotonic()
    with pytest.raises(Stop):
        proc.stream([sys.executable, "-c",
                     "import signal; print('up', flush=True); signal.pause()"],
                    on_line=stop, on_err=print, timeout=None)
    assert time.monotonic() - t0 < 30


def test_a_missing_command_is_typed() -> None:
    with pytest.raises(proc.CommandNotFound):
        proc.stream(["rsp-no-such-command"], on_line=print, on_err=print)


def test_keep_bounds_what_comes_back_but_never_cuts_the_last_line() -> None:
    seen: list[str] = []
    res = proc.stream([sys.executable, "-c",
                       "for i in range(1000): print('x' * 99)\nprint('R' * 500)"],
                      on_line=seen.append, on_err=seen.append, keep=1000)
    assert len(seen) == 1001  # every line was handed over
    assert res.stdout.endswith("R" * 500 + "\n") and len(res.stdout) <= 1000 + 600
