"""What a training function sees in each rank: its identity, a heartbeat and a report channel.

A gang runs `fn(ctx, payload)` in every rank. `ctx` is a `RankContext`: rank, local rank,
world size, attempt number, backend, device index and checkpoint directory, plus

* `ctx.heartbeat(step)`: "I am making progress". The launcher's watchdog tears the gang down
  when a rank stops calling it (a hang in a collective, one slow node);
* `ctx.report(step, **metrics)`: one row of plain numbers (loss, ...) that the launcher
  collects from every rank while the attempt runs, even from a rank that later dies;
* `ctx.checkpoint_saved(path)`: "a checkpoint is complete", which pushes it to S3 when
  staging is on.

The context needs no Ray, so a recipe also runs under torchrun or `torch.multiprocessing`
(`RankContext.from_env()`). Nothing here imports torch.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any, Literal

FaultKind = Literal["crash", "stall", "raise"]
CRASH_EXIT_CODE = 43


class FatalRankError(RuntimeError):
    """A rank failed in a way a restart cannot fix (a bad override, a missing module).

    The gang stops instead of using up its attempts.
    """


@dataclass(frozen=True)
class FaultSpec:
    """Fault injection for tests and drills: `kind` at `step` in `rank` during `attempt`."""

    kind: FaultKind
    rank: int
    step: int
    attempt: int = 0

    @staticmethod
    def parse(text: str) -> FaultSpec:
        """`KIND:RANK:STEP[:ATTEMPT]`, e.g. `crash:3:5` (rank 3 exits at step 5 of attempt 0)."""
        parts = text.split(":")
        if len(parts) not in (3, 4) or parts[0] not in ("crash", "stall", "raise"):
            raise ValueError(f"fault {text!r}: expected crash|stall|raise:RANK:STEP[:ATTEMPT]")
        try:
            nums = [int(p) for p in parts[1:]]
        except ValueError as e:
            raise ValueError(f"fault {text!r}: RANK, STEP and ATTEMPT must be integers") from e
        kind: FaultKind = parts[0]  # type: ignore[assignment]
        return FaultSpec(kind, *nums)


@dataclass(frozen=True)
class RankInfo:
    """Identity of one rank in one attempt; also exported as environment variables."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    num_nodes: int
    attempt: int = 0
    backend: str = "gloo"
    device: Literal["gpu", "cpu"] = "cpu"
    device_index: int | None = None
    cvd_policy: str = "node"
    checkpoint_dir: str | None = None
    master_addr: str = "127.0.0.1"
    master_port: int = 29500

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_env(environ: Mapping[str, str] | None = None) -> RankInfo:
        """Read torchrun-style variables (plus this launcher's RSP_* ones when present)."""
        env = os.environ if environ is None else environ
        world = int(env.get("WORLD_SIZE", "1"))
        local_world = int(env.get("LOCAL_WORLD_SIZE", str(world)))
        device_index = env.get("RSP_DEVICE_INDEX", "")
        device = env.get("RSP_DEVICE", "")
        if device not in ("gpu", "cpu"):
            device = "gpu" if device_index else "cpu"
        return RankInfo(
            rank=int(env.get("RANK", "0")),
            local_rank=int(env.get("LOCAL_RANK", "0")),
            world_size=world,
            local_world_size=local_world,
            node_rank=int(env.get("NODE_RANK", env.get("GROUP_RANK", "0"))),
            num_nodes=int(env.get("RSP_NUM_NODES", str(max(1, world // max(1, local_world))))),
            attempt=int(env.get("RSP_ATTEMPT", "0")),
            backend=env.get("RSP_BACKEND", "nccl" if device == "gpu" else "gloo"),
            device=device,  # type: ignore[arg-type]
            device_index=int(device_index) if device_index else None,
            cvd_policy=env.get("RSP_CVD_POLICY", "node"),
            checkpoint_dir=env.get("RSP_CHECKPOINT_DIR") or None,
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT", "29500")),
        )


@dataclass(frozen=True)
class Progress:
    """A snapshot the launcher polls: heartbeats so far, seconds since the last one."""

    beats: int
    last_step: int | None
    beat_age_s: float | None
    running_s: float
    reports: list[dict[str, Any]]


class RankContext:
    """Thread-safe: the training function calls it in one thread, the launcher polls it in
    another (the rank actor runs with two threads)."""

    def __init__(self, info: RankInfo, *, fault: FaultSpec | None = None,
                 on_checkpoint: Callable[[str], None] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 exit_fn: Callable[[int], Any] = os._exit) -> None:
        self.info = info
        self._fault = fault
        self._on_checkpoint = on_checkpoint
        self._clock = clock
        self._exit = exit_fn
        self._lock = threading.Lock()
        self._started = clock()
        self._beats = 0
        self._last_beat: float | None = None
        self._last_step: int | None = None
        self._reports: list[dict[str, Any]] = []
        self._sent = 0
        self._stall = threading.Event()

    @staticmethod
    def from_env(**kw: Any) -> RankContext:
        """A context for running a recipe without the launcher (torchrun, spawn)."""
        return RankContext(RankInfo.from_env(), **kw)

    # Shortcuts the recipes use most.
    @property
    def rank(self) -> int:
        return self.info.rank

    @property
    def world_size(self) -> int:
        return self.info.world_size

    @property
    def attempt(self) -> int:
        return self.info.attempt

    @property
    def checkpoint_dir(self) -> str | None:
        return self.info.checkpoint_dir

    def heartbeat(self, step: int | None = None) -> None:
        """Mark progress; `step` also arms fault injection (which fires before the beat: a
        rank told to fail at step S never reports S)."""
        if step is not None:
            self._maybe_fault(step)
        with self._lock:
            self._beats += 1
            self._last_beat = self._clock()
            if step is not None:
                self._last_step = step

    def report(self, step: int, **metrics: float | int | str | None) -> None:
        """Record one row of metrics for `step` (also a heartbeat)."""
        row: dict[str, Any] = {"step": int(step), "rank": self.info.rank,
                               "attempt": self.info.attempt}
        for k, v in metrics.items():
            row[k] = v if isinstance(v, (str, int, type(None))) else float(v)
        with self._lock:
            self._reports.append(row)
        self.heartbeat()

    def checkpoint_saved(self, path: str) -> None:
        """Call after a checkpoint under `path` is complete on every rank (after a barrier)."""
        self.heartbeat()
        if self._on_checkpoint is not None:
            self._on_checkpoint(path)
        self.heartbeat()

    def poll(self) -> Progress:
        """Heartbeat state plus the reports not handed out by an earlier poll."""
        now = self._clock()
        with self._lock:
            new = self._reports[self._sent:]
            self._sent = len(self._reports)
            age = None if self._last_beat is None else now - self._last_beat
            return Progress(self._beats, self._last_step, age, now - self._started, list(new))

    def reports(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._reports)

    def _maybe_fault(self, step: int) -> None:
        f = self._fault
        if f is None or (f.rank, f.step, f.attempt) != (self.info.rank, step, self.info.attempt):
            return
        if f.kind == "crash":
            print(f"[fault] rank {self.info.rank}: injected crash at step {step}", flush=True)
            self._exit(CRASH_EXIT_CODE)
        elif f.kind == "raise":
            raise RuntimeError(f"injected failure in rank {self.info.rank} at step {step}")
        else:
            print(f"[fault] rank {self.info.rank}: injected stall at step {step}", flush=True)
            while not self._stall.wait(3600):
                pass

    def release_stall(self) -> None:
        """Unblock an injected stall (tests; the launcher kills stalled ranks instead)."""
        self._stall.set()
