"""`ray-slurm run` and `ray-slurm sbatch` on the sandbox (issue 17): one-shot clusters.

An entrypoint that needs workers (the head has no CPUs) and exits 3: `run` exits 3 and nothing
of the cluster remains. An entrypoint interrupted with SIGINT (Ctrl-C): `run` exits 130 and
nothing remains. `sbatch` of the first entrypoint returns at once with the head's job id; the
head job ends FAILED with exit code 3, its log has the entrypoint's output, nothing remains.
`scancel` of a one-shot head while its workers run ends everything.
"""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
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


def sbatch(c: RayCluster, code: str) -> tuple[str, float]:
    t0 = time.monotonic()
    cp = subprocess.run([RAY_SLURM, "sbatch", str(c.path), "--", "python", "-c", code],
                        capture_output=True, text=True, timeout=300, env=c.base_env(),
                        stdin=subprocess.DEVNULL, check=False)
    took = time.monotonic() - t0
    assert cp.returncode == 0 and cp.stdout.strip().isdigit(), (cp.stdout, cp.stderr)
    return cp.stdout.strip(), took


def test_sbatch_returns_at_once_and_the_head_job_ends_with_the_entrypoint(
        sandbox: object, tmp_path: Path) -> None:
    c = RayCluster.from_file(tmp_path, "e2e-sbatch", CONFIG)
    try:
        head, took = sbatch(c, NEEDS_WORKERS)
        print("TIMINGS", json.dumps({"sbatch returned (s)": round(took, 1)}))
        wait_for(lambda: head not in [j for j, _ in c.jobs()], 900,
                 "the head job to end", every=2)
        show = subprocess.run(["scontrol", "show", "job", head], capture_output=True,
                              text=True, timeout=30, check=True).stdout
        assert "JobState=FAILED" in show and "ExitCode=3:0" in show, show
        log = c.cdir.log(head).read_text()
        assert "WORKER NODES" in log, log[-3000:]  # the entrypoint ran on autoscaled workers
        assert "the job ends with the entrypoint's exit code 3" in log
        nothing_left(c)
    finally:
        c.cleanup()


def test_scancel_of_a_one_shot_head_ends_everything(sandbox: object, tmp_path: Path) -> None:
    c = RayCluster.from_file(tmp_path, "e2e-sbatch-x", CONFIG)
    busy = ("import ray, time; ray.init();"
            "f = ray.remote(num_cpus=1)(lambda: time.sleep(900));"
            "refs = [f.remote() for _ in range(2)]; print('STARTED', flush=True); ray.get(refs)")
    try:
        head, _ = sbatch(c, busy)
        wait_for(lambda: len([j for j, st in c.jobs() if st == "RUNNING"]) >= 2, 600,
                 "a worker of the one-shot cluster to run", every=2)
        subprocess.run(["scancel", head], check=True, timeout=30)
        nothing_left(c)
    finally:
        c.cleanup()
