"""`Sandbox`: a real multi-node Slurm cluster (plus an optional private dockerd) on this machine.

Everything lives under one state directory; nothing in /etc is touched. Clients find the
cluster through ``SLURM_CONF`` (see `Sandbox.env`). Needs root and the Debian packages
``slurm-wlm slurmrestd slurm-wlm-jwt-plugin munge`` (``docker.io`` with ``docker=True``).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field, replace

from ray_slurm_provider.sandbox import (
    bringup,
    config,
    daemons,
    files,
    login,
    prereq,
    probes,
    pyslurmwheel,
    pyxis,
    roots,
    source,
    users,
)
from ray_slurm_provider.sandbox.config import SandboxSpec
from ray_slurm_provider.sandbox.layout import Layout
from ray_slurm_provider.sandbox.procs import (
    Entry,
    Registry,
    SandboxError,
    is_ours,
    job_processes,
    kill_pids,
    owned_processes,
    terminate,
)
from ray_slurm_provider.sandbox.users import SandboxUser

DEFAULT_STATE_DIR = "/tmp/rsp-sandbox"
STATE_DIR_ENV = "RAY_SLURM_SANDBOX_DIR"
#: How long `down` lets cancelled jobs finish (TERM, KillWait, KILL, Epilog) before it stops
#: the daemons anyway.
JOB_DRAIN_TIMEOUT_S = config.KILL_WAIT_S + 20.0


def _adds_login(saved: SandboxSpec, spec: SandboxSpec) -> bool:
    """True when `spec` is the running `saved` shape plus the login node: `up --login` on a
    running sandbox starts only its sshd."""
    return spec.login and not saved.login and replace(saved, login=True) == spec


def default_state_dir() -> str:
    return os.path.abspath(os.environ.get(STATE_DIR_ENV) or DEFAULT_STATE_DIR)


@dataclass(frozen=True)
class SandboxStatus:
    """A snapshot: each daemon's pid (None when it is not running) and each node's state."""

    state_dir: str
    daemons: dict[str, int | None] = field(default_factory=dict)
    nodes: dict[str, str] = field(default_factory=dict)  # "n1" -> "idle", "mix", "down*", ...
    slurm: str = ""  # the release it was brought up with
    strict: bool = False  # brought up with --strict

    @property
    def running(self) -> bool:
        """True when every daemon runs and every node is up."""
        return (bool(self.daemons) and all(p is not None for p in self.daemons.values())
                and bool(self.nodes) and all(probes.node_ready(s) for s in self.nodes.values()))


class Sandbox:
    """A local Slurm cluster: munged, slurmctld, N slurmd (n1..nN on 127.0.0.2..), slurmrestd
    with JWT on 127.0.0.1:6820 and, with ``docker=True``, a private dockerd.

    The constructor has no side effects. `up` is idempotent; `down` stops only what `up`
    started (by pid) and removes the state dir. Only one sandbox per port set can run on a
    machine; ``port_offset`` shifts every daemon port so a second one can run beside it.
    """

    def __init__(self, state_dir: str | None = None, nodes: int = 3, gpus_per_node: int = 2,
                 cpus_per_node: int = 2, memory_mb_per_node: int = 4000,
                 docker: bool = False, *, port_offset: int = 0, users: int = 0,
                 slurm: str = roots.HOST_RELEASE, accounting: bool = False,
                 pyxis: bool = False, pyslurm: bool = False,
                 login: bool = False, strict: bool = False, cgroups: bool = False) -> None:
        self.spec = SandboxSpec(nodes=nodes, gpus_per_node=gpus_per_node,
                                cpus_per_node=cpus_per_node,
                                memory_mb_per_node=memory_mb_per_node, docker=docker,
                                port_offset=port_offset, users=users, slurm=slurm,
                                accounting=accounting, pyxis=pyxis, pyslurm=pyslurm,
                                login=login, strict=strict, cgroups=cgroups)
        root = os.path.abspath(state_dir) if state_dir else default_state_dir()
        self.layout = Layout(root)
        self._registry = Registry(self.layout.pids_file)

    @classmethod
    def from_state_dir(cls, state_dir: str | None = None) -> Sandbox:
        """The sandbox whose state dir exists, with the shape it was brought up with."""
        layout = Layout(os.path.abspath(state_dir) if state_dir else default_state_dir())
        spec = files.read_spec(layout)
        if spec is None:
            raise SandboxError(f"no sandbox at {layout.root} (run `ray-slurm sandbox up`)")
        return cls(layout.root, nodes=spec.nodes, gpus_per_node=spec.gpus_per_node,
                   cpus_per_node=spec.cpus_per_node,
                   memory_mb_per_node=spec.memory_mb_per_node, docker=spec.docker,
                   port_offset=spec.port_offset, users=spec.users, slurm=spec.slurm,
                   accounting=spec.accounting, pyxis=spec.pyxis, pyslurm=spec.pyslurm,
                   login=spec.login, strict=spec.strict, cgroups=spec.cgroups)

    @property
    def state_dir(self) -> str:
        return self.layout.root

    def users(self) -> list[SandboxUser]:
        """The throwaway users `up --users N` created (empty without)."""
        return users.load(self.layout)

    def __repr__(self) -> str:
        return f"Sandbox({self.state_dir!r}, {self.spec})"

    def env(self) -> dict[str, str]:
        """Variables a client exports to use the sandbox. Never SLURM_JWT: with it, srun
        authenticates by JWT and task launch fails."""
        env = {
            "SLURM_CONF": self.layout.slurm_conf,
            "RAY_SLURM_REST_URL": self.spec.rest_url,
            "RAY_SLURM_JWT_FILE": self.layout.token_file,
            STATE_DIR_ENV: self.layout.root,
        }
        if self.spec.docker:
            env["DOCKER_HOST"] = self.layout.docker_host
        if self.spec.own_clients:  # the release's client commands come first
            env["PATH"] = os.pathsep.join([self.layout.bin_dir, os.environ.get("PATH", "")])
        if self.spec.pyxis:  # the sandbox's enroot (never with a root: SandboxSpec)
            env["PATH"] = os.pathsep.join([self.layout.enroot_bin_dir,
                                           os.environ.get("PATH", "")])
        if self.spec.login:
            env.update(login.exports(self.layout, self.spec.port_offset))
        return env

    def login_env(self) -> dict[str, str]:
        """What every SSH session on the login node gets (sshd's SetEnv): the sandbox's
        Slurm, as a site's login node has its own in /etc."""
        path = [self.layout.bin_dir] if self.spec.in_root else []
        if self.spec.pyxis:
            path.append(self.layout.enroot_bin_dir)
        path += ["/usr/local/bin", "/usr/bin", "/bin"]
        return {"SLURM_CONF": self.layout.slurm_conf, "PATH": os.pathsep.join(path)}

    # -- up ---------------------------------------------------------------------------------

    def up(self, install: bool = False) -> dict[str, str]:
        """Start whatever is not running and wait until it all works; return `env()`.

        Checks root and packages first (``install=True`` runs apt-get). A second call on a
        healthy sandbox starts nothing. When a step fails on a sandbox that was not running,
        everything it started is stopped again; the state dir (with the logs the error
        names) stays until `down`.
        """
        prereq.check_root()
        spec = self.spec
        needs = prereq.Needs(docker=spec.docker, root=spec.in_root, build=spec.from_source,
                             accounting=spec.accounting, pyxis=spec.pyxis, login=spec.login)
        prereq.ensure_packages(needs, install)
        if self.spec.pyxis:  # before the lock, like a root: a first build takes a minute
            pyxis.ensure_built(pyxis.build_for(self.spec.slurm))
        if self.spec.in_root:  # before the lock: a first build takes minutes
            roots.ensure_root(self.spec.slurm)
        elif self.spec.from_source:  # likewise
            built = source.ensure_built(source.install_for(self.spec.slurm))
            if self.spec.pyslurm:  # into the Python running this: import pyslurm works
                pyslurmwheel.ensure_installed(built)
        elif (host := roots.host_release()) != self.spec.slurm:
            raise SandboxError(f"this machine's Slurm is {host}, not {self.spec.slurm}; "
                               f"choose --slurm {host} or one of {', '.join(roots.RELEASES)}")
        if os.path.isdir(self.state_dir) and not files.looks_like_sandbox(self.layout):
            raise SandboxError(f"{self.state_dir} exists and is not a sandbox state dir "
                               "(no sandbox.json); choose an empty or new directory")
        fresh = False  # decided under the lock: another `up` may be starting it right now
        try:
            with files.locked(self.layout):
                fresh = not self._alive_entries()
                saved = files.read_spec(self.layout)
                if (saved is not None and saved != self.spec and self._alive_entries()
                        and not _adds_login(saved, self.spec)):
                    raise SandboxError(
                        f"a sandbox with another shape runs at {self.state_dir} ({saved}); "
                        "run `ray-slurm sandbox down` first, or use another --state-dir")
                files.prepare(self.layout, self.spec)
                made = users.ensure(self.layout, self.spec.users, self.spec.port_offset)
                if self.spec.login:
                    login.prepare(self.layout, self.spec.port_offset,
                                  [u.name for u in made], self.login_env())
                self._forget_unknown()
                bringup.start_missing(self.layout, self.spec, self._registry,
                                      self._alive_entries(), [u.name for u in self.users()])
                daemons.ensure_token(self.layout, self.spec)
                files.write_env_sh(self.layout, self.env())
        except BaseException:
            if fresh:  # nothing half-running: stop what this call started, keep the logs
                with contextlib.suppress(SandboxError, OSError):  # the first error is the one
                    self.down(keep_state_dir=True)
            raise
        return self.env()

    def _alive_entries(self) -> dict[str, Entry]:
        return {n: e for n, e in self._registry.load().items() if is_ours(e)}

    def _forget_unknown(self) -> None:
        known = set(daemons.daemon_names(self.spec))
        for name, entry in self._registry.load().items():
            if name not in known:
                if is_ours(entry):
                    raise SandboxError(f"{name} (pid {entry.pid}) runs but is not part of "
                                       f"this sandbox's shape; run `down` first")
                self._registry.forget(name)

    # -- status / single daemons --------------------------------------------------------------

    def status(self) -> SandboxStatus:
        """Which daemons run (name -> pid or None) and the node states from sinfo."""
        spec = files.read_spec(self.layout)
        if spec is None:
            return SandboxStatus(self.state_dir)
        entries = self._registry.load()
        pids: dict[str, int | None] = {}
        for name in daemons.daemon_names(spec):
            entry = entries.get(name)
            pids[name] = entry.pid if entry is not None and is_ours(entry) else None
        nodes = (probes.node_states(daemons.client_env(self.layout))
                 if pids.get("slurmctld") is not None else {})
        return SandboxStatus(self.state_dir, pids, nodes, spec.slurm, spec.strict)

    def stop_daemon(self, name: str) -> None:
        """Stop one daemon (e.g. "slurmctld", "slurmrestd", "slurmd:n2") by its pid and wait
        until it is gone. A daemon that is not running is left alone."""
        daemons.argv_for(name, self.layout, self._saved_spec())  # validates the name
        with files.locked(self.layout):
            entry = self._registry.load().get(name)
            if entry is not None and is_ours(entry):
                left = kill_pids([entry.pid])
                if left:
                    raise SandboxError(f"{name} (pid {entry.pid}) survived SIGKILL")
            self._registry.forget(name)

    def start_daemon(self, name: str) -> None:
        """Start one daemon again (after `stop_daemon`) and wait until it is ready."""
        spec = self._saved_spec()
        daemons.argv_for(name, self.layout, spec)
        with files.locked(self.layout):
            entry = self._registry.load().get(name)
            if entry is not None and is_ours(entry):
                return
            entry = daemons.start(name, self.layout, spec, self._registry)
            daemons.wait_ready(name, self.layout, spec, entry)
            if name == "slurmctld" or name.startswith("slurmd:"):
                # A restarted controller shows nodes "unk" until their slurmd re-registers.
                entries = self._registry.load()
                bringup.wait_nodes(self.layout, {n: e for n, e in entries.items()
                                                 if n.startswith("slurmd:") and is_ours(e)},
                                   children={name})

    def _saved_spec(self) -> SandboxSpec:
        spec = files.read_spec(self.layout)
        if spec is None:
            raise SandboxError(f"no sandbox at {self.state_dir} (run `up` first)")
        return spec

    # -- down ---------------------------------------------------------------------------------

    def down(self, keep_state_dir: bool = False) -> None:
        """Cancel the sandbox's jobs, remove its containers, stop every daemon `up` started
        (SIGTERM together, SIGKILL after a deadline) and remove the state dir (unless
        `keep_state_dir`: a failed `up` keeps its logs)."""
        if not os.path.isdir(self.state_dir):
            return
        if not files.looks_like_sandbox(self.layout):
            raise SandboxError(f"{self.state_dir} is not a sandbox state dir (no sandbox.json); "
                               "refusing to remove it")
        with files.locked(self.layout, create=False) as have_lock:
            if not have_lock:
                return
            entries = self._registry.load()
            live = {n: e for n, e in entries.items() if is_ours(e)}
            if "dockerd" in live:
                self._remove_containers()
            if "slurmctld" in live:
                daemons.cancel_all_jobs(self.layout, JOB_DRAIN_TIMEOUT_S)
            left = terminate(live.values())
            # What outlived its daemon: slurmstepd, containerd and shims (they carry our
            # marker), and job processes that escaped proctrack/linuxproc.
            strays = owned_processes(self.state_dir) + job_processes(self.layout.slurm_conf)
            left += kill_pids(strays, term_timeout_s=5.0)
            # Children the daemons forked while they stopped (a last slurmstepd): `down`
            # returns only once nothing of the sandbox runs.
            late = owned_processes(self.state_dir) + job_processes(self.layout.slurm_conf)
            left += kill_pids(late, term_timeout_s=5.0) if late else []
            saved = files.read_spec(self.layout) or self.spec
            kept = users.remove(self.layout, saved.port_offset)
            if not keep_state_dir:
                files.remove_state_dir(self.layout)
        if left:
            raise SandboxError(f"processes survived SIGKILL: {left}")
        if kept:
            raise SandboxError(f"could not delete the sandbox's users: {'; '.join(kept)}")

    def _remove_containers(self) -> None:
        try:
            probes.docker_remove_all(self.layout.docker_socket)
        except (OSError, SandboxError):
            pass  # dockerd stops below; its containers go with it
