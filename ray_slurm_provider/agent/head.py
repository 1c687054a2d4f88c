"""The head's role: the hand-off loop with `ray up`.

`ray up` cannot be told "the head starts itself", so it runs the head's start commands
through our command runner, which hands them over here (`start.json`); the agent starts Ray
in the batch step and reports back (`result.json`). A later `ray up` hands over again and the
agent restarts Ray in place; `ray stop` (the `ray-stop` marker) stops only this job's Ray.
"""

from __future__ import annotations

import dataclasses
import signal
import socket
import sys
import threading
import time

from ray_slurm_provider import ports, proc, shellcmd
from ray_slurm_provider.agent import oneshot
from ray_slurm_provider.agent.agent import START_BACKOFF, Agent, Stopping, log
from ray_slurm_provider.jobs import job_name
from ray_slurm_provider.retry import retry
from ray_slurm_provider.slurm.client import SlurmError
from ray_slurm_provider.state import StartRequest, StartResult, poll_interval


def wait_port_free(host: str, port: int, timeout: float) -> None:
    """Wait until nothing accepts connections on host:port (raise RuntimeError if it stays
    taken: another cluster on this node owns it; choose `provider.ports.base`)."""
    def taken(_: int) -> bool:
        with socket.socket() as s:
            s.settimeout(1.0)
            return s.connect_ex((host, port)) == 0

    if retry(taken, retry_if=bool, deadline_s=timeout, clock=time.monotonic,
             delay=lambda n, waited: 0.25):
        raise RuntimeError(f"port {port} on {host} is in use by another process; set "
                           "provider.ports.base to give this cluster other ports")


def _wait_gcs_port_free(argv: list[str]) -> None:
    # After a restart, the previous GCS may still hold its port for a moment.
    wait_port_free(shellcmd.get_flag(argv, "--node-ip-address") or "127.0.0.1",
                   int(shellcmd.get_flag(argv, "--port") or 6379), 60.0)


class HeadAgent(Agent):
    interrupted = False  # Ray stopped on request (or failed to start): wait for the next one
    ports_picked = False  # the port block is chosen once, at Ray's first start
    oneshot_code: int | None = None  # `ray-slurm sbatch`: the entrypoint's exit code

    def run(self) -> int:
        handled = ""
        while not self.terminating:
            req = self.wait_for_request(handled)
            if req is None:
                if self.stopping():
                    return 0  # told to stop before `ray up` sent a start command
                log("no start command from `ray up` in time; ending the job")
                return 1
            handled = req.id
            self.ndir.clear_ray_stop()
            self.interrupted = False
            code = self.head_once(req)
            if req.entrypoint:  # a one-shot cluster ends with its entrypoint, workers too
                self.end_cluster(req)
                if self.oneshot_code is not None:
                    log(f"the job ends with the entrypoint's exit code {self.oneshot_code}")
                    return self.oneshot_code
                # Setup or `ray start` failed: never an exit code an entrypoint could give.
                log(f"the cluster failed before the entrypoint ran (exit {code}); the job ends "
                    f"with {oneshot.CLUSTER_FAILED}")
                return oneshot.CLUSTER_FAILED
            if self.terminating or not self.interrupted:
                log(f"{self.ray_ended(code)}; the job ends")
                # Told to stop (`ray down`, the drain before its limit): a clean end, never
                # FAILED in accounting (as for workers, worker.py).
                return 0 if self.stopping() else code
            log("Ray stopped on request; waiting for the next start command")
        return 0

    def wait_for_request(self, handled: str) -> StartRequest | None:
        start = time.monotonic()
        deadline = start + self.spec.head_start_timeout_s
        while not self.terminating and time.monotonic() < deadline:
            req = self.ndir.read_start()
            if req and req.id != handled:
                return req
            time.sleep(poll_interval(time.monotonic() - start))
        return None

    def watch(self, req_id: str) -> None:
        """While Ray runs: a `ray-stop` marker or a newer start request stops it (not the job)."""
        while self.child is not None and self.child.poll() is None:
            req = self.ndir.read_start()
            if self.ndir.ray_stop_requested() or (req is not None and req.id != req_id):
                self.interrupted = True
                log("stop requested: stopping this job's Ray")
                self.child.send_signal(signal.SIGTERM)
                return
            time.sleep(0.5)

    def pick_ports(self) -> None:
        """Before Ray's first start here: the cluster's block, or the next one when any of
        its ports is taken on this node (a restart keeps the block it took)."""
        if self.ports_picked:
            return
        first = ports.PortBlock(self.spec.ports_base)
        block = ports.free_block(self.node_ip(), first, pinned=self.spec.ports_pinned,
                                 can_bind=ports.can_bind)
        if block != first:
            log(f"a port of block {first.base} is taken on this node: using {block.base}")
            self.spec = dataclasses.replace(self.spec, ports_base=block.base)
        self.ports_picked = True

    def run_oneshot(self, req: StartRequest) -> None:
        """`ray-slurm sbatch`: run the entrypoint as a Ray job, then stop Ray (the job ends)."""
        head = self.cdir.read_head()
        code = oneshot.CLUSTER_FAILED
        try:  # whatever happens here, Ray is stopped below: the job must end with it
            if head is None:
                log("ERROR: Ray is up but head.json is missing; the one-shot cannot run")
            else:
                code = oneshot.run_entrypoint(self.cdir, head, self.spec.auth_mode, req,
                                              sys.stdout, log, lambda: self.terminating)
        except Exception as e:  # Ray refused the job (a working dir it cannot upload, ...)
            log(f"ERROR: the one-shot entrypoint could not run: {type(e).__name__}: {e}")
        self.oneshot_code = code
        child = self.child
        if child is not None and child.poll() is None:
            child.send_signal(signal.SIGTERM)

    def end_cluster(self, req: StartRequest) -> None:
        """The one-shot is over (or the head job ends): cancel the cluster's workers now
        rather than let them find the head gone."""
        self.cdir.mark_teardown()
        name = job_name(self.spec.cluster_name)
        try:
            listed = self.ask("listing the workers", lambda: self.slurm.list_jobs(name))
            others = [j.job_id for j in listed if j.active and j.job_id != self.node_id]
            if others:
                log(f"cancelling the workers: {', '.join(others)}")
                self.ask("cancelling the workers", lambda: self.slurm.cancel(others))
        except SlurmError as e:
            log(f"could not cancel the workers ({e}); they end once they see the head gone")
        oneshot.remove_staged(self.cdir, req)

    def head_once(self, req: StartRequest) -> int:
        prog = shellcmd.Program(exports=dict(req.exports), before=list(req.before),
                                prefix=req.prefix, ray_start=list(req.ray_start))
        try:
            self.pick_ports()
            argv, env = self.build(prog, dict(req.env))
            _wait_gcs_port_free(argv)  # a restart: our previous GCS may hold it a moment
            self.run_before(prog.before, env)
        except (RuntimeError, proc.CommandError, SlurmError) as e:
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
            if req.entrypoint:
                threading.Thread(target=self.run_oneshot, args=(req,), daemon=True).start()

        # A busy node can make Ray's own start-up deadlines fire ("The current node timed
        # out during startup"): retry like a worker does before telling `ray up` it failed.
        code = 1

        def attempt(n: int) -> bool:
            """One start of Ray; whether that was the last."""
            nonlocal code
            if n > 1:
                try:
                    _wait_gcs_port_free(argv)
                except RuntimeError as e:
                    log(str(e))
                    return True
            try:
                code = self.run_ray(argv, env, up)
            except Stopping as e:
                log(f"{e}; the job ends")
                code = 1
                return True
            if started or self.terminating or n == self.spec.attempts:
                return True
            log(f"ray start failed (attempt {n}/{self.spec.attempts}, exit {code}); "
                "retrying")
            return False

        retry(attempt, attempts=self.spec.attempts, delay=START_BACKOFF,
              retry_if=lambda last: not last, sleep=self.pause)
        self.unmark()
        result = self.ndir.read_result()
        if result is None or result.id != req.id:
            self.ndir.write_result(StartResult(req.id, ok=False,
                                               error=f"ray start exited with {code}"))
            self.interrupted = True
        return code
