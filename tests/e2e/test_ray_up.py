"""`ray up` ... `ray down` on the real sandbox: Ray as bare processes, autoscaler v2 (default).

One cluster is brought up once for the module; the tests run in file order against it, as a
user would: up, exec, submit, scale up on demand, scale down when idle, a second cluster
beside it, then down. Timings are printed (pytest -s) for the closing notes, never asserted.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.e2e.harness import ROOT, RayCluster, squeue, wait_for

pytestmark = [pytest.mark.e2e]
CONFIG = ROOT / "cluster-configs" / "sandbox.yaml"
TIMINGS: dict[str, float] = {}


@pytest.fixture(scope="module")
def cluster(sandbox: object, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayCluster]:
    c = RayCluster.from_file(tmp_path_factory.mktemp("e2e"), "e2e", CONFIG)
    try:
        TIMINGS["ray up"] = c.up()
        yield c
    finally:
        c.down()
        c.cleanup()
        print("TIMINGS", json.dumps({k: round(v, 1) for k, v in TIMINGS.items()}))


def ray_pids_of(job_ids: list[str]) -> list[int]:
    """PIDs of processes that belong to these jobs' Ray (their temp dirs are named after the
    job id)."""
    pids = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            cmd = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if any(f"rsp-{j}" in cmd for j in job_ids):
            pids.append(int(p.name))
    return pids


def test_head_is_a_running_slurm_job(cluster: RayCluster) -> None:
    jobs = cluster.jobs()
    assert len(jobs) == 1 and jobs[0][1] == "RUNNING"
    head = cluster.head()
    assert head["job_id"] == jobs[0][0]
    assert head["ip"].startswith("127.0.0.")
    assert head["gcs_port"] == cluster.ports.gcs


def test_exec_runs_inside_the_head_job(cluster: RayCluster) -> None:
    out = cluster.ray("exec", str(cluster.path), "echo JOB=$SLURM_JOB_ID; ray status").stdout
    assert f"JOB={cluster.head()['job_id']}" in out
    assert "Autoscaler" in out or "Node status" in out


def test_get_head_ip(cluster: RayCluster) -> None:
    out = cluster.ray("get-head-ip", str(cluster.path)).stdout.strip().splitlines()[-1]
    assert out == cluster.head()["ip"]


def test_job_submit_scales_up_from_zero(cluster: RayCluster) -> None:
    t0 = time.monotonic()
    out = cluster.submit(
        "import ray, socket; ray.init();"
        "f = ray.remote(num_cpus=1)(lambda: ray.get_runtime_context().get_node_id());"
        "print('NODES', len(set(ray.get([f.remote() for _ in range(4)]))))"
    )
    TIMINGS["demand -> task done on new worker"] = time.monotonic() - t0
    assert re.search(r"NODES [1-3]", out), out
    assert len(cluster.jobs()) >= 2


def test_seed_examples_and_strict_spread(cluster: RayCluster) -> None:
    # `ray submit` = rsync to the head + exec there: covers the runner's file transfer.
    out = cluster.ray("submit", str(cluster.path), str(ROOT / "examples" / "seed_examples.py"),
                      timeout=900).stdout
    line = next(x for x in out.splitlines() if x.startswith("SEED_RESULTS "))
    res = json.loads(line.split(" ", 1)[1])
    assert res["get"] == [[i, ["Learning", "ray", "a", "b", "c", "d"][i]] for i in range(5)]
    assert len(res["wait"]) == 5 and res["actor"] == [1, 2, 3]
    assert res["pg_distinct_nodes"]["STRICT_PACK"] == 1
    assert res["pg_distinct_nodes"]["STRICT_SPREAD"] == 2
    # A STRICT_SPREAD group of 3 bundles needs 3 worker nodes: the autoscaler makes them.
    out = cluster.submit(
        "import ray; from ray.util.placement_group import placement_group; ray.init();"
        "pg = placement_group([{'CPU': 1}] * 3, strategy='STRICT_SPREAD');"
        "ray.get(pg.ready(), timeout=600); print('PG READY')", timeout=900)
    assert "PG READY" in out
    workers = [j for j, s in cluster.jobs() if j != cluster.head()["job_id"]]
    assert len(workers) >= 3


def test_gpu_node_type_scales_to_its_own_max(cluster: RayCluster) -> None:
    out = cluster.submit(
        "import ray, os; ray.init();"
        "g = ray.remote(num_gpus=1)(lambda: os.environ.get('CUDA_VISIBLE_DEVICES'));"
        "print('GPU', ray.get([g.remote() for _ in range(2)]))", timeout=900)
    assert re.search(r"GPU \['\d', '\d'\]", out), out
    status = cluster.ray("exec", str(cluster.path), "ray status").stdout
    assert "gpu_worker" in status


def test_idle_workers_are_cancelled(cluster: RayCluster) -> None:
    t0 = time.monotonic()
    wait_for(lambda: len(cluster.jobs()) == 1, 420, "idle workers to be scaled down",
             every=5)
    TIMINGS["idle scale-down (1 min timeout)"] = time.monotonic() - t0


def test_second_cluster_runs_beside_the_first(cluster: RayCluster,
                                              tmp_path_factory: pytest.TempPathFactory) -> None:
    cfg = yaml.safe_load(CONFIG.read_text())
    other = RayCluster(tmp_path_factory.mktemp("e2e-b"), "e2e-b", cfg)
    try:
        other.up()
        assert other.ports.gcs != cluster.ports.gcs
        assert "succeeded" in other.submit("import ray; ray.init(); print(ray.cluster_resources())")
        other.down()
        assert other.jobs() == []
    finally:
        other.cleanup()
    # The first cluster did not notice.
    assert len(cluster.jobs()) == 1
    assert "succeeded" in cluster.submit("import ray; ray.init(); print('still here')")


def test_down_leaves_nothing(cluster: RayCluster) -> None:
    ids = [j for j, _ in cluster.jobs()]
    TIMINGS["ray down"] = cluster.down()
    wait_for(lambda: squeue(f"ray-{cluster.name}") == [], 60, "jobs to leave squeue")
    wait_for(lambda: ray_pids_of(ids) == [], 60, "Ray processes of the cluster to exit")
    assert not cluster.cdir.head_info.exists()
