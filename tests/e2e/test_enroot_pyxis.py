"""Ray in Enroot and in Pyxis containers on the sandbox, live (`sandbox up --pyxis`):
`cluster-configs/sandbox-enroot.yaml` (the agent runs `enroot create` and `enroot start`) and
`cluster-configs/sandbox-pyxis.yaml` (the agent runs an `srun --container-image` step).

One cluster per runtime, shared by the module's tests in order. Checks: the head's raylet runs
in a mount namespace other than the host's and its job's; `ray exec` enters the head's
container; tasks, an actor, put/get/wait and a placement group run on an autoscaled worker,
in its container; a worker drained before its time limit (Slurm's signal) is replaced while
a driver's steps go on, and its container goes with it; a sandbox user's cluster of the same
name on the head's node keeps its containers and data apart from root's, and its `ray down`
leaves root's alone; `scancel` of a worker, then `ray down`, leave no job, no Ray process,
no enroot container and no unpacked root filesystem.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from ray_slurm_provider.jobs import temp_dir
from ray_slurm_provider.sandbox import Sandbox, image
from tests.e2e import drivers, procfs
from tests.e2e.faults import ENDED_BY_US, Driver, run_time_s, show_job, walltime_jobs
from tests.e2e.harness import ROOT, RayCluster, brought_up, wait_for
from tests.e2e.users import UserCluster, user_venv
from tests.integration.test_pyxis_sandbox import leftovers

pytestmark = [pytest.mark.e2e, pytest.mark.pyxis]
TIMINGS: dict[str, float] = {}
#: Jobs each cluster ran (head and workers), for the checks after `ray down`.
JOBS: dict[str, set[str]] = {}
#: The walltime driver of each cluster.
WALL: dict[str, Driver] = {}
#: How long a job's end may take to clear its container (pyxis: the job's epilog).
CLEAN_S = 60.0
WORKLOAD = """
import json, os, ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
ray.init()
def where():
    return [os.environ.get("SLURM_JOB_ID"), os.readlink("/proc/self/ns/mnt")]
f = ray.remote(num_cpus=1)(where)
refs = [f.remote() for _ in range(3)]
ready, _ = ray.wait(refs, num_returns=3, timeout=600)
tasks = ray.get(ready)
@ray.remote(num_cpus=1)
class Summer:
    def __init__(self, data):
        self.total = sum(data)
    def get(self):
        return [self.total, where()]
actor = Summer.remote(ray.put(list(range(100))))
total, in_actor = ray.get(actor.get.remote())
ray.kill(actor)
pg = placement_group([{"CPU": 1}])
ray.get(pg.ready(), timeout=600)
in_pg = ray.get(f.options(scheduling_strategy=PlacementGroupSchedulingStrategy(pg)).remote())
remove_placement_group(pg)
print("RESULT", json.dumps({"tasks": tasks, "total": total, "actor": in_actor, "pg": in_pg}))
"""


def mount_ns(pid: int | str) -> str:
    return os.readlink(f"/proc/{pid}/ns/mnt")


def ray_pids(jobs: set[str]) -> list[int]:
    """Processes of Ray below the temp dir of one of `jobs` (Ray names it in their argv)."""
    dirs = tuple(temp_dir("/tmp", j) + "/" for j in jobs)
    return [pid for pid, cmd in procfs.cmdlines() if any(d in cmd for d in dirs)]


def job_pids(job: str, needle: str) -> list[int]:
    return [pid for pid, cmd in procfs.cmdlines()
            if needle in cmd and procfs.environ(pid).get("SLURM_JOB_ID") == job]


def left_of(sandbox: Sandbox, cluster: RayCluster, jobs: set[str]) -> list[str]:
    """What root's enroot keeps of `jobs` (containers, roots, mounts: their names hold
    `rsp-<cluster>-<job>`, pyxis's as `pyxis_<job>_rsp-<cluster>-<job>`), drained nodes."""
    names = re.compile("|".join(rf"rsp-{cluster.name}-{j}(?!\d)" for j in jobs))
    return [x for x in leftovers(sandbox, None) if "drain" in x or names.search(x)]


def remains(sandbox: Sandbox, cluster: RayCluster, jobs: set[str]) -> list[str]:
    """Everything of `jobs` still there: Slurm jobs, Ray processes, enroot's leftovers."""
    queued = [f"job {j}" for j, _ in cluster.jobs() if j in jobs]
    procs = [f"pid {p}" for p in ray_pids(jobs)]
    return queued + procs + left_of(sandbox, cluster, jobs)


def settle(sandbox: Sandbox, cluster: RayCluster, jobs: set[str]) -> list[str]:
    """Poll `remains` until it is empty or CLEAN_S passed; return the last."""
    deadline = time.monotonic() + CLEAN_S
    left = remains(sandbox, cluster, jobs)
    while left and time.monotonic() < deadline:
        time.sleep(0.5)
        left = remains(sandbox, cluster, jobs)
    return left


@pytest.fixture(scope="module", params=["enroot", "pyxis"])
def cluster(request: pytest.FixtureRequest, sandbox: Sandbox,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayCluster]:
    rt = request.param
    if not sandbox.spec.pyxis:
        pytest.fail("the sandbox runs without enroot and pyxis: start it with `ray-slurm "
                    "sandbox up --pyxis`")
    sqsh = os.path.join(sandbox.layout.shared_dir, image.FILE_NAMES["enroot"])
    if not os.path.isfile(sqsh):
        image.build(sqsh, "enroot")
    c = RayCluster.from_file(tmp_path_factory.mktemp(rt), f"e2e-{rt}",
                             ROOT / "cluster-configs" / f"sandbox-{rt}.yaml")
    config = c.path.read_text().replace("/tmp/rsp-sandbox/shared/rsp-bind.sqsh", sqsh)
    assert sqsh in config  # the example's image, at this sandbox's state dir
    cfg = yaml.safe_load(config)
    types = cfg["available_node_types"]
    # Time limit 2 minutes: Slurm signals it 60 s before, Ray drains, a replacement follows.
    types["short_worker"] = {
        "resources": {"CPU": 0, "short": 1}, "min_workers": 0, "max_workers": 1,
        "node_config": {**types["cpu_worker"]["node_config"], "time": "2",
                        "drain_before_limit_s": 60}}
    cfg["max_workers"] += 1
    c.path.write_text(yaml.safe_dump(cfg))
    JOBS[rt] = set()
    try:
        TIMINGS[f"{rt}: ray up"] = c.up()
        JOBS[rt].add(str(c.head()["job_id"]))
        yield c
    finally:
        c.down()
        c.cleanup()
        print("TIMINGS", json.dumps({k: round(v, 1) for k, v in TIMINGS.items()}))


def runtime(cluster: RayCluster) -> str:
    return cluster.name.rsplit("-", 1)[1]


def test_walltime_driver_starts(cluster: RayCluster) -> None:
    """Steps on `short_worker` nodes until three ran on a node other than the first (checked
    by test_walltime_drains_..., the tests between run meanwhile)."""
    WALL[runtime(cluster)] = Driver(cluster, drivers.WALLTIME.format(seconds=420))


def test_the_heads_raylet_runs_in_a_mount_namespace_of_its_own(cluster: RayCluster) -> None:
    head = str(cluster.head()["job_id"])
    raylets = job_pids(head, "/raylet ")
    agents = job_pids(head, "ray_slurm_provider.agent")
    assert raylets and agents, (raylets, agents)
    ns = mount_ns(raylets[0])
    assert ns != mount_ns("self")  # the host's
    assert ns != mount_ns(agents[0])  # the job's (its slurmd's, with --pyxis)
    log = cluster.cdir.log(head)
    wait_for(lambda: "the head's container" in log.read_text(), 60,
             "the agent's Slurm probe from inside the container")
    assert "Slurm is reachable from inside the head's container" in log.read_text()


def test_ray_exec_enters_the_heads_container(cluster: RayCluster) -> None:
    head = str(cluster.head()["job_id"])
    assert os.path.isdir("/var/lib")  # the host has it; the image does not
    out = cluster.ray("exec", str(cluster.path),
                      "test -d /var/lib || echo IN_IMAGE; echo JOB=$SLURM_JOB_ID;"
                      " readlink /proc/self/ns/mnt; ray status").stdout
    assert "IN_IMAGE" in out and f"JOB={head}" in out and "Active:" in out, out
    assert mount_ns("self") not in out


def test_workload_runs_on_an_autoscaled_worker_in_its_container(cluster: RayCluster) -> None:
    head = str(cluster.head()["job_id"])
    t0 = time.monotonic()
    out = cluster.submit(WORKLOAD, timeout=300)
    TIMINGS[f"{runtime(cluster)}: workload on a new worker"] = time.monotonic() - t0
    result = json.loads(next(ln for ln in out.splitlines()
                             if ln.startswith("RESULT "))[len("RESULT "):])
    assert result["total"] == sum(range(100))
    places = [*result["tasks"], result["actor"], result["pg"]]
    host = mount_ns("self")
    for job, ns in places:
        assert job != head and ns != host, places
    JOBS[runtime(cluster)] |= {job for job, _ in places}


def test_scancel_of_a_worker_leaves_nothing_of_it(cluster: RayCluster, sandbox: Sandbox) -> None:
    workers = JOBS[runtime(cluster)] - {str(cluster.head()["job_id"])}
    assert workers
    job = sorted(workers)[0]
    assert ray_pids({job}) and left_of(sandbox, cluster, {job})  # it runs, in a container
    t0 = time.monotonic()
    subprocess.run(["scancel", job], check=True, timeout=30)
    left = settle(sandbox, cluster, {job})
    assert not left, f"left of job {job} after {CLEAN_S:.0f}s: {left}"
    TIMINGS[f"{runtime(cluster)}: scancel -> nothing left"] = time.monotonic() - t0


def test_walltime_drains_and_replaces_without_losing_tasks(cluster: RayCluster,
                                                         sandbox: Sandbox) -> None:
    jobs = walltime_jobs(WALL[runtime(cluster)])
    JOBS[runtime(cluster)] |= set(jobs)
    first = show_job(jobs[0])
    log = cluster.cdir.log(jobs[0]).read_text()
    assert first["JobState"] in ENDED_BY_US and "signal 15" in log, (first, log[-2000:])
    assert run_time_s(first) < 120, first
    left = settle(sandbox, cluster, {jobs[0]})
    assert not left, f"left of the drained worker after {CLEAN_S:.0f}s: {left}"


def shared_node(cluster: RayCluster) -> str:
    """A node that runs a job of `cluster` and has a CPU free for another head, else ""."""
    out = subprocess.run(["squeue", "-h", f"--name={cluster.job_name}", "-t", "RUNNING",
                          "-o", "%N"], capture_output=True, text=True, timeout=30,
                         check=True).stdout.split()
    idle = {ln.split()[0]: int(ln.split()[1].split("/")[1]) for ln in subprocess.run(
        ["sinfo", "-h", "-N", "-p", "cpu", "-o", "%N %C"], capture_output=True, text=True,
        timeout=30, check=True).stdout.splitlines()}
    ours = [n for n in sorted(set(out)) if idle.get(n, 0) > 0]
    return ours[0] if ours else ""


def test_a_user_runs_a_cluster_of_the_same_name_beside_it(cluster: RayCluster,
                                                         sandbox: Sandbox) -> None:
    """Same cluster name, on a node where root's cluster runs containers: the user's
    containers and unpacked roots live under the user's own enroot paths, and the user's
    `ray down` leaves root's alone."""
    user = sandbox.users()[0]
    root_head = str(cluster.head()["job_id"])
    root_had = left_of(sandbox, cluster, {root_head})
    assert root_had  # the container of root's head
    # The head's node may be full a while (the drained worker's idle replacement, 2 CPUs).
    node = wait_for(lambda: shared_node(cluster), 150, "a CPU beside root's containers")
    cfg = yaml.safe_load(cluster.path.read_text())
    cfg["available_node_types"]["head"]["node_config"]["nodelist"] = node
    theirs = UserCluster(user, user_venv(sandbox), cluster.name, cfg, sandbox.env())
    t0 = time.monotonic()
    with brought_up(theirs):
        head = str(theirs.head()["job_id"])
        out = theirs.ray("exec", str(theirs.path),
                         "test -d /var/lib || echo IN_IMAGE; echo JOB=$SLURM_JOB_ID").stdout
        assert "IN_IMAGE" in out and f"JOB={head}" in out, out
        mine = leftovers(sandbox, user)
        assert any(f"/data/{user.name}/" in x and head in x for x in mine), mine
        assert not [x for x in left_of(sandbox, cluster, {head}) if "/data/root/" in x]
    TIMINGS[f"{runtime(cluster)}: a user's cluster up and down"] = time.monotonic() - t0
    wait_for(lambda: not leftovers(sandbox, user), CLEAN_S, "the user's containers to go")
    assert sorted(left_of(sandbox, cluster, {root_head})) == sorted(root_had)
    assert cluster.ray("exec", str(cluster.path), "ray status").returncode == 0


def test_ray_down_leaves_nothing(cluster: RayCluster, sandbox: Sandbox) -> None:
    jobs = JOBS[runtime(cluster)]
    t0 = time.monotonic()
    cluster.down()
    assert cluster.jobs() == []  # `ray down` returned once Slurm had ended them
    left = settle(sandbox, cluster, jobs)
    assert not left, f"left of the cluster after {CLEAN_S:.0f}s: {left}"
    TIMINGS[f"{runtime(cluster)}: ray down -> nothing left"] = time.monotonic() - t0
    assert leftovers(sandbox, None) == []  # `enroot list` is empty too
    assert not [p for p in Path(sandbox.layout.enroot_dir, "nodes").glob("*/data/*/*")]
