"""A strict controller (issue 29): `sandbox up --strict`, the cluster run as a sandbox user.

Slurm exempts root and SlurmUser from rate limiting and PrivateData, so everything here runs
as the sandbox's first user (`--users 1`): `ray up`, the provider, the head's autoscaler and
every node agent share that user's one small token bucket (sandbox/strict.py). One cluster
serves the module, in file order: throttling is real, other users' jobs are hidden, the seeds'
workload, a burst to 8 workers (no duplicate submissions), a crash-looping type (held back,
never blamed on the purged jobs of a healthy type), a worker drained before its time limit and
replaced while a driver's tasks go on (running beside the tests before it), then `ray down`
leaves nothing, and `ray-slurm report` knows from accounting how every job ended, those
MinJobAge purged from the controller long before included. Needs `sandbox up --slurm 25.11
--accounting --users 1 --strict --cpus-per-node 4` (8 workers beside the head and the drained
worker). Figures are printed as `STRICT {...}` (pytest -s).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from ray_slurm_provider.jobs import decode_tags
from ray_slurm_provider.provider.submit import SUBMIT_TAG
from ray_slurm_provider.sandbox import Sandbox, files, strict
from tests.e2e import drivers
from tests.e2e.faults import ENDED_BY_US, Driver, walltime_jobs
from tests.e2e.harness import ROOT, brought_up, wait_for
from tests.e2e.users import UserCluster, user_venv

pytestmark = [pytest.mark.e2e, pytest.mark.strict]
NAME = "strict"
FIGURES: dict[str, Any] = {}
STATE: dict[str, Any] = {}
BURST = 8
#: Eight 1-CPU tasks that each hold their worker until all eight run: proof that eight
#: workers were up at once.
BURST_WORKLOAD = """
import json, time, ray
ray.init()
@ray.remote(num_cpus=1)
class Gate:
    def node(self):
        return ray.get_runtime_context().get_node_id()
gates = [Gate.remote() for _ in range(BURST)]
print("NODES=" + json.dumps(sorted(set(ray.get([g.node.remote() for g in gates],
                                               timeout=900)))))
""".replace("BURST", str(BURST))
CRASH = """
import ray
ray.init(log_to_driver=False)
ray.get(ray.remote(num_cpus=0, resources={"crash": 1})(lambda: 1).remote())
"""


def config() -> dict[str, Any]:
    cfg = yaml.safe_load((ROOT / "cluster-configs" / "sandbox.yaml").read_text())
    t = cfg["available_node_types"]
    del t["gpu_worker"]
    t["head"]["node_config"]["time"] = "1:00:00"
    t["cpu_worker"].update(max_workers=BURST, resources={"CPU": 1, "memory": 300_000_000})
    t["cpu_worker"]["node_config"].update(time="1:00:00", mem="700M")
    # Its jobs die in the prologue, before the agent runs; with MinJobAge=30 they soon leave
    # slurmctld, and the provider learns their end (FAILED) from accounting.
    t["crash_worker"] = {"resources": {"CPU": 0, "crash": 1}, "min_workers": 0,
                         "max_workers": 1,
                         "node_config": {"partition": "cpu", "cpus": 1, "time": "10",
                                         "prologue": ["echo 'module: command not found' >&2",
                                                      "exit 3"]}}
    # Time limit 2 minutes: told to stop 60 s before it (its agent drains Ray), then replaced.
    t["short_worker"] = {"resources": {"CPU": 0, "short": 1, "memory": 300_000_000},
                         "min_workers": 0, "max_workers": 1,
                         "node_config": {"partition": "cpu", "cpus": 1, "time": "2",
                                         "mem": "500M", "drain_before_limit_s": 60}}
    cfg["max_workers"] = BURST + 2
    cfg["idle_timeout_minutes"] = 0.5
    return cfg


def user_squeue(c: UserCluster, *args: str) -> subprocess.CompletedProcess[str]:
    return c.run(["squeue", "--noheader", *args], timeout=120)


def all_jobs(c: UserCluster) -> list[dict[str, str]]:
    """Every job of the user's cluster that slurmctld still knows (root sees them all),
    with its node type and submit tag."""
    out = subprocess.run(["squeue", "--noheader", "--states=all", f"--name={c.job_name}",
                          f"--user={c.user.name}", "--format=%i|%T|%k"], capture_output=True,
                         text=True, timeout=60, check=True).stdout
    rows = []
    for ln in out.splitlines():
        job_id, state, comment = ln.split("|", 2)
        tags = decode_tags(comment) or {}
        rows.append({"id": job_id, "state": state, "type": tags.get("ray-user-node-type", ""),
                     "submit": tags.get(SUBMIT_TAG, "")})
    return rows


@pytest.fixture(scope="module")
def strict_sandbox(sandbox: Sandbox) -> Sandbox:
    spec = files.read_spec(sandbox.layout)
    if spec is None or not spec.strict or not spec.accounting or not sandbox.users():
        pytest.fail("these tests need `ray-slurm sandbox up --slurm 25.11 --accounting "
                    "--users 1 --strict --cpus-per-node 4`")
    return sandbox


@pytest.fixture(scope="module")
def cluster(strict_sandbox: Sandbox) -> Iterator[UserCluster]:
    user = strict_sandbox.users()[0]
    venv = user_venv(strict_sandbox)
    c = UserCluster(user, venv, NAME, config(), strict_sandbox.env())
    # A run before this one (a reused sandbox keeps the user's ~/.ray_slurm) left its crash
    # counts: the crash test would pass on them without a crash of its own.
    (c.cdir.root / "errors.json").unlink(missing_ok=True)
    try:
        with brought_up(c) as took:
            FIGURES["ray up s"] = round(took, 1)
            yield c
    finally:
        print("STRICT", json.dumps(FIGURES, sort_keys=True))


def test_the_controller_is_strict_and_throttles_the_user(strict_sandbox: Sandbox) -> None:
    shown = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True,
                           timeout=60, check=True).stdout
    lines = strict.config_lines(shown)
    assert f"SlurmctldParameters = {strict.slurmctld_parameters()}" in lines, lines
    assert f"MinJobAge = {strict.MIN_JOB_AGE_S} sec" in lines, lines
    assert "PrivateData = jobs" in lines, lines
    user = strict_sandbox.users()[0]
    env = strict_sandbox.env()
    path = f"{env['PATH'].split(':')[0]}:/usr/bin:/bin" if "PATH" in env else "/usr/bin:/bin"
    # 25.11's `squeue --me` sends 3 RPCs (job user info, partitions, ...): 8 calls empty the
    # bucket and wait for its refill.
    n = 8
    t0 = time.monotonic()
    cp = subprocess.run(["runuser", "-u", user.name, "--", "env", f"PATH={path}",
                         f"SLURM_CONF={env['SLURM_CONF']}", "bash", "-c",
                         f"for i in $(seq {n}); do squeue --me --noheader || exit 1; done"],
                        capture_output=True, text=True, timeout=300, check=False)
    took = time.monotonic() - t0
    assert cp.returncode == 0, cp.stderr  # the client backs off by itself (23.11 on)
    log = Path(strict_sandbox.layout.log_dir, "slurmctld.log").read_text()
    assert re.search(rf"RPC rate limit exceeded by uid {user.uid} ", log), log[-2000:]
    FIGURES[f"{n} squeue by the user s"] = round(took, 1)
    assert took >= 2.0, took  # unthrottled, 8 calls take well under a second


def test_the_user_sees_only_their_own_jobs(cluster: UserCluster) -> None:
    root_job = subprocess.run(["sbatch", "--parsable", "-p", "cpu", "-t", "2", "--wrap",
                               "sleep 120"], capture_output=True, text=True, timeout=60,
                              check=True).stdout.strip()
    try:
        seen = user_squeue(cluster, "--format=%i")
        assert seen.returncode == 0, seen.stderr
        assert root_job not in seen.stdout.split(), seen.stdout
        assert str(cluster.head()["job_id"]) in seen.stdout.split(), seen.stdout
    finally:
        subprocess.run(["scancel", root_job], timeout=60, check=False)


def test_walltime_driver_starts(cluster: UserCluster) -> None:
    """Steps on `short_worker` nodes until three ran on a node other than the first: the
    first node was drained before its limit and a replacement took over."""
    STATE["wall"] = Driver(cluster, drivers.WALLTIME.format(seconds=420))


def test_seed_examples(cluster: UserCluster) -> None:
    script = Path(cluster.user.home) / "seed_examples.py"
    shutil.copy(ROOT / "examples" / "seed_examples.py", script)
    shutil.chown(script, cluster.user.uid, cluster.user.gid)
    t0 = time.monotonic()
    out = cluster.ray("submit", str(cluster.path), str(script), timeout=900).stdout
    FIGURES["seeds s"] = round(time.monotonic() - t0, 1)
    line = next(x for x in out.splitlines() if x.startswith("SEED_RESULTS "))
    res = json.loads(line.split(" ", 1)[1])
    assert res["get"] == [[i, ["Learning", "ray", "a", "b", "c", "d"][i]] for i in range(5)]
    assert res["actor"] == [1, 2, 3] and res["pg_distinct_nodes"]["STRICT_SPREAD"] == 2


def test_a_burst_to_8_workers_without_duplicates(cluster: UserCluster) -> None:
    t0 = time.monotonic()
    out = cluster.submit(BURST_WORKLOAD, timeout=900)
    FIGURES["burst to 8 s"] = round(time.monotonic() - t0, 1)
    nodes = json.loads(next(x for x in out.splitlines() if x.startswith("NODES="))[6:])
    assert len(nodes) == BURST, out
    workers = [j for j in all_jobs(cluster) if j["type"] == "cpu_worker"]
    tags = [(j["submit"], j["id"].split("_")[-1]) for j in workers]
    assert len(tags) == len(set(tags)), workers  # no submission queued twice
    cancelled_early = [j for j in workers if j["state"] == "CANCELLED"]
    FIGURES["worker jobs listed after the burst"] = len(workers)
    assert not cancelled_early, workers  # no stray: every submission got its answer in time


def crash_entry(errors: Path) -> dict[str, Any]:
    """crash_worker's entry in errors.json once it crashed twice, else {}."""
    try:
        entry = json.loads(errors.read_text()).get("crash_worker")
    except (OSError, ValueError):
        return {}
    return dict(entry) if entry and entry.get("failures", 0) >= 2 else {}


def test_a_crash_looping_type_is_held_back_and_idle_ends_are_no_crash(
        cluster: UserCluster) -> None:
    errors = cluster.cdir.root / "errors.json"
    assert not crash_entry(errors), "crash_worker crashed before its demand"
    sid = f"crash-{int(time.time())}"
    cluster.ray("job", "submit", "--address", cluster.dashboard, "--submission-id", sid,
                "--no-wait", "--", "python", "-c", CRASH)
    t0 = time.monotonic()
    try:
        entry = wait_for(lambda: crash_entry(errors), 420, "a second crash of crash_worker",
                         every=2)
    finally:
        cluster.ray("job", "stop", "--address", cluster.dashboard, sid, check=False)
    FIGURES["crash loop s"] = round(time.monotonic() - t0, 1)
    assert entry["kind"] == "crashed" and "module: command not found" in entry["message"], entry
    # The burst's workers went idle and were cancelled meanwhile; slurmctld purges them after
    # MinJobAge: none of that counts against cpu_worker.
    assert "cpu_worker" not in json.loads(errors.read_text()), errors.read_text()


def sacct(job_id: str) -> dict[str, str]:
    """What accounting says of a job (root sees every user's)."""
    out = subprocess.run(["sacct", "-X", "-n", "-P", "-j", job_id,
                          "--format=JobID,State,ElapsedRaw,TimelimitRaw"], capture_output=True,
                         text=True, timeout=60, check=True).stdout
    row = next(ln.split("|") for ln in out.splitlines() if ln.split("|")[0] == job_id)
    got = dict(zip(("id", "state", "elapsed_s", "limit_min"), row, strict=True))
    got["state"] = got["state"].split()[0]  # "CANCELLED by 1001"
    return got


def test_walltime_drains_and_replaces_without_losing_tasks(cluster: UserCluster) -> None:
    jobs = walltime_jobs(STATE["wall"])
    # The first job left slurmctld MinJobAge after it ended: only accounting knows it now.
    first = sacct(jobs[0])
    log = (cluster.cdir.logs / f"{jobs[0]}.out").read_text()
    limit, ran = int(first["limit_min"]) * 60, int(first["elapsed_s"])
    FIGURES["walltime"] = {"limit s": limit, "ran s": ran, "state": first["state"],
                           "jobs": jobs}
    # Drained on Slurm's signal before the limit: ended by its agent or our cancel.
    assert first["state"] in ENDED_BY_US and "signal 15" in log, (first, log[-2000:])
    assert "from its time limit (drain_before_limit_s: 60)" in log, log[-2000:]
    assert ran < limit, first
    STATE["drained"] = jobs[0]


def test_down_leaves_nothing(cluster: UserCluster) -> None:
    t0 = time.monotonic()
    cluster.down()
    FIGURES["ray down s"] = round(time.monotonic() - t0, 1)
    live = [j for j in all_jobs(cluster) if j["state"] in ("PENDING", "RUNNING", "COMPLETING")]
    assert live == [], live


def test_report_says_how_every_job_ended(cluster: UserCluster) -> None:
    """After `ray down` slurmctld has purged most of the run's jobs (MinJobAge): the report
    asks accounting, as the user (PrivateData=jobs), how each ended."""
    ray_slurm = str(cluster.venv / "bin" / "ray-slurm")
    cp = cluster.run([ray_slurm, "report", str(cluster.path), "--json"], timeout=120)
    assert cp.returncode == 0, cp.stderr
    data = json.loads(cp.stdout)
    jobs = {j["job"]: j for j in data["jobs"]}
    FIGURES["report"] = {"jobs": len(jobs), "notes": data["notes"],
                         "ended_by": {t: v["ended_by"] for t, v in data["types"].items()}}
    assert not data["notes"], data["notes"]  # accounting answered
    unknown = [j for j in jobs.values() if j["end"] in ("unknown", "active")]
    assert unknown == [], unknown
    # Billing is accounting's TRES of the allocation: every job that started has one.
    assert all(j["billing"] for j in jobs.values() if j["started"]), jobs
    ends = {t: {j["end"] for j in jobs.values() if j["type"] == t and j["job"] !=
                STATE["drained"]} for t in data["types"]}
    # Jobs a stop of ours ended are ours, never failures (their agents end them cleanly). A
    # worker that left the queue (its head gone at `ray down`) before the provider listed it
    # for the cancel is "completed"; so is the drained worker's replacement, drained in turn.
    assert ends["head"] == {"ray down"}, ends
    assert ends["cpu_worker"] <= {"autoscaler", "ray down", "completed"}, ends
    assert ends["short_worker"] <= {"autoscaler", "ray down", "completed"}, ends
    assert ends["crash_worker"] == {"failure"}, ends
    drained = jobs[STATE["drained"]]  # its agent drained Ray on Slurm's signal, then ended it
    assert drained["type"] == "short_worker" and drained["state"] in ENDED_BY_US, drained
