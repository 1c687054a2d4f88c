"""The sandbox's daemons: their names, command lines and environments, how to start one and
how to tell it is ready.

All run in the foreground under `proc.spawn` (``munged -F``, ``slurmctld -D``, ``slurmd -D``,
slurmrestd, dockerd, ``sshd -D``), so the pid we record is the daemon itself, known at once,
with no pid-file race. Names: ``munged``, ``slurmctld``, ``slurmd:n1`` ... ``slurmd:nN``,
``slurmrestd`` and, with docker, ``dockerd``; with login, ``sshd``.
"""

from __future__ import annotations

import grp
import os
import shutil
import socket

from ray_slurm_provider import proc
from ray_slurm_provider.sandbox import (
    accounting,
    config,
    files,
    login,
    probes,
    roots,
    source,
    users,
)
from ray_slurm_provider.sandbox.config import SandboxSpec
from ray_slurm_provider.sandbox.layout import Layout
from ray_slurm_provider.sandbox.procs import (
    OWNER_ENV,
    Entry,
    Registry,
    SandboxError,
    cmdline,
    exists,
    owned_processes,
)

READY_TIMEOUT_S = 60.0
TOKEN_LIFESPAN_S = 365 * 24 * 3600
_SBIN = ("/usr/local/sbin", "/usr/sbin", "/sbin")


def daemon_names(spec: SandboxSpec) -> list[str]:
    """All daemons of a sandbox, in start order."""
    names = ["munged", *(["mariadb", "slurmdbd"] if spec.accounting else []), "slurmctld"]
    names += [f"slurmd:{config.node_name(k)}" for k in range(1, spec.nodes + 1)]
    names.append("slurmrestd")
    if spec.docker:
        names.append("dockerd")
    if spec.login:
        names.append("sshd")
    return names


def _binary(name: str, spec: SandboxSpec | None = None) -> str:
    if spec is not None and spec.from_source and name in source.DAEMONS:
        built = source.install_for(spec.slurm).sbin(name)
        if not os.path.exists(built):
            raise SandboxError(f"{name}: not in the Slurm {spec.slurm} build {built}")
        return built
    if spec is not None and spec.in_root and name not in ("dockerd", "mariadbd"):
        inside = f"/usr/sbin/{name}"
        if not os.path.exists(roots.root_dir(spec.slurm) + inside):
            raise SandboxError(f"{name}: not in the Slurm {spec.slurm} root "
                               f"{roots.root_dir(spec.slurm)}")
        return inside
    path = os.environ.get("PATH", "/usr/bin:/bin")
    found = shutil.which(name, path=":".join([path, *_SBIN]))
    if found is None:
        raise SandboxError(f"{name}: command not found (is its package installed?)")
    return found


def _nogroup() -> str:
    try:
        grp.getgrnam("nogroup")
        return "nogroup"
    except KeyError:
        return "nobody"


def argv_for(name: str, layout: Layout, spec: SandboxSpec) -> list[str]:
    """The command line that starts daemon `name` in the foreground."""
    conf = layout.slurm_conf
    if name == "munged":
        return [_binary("munged", spec), "--foreground",
                f"--socket={layout.munge_socket}", f"--key-file={layout.munge_key}",
                f"--pid-file={layout.run_dir}/munged.pid",
                f"--log-file={layout.log_dir}/munged.log",
                f"--seed-file={layout.munge_dir}/munged.seed"]
    if name == "slurmctld":
        return [_binary("slurmctld", spec), "-D", "-f", conf]
    if name == "mariadb" and spec.accounting:
        return accounting.mariadbd_argv(_binary("mariadbd"), layout, spec.port_offset)
    if name == "slurmdbd" and spec.accounting:  # reads slurmdbd.conf next to SLURM_CONF
        return [_binary("slurmdbd", spec), "-D"]
    if name.startswith("slurmd:"):
        node = name.split(":", 1)[1]
        if node not in {config.node_name(k) for k in range(1, spec.nodes + 1)}:
            raise SandboxError(f"no node {node!r} in this sandbox (n1..n{spec.nodes})")
        return [_binary("slurmd", spec), "-D", "-N", node, "-f", conf]
    if name == "slurmrestd":
        # 22.05 names an API version; later releases name the plugin and serve every
        # version their data parsers know.
        plugin = ("openapi/slurmctld" if spec.slurm != roots.HOST_RELEASE
                  else f"openapi/{roots.rest_version(spec.slurm)}")
        # 25.11 and 26.05 cannot resolve the name "nobody" ("fatal: Unable to resolve user:
        # nobody"); its ids work.
        user = (["-u", "65534", "-g", "65534"] if spec.slurm != roots.HOST_RELEASE
                else ["-u", "nobody", "-g", _nogroup()])
        return [_binary("slurmrestd", spec), "-f", conf, *user,
                "-a", "rest_auth/jwt", "-s", plugin, f"{config.REST_HOST}:{spec.rest_port}"]
    if name == "dockerd" and spec.docker:
        d = layout.docker_dir
        # With throwaway users, the socket belongs to their group (a site's docker group).
        group = ["--group", users.group_name(spec.port_offset)] if spec.users else []
        return [_binary("dockerd"), *group, "--config-file", os.path.join(d, "daemon.json"),
                "--iptables=false", "--ip6tables=false", "--bridge=none",
                "--data-root", os.path.join(d, "data"), "--exec-root", os.path.join(d, "exec"),
                "--pidfile", os.path.join(d, "dockerd.pid"), "-H", layout.docker_host]
    if name == "sshd" and spec.login:
        return login.argv(layout)
    raise SandboxError(f"unknown daemon {name!r}; known: {', '.join(daemon_names(spec))}")


def client_env(layout: Layout) -> dict[str, str]:
    """Environment for the Slurm commands the sandbox runs itself (never SLURM_JWT)."""
    path = os.environ.get("PATH", "/usr/bin:/bin")
    first = [layout.bin_dir] if os.path.isdir(layout.bin_dir) else []  # a release in a root
    return proc.clean_env(drop_prefixes=("SLURM_",),
                          extra={"SLURM_CONF": layout.slurm_conf,
                                 "PATH": ":".join([*first, path, *_SBIN])})


def daemon_env(name: str, layout: Layout, pyxis: bool = False) -> dict[str, str]:
    """A daemon's environment: no SLURM_*/DOCKER_* from the caller, our SLURM_CONF, the owner
    marker; ``SLURM_JWT=daemon`` only for slurmrestd."""
    env = client_env(layout)
    for key in [k for k in env if k.startswith("DOCKER_")]:
        del env[key]
    env[OWNER_ENV] = layout.root
    if pyxis and name.startswith("slurmd:"):
        # Pyxis runs `enroot` from slurmstepd's PATH, which is slurmd's (with --pyxis).
        env["PATH"] = ":".join([layout.enroot_bin_dir, env["PATH"]])
    if name == "slurmrestd":
        env["SLURM_JWT"] = "daemon"
    return env


def start(name: str, layout: Layout, spec: SandboxSpec, registry: Registry) -> Entry:
    """Spawn daemon `name` and record it; does not wait for it to be ready."""
    argv = argv_for(name, layout, spec)
    if name == "dockerd":
        daemon_json = os.path.join(layout.docker_dir, "daemon.json")
        if not os.path.exists(daemon_json):
            with open(daemon_json, "w") as f:
                f.write("{}\n")
    _check_port_free(name, spec)
    spawn = spawn_argv(name, layout, spec, argv)
    pid = proc.spawn(spawn, env=daemon_env(name, layout, spec.pyxis), log_path=layout.log(name))
    entry = Entry(pid, tuple(argv))
    registry.record(name, entry)
    if spawn is not argv:
        # The pid becomes the daemon once the entry script has made its namespace and exec'd.
        probes.wait_until(lambda: cmdline(pid) == entry.argv or not exists(pid), 30.0,
                          f"{name} to enter its mount namespace",
                          lambda: describe_failure(name, layout))
    return entry


def spawn_argv(name: str, layout: Layout, spec: SandboxSpec, argv: list[str]) -> list[str]:
    """How daemon `name` is started: `argv` itself, or `argv` behind an entry script that
    makes its mount namespace first (a release in a root; slurmd with --pyxis)."""
    unshare = ["unshare", "--mount", "--propagation", "private", "/bin/sh"]
    if spec.in_root and name not in ("dockerd", "mariadb", "sshd"):
        return [*unshare, layout.enter_script, "daemon", "/", *argv]
    if spec.pyxis and name.startswith("slurmd:"):
        return [*unshare, layout.node_entry_script, name.split(":", 1)[1], *argv]
    return argv


def _port_of(name: str, spec: SandboxSpec) -> int | None:
    if name == "slurmctld":
        return spec.ctld_port
    if name == "slurmrestd":
        return spec.rest_port
    if name == "slurmdbd":
        return accounting.DBD_PORT + spec.port_offset
    if name == "mariadb":
        return accounting.DB_PORT + spec.port_offset
    if name == "sshd":
        return login.ssh_port(spec.port_offset)
    if name.startswith("slurmd:n"):
        return config.node_port(int(name.split(":n", 1)[1]), spec.port_offset)
    return None


def _check_port_free(name: str, spec: SandboxSpec) -> None:
    port = _port_of(name, spec)
    if port is not None and port in probes.listening_tcp_ports():
        raise SandboxError(
            f"cannot start {name}: TCP port {port} is already in use by another process "
            "(another Slurm sandbox with a different state dir, or a system Slurm?); "
            "a second sandbox needs another port offset (`--port-offset`)"
        )


def _socket_answers(path: str) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(2)
        try:
            s.connect(path)
        except OSError:
            return False
    return True


def is_ready(name: str, layout: Layout, spec: SandboxSpec) -> bool:
    """True once daemon `name` serves requests."""
    if name == "munged":
        return _socket_answers(layout.munge_socket)
    if name == "mariadb":
        return _socket_answers(accounting.db_socket(layout))
    if name in ("slurmdbd", "sshd"):
        return _port_of(name, spec) in probes.listening_tcp_ports()
    if name == "slurmctld":
        return probes.controller_up(client_env(layout))
    if name.startswith("slurmd:"):
        port = _port_of(name, spec)
        node = name.split(":", 1)[1]
        return (port in probes.listening_tcp_ports()
                and probes.node_ready(probes.node_states(client_env(layout)).get(node, "unk")))
    if name == "slurmrestd":
        return _rest_status(spec, None) is not None
    if name == "dockerd":
        return probes.docker_up(layout.docker_socket)
    raise SandboxError(f"unknown daemon {name!r}")


def log_paths(name: str, layout: Layout) -> list[str]:
    """The daemon's own log file(s), for error messages."""
    paths = [layout.log(name)]
    if name in ("slurmctld", "munged", "slurmdbd", "mariadb"):
        paths.append(os.path.join(layout.log_dir, f"{name}.log"))
    elif name.startswith("slurmd:"):
        paths.append(os.path.join(layout.log_dir, f"slurmd-{name.split(':', 1)[1]}.log"))
    return paths


def describe_failure(name: str, layout: Layout) -> str:
    return "\n".join(t for t in (probes.log_tail(p) for p in log_paths(name, layout)) if t)


def wait_ready(name: str, layout: Layout, spec: SandboxSpec, entry: Entry,
               timeout_s: float = READY_TIMEOUT_S) -> None:
    """Wait until `name` is ready; fail at once (with its log) if its process exits."""
    def check() -> bool:
        if not exists(entry.pid):
            raise SandboxError(f"{name} (pid {entry.pid}) exited during startup\n"
                               + describe_failure(name, layout))
        return is_ready(name, layout, spec)

    probes.wait_until(check, timeout_s, f"{name} to become ready",
                      lambda: describe_failure(name, layout))


def _rest_status(spec: SandboxSpec, token: str | None) -> int | None:
    return probes.rest_status(spec.rest_url, token, roots.rest_version(spec.slurm))


def ensure_token(layout: Layout, spec: SandboxSpec) -> None:
    """Make sure the token file holds a JWT that slurmrestd accepts (issue one if not)."""
    token = files.read_token(layout)
    if token is None or _rest_status(spec, token) == 401:
        token = _new_token(layout)
    last: list[int | None] = [None]

    def answers() -> bool:
        last[0] = _rest_status(spec, token)
        return last[0] == 200

    probes.wait_until(answers, 30.0, "slurmrestd to accept the JWT",
                      lambda: f"last HTTP status: {last[0]}\n"
                      + describe_failure("slurmrestd", layout))


def _new_token(layout: Layout) -> str:
    try:
        res = proc.run(["scontrol", "token", "username=root", f"lifespan={TOKEN_LIFESPAN_S}"],
                       env=client_env(layout), timeout=30)
    except proc.CommandError as e:
        raise SandboxError(f"scontrol token failed: {e}") from e
    for line in res.stdout.splitlines():
        if line.startswith("SLURM_JWT="):
            token = line.split("=", 1)[1].strip()
            files.write_token(layout, token)
            return token
    raise SandboxError(f"scontrol token printed no SLURM_JWT: {res.stdout!r}")


def cancel_all_jobs(layout: Layout, timeout_s: float) -> None:
    """scancel every job of the sandbox (all users': we are root) and wait until they and
    their slurmstepds are gone, at most `timeout_s`."""
    env = client_env(layout)
    try:
        res = proc.run(["squeue", "-h", "-o", "%A"], env=env, timeout=20)
        ids = res.stdout.split()
        if not ids:
            return
        proc.run(["scancel", *ids], env=env, timeout=30, check=False)
    except proc.CommandError:
        return

    def drained() -> bool:
        r = proc.run(["squeue", "-h", "-o", "%A"], env=env, timeout=20, check=False)
        stepds = owned_processes(layout.root, names=["slurmstepd"])
        return r.returncode == 0 and not r.stdout.split() and not stepds

    try:
        probes.wait_until(drained, timeout_s, "cancelled jobs to end")
    except (SandboxError, proc.CommandError):
        pass  # the caller stops the daemons anyway and kills leftover slurmstepds
