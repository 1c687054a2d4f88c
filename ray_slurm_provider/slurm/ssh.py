"""One multiplexed SSH connection to the login node (`provider.ssh`).

Every command of the login side runs on the login node through one master connection
(``ControlMaster=auto``, a control socket in a 0700 directory, ``ControlPersist``): the first
command opens it, later ones reuse it, `close` ends it. The remote command is one string of
shlex-quoted words, so no value is ever split or expanded by the login node's shell.

A cluster's tunnels (`ray-slurm env`) live on a master of their own, one per cluster, that
persists until `close_tunnels`: an idle master would end after ``ControlPersist`` and take
the tunnels with it, and closing one cluster's tunnels must not end another's, nor a
`ray up` running over the main connection.

Security: the host key is always checked (``StrictHostKeyChecking=yes``; an unknown key
stops with its fingerprint and how to accept it), no agent or X11 forwarding (``-a -x``,
``ClearAllForwardings``), ``BatchMode`` (no password prompt). Nothing secret goes on a
command line: what must reach the login node goes on stdin.
"""

from __future__ import annotations

import hashlib
import os
import re
import shlex
import stat
from collections.abc import Callable, Mapping, Sequence

from ray_slurm_provider import proc
from ray_slurm_provider.config import SshConfig

#: Where control sockets live (one per destination, named by ssh's %C hash).
CONTROL_DIR = "~/.ray_slurm/ssh"
#: ssh's own exit code for its failures (the remote command's otherwise).
SSH_FAILED = 255
#: The Slurm commands the login side runs.
SLURM_COMMANDS = ("sbatch", "squeue", "scancel", "scontrol", "sinfo", "srun")
#: sun_path's limit, and what ssh adds to the dir: "/" + %C (40) + its temporary suffix (17).
_SOCKET_PATH_MAX = 104
_SOCKET_NAME = 58
_VAR = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class SshError(RuntimeError):
    """The login node could not be reached or refused us; the message names the cause in
    one line. `transient`: the connection failed (asking again may work), as opposed to a
    refusal (host key, login) that only the user can fix."""

    def __init__(self, message: str, *, transient: bool = False) -> None:
        super().__init__(message)
        self.transient = transient


#: What ssh prints when the login node, or ssh itself, refused us: only the user can fix it.
REFUSALS = ("Host key verification failed", "host key is known", "Permission denied",
            "Too many authentication failures", "Unable to negotiate",
            "Bad owner or permissions", "Bad configuration option", "no such identity")
#: What ssh prints when the connection failed (named in the one line `explain` gives).
CONNECTION_FAILURES = ("Connection refused", "Could not resolve", "timed out",
                       "No route to host", "Network is unreachable", "Connection closed",
                       "closed by remote host", "Connection reset", "Broken pipe",
                       "not responding", "Host is down")


def destination(cfg: SshConfig) -> str:
    return f"{cfg.user}@{cfg.host}" if cfg.user else cfg.host


def control_dir(path: str = CONTROL_DIR) -> str:
    """The control sockets' directory: made 0700; one that others may enter, or that is
    not ours, is refused (its sockets would let them use our connection)."""
    d = os.path.expanduser(path)
    if len(d) + _SOCKET_NAME > _SOCKET_PATH_MAX:
        raise SshError(f"{d} is too long for ssh's control socket (a Unix socket path); "
                       "use a shorter home or state dir")
    os.makedirs(d, mode=0o700, exist_ok=True)
    st = os.lstat(d)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise SshError(f"{d} is not a directory of yours; remove it")
    if st.st_mode & 0o077:
        os.chmod(d, 0o700)
    return d


def base_options(cfg: SshConfig, control: str, *, socket: str | None = None,
                 persist: str | None = None) -> list[str]:
    """The options of every ssh call that may open a master: its socket (`socket`, else
    the main one, named by ssh's %C), how long it persists, checks, and no forwarding (also
    none that the user's ssh_config names; tunnels are added to a master afterwards)."""
    opts = [
        "-a", "-x",
        "-o", "BatchMode=yes",
        "-o", "StrictHostKeyChecking=yes",
        "-o", "ClearAllForwardings=yes",
        "-o", "ForwardAgent=no",
        "-o", "ForwardX11=no",
        "-o", "PermitLocalCommand=no",
        "-o", "ControlMaster=auto",
        "-o", f"ControlPath={socket or os.path.join(control, '%C')}",
        "-o", f"ControlPersist={persist or cfg.control_persist_s}",
        "-o", "ConnectTimeout=15",
        "-o", "ServerAliveInterval=30",
        "-p", str(cfg.port),
    ]
    if cfg.identity_file:
        opts += ["-i", os.path.expanduser(cfg.identity_file), "-o", "IdentitiesOnly=yes"]
    if cfg.known_hosts:
        opts += ["-o", f"UserKnownHostsFile={os.path.expanduser(cfg.known_hosts)}"]
    if cfg.jump_host:
        opts += ["-J", cfg.jump_host]
    return opts


def remote_command(argv: Sequence[str], env: Mapping[str, str] | None = None) -> str:
    """The one string the login node's shell runs: ``env K=V ... argv``, every word quoted."""
    words = [str(a) for a in argv]
    if not words:
        raise ValueError("empty argv")
    pairs = []
    for key, value in (env or {}).items():
        if not _VAR.match(key):
            raise ValueError(f"not an environment variable name: {key!r}")
        pairs.append(f"{key}={value}")
    prefix = ["env", *pairs] if pairs else []
    return shlex.join([*prefix, *words])


def remote_path(path: str) -> str:
    """`path` as the login node's shell must see it once quoted: "~/x" (which quoting would
    keep from expanding) is relative to the login home, where every session starts."""
    if path == "~":
        return "."
    if path.startswith("~/"):
        return "./" + path[2:]
    if path.startswith("~"):
        raise SshError(f"{path}: only ~/ paths (your own home) are supported over SSH")
    return path


def ssh_argv(cfg: SshConfig, control: str, command: str) -> list[str]:
    return ["ssh", *base_options(cfg, control), "--", destination(cfg), command]


def failure(cfg: SshConfig, stderr: str) -> SshError:
    """The error for ssh's own failure. Transient unless the login was refused: a
    connection lost mid-command often says nothing at all (the master, gone to the
    background, writes its messages nowhere), and asking again costs a few seconds."""
    refused = any(m in stderr for m in REFUSALS)
    return SshError(explain(cfg, stderr), transient=not refused)


def explain(cfg: SshConfig, stderr: str) -> str:
    """One line naming why ssh itself failed."""
    where = f"{cfg.host}:{cfg.port}"
    text = stderr.strip()
    if not text:
        return (f"the connection to the login node {where} ended (ssh exit 255 and no "
                "message: its shared connection may have closed)")
    if "Host key verification failed" in text or "host key is known" in text:
        if "IDENTIFICATION HAS CHANGED" in text:
            return (f"the host key of {where} is not the one in known_hosts (changed, or "
                    "someone is in between); check it with your site before you remove the old "
                    "entry")
        return f"unknown host key for {where}; {accept_hint(cfg)}"
    if "Permission denied" in text:
        return (f"{where} refused the login of {destination(cfg)} (Permission denied: "
                "the key is not accepted; check provider.ssh.user and identity_file)")
    for marker in CONNECTION_FAILURES:
        if marker in text:
            return f"cannot reach the login node {where}: {marker}"
    last = text.splitlines()[-1]
    return f"ssh to {where} failed: {last}"


def fingerprints(cfg: SshConfig) -> list[str]:
    """The login node's host key fingerprints as ``ssh-keyscan`` sees them (unverified:
    for the user to compare with what the site publishes)."""
    try:
        scan = proc.run(["ssh-keyscan", "-p", str(cfg.port), "-T", "10", cfg.host],
                        timeout=20, check=False)
        if not scan.stdout.strip():
            return []
        res = proc.run(["ssh-keygen", "-l", "-f", "-"], input=scan.stdout, timeout=20,
                       check=False)
    except proc.CommandError:
        return []
    return [line.strip() for line in res.stdout.splitlines() if line.strip()]


def accept_hint(cfg: SshConfig) -> str:
    """How to accept an unknown host key, with its fingerprint."""
    prints = "; ".join(fingerprints(cfg)) or "fingerprint unavailable"
    port = f" -p {cfg.port}" if cfg.port != 22 else ""
    return (f"its key is {prints}. If your site publishes that fingerprint, accept it with "
            f"`ssh{port} {destination(cfg)} true` (answer yes), then run again")


class SshLink:
    """The one connection to the login node. Constructing it runs nothing."""

    def __init__(self, cfg: SshConfig, *, control: str | None = None) -> None:
        self.cfg = cfg
        self._control = control

    @property
    def host(self) -> str:
        return self.cfg.host

    @property
    def control(self) -> str:
        if self._control is None:
            self._control = control_dir()
        return self._control

    def run(self, argv: Sequence[str], *, input: str | None = None,
            env: Mapping[str, str] | None = None, timeout: float = 60.0,
            check: bool = True) -> proc.Result:
        """Run `argv` on the login node. ssh's own failure raises SshError (one line);
        a command missing there CommandNotFound; a non-zero exit CommandFailed."""
        command = remote_command(argv, env)
        res = proc.run(ssh_argv(self.cfg, self.control, command), input=input,
                       timeout=timeout, check=False)
        return self._result(argv, res, check)

    def stream(self, argv: Sequence[str], *, on_line: Callable[[str], None],
               on_err: Callable[[str], None], input: str | None = None,
               timeout: float | None = 60.0, keep: int | None = None) -> proc.Result:
        """`run` without `check`, its output handed over line by line as it comes
        (proc.stream; `keep`: how much of it to return)."""
        res = proc.stream(ssh_argv(self.cfg, self.control, remote_command(argv)),
                          on_line=on_line, on_err=on_err, input=input, timeout=timeout,
                          keep=keep)
        return self._result(argv, res, False)

    def _result(self, argv: Sequence[str], res: proc.Result, check: bool) -> proc.Result:
        """ssh's own failure as SshError; with `check`, the command's as `run` says."""
        if res.returncode == SSH_FAILED:
            raise failure(self.cfg, res.stderr)
        result = proc.Result(list(argv), res.returncode, res.stdout, res.stderr)
        if res.returncode == 127 and check:
            raise proc.CommandNotFound(list(argv), f"{argv[0]}: command not found on "
                                       f"{self.cfg.host}", 127, res.stdout, res.stderr)
        if res.returncode != 0 and check:
            msg = res.stderr.strip() or res.stdout.strip() or f"exit code {res.returncode}"
            raise proc.CommandFailed(list(argv), msg, res.returncode, res.stdout, res.stderr)
        return result

    def tunnel_socket(self, name: str) -> str:
        """The control socket of cluster `name`'s tunnel master (as long as ssh's %C)."""
        key = f"{destination(self.cfg)}:{self.cfg.port}:{self.cfg.jump_host}\0{name}"
        return os.path.join(self.control, "t" + hashlib.sha256(key.encode()).hexdigest()[:39])

    def _control_command(self, socket: str, op: str, *extra: str) -> proc.Result:
        """`ssh -O op` to the master at `socket`. ``-F /dev/null``: with the user's
        ssh_config, a forward request would also carry every LocalForward, RemoteForward and
        DynamicForward it names for the host (ClearAllForwardings would drop ours too)."""
        argv = ["ssh", "-F", "/dev/null", "-o", f"ControlPath={socket}", "-O", op, *extra,
                "--", destination(self.cfg)]
        return proc.run(argv, timeout=30, check=False)

    def forward(self, name: str, local_port: int, host: str, port: int) -> None:
        """A tunnel of cluster `name` on its own master (started when none runs, persisting
        until `close_tunnels`): 127.0.0.1:`local_port` on this machine to `host`:`port` as
        the login node sees it. Only ever bound to 127.0.0.1. Asking again for a tunnel the
        master has is no error (ssh keeps the one it has)."""
        socket = self.tunnel_socket(name)
        if self._control_command(socket, "check").returncode != 0:
            argv = ["ssh", *base_options(self.cfg, self.control, socket=socket, persist="yes"),
                    "--", destination(self.cfg), "true"]
            res = proc.run(argv, timeout=60, check=False)
            if res.returncode != 0:
                raise failure(self.cfg, res.stderr)
        spec = f"127.0.0.1:{int(local_port)}:{host}:{int(port)}"
        res = self._control_command(socket, "forward", "-L", spec)
        if res.returncode != 0:
            said = (res.stderr.strip().splitlines() or ["ssh failed"])[-1]
            raise SshError(f"cannot forward 127.0.0.1:{local_port} to {host}:{port}: {said}")

    def close_tunnels(self, name: str) -> None:
        """End cluster `name`'s tunnel master and its tunnels (nothing when none runs); the
        main connection and other clusters' tunnels stay."""
        self._control_command(self.tunnel_socket(name), "exit")

    def read_file(self, path: str) -> str | None:
        """A file of the login node (a path under ~ is read from the login home), or None
        when it does not exist. Its text comes back on stdout, never on a command line."""
        res = self.run(["cat", "--", remote_path(path)], timeout=60, check=False)
        if res.returncode != 0:
            if "No such file" in res.stderr:
                return None
            raise SshError(f"cannot read {path} on {self.cfg.host}: {res.stderr.strip()}")
        return res.stdout

    def close(self) -> None:
        """End the master connection (nothing when none is open)."""
        argv = ["ssh", *base_options(self.cfg, self.control), "-O", "exit", "--",
                destination(self.cfg)]
        proc.run(argv, timeout=20, check=False)

    def is_open(self) -> bool:
        argv = ["ssh", *base_options(self.cfg, self.control), "-O", "check", "--",
                destination(self.cfg)]
        return proc.run(argv, timeout=20, check=False).returncode == 0

    def missing_commands(self, commands: Sequence[str] = SLURM_COMMANDS) -> list[str]:
        """Which of `commands` the login node's PATH lacks."""
        script = 'for c in "$@"; do command -v "$c" >/dev/null 2>&1 || echo "$c"; done'
        res = self.run(["sh", "-c", script, "sh", *commands], timeout=30)
        return res.stdout.split()

    def package_version(self, python: str) -> str | None:
        """This package's version in the login node's `python`, None when it lacks it."""
        code = ("import importlib.metadata as m\n"
                "try:\n    print(m.version('ray-slurm-provider'))\n"
                "except m.PackageNotFoundError:\n    print('')\n")
        res = self.run([python, "-c", code], timeout=60, check=False)
        if res.returncode != 0:
            return None
        return res.stdout.strip() or None

