"""Where everything lives: every path of a sandbox, all under one state directory.

    <state>/sandbox.json  pids.json  lock  env.sh  jwt.token (0600)
            etc/slurm.conf gres.conf epilog.sh     (world-readable: slurmrestd runs as nobody)
            etc/enter.sh cgroup.conf bin/<client>  with a release in a root (roots.py)
            munge/  ctld/ (StateSaveLocation, jwt key)  spool/<node>/  run/  log/
            fakegpu/<node>/nvidiaK -> /dev/null     docker/ (socket, data, exec)
            users.json  home/<user>/ (0700)  shared/ (0755)      with --users N
            etc/plugstack.conf enroot-ns.sh  lib/spank_pyxis.so  enroot/bin/enroot  pyxis/ (runtime)
            enroot/local/{run,cache,data}/<user>/  the login node's enroot storage; in each
            enroot/nodes/<node>/...                slurmd's namespace, bound over local/
                                                                 (all with --pyxis)
            ssh/sshd_config ssh_host_ed25519_key known_hosts config keys/<user>/  (--login)
"""

from __future__ import annotations

import os
from dataclasses import dataclass

_MAX_SOCKET_PATH = 100  # sun_path is 108 bytes, keep a margin


@dataclass(frozen=True)
class Layout:
    """Every path the sandbox uses, all under one state directory."""

    root: str

    def __post_init__(self) -> None:
        if not os.path.isabs(self.root):
            raise ValueError(f"state dir must be an absolute path, got {self.root!r}")
        longest = max(self.munge_socket, self.docker_socket, key=len)
        if len(longest) > _MAX_SOCKET_PATH:
            raise ValueError(f"state dir {self.root!r} is too long for a unix socket path")

    def _p(self, *parts: str) -> str:
        return os.path.join(self.root, *parts)

    # files the sandbox itself keeps
    @property
    def spec_file(self) -> str:
        return self._p("sandbox.json")

    @property
    def pids_file(self) -> str:
        return self._p("pids.json")

    @property
    def lock_file(self) -> str:
        return self._p("lock")

    @property
    def env_file(self) -> str:
        return self._p("env.sh")

    @property
    def token_file(self) -> str:
        return self._p("jwt.token")

    @property
    def users_file(self) -> str:
        return self._p("users.json")

    # directories
    @property
    def etc_dir(self) -> str:
        return self._p("etc")

    @property
    def munge_dir(self) -> str:
        return self._p("munge")

    @property
    def ctld_dir(self) -> str:
        return self._p("ctld")

    @property
    def spool_dir(self) -> str:
        return self._p("spool")

    @property
    def run_dir(self) -> str:
        return self._p("run")

    @property
    def log_dir(self) -> str:
        return self._p("log")

    @property
    def fakegpu_dir(self) -> str:
        return self._p("fakegpu")

    @property
    def docker_dir(self) -> str:
        return self._p("docker")

    @property
    def home_dir(self) -> str:
        """Parent of the throwaway users' homes (a site's /home)."""
        return self._p("home")

    @property
    def shared_dir(self) -> str:
        """Software every throwaway user runs, installed by root (a site's /apps)."""
        return self._p("shared")

    @property
    def bin_dir(self) -> str:
        """Client wrappers of a release that lives in a root (first on the sandbox's PATH)."""
        return self._p("bin")

    @property
    def enroot_dir(self) -> str:
        """Enroot's wrapper and node-local storage (with --pyxis)."""
        return self._p("enroot")

    @property
    def enroot_bin_dir(self) -> str:
        """The ``enroot`` wrapper, first on slurmd's PATH and in env.sh (with --pyxis)."""
        return self._p("enroot", "bin")

    @property
    def enroot_local_dir(self) -> str:
        """Enroot's node-local storage: the login node's own on the host; in each slurmd's
        mount namespace its node's dir is bound over it (with --pyxis)."""
        return self._p("enroot", "local")

    def enroot_node_dir(self, node: str) -> str:
        return self._p("enroot", "nodes", node)

    @property
    def pyxis_runtime_dir(self) -> str:
        return self._p("pyxis")

    # individual files
    @property
    def plugstack_conf(self) -> str:
        return self._p("etc", "plugstack.conf")

    @property
    def pyxis_plugin(self) -> str:
        """The state dir's copy of the cached pyxis plugin (with --pyxis), outside etc/ as a
        site's is: a Ray node's container gets it only as the agent binds the SPANK stack."""
        return self._p("lib", "spank_pyxis.so")

    @property
    def node_entry_script(self) -> str:
        """slurmd's entry into its mount namespace with the sandbox's enroot (--pyxis)."""
        return self._p("etc", "enroot-ns.sh")

    @property
    def enter_script(self) -> str:
        return self._p("etc", "enter.sh")

    @property
    def cgroup_conf(self) -> str:
        return self._p("etc", "cgroup.conf")

    @property
    def slurm_conf(self) -> str:
        return self._p("etc", "slurm.conf")

    @property
    def gres_conf(self) -> str:
        return self._p("etc", "gres.conf")

    @property
    def epilog(self) -> str:
        return self._p("etc", "epilog.sh")

    @property
    def munge_key(self) -> str:
        return self._p("munge", "munge.key")

    @property
    def munge_socket(self) -> str:
        return self._p("munge", "munge.socket")

    @property
    def jwt_key(self) -> str:
        return self._p("ctld", "jwt_hs256.key")

    @property
    def docker_socket(self) -> str:
        return self._p("docker", "docker.sock")

    @property
    def docker_host(self) -> str:
        return f"unix://{self.docker_socket}"

    def log(self, name: str) -> str:
        """Log file for a daemon's own stdout/stderr ("slurmd:n1" -> log/slurmd-n1.out)."""
        return self._p("log", name.replace(":", "-") + ".out")

    def fake_gpu_dir(self, node: str) -> str:
        return self._p("fakegpu", node)
