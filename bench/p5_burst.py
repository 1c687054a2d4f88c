"""P5, the provider's part of a burst 0 -> N: Ray's own v2 code over the provider on a fake Slurm.

Each autoscaler tick, Ray's reconciler decides how many queued nodes to release
(`Reconciler._compute_to_launch`, its own code: `upscaling_speed` and
AUTOSCALER_MAX_CONCURRENT_LAUNCHES, with no node running yet, the worst case of a burst from
zero). Ray's `NodeProviderAdapter` hands them to the provider in create calls of at most
`max_launch_batch` nodes (its own code and threads). Then one listing. Counted: ticks until
every node was submitted, create calls, Slurm submit RPCs (FakeSlurm's counters), submitted
nodes the next listing missed, and the CPU time of the burst (all threads of this process).

    .venv/bin/python -m bench.p5_burst [--nodes 256]

Needs no sandbox. The ticks are Ray's policy; the provider's part is the submits per tick.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

from ray.autoscaler._private.constants import AUTOSCALER_MAX_LAUNCH_BATCH
from ray.autoscaler.v2.instance_manager.node_provider import NodeProviderAdapter
from ray.autoscaler.v2.instance_manager.reconciler import Reconciler
from ray.core.generated.instance_manager_pb2 import Instance

from bench.common import save
from ray_slurm_provider.provider.provider import SlurmNodeProvider
from tests.fakes import FakeSlurm

TYPE = "cpu_worker"


class Reader:
    """The one thing the adapter reads from the autoscaling config: the type's node config."""

    class Config:
        def get_cloud_node_config(self, node_type: str) -> dict[str, Any]:
            return {"partition": "cpu", "cpus": 1}

        def get_node_resources(self, node_type: str) -> dict[str, float]:
            return {"CPU": 1}

        def get_node_labels(self, node_type: str) -> dict[str, str]:
            return {}

        def get_config(self, key: str, default: Any = None) -> Any:
            return {"cluster_name": "p5"}.get(key, default)

    def get_cached_autoscaling_config(self) -> Any:
        return self.Config()


def burst(n: int, upscaling_speed: float, max_concurrent: int, batch: int,
          state: Path) -> dict[str, Any]:
    fake = FakeSlurm()
    provider = SlurmNodeProvider({"type": "external", "state_dir": str(state),
                                  "module": "ray_slurm_provider.provider.SlurmNodeProvider",
                                  "python": "/opt/venv/bin/python"}, "p5")
    provider._client = fake
    creates = 0
    create = provider.create_node_with_resources_and_labels

    def counted(*a: Any, **kw: Any) -> Any:
        nonlocal creates
        creates += 1
        return create(*a, **kw)

    provider.create_node_with_resources_and_labels = counted  # type: ignore[method-assign]
    adapter = NodeProviderAdapter(provider, Reader(),  # type: ignore[arg-type]
                                  max_launch_batch_per_type=batch,
                                  max_concurrent_launches=max_concurrent)
    queued = [Instance(instance_id=str(i), instance_type=TYPE) for i in range(n)]
    requested: list[Instance] = []
    ticks, listed_late = 0, 0
    cpu0 = time.process_time()
    while queued:
        ticks += 1
        to_launch = Reconciler._compute_to_launch(queued, requested, [], upscaling_speed,
                                                  max_concurrent)[TYPE]
        adapter.launch({TYPE: len(to_launch)}, request_id=f"tick{ticks}")
        adapter._main_executor.submit(lambda: None).result()  # the launch was handed on
        adapter._node_launcher_executors.shutdown(wait=True)  # ... and every create ran
        adapter._node_launcher_executors = type(adapter._node_launcher_executors)(
            max_workers=adapter._node_launcher_executors._max_workers)
        launched = {id(i) for i in to_launch}
        queued = [i for i in queued if id(i) not in launched]
        submitted = len(fake.jobs)
        listed = len(provider.non_terminated_nodes({}))
        listed_late += submitted - listed
        # A listed node is ALLOCATED for Ray: no longer counted against the launch limit.
        requested = []
    cpu = time.process_time() - cpu0
    errors = adapter.poll_errors()
    return {"nodes": n, "upscaling_speed": upscaling_speed,
            "max_concurrent_launches": max_concurrent, "max_launch_batch": batch,
            "ticks": ticks, "create_calls": creates,
            "submit_rpcs": fake.calls["submit"] + fake.calls["submit_array"],
            "submitted": len(fake.jobs), "not_listed_next_tick": listed_late,
            "launch_errors": len(errors), "provider_cpu_ms": round(cpu * 1000, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=256)
    ap.add_argument("--name", default="p5-burst")
    args = ap.parse_args()
    n = args.nodes
    cases = [  # (upscaling_speed, AUTOSCALER_MAX_CONCURRENT_LAUNCHES, AUTOSCALER_MAX_LAUNCH_BATCH)
        (1.0, 10, AUTOSCALER_MAX_LAUNCH_BATCH),  # Ray's defaults, the shipped configs' speed
        (1.0, 10, 1000),  # the same, with the head's default batch (raystart.py)
        (float(n), n, AUTOSCALER_MAX_LAUNCH_BATCH),  # Ray opened up, Ray's batch of 5
        (float(n), n, 1000),  # Ray opened up, the head's batch: the provider's part alone
    ]
    results = []
    for speed, conc, batch in cases:
        with tempfile.TemporaryDirectory() as d:
            r = burst(n, speed, conc, batch, Path(d))
        print(r)
        results.append(r)
    save(args.name, {"cases": results})


if __name__ == "__main__":
    main()
