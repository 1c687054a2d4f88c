"""What /proc says about the processes on this machine: command lines, state and memory.

The one home of /proc reading for the e2e tests (`tests/e2e/faults.py`) and the benchmarks
(`bench/common.py`, run as `python -m bench.<name>` from the repository root). It only reads.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

PROC = Path("/proc")


def cmdlines() -> Iterator[tuple[int, str]]:
    """(pid, command line with its NULs as spaces) of every process whose command line we
    may read."""
    for p in PROC.iterdir():
        if not p.name.isdigit():
            continue
        try:
            cmd = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        yield int(p.name), cmd


def pids_with(*needles: str) -> list[int]:
    """PIDs whose command line contains every needle."""
    return [pid for pid, cmd in cmdlines() if all(n in cmd for n in needles)]


def environ(pid: int | str) -> dict[str, str]:
    """A process's environment as it started (root reads anyone's); {} when it is gone."""
    try:
        raw = (PROC / str(pid) / "environ").read_bytes()
    except OSError:
        return {}
    pairs = (item.decode(errors="replace").partition("=") for item in raw.split(b"\0") if item)
    return {k: v for k, _, v in pairs}


def owner(pid: int | str) -> int | None:
    """The real uid of a process, or None when it is gone."""
    try:
        for line in (PROC / str(pid) / "status").read_text().splitlines():
            if line.startswith("Uid:"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def stat_fields(pid: int | str) -> list[str]:
    """The fields of /proc/<pid>/stat after the command name: [0] is the state, [1] the
    parent pid, [11:15] utime, stime, cutime, cstime (clock ticks). Raises OSError when the
    process is gone."""
    return (PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()


def pss_kb(pid: int | str, field: str = "Pss") -> int:
    """Proportional set size (kB) of a process, or another field of its smaps_rollup (`Rss`);
    0 when it is gone or not ours to read."""
    try:
        for line in (PROC / str(pid) / "smaps_rollup").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0
