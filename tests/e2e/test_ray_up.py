"""`ray up` ... `ray down` on the real sandbox: Ray as bare processes, autoscaler v2 (default).

One cluster is brought up once for the module; the tests run in file order against it, as a
user would: up, exec, submit, scale up on demand, scale down when idle, a second cluster
beside it, then down. Timings are printed (pytest -s) for the closing notes, never asserted.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from ray_slurm_provider.jobs import temp_dir
from tests.e2e import browser, procfs
from tests.e2e.harness import RAY, ROOT, RayCluster, printed, squeue, wait_for

pytestmark = [pytest.mark.e2e]
CONFIG = ROOT / "cluster-configs" / "sandbox.yaml"
TIMINGS: dict[str, float] = {}
STATE: dict[str, str] = {}


@pytest.fixture(scope="module")
def cluster(sandbox: object, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayCluster]:
    # Idle workers leave after 30 s, not the example's minute: the idle test waits for them.
    c = RayCluster.from_file(tmp_path_factory.mktemp("e2e"), "e2e", CONFIG,
                             idle_timeout_minutes=0.5)
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
    dirs = [temp_dir("/tmp", j) + "/" for j in job_ids]
    return [pid for pid, cmd in procfs.cmdlines() if any(d in cmd for d in dirs)]


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


def test_second_ray_up_updates_the_same_head(cluster: RayCluster) -> None:
    head = cluster.head()["job_id"]
    TIMINGS["ray up on a running cluster"] = cluster.up()
    assert [j for j, _ in cluster.jobs()] == [head]
    assert str(cluster.head()["job_id"]) == head


def test_submit_from_the_home_directory(cluster: RayCluster) -> None:
    """Issue 14.5: `ray submit` of a script in the home directory copies it onto itself
    (`~/<name>` on the head is the same file on the shared filesystem): that failed with
    shutil.SameFileError."""
    script = Path.home() / f"rsp-e2e-submit-{os.getpid()}.py"
    script.write_text("print('SUBMITTED', 6 * 7)\n")
    try:
        cp = cluster.ray("submit", str(cluster.path), str(script), timeout=300, check=False)
    finally:
        script.unlink(missing_ok=True)
    assert cp.returncode == 0 and "SUBMITTED 42" in cp.stdout + cp.stderr, cp.stderr[-2000:]


def test_attach_rsync_and_dashboard(cluster: RayCluster, tmp_path: Path) -> None:
    cp = subprocess.run([RAY, "attach", str(cluster.path)], input="echo ATTACHED $SLURM_JOB_ID\n"
                        "exit\n", capture_output=True, text=True, timeout=120, env=cluster.env())
    assert f"ATTACHED {cluster.head()['job_id']}" in cp.stdout, cp.stdout + cp.stderr
    src = tmp_path / "up.txt"
    src.write_text("hello")
    remote = str(cluster.cdir.root / "rsync-test.txt")
    cluster.ray("rsync-up", str(cluster.path), str(src), remote)
    cluster.ray("rsync-down", str(cluster.path), remote, str(tmp_path / "down.txt"))
    assert (tmp_path / "down.txt").read_text() == "hello"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dash = subprocess.Popen([RAY, "dashboard", "-p", str(port), str(cluster.path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=cluster.env(), start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}/api/version"
        wait_for(lambda: _status(url) != 0, 60, "the forwarded dashboard", every=0.5)
        assert _status(url) == 401  # token auth: refused without the token
        token = (cluster.cdir.root / "auth_token").read_text().strip()
        assert _status(url, token) == 200
    finally:
        dash.terminate()
        dash.wait(timeout=30)


def _status(url: str, token: str = "") -> int:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token
                                 else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)
    except OSError:
        return 0


def test_job_submit_scales_up_from_zero(cluster: RayCluster) -> None:
    """Also: the driver (on the head) and the tasks (on new workers) run the login side's Ray,
    the one that ran `ray up` (provider.python; CI runs this module on the lowest Ray that
    pyproject.toml declares too)."""
    t0 = time.monotonic()
    out = cluster.submit(
        "import ray, socket; ray.init();"
        "f = ray.remote(num_cpus=1)(lambda: (ray.get_runtime_context().get_node_id(),"
        " ray.__version__));"
        "got = ray.get([f.remote() for _ in range(4)]);"
        "print('NODES', len({n for n, _ in got}));"
        "print('VERSIONS', sorted({ray.__version__} | {v for _, v in got}))"
    )
    TIMINGS["demand -> task done on new worker"] = time.monotonic() - t0
    assert re.search(r"NODES [1-3]", out), out
    assert f"VERSIONS {[login_ray_version()]}" in out, out
    assert len(cluster.jobs()) >= 2


def login_ray_version() -> str:
    """The Ray of the `ray` that the tests run (asked of that `ray`, not imported here)."""
    cp = subprocess.run([RAY, "--version"], capture_output=True, text=True, timeout=60,
                        check=True)
    return cp.stdout.split()[-1]


def ray_slurm(cluster: RayCluster, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(Path(RAY).with_name("ray-slurm")), *args], capture_output=True,
                          text=True, timeout=60, env=cluster.base_env(), check=False)


def test_ray_logs_of_a_scancelled_worker_outlive_its_job(cluster: RayCluster) -> None:
    """Issue 17.3: the agent keeps a node's Ray logs in the cluster dir when its job ends."""
    head = str(cluster.head()["job_id"])
    # A worker whose Ray is up: the autoscaler may have just started another (on 26.05 it
    # was often first in the listing, cancelled before Ray had written any log).
    worker = wait_for(lambda: next((j for j, st in cluster.jobs() if j != head and
                                    st == "RUNNING" and cluster.cdir.ray_up(j)), None),
                      120, "a worker with Ray up")
    subprocess.run(["scancel", worker], check=True, timeout=30, env=cluster.env())
    wait_for(lambda: worker not in [j for j, _ in cluster.jobs()], 60, "the worker to end")
    listing = ray_slurm(cluster, "logs", str(cluster.path), worker, "--ray")
    assert listing.returncode == 0 and "raylet.out" in listing.stdout, listing.stderr
    raylet = ray_slurm(cluster, "logs", str(cluster.path), worker, "--ray", "raylet.out")
    assert raylet.returncode == 0 and raylet.stdout.strip(), raylet.stderr
    STATE["scancelled worker"] = worker
    # Issue 31: the report, while the cluster runs, knows who ended it (the controller, as
    # the sandbox keeps no accounting: the records keep its answer for after MinJobAge).
    wait_for(lambda: report(cluster).get(worker, {}).get("end") == "scancel", 60,
             "the report to say the worker was scancelled", every=2)


def report(cluster: RayCluster, *args: str) -> dict[str, dict[str, Any]]:
    """`ray-slurm report CFG --json`'s jobs by id."""
    cp = ray_slurm(cluster, "report", str(cluster.path), "--json", *args)
    assert cp.returncode == 0, cp.stderr
    data = json.loads(cp.stdout)
    STATE["report"] = data
    return {j["job"]: j for j in data["jobs"]}


def test_tools_in_a_shell_after_ray_slurm_env(cluster: RayCluster) -> None:
    """Issue 14.16: after `eval "$(ray-slurm env CONFIG)"`, ray.init(), `ray status` and
    `ray job submit` all reach the cluster (RAY_ADDRESS was the dashboard URL, which made
    ray.init() and `ray status` crash)."""
    script = f"""set -e
eval "$(ray-slurm env {cluster.path})"
python -c 'import ray; ray.init(); print("INIT", len(ray.nodes()) >= 1); ray.shutdown()'
ray status | grep -q "Node status" && echo STATUS ok
ray job submit -- python -c 'print("JOB", 6 * 7)'
"""
    env = cluster.base_env()  # nothing of the harness's own Ray settings
    for k in [k for k in env if k.startswith("RAY_")]:
        env.pop(k)
    cp = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env,
                        timeout=300, check=False, cwd=ROOT)
    out = cp.stdout + cp.stderr
    assert cp.returncode == 0, out
    assert "INIT True" in out and "STATUS ok" in out and "JOB 42" in out, out


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


def test_second_cluster_runs_beside_the_first(cluster: RayCluster,
                                              tmp_path_factory: pytest.TempPathFactory) -> None:
    """Runs while the first cluster's workers go idle: the next test waits for their
    scale-down, which this test's time counts towards.

    The second cluster has `auth: {mode: disabled}` and a home (login side and nodes) with a
    leftover `~/.ray/auth_token`, as a shared $HOME has after any `ray get-auth-token
    --generate`. From Ray 2.59 `ray start --head` switches token auth on by itself when that
    file exists and RAY_AUTH_MODE is unset; a worker started with the mode the provider set
    could then not join. The provider sets the mode on every node, so the cluster keeps the
    mode it was configured with: the dashboard answers without a token and a task runs on a
    new worker."""
    head = str(cluster.head()["job_id"])
    tmp = tmp_path_factory.mktemp("e2e-b")
    home = tmp / "home"
    leftover = home / ".ray" / "auth_token"
    leftover.parent.mkdir(parents=True)
    leftover.write_text("leftover" * 8)
    cfg = yaml.safe_load(CONFIG.read_text())
    cfg["provider"]["auth"] = {"mode": "disabled"}
    cfg["provider"]["environment"] = {"HOME": str(home)}
    other = RayCluster(tmp, "e2e-b", cfg)
    other.extra_env["HOME"] = str(home)
    try:
        other.up()
        assert other.ports.gcs != cluster.ports.gcs
        assert _status(f"{other.dashboard}/api/version") == 200  # no token asked for
        # Node ids, not addresses: the worker's job may land on the head's Slurm node.
        # The entrypoint (the driver) runs on the head.
        out = other.submit(
            "import ray; ray.init();"
            "node = lambda: ray.get_runtime_context().get_node_id();"
            "f = ray.remote(num_cpus=1)(node);"
            "print('NODES', node(), ray.get(f.remote()))", timeout=600)
        head_node, task_node = printed(out, "NODES")
        assert task_node != head_node, out
        assert leftover.read_text() == "leftover" * 8
        other.down()
        # scancel is sent by then; a job may still be COMPLETING (its processes exiting).
        wait_for(lambda: other.jobs() == [], 60, "the second cluster's jobs to end",
                 every=0.5)
    finally:
        other.cleanup()
    # The first cluster did not notice: the same head, still answering. (Its idle workers
    # may be leaving meanwhile: the next test waits for that.)
    assert str(cluster.head()["job_id"]) == head
    assert (head, "RUNNING") in cluster.jobs()
    assert "succeeded" in cluster.submit("import ray; ray.init(); print('still here')")


def test_idle_workers_are_cancelled(cluster: RayCluster) -> None:
    t0 = time.monotonic()
    wait_for(lambda: len(cluster.jobs()) == 1, 420, "idle workers to be scaled down",
             every=5)
    TIMINGS["idle scale-down (30 s timeout), after the second cluster's test"] = (
        time.monotonic() - t0)


def test_down_leaves_nothing(cluster: RayCluster) -> None:
    ids = [j for j, _ in cluster.jobs()]
    TIMINGS["ray down"] = cluster.down()
    # Issue 18 (P6): `ray down` returns once Slurm has ended every job (COMPLETING included).
    assert squeue(f"ray-{cluster.name}") == []
    wait_for(lambda: ray_pids_of(ids) == [], 60, "Ray processes of the cluster to exit")
    assert not cluster.cdir.head_file.exists()
    # Issue 14.19: the head's log is what one needs after `ray down` (or a crash).
    cp = subprocess.run([str(Path(RAY).with_name("ray-slurm")), "logs", str(cluster.path),
                         "head"], capture_output=True, text=True, timeout=60,
                        env=cluster.base_env(), check=False)
    assert cp.returncode == 0 and "[ray-slurm " in cp.stdout, cp.stderr
    # Issue 17.3: Ray's logs of the head, and of the worker scancelled earlier, after `ray down`.
    for job in ("head", STATE["scancelled worker"]):
        listing = ray_slurm(cluster, "logs", str(cluster.path), job, "--ray")
        assert listing.returncode == 0 and "raylet.out" in listing.stdout, (job, listing)
    monitor = ray_slurm(cluster, "logs", str(cluster.path), "head", "--ray", "monitor.log")
    assert "Autoscaler" in monitor.stdout or "autoscaler" in monitor.stdout, monitor


def test_report_after_down_in_a_browser(cluster: RayCluster, tmp_path: Path) -> None:
    """Issue 31: after `ray down`, `ray-slurm report` has every job of the run, each ended and
    by whom; its page, opened headless, has one bar per job with the same ends and totals,
    and loads nothing over the network."""
    jobs = report(cluster)
    data = STATE["report"]
    head = cluster.cdir.read_head()  # gone after `ray down`: the records still name it
    assert head is None and len(jobs) >= 3, jobs
    heads = [j for j in jobs.values() if j["kind"] == "head"]
    assert [j["end"] for j in heads] == ["ray down"], heads
    assert jobs[STATE["scancelled worker"]]["end"] == "scancel"
    assert all(j["ended"] and j["end"] != "active" for j in jobs.values()), jobs
    assert any(j["end"] == "autoscaler" for j in jobs.values()), jobs  # idle scale-down
    assert all(j["ray_up"] for j in heads) and data["ended"] and data["wall_s"] > 0
    records = cluster.cdir.root / "history" / f"{data['run']}.jsonl"
    print("REPORT records bytes", records.stat().st_size, "jobs", len(jobs))
    html = tmp_path / "report.html"
    cp = ray_slurm(cluster, "report", str(cluster.path), "--html", str(html))
    assert cp.returncode == 0 and html.is_file(), cp.stderr
    t0 = time.monotonic()
    with browser.page(html) as page:
        bars = page.find_elements("css selector", "g.job")
        assert sorted(b.get_attribute("data-job") for b in bars) == sorted(jobs)
        assert {b.get_attribute("data-job"): b.get_attribute("data-end") for b in bars} == {
            k: j["end"] for k, j in jobs.items()}
        total = page.find_element("css selector", "#totals .card b").text
        assert total == str(sum(t["jobs"] for t in data["types"].values()))
        assert browser.network_entries(page) == []
        shot = tmp_path / "report.png"
        browser.full_screenshot(page, shot)
        assert shot.stat().st_size > 10_000
        keep = os.environ.get("RSP_REPORT_SCREENSHOT")
        if keep:
            Path(keep).write_bytes(shot.read_bytes())
    TIMINGS["report page in the browser"] = time.monotonic() - t0
