"""The node agent: runs in every job's batch step and keeps Ray there.

`python -m ray_slurm_provider.agent --spec '<json>'` is the last line of every job script.
Running Ray under the batch step (with `ray start --block`) ties the Ray node's life to the
job's: `scancel`, the time limit or a node failure end Ray, and Ray ending ends the job, so no
job lingers without a Ray node and no Ray node outlives its job.

* worker: builds `ray start` from the node type's `worker_start_ray_commands`, adds what
  Slurm allocated (CPUs, GPUs, memory, the node's address) and the cluster's ports, and
  retries a failed start before ending the job with a clear log line.
* head: `ray up` cannot be told "the head starts itself", so it runs the head's start
  commands through our command runner, which hands them over here (`start.json`); the agent
  starts Ray in the batch step and reports back (`result.json`). A later `ray up` hands over
  again and the agent restarts Ray in place; `ray stop` stops only this job's Ray.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import threading
import time
from typing import Any

from ray_slurm_provider import proc, shellcmd
from ray_slurm_provider.agent import headwatch
from ray_slurm_provider.agent.container import NodeContainer
from ray_slurm_provider.agent.netaddr import node_ip
from ray_slurm_provider.agent.raystart import ray_start_argv
from ray_slurm_provider.config import ProviderConfig, load
from ray_slurm_provider.jobs import job_name, temp_dir
from ray_slurm_provider.nodespec import NodeSpec, log, node_id, wait_port_free
from ray_slurm_provider.slurm.client import SlurmClient, SlurmError
from ray_slurm_provider.slurm.factory import make_client
from ray_slurm_provider.state import (
    AgentInfo,
    ClusterDir,
    HeadInfo,
    RayUp,
    StartRequest,
    StartResult,
)

STARTED_MARKER = "Ray runtime started"


def slurm_client(spec: NodeSpec) -> SlurmClient:
    """The Slurm client of the cluster's `provider.slurm_api` (never talks to Slurm yet)."""
    return make_client(load(ProviderConfig, {"slurm_api": spec.slurm_api, "rest": spec.rest},
                            "provider"))


class Agent:
    def __init__(self, spec: NodeSpec, env: dict[str, str]) -> None:
        self.spec = spec
        self.env = env
        self.job_id = env["SLURM_JOB_ID"]  # numeric: container names, temp dir, srun
        self.node_id = node_id(env)  # what the provider lists: the state dir, Ray's instance id
        self.cdir = ClusterDir(spec.state_dir, spec.cluster_name)
        self.ndir = self.cdir.node(self.node_id)
        self.slurm = slurm_client(spec)
        self.child: Any = None
        self.head_job: str | None = None  # the head's job id this worker joined
        self.terminating = False
        self.interrupted = False
        self.temp_dir = temp_dir(spec.temp_dir_root, self.job_id)
        self.container = NodeContainer.from_spec(
            spec.container, cluster_name=spec.cluster_name, job_id=self.job_id,
            temp_dir=self.temp_dir, cluster_dir=str(self.cdir.root), env=env,
            drain_timeout_s=spec.drain_timeout_s, head=spec.kind == "head",
            env_names=spec.env_names, log=log)

    # --- plumbing -------------------------------------------------------------------------
    def node_ip(self) -> str:
        return node_ip(self.env, self.spec.node_ip_interface, self.slurm)

    def on_term(self, signum: int, _frame: Any) -> None:
        self.terminating = True
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

    def run_ray(self, argv: list[str], env: dict[str, str], on_started: Any) -> int:
        """Run `ray start --block`; stream its output; call on_started once Ray is up."""
        if self.container is not None:
            self.container.remove()  # a previous run's container of this job, if any
        log("starting: " + " ".join(argv))
        self.child = proc.start(argv, env=env)
        assert self.child.stdout is not None
        for line in self.child.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            if STARTED_MARKER in line:
                on_started()
        code = int(self.child.wait())
        self.child = None
        return code

    def run_before(self, cmds: list[str], env: dict[str, str]) -> None:
        for c in cmds:
            log(f"running: {c}")
            res = proc.run(["bash", "-c", c], env=env, timeout=3600, check=False)
            sys.stdout.write(res.stdout + res.stderr)
            if res.returncode != 0:
                raise RuntimeError(f"command failed with exit code {res.returncode}: {c}")

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
            argv, env = self.container.wrap(argv, env)
        return argv, env

    def mark_started(self, argv: list[str], env: dict[str, str]) -> None:
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
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    def prepare_container(self) -> None:
        """Load the image and sweep containers of this cluster whose job is gone."""
        if self.container is None:
            return
        self.container.prepare()

        def active() -> set[str]:
            jobs = self.slurm.list_jobs(job_name(self.spec.cluster_name))
            # Containers carry the numeric SLURM_JOB_ID (as the site epilog sees it).
            return {j.numeric_id for j in jobs if j.active}

        try:
            self.container.sweep(active)
        except (proc.CommandError, OSError, SlurmError) as e:
            log(f"could not sweep old containers: {e}")

    def watch_head(self) -> None:
        """End this worker's job soon after its head is gone, or its job is (headwatch.py)."""
        head = self.cdir.read_head()
        if head:
            headwatch.start(self.cdir, head, on_gone=self.on_head_gone,
                            alive=lambda: self.child is not None and not self.terminating,
                            node=self.ndir)

    def on_head_gone(self, reason: str) -> None:
        log(f"{reason}; ending this worker")
        self.on_term(signal.SIGTERM, None)

    # --- roles ----------------------------------------------------------------------------
    def worker(self) -> int:
        cmds = self.spec.start_commands or ["ray start --address=$RAY_HEAD_IP:$RAY_GCS_PORT"]
        prog = shellcmd.parse("; ".join(cmds))
        for attempt in range(1, self.spec.attempts + 1):
            started = False
            try:
                argv, env = self.build(prog, {})
                self.run_before(prog.before, env)

                def up(a: list[str] = argv, e: dict[str, str] = env) -> None:
                    nonlocal started
                    started = True
                    self.mark_started(a, e)
                    self.watch_head()

                code = self.run_ray(argv, env, up)
            except (RuntimeError, proc.CommandError) as e:
                log(f"ray start attempt {attempt} failed: {e}")
                code = 1
            if started or self.terminating:
                log(f"Ray exited with code {code}; the job ends")
                return code
            log(f"ray start failed (attempt {attempt}/{self.spec.attempts}, exit {code})")
            if attempt < self.spec.attempts:
                time.sleep(min(2**attempt, 30))
        log("giving up: Ray never started on this node; ending the job so the autoscaler "
            "can replace it")
        return 1

    def head(self) -> int:
        handled = ""
        while not self.terminating:
            req = self.wait_for_request(handled)
            if req is None:
                if not self.terminating:
                    log("no start command from `ray up` in time; ending the job")
                return 1
            handled = req.id
            self.ndir.clear_stop()
            self.interrupted = False
            code = self.head_once(req)
            if self.terminating or not self.interrupted:
                log(f"Ray exited with code {code}; the job ends")
                return code
            log("Ray stopped on request; waiting for the next start command")
        return 0

    def wait_for_request(self, handled: str) -> StartRequest | None:
        deadline = time.monotonic() + self.spec.head_start_timeout_s
        while not self.terminating and time.monotonic() < deadline:
            req = self.ndir.read_start()
            if req and req.id != handled:
                return req
            time.sleep(0.2)
        return None

    def watch(self, req_id: str) -> None:
        """While Ray runs: a `stop` file or a newer start request stops it (not the job)."""
        while self.child is not None and self.child.poll() is None:
            req = self.ndir.read_start()
            if self.ndir.stop_requested() or (req is not None and req.id != req_id):
                self.interrupted = True
                log("stop requested: stopping this job's Ray")
                self.child.send_signal(signal.SIGTERM)
                return
            time.sleep(0.5)

    def head_once(self, req: StartRequest) -> int:
        prog = shellcmd.Program(exports=dict(req.exports), before=list(req.before),
                                ray_start=list(req.ray_start))
        try:
            argv, env = self.build(prog, dict(req.env))
            # After a restart, the previous GCS may still hold its port for a moment.
            wait_port_free(shellcmd.get_flag(argv, "--node-ip-address") or "127.0.0.1",
                           int(shellcmd.get_flag(argv, "--port") or 6379), 60.0)
            self.run_before(prog.before, env)
        except (RuntimeError, proc.CommandError) as e:
            log(f"head start failed: {e}")
            self.ndir.write_result(StartResult(req.id, ok=False, error=str(e)))
            self.interrupted = True  # let `ray up` try again
            return 1

        started = False

        def up() -> None:
            nonlocal started
            started = True
            self.mark_started(argv, env)
            self.ndir.write_result(StartResult(req.id, ok=True))
            threading.Thread(target=self.watch, args=(req.id,), daemon=True).start()

        # A busy node can make Ray's own start-up deadlines fire ("The current node timed
        # out during startup"): retry like a worker does before telling `ray up` it failed.
        for attempt in range(1, self.spec.attempts + 1):
            code = self.run_ray(argv, env, up)
            if started or self.terminating or attempt == self.spec.attempts:
                break
            log(f"ray start failed (attempt {attempt}/{self.spec.attempts}, exit {code}); "
                "retrying")
            time.sleep(min(2**attempt, 30))
            try:
                wait_port_free(shellcmd.get_flag(argv, "--node-ip-address") or "127.0.0.1",
                               int(shellcmd.get_flag(argv, "--port") or 6379), 60.0)
            except RuntimeError as e:
                log(str(e))
                break
        self.unmark()
        result = self.ndir.read_result()
        if result is None or result.id != req.id:
            self.ndir.write_result(StartResult(req.id, ok=False,
                                               error=f"ray start exited with {code}"))
            self.interrupted = True
        return code

    def main(self) -> int:
        signal.signal(signal.SIGTERM, self.on_term)
        signal.signal(signal.SIGINT, self.on_term)
        self.ndir.write_agent(AgentInfo(host=self.env.get("SLURMD_NODENAME", ""),
                                        pid=os.getpid(), kind=self.spec.kind,
                                        job_id=self.job_id))
        try:
            try:
                self.prepare_container()
            except RuntimeError as e:
                log(f"ERROR: {e}; the job ends")
                return 1
            return self.head() if self.spec.kind == "head" else self.worker()
        finally:
            self.cleanup()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="ray_slurm_provider.agent")
    ap.add_argument("--spec", required=True, help="NodeSpec as JSON")
    args = ap.parse_args(argv)
    spec = NodeSpec.from_json(args.spec)
    return Agent(spec, dict(os.environ)).main()


if __name__ == "__main__":
    sys.exit(main())
