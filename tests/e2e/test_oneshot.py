"""`ray-slurm run` on the sandbox (issue 17.1): an ephemeral cluster for one entrypoint.

An entrypoint that needs workers (the head has no CPUs) and exits 3: `run` exits 3 and nothing
of the cluster remains. An entrypoint interrupted with SIGINT (Ctrl-C): `run` exits 130 and
nothing remains.
"""

from __future__ import annotations

import signal
import subprocess
import threading
from pathlib import Path

import pytest

from tests.e2e.harness import RAY, ROOT, RayCluster, wait_for

pytestmark = [pytest.mark.e2e]
CONFIG = ROOT / "cluster-configs" / "sandbox.yaml"
RAY_SLURM = str(Path(RAY).with_name("ray-slurm"))
NEEDS_WORKERS = (
    "import ray, sys; ray.init();"
    "f = ray.remote(num_cpus=1)(lambda: ray.get_runtime_context().get_node_id());"
    "print('WORKER NODES', len(set(ray.get([f.remote() for _ in range(2)]))), flush=True);"
    "sys.exit(3)")


def nothing_left(c: RayCluster) -> None:
    wait_for(lambda: c.jobs() == [], 90, "every job of the cluster to leave squeue", every=1)
    assert not c.cdir.head_file.exists()


def test_run_exits_with_the_entrypoints_code_and_leaves_nothing(
        sandbox: object, tmp_path: Path) -> None:
    c = RayCluster.from_file(tmp_path, "e2e-run", CONFIG)
    try:
        cp = subprocess.run([RAY_SLURM, "run", str(c.path), "--", "python", "-c",
                             NEEDS_WORKERS], capture_output=True, text=True, timeout=900,
                            env=c.base_env(), stdin=subprocess.DEVNULL, check=False)
        assert cp.returncode == 3, (cp.stdout[-2000:], cp.stderr[-4000:])
        assert "WORKER NODES" in cp.stdout, cp.stdout  # ran on autoscaled workers
        assert "ray down" in cp.stderr
        nothing_left(c)
    finally:
        c.cleanup()


def test_ctrl_c_stops_the_job_and_the_cluster(sandbox: object, tmp_path: Path) -> None:
    c = RayCluster.from_file(tmp_path, "e2e-run-int", CONFIG)
    p = subprocess.Popen([RAY_SLURM, "run", str(c.path), "--", "python", "-c",
                          "import time; print('STARTED', flush=True); time.sleep(900)"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=c.base_env(), stdin=subprocess.DEVNULL)
    out: list[str] = []
    err: list[str] = []
    readers = [threading.Thread(target=lambda s=s, o=o: o.extend(s), daemon=True)
               for s, o in ((p.stdout, out), (p.stderr, err))]
    for t in readers:
        t.start()
    try:
        wait_for(lambda: any("STARTED" in line for line in out), 600,
                 "the entrypoint to start", error=AssertionError)
        p.send_signal(signal.SIGINT)
        assert p.wait(timeout=300) == 130, "".join(err)[-4000:]
        for t in readers:
            t.join(10)
        assert "SIGINT: stopping the job and the cluster" in "".join(err)
        nothing_left(c)
    finally:
        if p.poll() is None:
            p.kill()
        c.cleanup()
