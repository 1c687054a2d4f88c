"""Processes by pid: the pid registry, liveness checks and stopping without pkill.

A pid is only trusted while ``/proc/<pid>/cmdline`` still equals the argv recorded when the
sandbox started it, so a reused pid is never signalled. A zombie counts as gone (this
machine's init may never reap it).
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

#: Set in the environment of every daemon the sandbox starts, value = state dir. Children the
#: daemons fork (slurmstepd, containerd, shims) inherit it, which is how `down` finds them.
OWNER_ENV = "RAY_SLURM_SANDBOX_OWNER"


class SandboxError(RuntimeError):
    """The sandbox could not be brought up, checked or taken down; the message says why."""


@dataclass(frozen=True)
class Entry:
    """One daemon the sandbox started: its pid and the exact argv it was started with."""

    pid: int
    argv: tuple[str, ...]


class Registry:
    """``pids.json``: daemon name -> Entry. Written atomically after every change."""

    def __init__(self, path: str) -> None:
        self.path = path

    def load(self) -> dict[str, Entry]:
        try:
            with open(self.path) as f:
                raw = json.load(f)
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:
            raise SandboxError(f"cannot read pid registry {self.path}: {e}") from e
        return {name: Entry(int(v["pid"]), tuple(v["argv"])) for name, v in raw.items()}

    def _save(self, entries: Mapping[str, Entry]) -> None:
        data = {n: {"pid": e.pid, "argv": list(e.argv)} for n, e in entries.items()}
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(data, f, indent=2, sort_keys=True)
        os.replace(tmp, self.path)

    def record(self, name: str, entry: Entry) -> None:
        entries = self.load()
        entries[name] = entry
        self._save(entries)

    def forget(self, name: str) -> None:
        entries = self.load()
        if entries.pop(name, None) is not None:
            self._save(entries)


def _read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return None


def cmdline(pid: int) -> tuple[str, ...] | None:
    """The argv of a running process, or None if there is no such process."""
    raw = _read(f"/proc/{pid}/cmdline")
    if raw is None:
        return None
    return tuple(a.decode(errors="replace") for a in raw.split(b"\0")[:-1])


def _state(pid: int) -> str | None:
    raw = _read(f"/proc/{pid}/stat")
    if raw is None:
        return None
    after_comm = raw.rsplit(b")", 1)[-1].split()
    return after_comm[0].decode() if after_comm else None


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def exists(pid: int) -> bool:
    """True while the process exists and is not a zombie."""
    _reap(pid)
    state = _state(pid)
    return state is not None and state not in ("Z", "X")


def is_ours(entry: Entry) -> bool:
    """True while the recorded process runs, with the recorded argv (no pid reuse)."""
    return exists(entry.pid) and same_command(cmdline(entry.pid), entry.argv)


def same_command(running: tuple[str, ...] | None, argv: tuple[str, ...]) -> bool:
    """`running` (a cmdline) is the process started with `argv`. sshd retitles its
    listener ("sshd: <argv> [listener] 0 of 10-100 startups"), which names the argv too."""
    if running is None:
        return False
    if running == argv:
        return True
    title = f"sshd: {' '.join(argv)} [listener]"
    return len(running) == 1 and running[0].startswith(title)


def _environ(pid: int) -> list[bytes]:
    raw = _read(f"/proc/{pid}/environ")
    return raw.split(b"\0") if raw else []


def comm(pid: int) -> str:
    raw = _read(f"/proc/{pid}/comm")
    return raw.decode(errors="replace").strip() if raw else ""


def _find(match: Callable[[int, list[bytes]], bool]) -> list[int]:
    protected = _ancestors()
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) not in protected:
            pid = int(entry)
            if match(pid, _environ(pid)) and exists(pid):
                found.append(pid)
    return found


def owned_processes(owner: str, names: Iterable[str] | None = None) -> list[int]:
    """Pids whose environment carries ``OWNER_ENV=owner`` (optionally only these comms):
    descendants of the sandbox's daemons. Never the caller or its ancestors."""
    marker = f"{OWNER_ENV}={owner}".encode()
    wanted = set(names) if names is not None else None
    return _find(lambda pid, env: (wanted is None or comm(pid) in wanted) and marker in env)


def job_processes(slurm_conf: str) -> list[int]:
    """Processes of the sandbox's jobs: Slurm puts ``SLURM_CONF`` (even with
    ``--export=NONE``) and ``SLURM_JOB_ID`` into every job's environment. Never the caller
    or its ancestors."""
    conf = f"SLURM_CONF={slurm_conf}".encode()
    return _find(lambda pid, env: conf in env and any(e.startswith(b"SLURM_JOB_ID=")
                                                        for e in env))


def _ancestors() -> set[int]:
    pids = set()
    pid = os.getpid()
    while pid > 1 and pid not in pids:
        pids.add(pid)
        raw = _read(f"/proc/{pid}/stat")
        if raw is None:
            break
        pid = int(raw.rsplit(b")", 1)[-1].split()[1])
    return pids


def _signal(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def wait_gone(pids: Iterable[int], timeout_s: float) -> list[int]:
    """Wait until none of `pids` exists; return those still there at the deadline."""
    left = list(pids)
    deadline = time.monotonic() + timeout_s
    delay = 0.02
    while left:
        left = [p for p in left if exists(p)]
        if not left or time.monotonic() >= deadline:
            break
        time.sleep(delay)
        delay = min(delay * 1.5, 0.2)
    return left


def terminate(entries: Iterable[Entry], term_timeout_s: float = 15.0) -> list[int]:
    """SIGTERM every live recorded process at once, wait, SIGKILL survivors.

    Only processes whose cmdline still matches are signalled. Returns the pids that even
    SIGKILL did not remove (normally none).
    """
    live = [e.pid for e in entries if is_ours(e)]
    return kill_pids(live, term_timeout_s)


def kill_pids(pids: Iterable[int], term_timeout_s: float = 15.0) -> list[int]:
    """SIGTERM `pids` together, wait up to `term_timeout_s`, then SIGKILL what is left."""
    pids = list(pids)
    for pid in pids:
        _signal(pid, signal.SIGTERM)
    left = wait_gone(pids, term_timeout_s)
    for pid in left:
        _signal(pid, signal.SIGKILL)
    return wait_gone(left, 5.0)
