"""The command runner: `ray up/exec/attach/submit/rsync/dashboard` without SSH.

Commands run on the node with `srun --jobid=<job> --overlap` (on a gang member's own node of
its job), i.e. as a step of the node's own job: Slurm authenticates the user with munge, no
SSH keys are needed, and the step can only see that job's allocation. Never run as a step:

* `ray start`: it is handed to the node agent in the batch step (handoff.py), so Ray lives
  and dies with the job instead of being orphaned by (or killed with) a step;
* `ray stop`: it would kill every Ray process of the user on that node, other clusters
  included; it becomes "stop this job's Ray", and `shutdown` becomes `scancel` of this job.

File transfers use the shared filesystem (transfer.py); the provider is seen through
`ProviderView`.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import Any, NoReturn, Protocol

import click
from ray.autoscaler.command_runner import CommandRunnerInterface
from ray.autoscaler.tags import NODE_KIND_HEAD, TAG_RAY_NODE_KIND, TAG_RAY_USER_NODE_TYPE

from ray_slurm_provider import auth, proc, shellcmd
from ray_slurm_provider.config import NodeConfig, ProviderConfig
from ray_slurm_provider.jobs import temp_dir
from ray_slurm_provider.nodespec import split
from ray_slurm_provider.provider import handoff, transfer
from ray_slurm_provider.provider.forward import forward_all
from ray_slurm_provider.provider.handoff import runner_error
from ray_slurm_provider.runtimes import RunContext, Runtime, get_runtime
from ray_slurm_provider.slurm.client import TransientSlurmError
from ray_slurm_provider.state import ClusterDir, HeadInfo, poll_interval
from ray_slurm_provider.units import fmt_duration

DEFAULT_DASHBOARD_PORT = 8265


class ProviderView(Protocol):
    """What the runner needs of the provider (SlurmNodeProvider is one)."""

    @property
    def cluster_name(self) -> str: ...
    @property
    def cluster_dir(self) -> ClusterDir: ...
    @property
    def pcfg(self) -> ProviderConfig: ...
    def node_tags(self, node_id: str) -> dict[str, str]: ...
    def non_terminated_nodes(self, tag_filters: dict[str, str]) -> list[str]: ...
    def describe_job(self, node_id: str) -> str: ...
    def is_terminated(self, node_id: str) -> bool: ...
    def terminate_node(self, node_id: str) -> object: ...
    def node_config(self, node_type: str) -> NodeConfig: ...


class NodeNotReady(Exception):
    """The node's job is not running yet; Ray's NodeUpdater retries on any exception."""


class SrunCommandRunner(CommandRunnerInterface):
    def __init__(self, provider: ProviderView, node_id: str, log_prefix: str = "") -> None:
        self.provider = provider
        self.node_id = node_id
        self.log_prefix = log_prefix
        self.cdir = provider.cluster_dir
        self.ndir = self.cdir.node(node_id)
        self._clock: Callable[[], float] = time.monotonic
        self._sleep: Callable[[float], None] = time.sleep

    # --- helpers ------------------------------------------------------------------------
    def _fail(self, msg: str, code: int | None, cmd: str, exit_on_fail: bool) -> NoReturn:
        if exit_on_fail:
            raise click.ClickException(f"{msg}: {cmd}")
        raise runner_error(msg, code, cmd)

    def _check_alive(self, wait_s: float = 0.0, *, queued_head: bool = False) -> None:
        """A step can only run once the job runs and its agent is up. Waits up to `wait_s`
        (so `ray up` notices a started job within a fraction of a second instead of its
        5 s retry period), refreshing Slurm's view every few seconds. For `ray up`'s first
        look at the head (`queued_head`), waits `provider.head_wait_s` in this one call
        (Ray's own wait ends after 15 minutes), saying why, and then cancels the job."""
        start = self._clock()
        if queued_head:
            wait_s = max(wait_s, self.provider.pcfg.head_wait_s)
        next_query = next_note = 0.0
        while not self.ndir.agent_up():
            now = self._clock()
            if now >= start + wait_s:
                break
            if now >= next_query:
                if self._job_gone():
                    break
                next_query = now + 3.0
            if queued_head and now >= next_note:
                print(f"{self.log_prefix}{self.provider.describe_job(self.node_id)}; waited "
                      f"{fmt_duration(int(now - start))} of {fmt_duration(int(wait_s))} "
                      "(provider.head_wait_s)", flush=True)
                next_note = now + 60.0
            self._sleep(poll_interval(now - start))
        else:
            return
        what = self.provider.describe_job(self.node_id)
        if queued_head and not self.provider.is_terminated(self.node_id):
            self.provider.terminate_node(self.node_id)
            raise NodeNotReady(f"{what}, after a wait of {fmt_duration(int(wait_s))}; cancelled "
                               "it so that it cannot start later and hold an allocation "
                               "nobody uses (wait longer: provider.head_wait_s)")
        raise NodeNotReady(what)

    def _head(self) -> bool:
        return self.provider.node_tags(self.node_id).get(TAG_RAY_NODE_KIND) == NODE_KIND_HEAD

    def srun_argv(self, shell_cmd: str, pty: bool = False,
                  in_container: bool = False) -> list[str]:
        argv = ["srun", f"--jobid={self.job_id()}", "--overlap", "--nodes=1", "--ntasks=1",
                "--quiet"]
        agent = self.ndir.read_agent() if self.member else None
        if agent and agent.host:  # a gang member: its own node of the job (gangs.py)
            argv.append(f"--nodelist={agent.host}")
        if pty:
            argv.append("--pty")
        inner = ["bash", "-c", shell_cmd]
        ctx = self.container() if in_container else None
        if ctx is None:
            return [*argv, *inner]
        rt, rctx = ctx
        return [*argv, *rt.step_options(rctx), *rt.exec(rctx, inner, interactive=pty)]

    def job_id(self) -> str:
        """The numeric id (22.05's srun refuses an array task's `123_4`): agent.json's."""
        agent = self.ndir.read_agent() if not self.node_id.isdigit() else None
        return agent.job_id if agent and agent.job_id else split(self.node_id)[0]

    @property
    def member(self) -> str:
        """The node's index in a gang job, or "" (nodespec.split)."""
        return str(split(self.node_id)[1]) if split(self.node_id)[1] is not None else ""

    def container(self) -> tuple[Runtime, RunContext] | None:
        """The runtime and context of this node's container, or None without one."""
        node_type = self.provider.node_tags(self.node_id).get(TAG_RAY_USER_NODE_TYPE, "")
        ncfg = self.provider.node_config(node_type)
        if ncfg.container.runtime == "none":
            return None
        pcfg = self.provider.pcfg
        job_id = self.job_id()
        # The agent's record: a daemonless runtime starts a second container, which needs
        # the node container's own binds, GPUs and PATH (only the agent in the job knows them).
        agent = self.ndir.read_agent()
        tmp = agent.temp_dir if agent and agent.temp_dir else temp_dir(
            pcfg.temp_dir_root, f"{job_id}.{self.member}" if self.member else job_id)
        rctx = RunContext(self.provider.cluster_name, job_id, ncfg.container, tmp,
                          str(self.cdir.root), tuple(agent.container_gpus) if agent else (),
                          pcfg.drain_timeout_s, tuple(agent.container_mounts) if agent else (),
                          path=agent.container_path if agent else "", member=self.member)
        return get_runtime(ncfg.container.runtime), rctx

    def step_env(self) -> dict[str, str]:
        # srun inside another job (the head's autoscaler) must not inherit that job's
        # SLURM_* variables; the Ray tools the step runs need the cluster's auth settings.
        token = self.cdir.root / auth.TOKEN_FILE
        a = auth.auth_env(self.provider.pcfg.auth.mode, token)
        head = self.cdir.read_head()
        extra = dict(a)
        if head:
            extra["RAY_ADDRESS"] = f"{head.ip}:{head.gcs_port}"
        return proc.clean_env(drop_prefixes=("SLURM_", "SBATCH_", "SRUN_", "SALLOC_"),
                              keep=("SLURM_CONF",), extra=extra)

    # --- CommandRunnerInterface ---------------------------------------------------------
    def run(
        self,
        cmd: str | None = None,
        timeout: int = 120,
        exit_on_fail: bool = False,
        port_forward: list[tuple[int, int]] | None = None,
        with_output: bool = False,
        environment_variables: dict[str, object] | None = None,
        run_env: str = "auto",
        ssh_options_override_ssh_key: str = "",
        shutdown_after_run: bool = False,
    ) -> Any:
        fwd = []
        if port_forward:
            head = self.cdir.read_head()
            if not head:
                self._fail("the head's Ray is not up, nothing to forward to", None,
                           str(port_forward), exit_on_fail)
            # The dashboard port the head really took (its block may have moved: ports.py).
            fwd = forward_all(port_forward, head.ip, self.moved_ports(head))
            for f in fwd:
                print(f"Forwarding 127.0.0.1:{f.local_port} -> {f.host}:{f.remote_port}")
        try:
            if cmd is None:
                print("Press Ctrl-C to stop forwarding.")
                while True:
                    time.sleep(3600)
            return self._run(cmd, timeout, exit_on_fail, with_output,
                             environment_variables, shutdown_after_run, run_env)
        finally:
            for f in fwd:
                f.stop()

    def _run(self, cmd: str, timeout: int, exit_on_fail: bool, with_output: bool,
             env: dict[str, object] | None, shutdown_after_run: bool, run_env: str) -> Any:
        prog = shellcmd.parse(cmd)
        if prog.ray_start is not None:
            self.handoff(prog, env, timeout)
            return b"" if with_output else 0
        special = prog.ray_stop or prog.shutdown
        if prog.ray_stop:
            handoff.stop_ray(self.ndir)
        out: Any = b"" if with_output else 0
        rest = " && ".join(prog.rest) if special else cmd
        if rest.strip():
            # Ray's rule: "auto" means inside the container unless the command drives the
            # container runtime itself.
            inside = run_env == "docker" or (
                run_env == "auto" and not rest.lstrip().startswith(("docker ", "podman ")))
            out = self.run_step(shellcmd.env_exports(env) + rest, timeout, exit_on_fail,
                                with_output, in_container=inside)
        if prog.shutdown or shutdown_after_run:
            self.provider.terminate_node(self.node_id)
        return out

    def run_step(self, shell_cmd: str, timeout: int, exit_on_fail: bool,
                 with_output: bool, in_container: bool = False) -> Any:
        probe = shell_cmd.strip() == "uptime"  # Ray's readiness probe
        self._check_alive(wait_s=timeout if probe else 0.0, queued_head=probe and self._head())
        if probe and not exit_on_fail and not with_output:
            # Ray's readiness test: the agent in the batch step is the node being up; an srun
            # step would only add its own start-up to `ray up`. (`ray exec` sets exit_on_fail.)
            return 0
        pty = not with_output and sys.stdin.isatty() and sys.stdout.isatty()
        argv = self.srun_argv(shell_cmd, pty=pty, in_container=in_container)
        try:
            if with_output:
                res = proc.run(argv, env=self.step_env(), timeout=max(timeout, 60), check=False)
                if res.returncode != 0:
                    sys.stderr.write(res.stderr)
                    self._fail("Command failed", res.returncode, shell_cmd, exit_on_fail)
                return res.stdout.encode()
            # Interactive and long commands (attach, exec, submit) get no time limit.
            code = proc.run_attached(argv, env=self.step_env())
        except proc.CommandError as e:
            self._fail(str(e), e.returncode, shell_cmd, exit_on_fail)
        if code != 0:
            self._fail("Command failed", code, shell_cmd, exit_on_fail)
        return code

    def handoff(self, prog: shellcmd.Program, env: dict[str, object] | None,
                timeout: int) -> None:
        """Give `ray start` to the head's agent and wait for Ray to come up."""
        self._check_alive()
        req_id = handoff.request_start(self.ndir, prog, env)
        print(f"{self.log_prefix}Starting Ray in the batch step of Slurm job {self.node_id}")
        handoff.wait_started(self.ndir, req_id, timeout=max(timeout, 600), node_id=self.node_id,
                             log=self.cdir.log(self.node_id), job_gone=self._job_gone)
        handoff.announce(self.cdir, self.node_id, self.provider.pcfg.temp_dir_root,
                         self.log_prefix)

    def _job_gone(self) -> bool:
        """Whether the node's job has left Slurm; a listing Slurm could not answer says
        nothing (the wait goes on, within its deadline)."""
        try:
            self.provider.non_terminated_nodes({})
        except TransientSlurmError as e:
            print(f"{self.log_prefix}Slurm did not answer ({e.slurm_message}); still waiting")
            return False
        return self.provider.is_terminated(self.node_id)

    def run_rsync_up(self, source: str, target: str, options: Any = None) -> None:
        dst = transfer.remote_path(self.cdir, target)
        if dst == str(self.cdir.bootstrap_config):
            transfer.copy_bootstrap_config(source, dst)
        else:
            transfer.copy(source, dst)

    @staticmethod
    def moved_ports(head: HeadInfo) -> dict[int, int]:
        """Ray's default ports a forward asks for, as this head took them (its block may
        have moved: ports.py)."""
        return {DEFAULT_DASHBOARD_PORT: head.dashboard_port}

    def run_rsync_down(self, source: str, target: str, options: Any = None) -> None:
        transfer.copy(transfer.remote_path(self.cdir, source), os.path.expanduser(target))

    def remote_shell_command_str(self) -> str:
        return " ".join(self.srun_argv("bash", pty=True)[:-2]) + " bash\n"

    def run_init(self, *, as_head: bool, file_mounts: dict[str, str],
                 sync_run_yet: bool) -> bool | None:
        return None

