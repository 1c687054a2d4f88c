"""The node agent's core: what the head and the worker share (worker.py, head.py).

`python -m ray_slurm_provider.agent --spec '<json>'` is the last line of every job script.
Running Ray under the batch step (with `ray start --block`) ties the Ray node's life to the
job's: `scancel`, the time limit or a node failure end Ray, and Ray ending ends the job, so no
job lingers without a Ray node and no Ray node outlives its job.

The agent reports through the cluster directory (state.py): `agent.json` once it runs,
`ray.json` (and on the head `head.json`) while Ray is up. It asks Slurm (the cluster's client)
only for its node's address and, with a container, which of the cluster's jobs still run.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any, TypeVar

from ray_slurm_provider import proc, shellcmd
from ray_slurm_provider.agent.container import NodeContainer
from ray_slurm_provider.agent.netaddr import node_ip
from ray_slurm_provider.agent.raystart import ray_start_argv
from ray_slurm_provider.agent.tempdir import finish, job_dir, sweep
from ray_slurm_provider.config import ProviderConfig
from ray_slurm_provider.jobs import job_name, temp_dir
from ray_slurm_provider.nodespec import NodeSpec, node_id
from ray_slurm_provider.retry import exponential
from ray_slurm_provider.schema import load
from ray_slurm_provider.slurm.client import SlurmClient, SlurmError, ask
from ray_slurm_provider.slurm.factory import make_client
from ray_slurm_provider.state import AgentInfo, ClusterDir, HeadInfo, RayUp

STARTED_MARKER = "Ray runtime started"
#: Between the tries of a `ray start` that failed (worker.py, head.py): 2, 4, 8, 16, 30 s.
START_BACKOFF = exponential(2.0, cap_s=30.0)
SETUP_TIMEOUT_S = 3600.0  # one setup command (pip install, a module load)

T = TypeVar("T")


def log(msg: str) -> None:
    print(f"[ray-slurm {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def slurm_client(spec: NodeSpec) -> SlurmClient:
    """The Slurm client of the cluster's `provider.slurm_api` (never talks to Slurm yet)."""
    return make_client(load(ProviderConfig, {"slurm_api": spec.slurm_api, "rest": spec.rest},
                            "provider"))


class Stopping(RuntimeError):
    """The job was told to stop (TERM) before this step: the role ends without Ray."""


class Agent:
    """One job's agent; a role (HeadAgent, WorkerAgent) implements `run`."""

    def __init__(self, spec: NodeSpec, env: dict[str, str]) -> None:
        self.spec = spec
        self.env = env
        self.job_id = env["SLURM_JOB_ID"]  # numeric: container names, temp dir, srun
        self.node_id = node_id(env, spec.group_size)  # listed: state dir, Ray's instance id
        self.cdir = ClusterDir(spec.state_dir, spec.cluster_name)
        self.ndir = self.cdir.node(self.node_id)
        self.slurm = slurm_client(spec)
        self.child: Any = None  # `ray start --block`
        self.step: Any = None  # the setup command running now
        self._ip: str | None = None
        self.head_job: str | None = None  # the head's job id this worker joined
        self.terminating = False
        self.stop_reason: str | None = None  # why the job was told to stop, if not a signal
        self.was_up = False  # Ray came up here at least once
        # Set once the TERM has been acted on (the terminator thread); waits end on it.
        self._stopped = threading.Event()
        wake = os.pipe()  # a signal handler writes a byte to wake a wait (self-pipe)
        self._wake_r = wake[0]
        self._wake_w = wake[1]
        # Per job, or per member of a gang job (two may share a host: the sandbox's nodes do).
        self.temp_dir = temp_dir(spec.temp_dir_root, self.job_id if spec.group_size == 1 else
                                 f"{self.job_id}.{env['SLURM_NODEID']}")
        self.temp_ready = False  # the temp dir is this user's own: cleanup may read, remove it
        self.temp_private = False  # below the private parent `rsp-<uid>` (agent/tempdir.py)
        self.container = NodeContainer.from_spec(
            spec.container, cluster_name=spec.cluster_name, job_id=self.job_id,
            temp_dir=self.temp_dir, cluster_dir=str(self.cdir.root), env=env,
            drain_timeout_s=spec.drain_timeout_s, head=spec.kind == "head",
            env_names=spec.env_names, log=log,
            member=env.get("SLURM_NODEID", "") if spec.group_size > 1 else "")

    def run(self) -> int:
        """The role: start Ray and keep it; the job's exit code."""
        raise NotImplementedError

    # --- plumbing -------------------------------------------------------------------------
    def node_ip(self) -> str:
        """This node's address (asked once: it does not change while the job runs)."""
        if self._ip is None:
            self._ip = node_ip(self.env, self.spec.node_ip_interface, self.slurm,
                               pause=self.pause)
        return self._ip

    def on_signal(self, signum: int, _frame: Any) -> None:
        """The TERM/INT handler: a flag and one byte to the terminator thread, nothing else
        (printing or reading files here can deadlock or raise inside the main thread's own
        I/O). Setup steps and back-offs check the flag, so Ray never starts after it."""
        self.terminating = True
        os.write(self._wake_w, bytes([signum & 0xFF]))

    def _terminator(self) -> None:
        while True:
            signum = os.read(self._wake_r, 1)
            if not signum:
                return
            self.on_term(signum[0], None)

    def pause(self, seconds: float) -> None:
        """A back-off that ends early when the job is told to stop."""
        self._stopped.wait(seconds)

    def ask(self, what: str, call: Callable[[], T]) -> T:
        """`call()`, asked again while Slurm does not answer in time (slurm.client.ask); the
        waits end early when the job is told to stop."""
        return ask(what, call, say=log, sleep=self.pause)

    def on_term(self, signum: int, _frame: Any) -> None:
        """Stop this job's Ray (and its container): the terminator thread, or the head watch."""
        self.terminating = True
        self._stopped.set()
        step = self.step
        if step is not None and step.poll() is None:  # a setup command: Ray never starts
            proc.kill_tree(step.pid, signal.SIGTERM)
        if self.child is not None and self.child.poll() is None:
            if self.head_going():
                # Ray's drain would wait for a GCS that is gone (`ray down`: the head stops
                # first) until Slurm's SIGKILL.
                log(f"signal {signum}: the head is gone; stopping Ray without draining")
                proc.kill_tree(self.child.pid)
            else:
                log(f"signal {signum}: stopping Ray (drain up to {self.spec.drain_timeout_s}s)")
                self.child.send_signal(signal.SIGTERM)
        if self.container is not None:
            # The container is the daemon's child, not ours: stop it within KillWait.
            self.container.stop_async()

    def head_going(self) -> bool:
        """A worker outside a container whose head is gone or being cancelled (`ray down`)."""
        if self.spec.kind != "worker" or self.container is not None:
            return False
        head = self.cdir.read_head()
        return self.cdir.teardown_marked() or (head.job_id if head else None) != self.head_job

    def ray_ended(self, code: int) -> str:
        """What the log says once Ray has exited: a stop the job was told of is no failure
        (`ray start --block` exits with 1 after the TERM)."""
        if not self.terminating:
            return f"Ray exited with code {code}"
        return f"Ray stopped: {self.stop_reason or self.signal_reason()}"

    def signal_reason(self) -> str:
        """Why Slurm sent the TERM: its time limit, or the drain before it (where Slurm gives
        the job its end time, SLURM_JOB_END_TIME), else a cancel."""
        end = self.env.get("SLURM_JOB_END_TIME", "")
        left = int(end) - time.time() if end.isdigit() else math.inf
        # `--signal=B:TERM@<s>` comes up to a minute early (Slurm's event resolution).
        drain = self.spec.drain_before_limit_s
        if drain and 0 < left <= drain + 60:
            return (f"the job is {max(1, round(left / 60))} min from its time limit "
                    f"(drain_before_limit_s: {drain})")
        if left <= 60:  # Slurm's TERM at the limit comes on time
            return "the job reached its time limit"
        cancelled = "the job was cancelled (terminated by the autoscaler, scancel or `ray down`)"
        if self.spec.group_size > 1:  # srun also ends every member when one fails
            return f"{cancelled}, or another member of its gang ended"
        return cancelled

    def stopping(self) -> bool:
        """`terminating`, read again: the terminator thread sets it at any moment."""
        return self.terminating

    def run_ray(self, argv: list[str], env: dict[str, str], on_started: Any) -> int:
        """Run `ray start --block`; stream its output; call on_started once Ray is up."""
        if self.container is not None:
            self.container.clear()  # a previous run's container of this job, if any
        if self.terminating:
            raise Stopping("told to stop before Ray started")
        log("starting: " + " ".join(argv))
        # A session of its own: the workers of a raylet that was killed are orphans, and
        # only their session still ties them to this job's Ray (end_leftovers).
        self.child = proc.start(argv, env=env, new_session=True)
        if self.stopping():  # the TERM came while it started: on_term saw no child yet
            self.child.send_signal(signal.SIGTERM)
        eof = threading.Event()
        # A TERM mid-start ends `ray start` but not the daemons it has started.
        threading.Thread(target=proc.end_orphans, args=(self.child, eof, self._orphans),
                         daemon=True).start()
        assert self.child.stdout is not None
        for line in self.child.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            if STARTED_MARKER in line:
                on_started()
        eof.set()
        code = int(self.child.wait())
        self.end_leftovers(self.child.pid)
        self.child = None
        return code

    def end_leftovers(self, session: int) -> None:
        """End what Ray left in its session once `ray start` has exited. A worker still
        running writes its log in the temp dir that cleanup removes next, and Ray fails its
        task with FileNotFoundError, an error no retry covers."""
        left = proc.end_session(session)
        if left:
            log(f"ended {len(left)} process(es) Ray left behind: {left}")

    def _orphans(self, pids: list[int]) -> None:
        log(f"ending {len(pids)} process(es) `ray start` left behind: {pids}")

    def run_before(self, cmds: list[str], env: dict[str, str]) -> None:
        for c in cmds:
            if self.terminating:
                raise Stopping(f"told to stop before: {c}")
            log(f"running: {c}")
            # Started, not run: a TERM meanwhile ends it (on_term), not Slurm's SIGKILL later.
            step = self.step = proc.start(["bash", "-c", c], env=env)
            if self.stopping():  # the TERM came while it started: on_term saw no step yet
                proc.kill_tree(step.pid, signal.SIGTERM)
            limit = threading.Timer(SETUP_TIMEOUT_S, step.kill)
            limit.start()
            try:
                assert step.stdout is not None
                for line in step.stdout:
                    sys.stdout.write(line)
                code = step.wait()
            finally:
                limit.cancel()
                self.step = None
            if self.terminating:
                raise Stopping(f"told to stop while running: {c}")
            if code != 0:
                raise RuntimeError(f"command failed with exit code {code}: {c}")

    def build(self, prog: shellcmd.Program, extra_env: dict[str, str]) -> tuple[
        list[str], dict[str, str]
    ]:
        ip = self.node_ip()
        head = self.cdir.read_head() if self.spec.kind == "worker" else None
        if self.spec.kind == "worker" and not head:
            raise RuntimeError(f"no running head found ({self.cdir.head_file} missing)")
        head_ip = ip if head is None else head.ip
        self.head_job = head.job_id if head else None
        # Ray's per-node overrides come only from this node's own start request.
        inherited = {k: v for k, v in self.env.items()
                     if k not in ("RAY_OVERRIDE_RESOURCES", "RAY_OVERRIDE_LABELS")}
        argv, env = ray_start_argv(
            self.spec, prog, env={**inherited, **extra_env}, job_id=self.node_id, node_ip=ip,
            head_ip=head_ip, temp_dir=self.temp_dir, cluster_dir=self.cdir,
            head_port=head.gcs_port if head else None,
        )
        if self.container is not None:
            return self.container.wrap(argv, env, prefix=prog.prefix)
        return shellcmd.in_shell(prog.prefix, argv), env

    def mark_started(self, argv: list[str], env: dict[str, str]) -> None:
        self.was_up = True
        ip = shellcmd.get_flag(argv, "--node-ip-address") or ""
        self.ndir.write_ray_up(RayUp(ip=ip, job_id=self.job_id))
        if self.spec.kind == "head":
            self.cdir.write_head(HeadInfo(
                job_id=self.job_id, ip=ip,
                gcs_port=int(shellcmd.get_flag(argv, "--port") or "6379"),
                dashboard_port=int(shellcmd.get_flag(argv, "--dashboard-port") or 8265),
                client_port=int(shellcmd.get_flag(argv, "--ray-client-server-port") or 10001),
            ))
        log(f"Ray is up on {ip} (node {self.node_id}, job {self.job_id}, node type "
            f"{self.spec.node_type})")
        if self.spec.kind == "head" and self.container is not None \
                and self.container.cfg.slurm_access == "mount":
            threading.Thread(target=self.container.check_slurm, daemon=True,
                             args=(str(self.cdir.root), self.spec.cluster_name)).start()

    def unmark(self) -> None:
        """Ray is no longer up here."""
        self.ndir.clear_ray_up()
        if self.spec.kind == "head":
            self.cdir.clear_head(self.job_id)  # unless a newer head took over

    def cleanup(self) -> None:
        self.unmark()
        if self.container is not None:
            self.container.remove()
        if self.temp_ready:  # else it may be another user's (agent/tempdir.py): left alone
            finish(self.temp_dir, self.cdir.ray_logs(self.node_id),
                   self.spec.ray_logs_max_mb << 20, log)

    def prepare_container(self) -> None:
        """Load the image and sweep containers of this cluster whose job is gone."""
        if self.container is None:
            return
        self.container.prepare()

        def active() -> set[str]:
            jobs = self.slurm.list_jobs(job_name(self.spec.cluster_name))
            # Containers carry the numeric SLURM_JOB_ID (as the site epilog sees it). A job
            # still COMPLETING is draining: its container is not the sweep's to remove.
            return {j.numeric_id for j in jobs if j.active or j.state == "COMPLETING"}

        try:
            self.container.sweep(active)
        except (proc.CommandError, OSError, SlurmError) as e:
            log(f"could not sweep old containers: {e}")

    def make_temp_dir(self) -> str | None:
        """Take the job's Ray temp dir (tempdir.job_dir); None, or why it cannot be had."""
        try:
            self.temp_dir, self.temp_private = job_dir(self.temp_dir, log)
        except RuntimeError as e:
            return str(e)
        self.temp_ready = True
        if self.container is not None:  # it binds the dir actually used
            self.container.ctx = replace(self.container.ctx, temp_dir=self.temp_dir)
        return None

    def main(self) -> int:
        threading.Thread(target=self._terminator, daemon=True, name="terminator").start()
        signal.signal(signal.SIGTERM, self.on_signal)
        signal.signal(signal.SIGINT, self.on_signal)
        error = self.make_temp_dir()
        info = AgentInfo(host=self.env.get("SLURMD_NODENAME", ""), pid=os.getpid(),
                         kind=self.spec.kind, job_id=self.job_id,
                         temp_dir=self.temp_dir if self.temp_ready else "")
        try:
            self.ndir.write_agent(self.container.recorded(info) if self.container else info)
            if self.temp_private:  # a fallback's parent may be another user's: never swept
                sweep(self.temp_dir, self.slurm, log)
            try:
                if error is not None:
                    raise RuntimeError(error)
                self.prepare_container()
            except RuntimeError as e:
                log(f"ERROR: {e}; the job ends")
                return 1
            return self.run()
        finally:
            self.cleanup()
