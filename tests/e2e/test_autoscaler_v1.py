"""The same provider under Ray's v1 autoscaler (`RAY_UP_enable_autoscaler_v2=0`).

v1 matches raylets to provider nodes by IP, so each worker takes a whole sandbox node (2 CPUs)
and thereby its own address.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import yaml

from tests.e2e.harness import ROOT, RayCluster, squeue, wait_for

pytestmark = [pytest.mark.e2e]


@pytest.fixture(scope="module")
def cluster(sandbox: object, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayCluster]:
    cfg = yaml.safe_load((ROOT / "cluster-configs" / "sandbox.yaml").read_text())
    types = cfg["available_node_types"]
    del types["gpu_worker"]
    types["cpu_worker"]["resources"] = {"CPU": 2}
    types["cpu_worker"]["node_config"]["cpus"] = 2
    types["cpu_worker"]["max_workers"] = 1
    c = RayCluster(tmp_path_factory.mktemp("v1"), "e2e-v1", cfg)
    try:
        c.up(RAY_UP_enable_autoscaler_v2="0")
        yield c
    finally:
        c.down()
        c.cleanup()


def test_head_runs_the_v1_monitor(cluster: RayCluster) -> None:
    # Other clusters share this host: look only at the monitor reading this cluster's config.
    out = cluster.ray("exec", str(cluster.path), "ps -eo args").stdout
    mine = [line for line in out.splitlines()
            if "monitor.py" in line and str(cluster.cdir.bootstrap_config) in line]
    assert mine and all("_private/monitor.py" in line for line in mine), mine


def test_v1_scales_up_a_worker_and_runs_tasks(cluster: RayCluster) -> None:
    out = cluster.submit(
        "import ray, json; ray.init();"
        "f = ray.remote(num_cpus=2)(lambda: ray.util.get_node_ip_address());"
        "print('IPS', json.dumps(ray.get([f.remote() for _ in range(2)])))", timeout=600)
    line = next(x for x in out.splitlines() if x.startswith("IPS "))
    ips = json.loads(line[4:])
    assert len(set(ips)) == 1 and ips[0] != cluster.head()["ip"]
    workers = [j for j, _ in cluster.jobs() if j != cluster.head()["job_id"]]
    assert len(workers) == 1


def test_v1_down_cancels_everything(cluster: RayCluster) -> None:
    cluster.down()
    wait_for(lambda: squeue(f"ray-{cluster.name}") == [], 60, "jobs to leave squeue")
