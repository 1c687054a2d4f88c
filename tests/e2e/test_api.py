"""The Python API (`ray_slurm_provider.SlurmCluster`) on the real sandbox, the whole cycle as a
notebook runs it: `with SlurmCluster(path) as c:` brings the head up, `c.request_resources`
brings a worker job up, `ray.init(c.address)` (Ray Client, from this process, which is no node
of the cluster) runs a task on it, `c.status()` lists both, `c.logs("head")` reads the head's
log, and leaving the block leaves no job of the cluster in squeue. Timings are printed
(pytest -s), never asserted.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import ray

from ray_slurm_provider import SlurmCluster, rayapi
from tests.e2e.harness import ROOT, RayCluster, wait_for

pytestmark = [pytest.mark.e2e]
CONFIG = ROOT / "cluster-configs" / "sandbox.yaml"
#: What reading `c.address` sets in this process (put back afterwards: later tests' commands
#: inherit the environment).
AUTH_VARS = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH")


def test_the_python_api_runs_the_whole_cycle(sandbox: object, tmp_path: Path) -> None:
    rc = RayCluster.from_file(tmp_path, "api", CONFIG)  # the config, its state in tmp_path
    timings: dict[str, float] = {}
    saved = {k: os.environ.get(k) for k in AUTH_VARS}
    t0 = time.monotonic()
    try:
        with SlurmCluster(rc.path) as c:
            timings["up"] = time.monotonic() - t0
            head = str(rc.head()["job_id"])
            assert [j for j, _ in rc.jobs()] == [head]
            t1 = time.monotonic()
            c.request_resources(num_cpus=1)
            wait_for(lambda: len(rc.jobs()) >= 2, 60, "a worker job for request_resources",
                     every=0.5)
            timings["request_resources -> worker job"] = time.monotonic() - t1
            try:  # a failed ray.init too: later modules' ray.init share this process
                ray.init(c.address)
                where = ray.remote(num_cpus=1)(
                    lambda: ray.get_runtime_context().get_node_id())
                worker_node = ray.get(where.remote(), timeout=120)
            finally:
                ray.shutdown()
            timings["task on the worker"] = time.monotonic() - t1
            nodes = c.status()["nodes"]
            assert [(n["job_id"], n["state"]) for n in nodes if n["kind"] == "head"] == [
                (head, "RUNNING")], nodes
            assert any(n["kind"] == "worker" and n["state"] == "RUNNING" and n["ray_up"]
                       for n in nodes), nodes
            assert worker_node
            assert "head" in c.status_table()
            assert c.logs("head").strip(), "the head's log is empty"
            t2 = time.monotonic()
        timings["down"] = time.monotonic() - t2
        assert rc.jobs() == []
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        rayapi.use_auth({})  # Ray reads them again: the tests after this one share the process
        if rc.jobs():
            rc.down()
            rc.cleanup()
        timings["total"] = time.monotonic() - t0
        print("TIMINGS", json.dumps({k: round(v, 1) for k, v in timings.items()}))
