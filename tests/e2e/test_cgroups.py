"""Slurm's cgroups (issue 29.3): `sandbox up --cgroups` (22.05, cgroup v1 on this machine),
`TaskPlugin=task/cgroup` with ConstrainCores and ConstrainRAMSpace.

A Ray task on a worker runs on exactly the cores Slurm allocated to the worker's job (Ray's
`--num-cpus` is passed explicitly, so Ray's own CPU count would prove nothing), and filling
the object store to 90 % at the agent's default fraction (30 % of the job's memory, in
/dev/shm, which counts against the job's memory cgroup) gets no worker OOM-killed.
"""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Iterator

import pytest
import yaml

from ray_slurm_provider.sandbox import Sandbox, files
from tests.e2e.harness import ROOT, RayCluster, brought_up

pytestmark = [pytest.mark.e2e, pytest.mark.cgroups]
WHERE = """
import json, os, ray
ray.init()
@ray.remote(num_cpus=1)
def where():
    return {"cpus": sorted(os.sched_getaffinity(0)), "job": os.environ.get("SLURM_JOB_ID", ""),
            "cgroup": open("/proc/self/cgroup").read()}
print("WHERE=" + json.dumps(ray.get(where.remote())))
"""
FILL = """
import json, ray, numpy as np
ray.init()
@ray.remote(num_cpus=1)
def fill():
    import os
    store = [n["Resources"].get("object_store_memory", 0) for n in ray.nodes()
             if n["Alive"] and n["NodeID"] == ray.get_runtime_context().get_node_id()][0]
    chunk = 32 << 20
    refs = [ray.put(np.ones(chunk, dtype=np.uint8)) for _ in range(int(store * 0.9) // chunk)]
    return {"store": store, "filled": len(refs) * chunk, "job": os.environ.get("SLURM_JOB_ID")}
print("FILL=" + json.dumps(ray.get(fill.remote(), timeout=600)))
"""


@pytest.fixture(scope="module")
def cluster(sandbox: Sandbox, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayCluster]:
    spec = files.read_spec(sandbox.layout)
    if spec is None or not spec.cgroups:
        pytest.fail("these tests need `ray-slurm sandbox up --cgroups`")
    cfg = yaml.safe_load((ROOT / "cluster-configs" / "sandbox.yaml").read_text())
    t = cfg["available_node_types"]
    del t["gpu_worker"]
    t["cpu_worker"]["node_config"]["mem"] = "1500M"
    t["cpu_worker"]["resources"] = {"CPU": 1}
    c = RayCluster(tmp_path_factory.mktemp("cg"), "cgroups", cfg)
    with brought_up(c):
        yield c


def cpu_ids(job_id: str) -> list[int]:
    """The cores Slurm allocated to the job on its node (`scontrol show job -d`)."""
    out = subprocess.run(["scontrol", "show", "job", "-d", job_id], capture_output=True,
                         text=True, timeout=60, check=True).stdout
    m = re.search(r"CPU_IDs=(\S+)", out)
    assert m, out
    ids: list[int] = []
    for part in m.group(1).split(","):
        lo, _, hi = part.partition("-")
        ids += list(range(int(lo), int(hi or lo) + 1))
    return ids


def test_a_task_runs_on_exactly_the_jobs_cores(cluster: RayCluster) -> None:
    out = cluster.submit(WHERE, timeout=600)
    where = json.loads(next(x for x in out.splitlines() if x.startswith("WHERE="))[6:])
    print("CGROUPS where", json.dumps(where))
    assert where["job"], where
    assert "cpuset:/slurm_" in where["cgroup"], where["cgroup"]
    assert where["cpus"] == cpu_ids(where["job"]), where


def test_a_full_object_store_gets_no_worker_oom_killed(cluster: RayCluster) -> None:
    out = cluster.submit(FILL, timeout=900)
    fill = json.loads(next(x for x in out.splitlines() if x.startswith("FILL="))[5:])
    print("CGROUPS fill", json.dumps(fill))
    assert fill["filled"] >= 0.8 * fill["store"] > 0, fill
    state = subprocess.run(["squeue", "--noheader", "--jobs", fill["job"], "--format=%T"],
                           capture_output=True, text=True, timeout=60, check=False).stdout
    assert state.strip() == "RUNNING", (fill, state)
