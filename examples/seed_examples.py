"""The Ray basics from the project's seed documents, as one driver to run on a cluster.

Tasks, put/get/wait, task dependencies, actors, and the four placement-group strategies.
Run it with `ray submit CLUSTER.yaml examples/seed_examples.py` or `ray job submit`.
"""

from __future__ import annotations

import json
import os
import socket
import time

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

ray.init()
DATABASE = ["Learning", "ray", "a", "b", "c", "d"]
db_ref = ray.put(DATABASE)


@ray.remote(num_cpus=1)
def retrieve_task(item: int, db: list[str]) -> tuple[int, str]:
    time.sleep(item / 10.0)
    return item, db[item]


@ray.remote(num_cpus=1)
def follow_up_task(prev: tuple[int, str], db: list[str]) -> tuple[tuple[int, str], str]:
    item, _ = prev
    return prev, db[item + 1]


@ray.remote(num_cpus=1)
class Counter:
    def __init__(self) -> None:
        self.n = 0

    def add(self, k: int) -> int:
        self.n += k
        return self.n


@ray.remote(num_cpus=0.5)
def where() -> str:
    return ray.get_runtime_context().get_node_id()


results: dict[str, object] = {}
# Tasks and ray.get.
results["get"] = ray.get([retrieve_task.remote(i, db_ref) for i in range(5)])
# ray.wait: collect results as they finish.
pending = [retrieve_task.remote(i, db_ref) for i in range(5)]
done: list[tuple[int, str]] = []
while pending:
    finished, pending = ray.wait(pending, num_returns=min(2, len(pending)), timeout=60.0)
    done.extend(ray.get(finished))
results["wait"] = sorted(done)
# Task dependencies: futures passed to other tasks.
refs = [retrieve_task.remote(i, db_ref) for i in (0, 2, 4)]
results["deps"] = ray.get([follow_up_task.remote(r, db_ref) for r in refs])
# Actors keep state.
c = Counter.remote()
results["actor"] = ray.get([c.add.remote(1) for _ in range(3)])
ray.kill(c)
# Placement groups, all four strategies (half-CPU bundles, so STRICT_PACK fits one small node).
pgs = {}
for strategy in ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"):
    pg = placement_group([{"CPU": 0.5}] * 2, strategy=strategy)
    ray.get(pg.ready(), timeout=600)
    nodes = ray.get([
        where.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=i)).remote()
        for i in range(2)
    ])
    pgs[strategy] = len(set(nodes))
    remove_placement_group(pg)
results["pg_distinct_nodes"] = pgs
results["driver_host"] = socket.gethostname()
results["pid"] = os.getpid()
print("SEED_RESULTS " + json.dumps(results))
