"""Rank functions for test_gang.py: shipped to the Ray workers as a py_module.

They need no torch: a "checkpoint" is a JSON file rank 0 writes, which is all the launcher's
restart logic relies on (the training function resumes from what it finds).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from ray_slurm_provider.gang import FatalRankError, RankContext

ENV_KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK",
            "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS",
            "RSP_DEVICE_INDEX", "RSP_ATTEMPT", "NCCL_SOCKET_IFNAME", "FI_PROVIDER")


def _barrier(ctx: RankContext, step: int) -> None:
    """Stands for a collective: wait (up to 60 s) until every rank has reached `step`."""
    root = (ctx.checkpoint_dir or "") + ".barrier"
    os.makedirs(root, exist_ok=True)
    mine = os.path.join(root, f"bar.{ctx.attempt}.{ctx.rank}")
    with open(mine + ".tmp", "w") as f:
        f.write(str(step))
    os.replace(mine + ".tmp", mine)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        reached = []
        for r in range(ctx.world_size):
            try:
                with open(os.path.join(root, f"bar.{ctx.attempt}.{r}")) as f:
                    reached.append(int(f.read() or -1))
            except (FileNotFoundError, ValueError):
                reached.append(-1)
        if min(reached) >= step:
            return
        time.sleep(0.02)
    raise TimeoutError(f"barrier at step {step}")


def steps(ctx: RankContext, payload: dict[str, Any]) -> dict[str, Any]:
    """`payload["steps"]` steps in lockstep (a file barrier per step when there is a
    checkpoint dir); rank 0 checkpoints every step; every rank resumes from it."""
    ckpt = os.path.join(ctx.checkpoint_dir or "", "state.json")
    start = 0
    if ctx.checkpoint_dir and os.path.exists(ckpt):
        with open(ckpt) as f:
            start = int(json.load(f)["next"])
    for step in range(start, int(payload["steps"])):
        ctx.heartbeat(step)
        if ctx.checkpoint_dir:
            _barrier(ctx, step)
        time.sleep(float(payload.get("step_s", 0.05)))  # stands for a training step
        ctx.report(step, loss=1.0 / (step + 1))
        if ctx.rank == 0 and ctx.checkpoint_dir:
            tmp = ckpt + ".tmp"
            with open(tmp, "w") as f:
                json.dump({"next": step + 1}, f)
            os.replace(tmp, ckpt)
            if payload.get("saved"):
                ctx.checkpoint_saved(ckpt)
    return {"env": {k: os.environ.get(k) for k in ENV_KEYS}, "start": start,
            "slurm": sorted(k for k in os.environ if k.startswith("SLURM_")),
            "info": ctx.info.as_dict()}


def fatal(ctx: RankContext, payload: Any) -> None:
    raise FatalRankError("bad override: model.nope")
