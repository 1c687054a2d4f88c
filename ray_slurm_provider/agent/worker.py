"""The worker's role: start Ray from the node type's `worker_start_ray_commands`, keep it.

The agent adds what Slurm allocated (CPUs, GPUs, memory, the node's address) and the
cluster's ports (raystart.py), retries a failed start before ending the job with a clear log
line, and ends the job soon after its head is gone (headwatch.py).
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from typing import Any

from ray_slurm_provider import proc, shellcmd
from ray_slurm_provider.agent import headwatch
from ray_slurm_provider.agent.agent import START_BACKOFF, Agent, Stopping, log
from ray_slurm_provider.nodespec import DEFAULT_WORKER_START, NodeSpec
from ray_slurm_provider.retry import retry
from ray_slurm_provider.slurm.client import SlurmError


class WorkerAgent(Agent):
    def __init__(self, spec: NodeSpec, env: dict[str, str]) -> None:
        super().__init__(spec, env)
        # The head watch's period and GCS probe: tests shorten the one and fake the other.
        self.watch_period_s = headwatch.PERIOD_S
        self.watch_connect: Callable[[str, int], str] = headwatch.probe_gcs

    signalled = False  # Slurm signalled the job (scancel, time limit, srun ending a gang)

    def on_signal(self, signum: int, frame: Any) -> None:
        self.signalled = True
        super().on_signal(signum, frame)

    finished = False  # run() has returned: the head watch ends

    def run(self) -> int:
        try:
            return self.attempts()
        finally:
            self.finished = True

    def attempts(self) -> int:
        """Start Ray, up to `spec.attempts` times; the job's exit code."""
        if self.released():
            log("this gang member was released before its Ray started; its task ends")
            return 0
        prog = shellcmd.parse_commands(self.spec.start_commands or DEFAULT_WORKER_START)
        watching = False

        def attempt(n: int) -> int | None:
            """One start of Ray: the job's exit code, or None to try again."""
            nonlocal watching
            started = False
            try:
                argv, env = self.build(prog, {})
                if not watching:
                    # From before `ray start`: one that is still connecting to a head that
                    # has gone would otherwise retry a dead GCS until Slurm's time limit.
                    watching = self.watch_head()
                self.run_before(prog.before, env)

                def up(a: list[str] = argv, e: dict[str, str] = env) -> None:
                    nonlocal started
                    started = True
                    self.mark_started(a, e)

                code = self.run_ray(argv, env, up)
            except Stopping as e:
                log(f"{e}; the job ends")
                return 0
            except (RuntimeError, proc.CommandError, SlurmError) as e:
                log(f"ray start attempt {n} failed: {e}")
                code = 1
            if started or self.terminating:
                return self.ended(code)
            log(f"ray start failed (attempt {n}/{self.spec.attempts}, exit {code})")
            return None

        code = retry(attempt, attempts=self.spec.attempts, delay=START_BACKOFF,
                     retry_if=lambda c: c is None, sleep=self.pause)
        if code is not None:
            return code
        log("giving up: Ray never started on this node; ending the job so the autoscaler "
            "can replace it")
        return 1

    def released(self) -> bool:
        """A gang member the autoscaler terminated (provider/gangs.py): its Ray stops and its
        task ends with exit 0, so `srun --kill-on-bad-exit` leaves the other members be."""
        return self.spec.group_size > 1 and self.ndir.released()

    def ended(self, code: int) -> int:
        """The job's (in a gang: this task's) exit code once Ray has exited."""
        if self.released() and not self.signalled:
            log(f"Ray exited with code {code}; this gang member was released, its task ends")
            return 0
        if self.spec.group_size > 1 and not self.terminating:
            # Lost: the other members must end too (srun ends them on a non-zero exit).
            log(f"Ray exited with code {code} on its own; ending the whole gang job")
            return code or 1
        log(f"{self.ray_ended(code)}; the job ends")
        # A stop the job was told of ends it cleanly: with Ray's exit code (1 after the TERM,
        # 247 without a head) Slurm would record FAILED, a failure on every dashboard. Not
        # a worker whose head went away before its Ray ever came up: a type that cannot
        # join its head must still count against it (provider/ends.py judges FAILED).
        told = self.terminating and (self.was_up or self.stop_reason is None)
        return 0 if told else code

    def watch_head(self) -> bool:
        """End this worker's job soon after its head is gone, or its job is (headwatch.py),
        from now until the agent stops; whether there is a head to watch."""
        head = self.cdir.read_head()
        if head:
            headwatch.start(self.cdir, head, on_gone=self.on_head_gone,
                            alive=lambda: not (self.terminating or self.finished),
                            node=self.ndir, period_s=self.watch_period_s,
                            connect=self.watch_connect)
        return head is not None

    def on_head_gone(self, reason: str) -> None:
        log(f"{reason}; ending this worker")
        self.stop_reason = reason
        self.on_term(signal.SIGTERM, None)
