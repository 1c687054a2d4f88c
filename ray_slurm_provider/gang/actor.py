"""The rank actor: one process per rank, created fresh for every attempt.

Order matters and is the point of this class:

1. `__init__` reads `ray.get_gpu_ids()` before anything can touch CUDA, and imports no torch.
2. `describe()` says where the actor landed; the driver orders the ranks from that.
3. `probe_port()` runs on rank 0's actor only: a free port on rank 0's own host.
4. `stage_in()` runs on the node leaders when S3 staging is on.
5. `run()` scrubs the inherited Slurm/MPI variables, writes the full rank environment, only
   then imports the training function's module (which imports torch), and calls it.

The actor runs with two threads (`max_concurrency=2`) so that `poll()` answers while `run()`
trains: the driver reads heartbeats and reports from it. Actors are created with
`max_restarts=0`: a restarted rank cannot rejoin a process group, so only the driver restarts,
and always the whole gang. Results are plain JSON types, so the driver never unpickles a torch
object (and never imports torch).
"""

from __future__ import annotations

import importlib
import json
import os
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict
from typing import Any

from ray_slurm_provider.gang.context import FaultSpec, Progress, RankContext, RankInfo
from ray_slurm_provider.gang.rankenv import apply_env
from ray_slurm_provider.gang.rendezvous import probe_free_port
from ray_slurm_provider.gang.s3stage import S3Stage


def load_function(spec: str) -> Callable[..., Any]:
    """`package.module:function` -> the function (imported in the rank, after the env)."""
    mod, sep, attr = spec.partition(":")
    if not sep or not mod or not attr:
        raise ValueError(f"function {spec!r}: expected module:function")
    fn = getattr(importlib.import_module(mod), attr, None)
    if not callable(fn):
        raise ValueError(f"function {spec!r}: {mod} has no callable {attr!r}")
    return fn  # type: ignore[no-any-return]


def plain(value: Any) -> Any:
    """JSON-safe copy (numbers, strings, lists, dicts; anything else as its str())."""
    return json.loads(json.dumps(value, default=str))


class RankWorker:
    def __init__(self, slot: int, bundle: int) -> None:
        import ray

        self.slot = slot
        self.bundle = bundle
        self.gpu_ids = [str(g) for g in ray.get_gpu_ids()]
        self.cvd_at_start = os.environ.get("CUDA_VISIBLE_DEVICES")
        self.node_ip = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
        self.node_id = ray.get_runtime_context().get_node_id()
        self.ctx: RankContext | None = None
        self.started = time.monotonic()

    def describe(self) -> dict[str, Any]:
        return {"slot": self.slot, "bundle": self.bundle, "node_ip": self.node_ip,
                "node_id": self.node_id, "gpu_ids": self.gpu_ids,
                "hostname": socket.gethostname(), "pid": os.getpid(),
                "slurm_job_id": _slurm_job(os.environ),
                "ray_cvd": self.cvd_at_start}

    def probe_port(self) -> int:
        return probe_free_port("")

    def stage_in(self, s3_uri: str, endpoint: str | None, local_dir: str) -> list[str]:
        return S3Stage(s3_uri, endpoint).pull(local_dir)

    def run(self, fn: str, payload: Any, info: dict[str, Any], env: dict[str, str | None],
            fault: dict[str, Any] | None, stage: dict[str, Any] | None) -> dict[str, Any]:
        scrubbed = apply_env(os.environ, env)
        rank_info = RankInfo(**info)
        pusher: S3Stage | None = None
        if stage is not None:
            pusher = S3Stage(stage["uri"], stage.get("endpoint"))

        def on_checkpoint(path: str) -> None:
            if pusher is not None and rank_info.checkpoint_dir:
                sent = pusher.push(rank_info.checkpoint_dir)
                print(f"[launch] rank {rank_info.rank}: pushed {len(sent)} file(s) to "
                      f"{pusher.uri}", flush=True)

        self.ctx = RankContext(rank_info, fault=FaultSpec(**fault) if fault else None,
                               on_checkpoint=on_checkpoint)
        print(f"[launch] rank {rank_info.rank}/{rank_info.world_size} node_rank="
              f"{rank_info.node_rank} local_rank={rank_info.local_rank} ip={self.node_ip} "
              f"ray_gpu_ids={self.gpu_ids} CUDA_VISIBLE_DEVICES="
              f"{os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')} master="
              f"{rank_info.master_addr}:{rank_info.master_port} attempt={rank_info.attempt} "
              f"scrubbed={len(scrubbed)}", flush=True)
        t0 = time.monotonic()
        func = load_function(fn)
        import_s = time.monotonic() - t0
        result = func(self.ctx, payload)
        if pusher is not None:
            on_checkpoint(rank_info.checkpoint_dir or "")
        seen = {k: os.environ.get(k) for k in
                ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK",
                 "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS")}
        return {"result": plain(result), "env": seen, "reports": self.ctx.poll().reports,
                "import_s": round(import_s, 2), "run_s": round(time.monotonic() - t0, 2),
                "actor_s": round(time.monotonic() - self.started, 2),
                "slurm_left": sorted(k for k in os.environ if k.startswith("SLURM_"))}

    def poll(self) -> dict[str, Any]:
        if self.ctx is None:
            p = Progress(0, None, None, time.monotonic() - self.started, [])
        else:
            p = self.ctx.poll()
        return asdict(p)


def _slurm_job(env: Mapping[str, str]) -> str:
    """The rank's Slurm job as squeue and the provider name it: `<array>_<task>` for a task of
    a job array (its SLURM_JOB_ID is then another number), else SLURM_JOB_ID."""
    array, task = env.get("SLURM_ARRAY_JOB_ID"), env.get("SLURM_ARRAY_TASK_ID")
    return f"{array}_{task}" if array and task else env.get("SLURM_JOB_ID", "")
