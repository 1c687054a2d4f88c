"""`ray-slurm run` and `ray-slurm sbatch` on the sandbox (issue 17): one-shot clusters.

An entrypoint that needs workers (the head has no CPUs) and exits 3: `run` exits 3 and nothing
of the cluster remains. An entrypoint interrupted with SIGINT (Ctrl-C): `run` exits 130 and
nothing remains. `sbatch` of the first entrypoint returns at once with the head's job id; the
head job ends FAILED with exit code 3, its log has the entrypoint's output, nothing remains.
`scancel` of a one-shot head while its workers run ends everything. Two `sbatch` runs of one
YAML queued back to back both finish (each is its own cluster, issue 26.1), and a setup
command that fails when run twice (`mkdir`) runs once in each (issue 26.2).
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from ray_slurm_provider.jobs import job_name
from ray_slurm_provider.state import ClusterDir
from tests.e2e.harness import RAY, ROOT, RayCluster, squeue, wait_for

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


@dataclass
class Run:
    """One `ray-slurm sbatch` run: its head job, its own cluster name and dir (issue 26.1)."""

    head: str
    took: float
    name: str
    cdir: ClusterDir

    def jobs(self) -> list[tuple[str, str]]:
        return squeue(job_name(self.name))

    def cleanup(self) -> None:
        subprocess.run(["scancel", f"--name={job_name(self.name)}"], timeout=30, check=False)


def sbatch(c: RayCluster, code: str) -> Run:
    t0 = time.monotonic()
    cp = subprocess.run([RAY_SLURM, "sbatch", str(c.path), "--", "python", "-c", code],
                        capture_output=True, text=True, timeout=300, env=c.base_env(),
                        stdin=subprocess.DEVNULL, check=False)
    took = time.monotonic() - t0
    assert cp.returncode == 0 and cp.stdout.strip().isdigit(), (cp.stdout, cp.stderr)
    m = re.search(r"ray-slurm sbatch: run (\S+) ", cp.stderr)
    assert m, cp.stderr
    name = f"{c.name}-{m.group(1)}"
    return Run(cp.stdout.strip(), took, name, ClusterDir(str(c.state_dir), name))


def ended(run: Run, timeout: float = 900) -> str:
    """Wait for the run's head to leave the queue; `scontrol show job` of it."""
    wait_for(lambda: run.head not in [j for j, _ in run.jobs()], timeout,
             f"head job {run.head} to end", every=2)
    return subprocess.run(["scontrol", "show", "job", run.head], capture_output=True,
                          text=True, timeout=30, check=True).stdout


def run_left_nothing(run: Run) -> None:
    wait_for(lambda: run.jobs() == [], 90, "every job of the run to leave squeue", every=1)
    assert not run.cdir.head_file.exists()
    assert not (run.cdir.root / "oneshot").exists() or not any(
        (run.cdir.root / "oneshot").iterdir())


def test_sbatch_returns_at_once_and_the_head_job_ends_with_the_entrypoint(
        sandbox: object, tmp_path: Path) -> None:
    c = RayCluster.from_file(tmp_path, "e2e-sbatch", CONFIG)
    run = None
    try:
        run = sbatch(c, NEEDS_WORKERS)
        print("TIMINGS", json.dumps({"sbatch returned (s)": round(run.took, 1)}))
        show = ended(run)
        assert "JobState=FAILED" in show and "ExitCode=3:0" in show, show
        log = run.cdir.log(run.head).read_text()
        assert "WORKER NODES" in log, log[-3000:]  # the entrypoint ran on autoscaled workers
        assert "the job ends with the entrypoint's exit code 3" in log
        run_left_nothing(run)
    finally:
        if run is not None:
            run.cleanup()


def test_scancel_of_a_one_shot_head_ends_everything(sandbox: object, tmp_path: Path) -> None:
    c = RayCluster.from_file(tmp_path, "e2e-sbatch-x", CONFIG)
    busy = ("import ray, time; ray.init();"
            "f = ray.remote(num_cpus=1)(lambda: time.sleep(900));"
            "refs = [f.remote() for _ in range(2)]; print('STARTED', flush=True); ray.get(refs)")
    run = None
    try:
        run = sbatch(c, busy)
        r = run
        wait_for(lambda: len([j for j, st in r.jobs() if st == "RUNNING"]) >= 2, 600,
                 "a worker of the one-shot cluster to run", every=2)
        subprocess.run(["scancel", run.head], check=True, timeout=30)
        run_left_nothing(run)
    finally:
        if run is not None:
            run.cleanup()


def test_two_sbatch_runs_of_one_yaml_queued_back_to_back_both_finish(
        sandbox: object, tmp_path: Path) -> None:
    """Issue 26.1: the first run's end cancelled every job of the cluster's name, the second
    run's queued head included; each run is now its own cluster. Issue 26.2: `sbatch` ran
    setup_commands twice (once as setup, once inside Ray's head setup), so a `mkdir` failed
    the head before Ray started: each run's head makes its own dir, once."""
    marks = tmp_path / "setup"
    marks.mkdir()
    c = RayCluster.from_file(tmp_path, "e2e-sbatch-2", CONFIG,
                             setup_commands=[f"mkdir {marks}/$SLURM_JOB_ID"])
    code = "import ray; ray.init(); print('RUN DONE', flush=True)"
    runs: list[Run] = []
    try:
        runs = [sbatch(c, code) for _ in range(2)]
        assert runs[0].name != runs[1].name
        for run in runs:
            show = ended(run)
            log = run.cdir.log(run.head).read_text()
            assert "JobState=COMPLETED" in show and "ExitCode=0:0" in show, (show, log[-3000:])
            assert "RUN DONE" in log
            run_left_nothing(run)
        assert sorted(p.name for p in marks.iterdir()) == sorted(r.head for r in runs)
    finally:
        for run in runs:
            run.cleanup()
