"""M1 (head side): the memory the provider adds to the head's autoscaler process.

In a fresh process that has imported what Ray's v2 monitor imports (`ray.autoscaler.v2.monitor`),
RSS and USS (private memory, /proc/self/smaps_rollup) are read: after that import, after
importing the provider, and after the provider listed a cluster of `--jobs` jobs through the
real parser (P4's synthetic squeue output and cluster directory) and answered one tick's
queries. The node agent's memory (the other half of M1) is measured live by
`bench.scale ... mem`.

    .venv/bin/python -m bench.m1_provider_memory [--jobs 10000]

Needs no sandbox.
"""

from __future__ import annotations

import argparse
import gc
import tempfile
from pathlib import Path
from typing import Any
from unittest import mock

from bench.common import save


def mem_kb() -> dict[str, int]:
    """This process's Rss and private (Private_Clean + Private_Dirty) memory, kB."""
    out = {"rss_kb": 0, "uss_kb": 0}
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key == "Rss":
            out["rss_kb"] = int(rest.split()[0])
        elif key in ("Private_Clean", "Private_Dirty"):
            out["uss_kb"] += int(rest.split()[0])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=10000)
    ap.add_argument("--name", default="m1-provider")
    args = ap.parse_args()
    import ray.autoscaler.v2.monitor  # noqa: F401  (what the head's autoscaler has anyway)

    gc.collect()
    steps: dict[str, Any] = {"ray_monitor_imported": mem_kb()}
    from ray_slurm_provider import proc
    from ray_slurm_provider.provider.provider import SlurmNodeProvider
    from ray_slurm_provider.slurm.cli import CliSlurmClient

    gc.collect()
    steps["provider_imported"] = mem_kb()
    from bench.p4_listing_cpu import (
        CLUSTER,
        NODES,
        FakeRun,
        make_state,
        scontrol_nodes,
        squeue_output,
    )

    text = squeue_output(args.jobs)
    fake = FakeRun(text, scontrol_nodes(NODES))
    with mock.patch.object(proc, "run", fake), tempfile.TemporaryDirectory() as tmp:
        make_state(tmp, args.jobs)
        gc.collect()
        steps["listing_text_built"] = mem_kb()  # the bench's own input, not the provider's
        provider = SlurmNodeProvider({"state_dir": tmp}, CLUSTER)
        provider._client = CliSlurmClient(env={"PATH": "/usr/bin"})
        for _ in range(2):  # the first tick builds every record; the second reuses them
            for node_id in provider.non_terminated_nodes({}):
                provider.node_tags(node_id)
                provider.is_running(node_id)
        gc.collect()
        steps["after_two_ticks"] = mem_kb()
    base, imp = steps["ray_monitor_imported"], steps["provider_imported"]
    built, ticks = steps["listing_text_built"], steps["after_two_ticks"]
    res = {"jobs": args.jobs, "steps": steps,
           "import_rss_mb": round((imp["rss_kb"] - base["rss_kb"]) / 1024, 1),
           "import_uss_mb": round((imp["uss_kb"] - base["uss_kb"]) / 1024, 1),
           "state_rss_mb": round((ticks["rss_kb"] - built["rss_kb"]) / 1024, 1),
           "state_uss_mb": round((ticks["uss_kb"] - built["uss_kb"]) / 1024, 1)}
    save(args.name, res)


if __name__ == "__main__":
    main()
