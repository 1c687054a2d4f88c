#!/usr/bin/env python3
"""Megatron on a Ray cluster of Slurm jobs, without torchrun: the `ray job submit` entrypoint.

    python launch.py RECIPE [gang options] [key=value overrides ...]

RECIPE
  tiny               tiny GPT on megatron-core alone (tiny_gpt.py); any machine, CPU or GPU
  deepseek-v2-lite   the seed's DeepSeek-V2-Lite pretraining on Megatron-Bridge
                     (deepseek_v2_lite.py); defaults to 2 nodes x 8 GPUs

Gang options (`--nodes`, `--ranks-per-node`, `--device`, `--cvd-policy`, `--profile`,
`--max-attempts`, `--checkpoint-dir`, ...) are ray_slurm_provider.gang's; `--help` lists
them. Everything else of the form `key=value` is a Hydra-style override of the recipe's
config (`model.tensor_model_parallel_size=2`, `train.train_iters=100`, `+new.key=1`).

The driver (this process, on the head) imports neither torch nor Megatron: the ranks do. It
prints one `GANG_RESULT {...}` JSON line at the end and exits non-zero when the gang failed.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from typing import Any

from ray_slurm_provider.gang import FatalRankError, GangFailed, GangResult, SpecError, run_gang
from ray_slurm_provider.gang.overrides import OverrideError, parse_overrides
from ray_slurm_provider.gang.spec import add_arguments, from_args

RECIPES: dict[str, dict[str, Any]] = {
    "tiny": {"fn": "tiny_gpt:train", "defaults": {}},
    "deepseek-v2-lite": {
        "fn": "deepseek_v2_lite:train",
        # The seed's layout and environment: 2 nodes x 8 GPUs on EFA, in one gang node group
        # (cluster.yaml's gpu_worker: one Slurm job of 2 nodes).
        "defaults": {"nodes": 2, "ranks_per_node": 8, "profile": ["megatron", "efa"],
                     "cpus_per_rank": 8.0, "stall_timeout": 1800.0, "placement": "group"},
    },
}


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("recipe", choices=sorted(RECIPES))
    add_arguments(p)
    args, rest = p.parse_known_args(argv)
    unknown = [r for r in rest if r.startswith("-") and not r.startswith(("+", "~"))]
    if unknown:
        p.error(f"unrecognized arguments: {' '.join(unknown)}")
    given = set(argv)
    for key, value in RECIPES[args.recipe]["defaults"].items():
        flag = "--" + key.replace("_", "-")
        if not any(a == flag or a.startswith(flag + "=") for a in given):
            setattr(args, key, value)
    return args, rest


def summary(result: GangResult) -> str:
    lines = []
    for a in result.attempts:
        status = "ok" if a.ok else f"FAILED ({a.failure})"
        lines.append(f"attempt {a.attempt}: {status}, {a.wall_s:.1f}s, rendezvous {a.master}")
        rows = sorted((r for r in a.reports if r.get("rank") == 0 and "loss" in r),
                      key=lambda r: int(r["step"]))
        if rows:
            lines.append("  rank 0 loss: " + " ".join(
                f"{r['step']}:{float(r['loss']):.4f}" for r in rows))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse(sys.argv[1:] if argv is None else argv)
    try:
        spec = from_args(args)
        parse_overrides(overrides)
        if args.recipe == "tiny":  # its config is plain dataclasses: check overrides here
            import tiny_gpt

            tiny_gpt.build_config(overrides)
    except (SpecError, OverrideError, FatalRankError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import ray

    # `ray job stop` sends SIGTERM: exit through the launcher's `finally` (actors killed,
    # placement group removed) instead of dying on the spot.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    ray.init()
    fn = RECIPES[args.recipe]["fn"]
    try:
        result = run_gang(spec, fn, {"overrides": overrides})
        rc = 0
    except GangFailed as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        result, rc = e.result, 1
    print(summary(result), flush=True)
    print("GANG_RESULT " + json.dumps(result.as_dict()), flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
