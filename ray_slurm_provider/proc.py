"""The one place that runs external commands.

Every command is an argv list with a timeout; nothing goes through a shell. Failures are
typed so callers can tell "the binary is missing" from "it ran and said no" from "it hung".
"""

from __future__ import annotations

import collections
import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import psutil

DEFAULT_TIMEOUT_S = 60.0


class CommandError(Exception):
    """A command could not be run or exited non-zero."""

    def __init__(self, argv: Sequence[str], message: str, returncode: int | None = None,
                 stdout: str = "", stderr: str = "") -> None:
        super().__init__(message)
        self.argv = list(argv)
        self.returncode = returncode
        self.stdout = stdout
        self.stderr = stderr


class CommandNotFound(CommandError):
    """The executable does not exist on PATH."""


class CommandTimeout(CommandError):
    """The command ran past its timeout and was killed."""


class CommandFailed(CommandError):
    """The command exited non-zero; `stderr` holds its own words."""


@dataclass(frozen=True)
class Result:
    argv: list[str]
    returncode: int
    stdout: str
    stderr: str


class Remote(Protocol):
    """Runs an argv on another machine (`slurm.ssh.SshLink`: the login node), raising the
    errors `run` raises for a local command."""

    def run(self, argv: Sequence[str], *, input: str | None = None,
            env: Mapping[str, str] | None = None, timeout: float = DEFAULT_TIMEOUT_S,
            check: bool = True) -> Result: ...


def run(
    argv: Sequence[str],
    *,
    timeout: float = DEFAULT_TIMEOUT_S,
    input: str | None = None,
    env: Mapping[str, str] | None = None,
    check: bool = True,
    cwd: str | None = None,
) -> Result:
    """Run `argv` and capture its output as text.

    `env`, when given, replaces the environment entirely (callers build it with `clean_env`).
    With `check`, a non-zero exit raises `CommandFailed` carrying stderr. Without `input`
    the command reads an empty stdin: never the caller's terminal (ssh would take keystrokes
    meant for `ray up`). Bytes that are not UTF-8 (a job name, a remote file) come back as
    U+FFFD rather than failing the whole call.
    """
    args = [str(a) for a in argv]
    if not args:
        raise ValueError("empty argv")
    try:
        cp = subprocess.run(
            args,
            input=input,
            stdin=subprocess.DEVNULL if input is None else None,
            capture_output=True,
            text=True,
            encoding="utf-8",
            errors="replace",
            timeout=timeout,
            env=dict(env) if env is not None else None,
            cwd=cwd,
            check=False,
        )
    except FileNotFoundError as e:
        raise CommandNotFound(args, f"{args[0]}: command not found") from e
    except subprocess.TimeoutExpired as e:
        out = _text(e.stdout)
        err = _text(e.stderr)
        raise CommandTimeout(args, f"{args[0]} timed out after {timeout:g}s", None, out, err) from e
    res = Result(args, cp.returncode, cp.stdout, cp.stderr)
    if check and cp.returncode != 0:
        msg = (cp.stderr.strip() or cp.stdout.strip() or f"exit code {cp.returncode}")
        raise CommandFailed(args, msg, cp.returncode, cp.stdout, cp.stderr)
    return res


def stream(
    argv: Sequence[str],
    *,
    on_line: Callable[[str], None],
    on_err: Callable[[str], None],
    input: str | None = None,
    timeout: float | None = DEFAULT_TIMEOUT_S,
    keep: int | None = None,
) -> Result:
    """Run `argv` as `run` does (no check), handing each line of its stdout to `on_line` and
    of its stderr to `on_err` as it comes (a remote `logs --follow`, `ray exec`'s output);
    the output is also returned: all of it, or with `keep` the last lines within about
    that many characters (always the last line: an hours-long `--follow` stays bounded).
    Past `timeout` (None: no limit) the command is killed and CommandTimeout raised; so it
    is on any exception of the caller's (KeyboardInterrupt), which is raised again."""
    args = [str(a) for a in argv]
    if not args:
        raise ValueError("empty argv")
    try:
        child = subprocess.Popen(
            args, stdin=subprocess.DEVNULL if input is None else subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, encoding="utf-8",
            errors="replace", bufsize=1)
    except FileNotFoundError as e:
        raise CommandNotFound(args, f"{args[0]}: command not found") from e
    out = _Tail(keep)
    err = _Tail(STDERR_KEPT)
    timed_out = threading.Event()

    def expire() -> None:
        timed_out.set()
        child.kill()

    def feed() -> None:
        assert child.stdin is not None
        with contextlib.suppress(BrokenPipeError):  # it ended without reading it all
            child.stdin.write(input or "")
            child.stdin.close()

    def read_err() -> None:
        assert child.stderr is not None
        for line in child.stderr:
            err.add(line)
            on_err(line)

    helpers = [threading.Thread(target=read_err, daemon=True)]
    if input is not None:
        helpers.append(threading.Thread(target=feed, daemon=True))
    timer = threading.Timer(timeout, expire) if timeout is not None else None
    try:
        for t in helpers:
            t.start()
        if timer is not None:
            timer.start()
        assert child.stdout is not None
        for line in child.stdout:
            out.add(line)
            on_line(line)
        child.wait()
    except BaseException:
        child.kill()
        child.wait()
        raise
    finally:
        if timer is not None:
            timer.cancel()
        for t in helpers:
            t.join(timeout=5)
    if timed_out.is_set():
        raise CommandTimeout(args, f"{args[0]} timed out after {timeout:g}s", None,
                             out.text(), err.text())
    return Result(args, child.returncode, out.text(), err.text())


#: What `stream` keeps of a command's stderr (its last words are what an error says).
STDERR_KEPT = 64 * 1024


class _Tail:
    """The last lines of a stream within `limit` characters (None: all), and always the
    last line whole."""

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self.lines: collections.deque[str] = collections.deque()
        self.size = 0

    def add(self, line: str) -> None:
        self.lines.append(line)
        self.size += len(line)
        while self.limit is not None and self.size > self.limit and len(self.lines) > 1:
            self.size -= len(self.lines.popleft())

    def text(self) -> str:
        return "".join(self.lines)


def _text(data: bytes | str | None) -> str:
    """What a timed-out command printed (subprocess hands it over undecoded)."""
    if isinstance(data, bytes):
        return data.decode(errors="replace")
    return data or ""


def start(
    argv: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    new_session: bool = False,
) -> subprocess.Popen[str]:
    """Start a long-running child whose output the caller streams (the node agent's Ray).

    stdout and stderr are merged into one text pipe, line-buffered. With `new_session` the
    child leads a session of its own, which end_session can end whole later.
    """
    args = [str(a) for a in argv]
    try:
        return subprocess.Popen(
            args,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            env=dict(env) if env is not None else None,
            start_new_session=new_session,
        )
    except FileNotFoundError as e:
        raise CommandNotFound(args, f"{args[0]}: command not found") from e


def run_attached(
    argv: Sequence[str],
    *,
    timeout: float | None = None,
    env: Mapping[str, str] | None = None,
) -> int:
    """Run with the caller's stdin/stdout/stderr (interactive shells, streamed output).

    Returns the exit code; raises CommandTimeout past `timeout` (None: no limit, for
    `ray attach`).
    """
    args = [str(a) for a in argv]
    try:
        return subprocess.run(args, env=dict(env) if env is not None else None,
                              timeout=timeout, check=False).returncode
    except FileNotFoundError as e:
        raise CommandNotFound(args, f"{args[0]}: command not found") from e
    except subprocess.TimeoutExpired as e:
        raise CommandTimeout(args, f"{args[0]} timed out after {timeout:g}s") from e


def run_in_group(
    argv: Sequence[str],
    *,
    timeout: float | None,
    env: Mapping[str, str] | None = None,
    stdout: int | None = None,
    grace_s: float = 15.0,
) -> int:
    """Run a child in its own session and wait for it; return its exit code.

    A terminal's Ctrl-C reaches only the caller, which decides what the child gets: if
    anything is raised while waiting (a signal handler's exception), the child's whole group
    gets SIGTERM, then SIGKILL after `grace_s`, and the exception propagates. `stdout` is a
    file descriptor (e.g. 2, to keep the caller's stdout for its own output). Past `timeout`
    the group is stopped the same way and CommandTimeout is raised.
    """
    args = [str(a) for a in argv]
    try:
        p = subprocess.Popen(args, env=dict(env) if env is not None else None, stdout=stdout,
                             stdin=subprocess.DEVNULL, start_new_session=True)
    except FileNotFoundError as e:
        raise CommandNotFound(args, f"{args[0]}: command not found") from e
    try:
        try:
            return p.wait(timeout=timeout)
        except subprocess.TimeoutExpired as e:
            raise CommandTimeout(args, f"{args[0]} timed out after {timeout:g}s") from e
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGTERM)
        try:
            p.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        raise


def clean_env(
    base: Mapping[str, str] | None = None,
    *,
    drop_prefixes: Sequence[str] = (),
    keep: Sequence[str] = (),
    extra: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """A copy of `base` (default: os.environ) without variables starting with any prefix.

    Used to stop a job's own SLURM_* variables from leaking into the jobs it submits.
    """
    src = os.environ if base is None else base
    out = {k: v for k, v in src.items()
           if k in keep or not any(k.startswith(p) for p in drop_prefixes)}
    if extra:
        out.update(extra)
    return out


def spawn(
    argv: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    log_path: str,
) -> int:
    """Start a long-running process that does not daemonize itself; return its pid.

    The process gets its own session (no terminal signals reach it), stdin from /dev/null and
    stdout/stderr appended to `log_path`. The caller does not wait for it: it records the pid
    and later stops it by that pid.
    """
    args = [str(a) for a in argv]
    if not args:
        raise ValueError("empty argv")
    with open(log_path, "ab") as log:
        try:
            p = subprocess.Popen(
                args,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=dict(env) if env is not None else None,
                start_new_session=True,
                close_fds=True,
            )
        except FileNotFoundError as e:
            raise CommandNotFound(args, f"{args[0]}: command not found") from e
    return p.pid


def kill_tree(pid: int, sig: int = signal.SIGKILL) -> int:
    """Signal `pid` and every process below it, all found before any is signalled (so none is
    reparented to init first and missed). The node agent's own `ray start` only: killing
    just that process would orphan the agents under its raylet, and Slurm's
    proctrack/linuxproc does not find orphans. Processes that end meanwhile, and those the
    kernel does not let us signal (other users'), are skipped. Returns how many were
    signalled."""
    try:
        root = psutil.Process(pid)
        tree = [root, *root.children(recursive=True)]
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return 0
    n = 0
    for p in tree:
        # psutil checks that the pid still names the process it listed (no pid reuse).
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            p.send_signal(sig)
            n += 1
    return n


#: How long a child's output may stay open after it exited before its holders are ended.
ORPHAN_GRACE_S = 5.0


def pipe_holders(fd: int) -> list[int]:
    """The other processes that hold the pipe behind `fd` open. psutil lists no pipes among
    a process's open files, so each process's fd links are read; those of other users
    cannot be read and are not ours, and a process may end while it is looked at."""
    target, me, out = f"pipe:[{os.fstat(fd).st_ino}]", os.getpid(), []
    for pid in psutil.pids():
        if pid == me:
            continue
        with contextlib.suppress(OSError):
            fds = os.scandir(f"/proc/{pid}/fd")
            with fds:
                if any(_link(e.path) == target for e in fds):
                    out.append(pid)
    return out


def _link(path: str) -> str:
    """Where an fd link points, or "" when the fd closed meanwhile."""
    try:
        return os.readlink(path)
    except OSError:
        return ""


def end_orphans(child: subprocess.Popen[str], eof: threading.Event,
                tell: Callable[[list[int]], object] = lambda _: None) -> list[int]:
    """Once `child` has exited, end (with what they started) the processes that still hold
    its output ORPHAN_GRACE_S later, unless the reader saw `eof`: daemons a `ray start`
    killed mid-start left behind, which would keep the reader waiting and outlive the job.
    `tell` hears their pids first. Run in a thread of its own beside the reader."""
    child.wait()
    if eof.wait(ORPHAN_GRACE_S) or child.stdout is None:
        return []
    try:
        pids = pipe_holders(child.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # closed meanwhile, or not a pipe
        return []
    if pids:
        tell(pids)
    for pid in pids:
        kill_tree(pid)
    return pids



def end_session(sid: int, grace_s: float = 5.0) -> list[int]:
    """KILL every process of this user in session `sid` (a child started with `new_session`,
    which has exited), again and again until none is left or `grace_s` has passed; return
    their pids. Orphans go to init, so only their session still ties them to the child."""
    if sid <= 1:  # led by no child: the kernel's threads' (0), init's (1)
        return []
    ended: list[int] = []
    deadline = time.monotonic() + grace_s
    while True:
        left = _in_session(sid)
        for p in left:
            with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                p.kill()
        ended += [p.pid for p in left if p.pid not in ended]
        if not left or time.monotonic() >= deadline:
            return ended
        time.sleep(0.05)  # a process forked while the others were signalled: once more


def _in_session(sid: int) -> list[psutil.Process]:
    """This user's processes in session `sid`, zombies left out (they have ended)."""
    uid, me, found = os.getuid(), os.getpid(), []
    for p in psutil.process_iter(["uids", "status"]):
        try:
            if p.pid == me or p.info["uids"] is None or p.info["uids"].real != uid:
                continue
            if p.info["status"] != psutil.STATUS_ZOMBIE and os.getsid(p.pid) == sid:
                found.append(p)
        except (OSError, psutil.Error):  # ended meanwhile
            continue
    return found
