"""Two real Unix users share the sandbox's nodes, its dockerd and one cluster name.

The sandbox's throwaway users (``sandbox up --users 2``) each `ray up` the same Docker example
config (`cluster-configs/sandbox-docker.yaml`, same ``cluster_name``), from their own homes,
with their own default ``~/.ray_slurm``. The homes are 0755, as at many sites, so what keeps
the other user out is the provider's own modes, not the home's.

The tests run in file order against the two clusters:
1. both heads run; where they share a node, the second moved to another port block;
2. user B's workers start first; then user A's workers start on the same nodes (A's node
   agents sweep containers with B's live ones present) while both workloads run;
3. each user is kept out of the other's cluster: token, cluster dir, Ray temp dirs, Slurm jobs,
   and Ray itself (a request with the wrong token is refused);
4. `ray down` by A removes A's jobs and containers and leaves B's jobs, containers and Ray as
   they were (B still runs a job);
5. after B's `ray down` nothing of either cluster remains.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ray_slurm_provider.jobs import temp_dir
from ray_slurm_provider.runtimes.docker import OWNER_LABEL
from ray_slurm_provider.sandbox import Sandbox
from tests.e2e.harness import ROOT, wait_for
from tests.e2e.users import UserCluster, load_config, user_venv

pytestmark = [pytest.mark.e2e]
CONFIG = ROOT / "cluster-configs" / "sandbox-docker.yaml"
NAME = "shared-docker"
#: Four 1-CPU tasks of 8 s: two workers per cluster (the heads have CPU: 0). The workers, and
#: so their containers, stay for the idle timeout (10 min here) after the tasks end.
WORKLOAD = """
import json, time, ray
ray.init()
@ray.remote(num_cpus=1)
def where(i):
    time.sleep(8)
    return ray.get_runtime_context().get_node_id()
print("NODES=" + json.dumps(sorted(set(ray.get([where.remote(i) for i in range(4)])))))
"""
STATE: dict[str, object] = {}


def containers() -> dict[str, tuple[str, str]]:
    """Container id -> (slurm job id, owner uid) of every container of the cluster name,
    whoever owns it (root sees the whole daemon)."""
    fmt = '{{.ID}} {{.Label "slurm.job_id"}} {{.Label "' + OWNER_LABEL + '"}}'
    out = subprocess.run(["docker", "ps", "--filter", f"label=ray-slurm.cluster={NAME}",
                          "--format", fmt], capture_output=True, text=True, timeout=60,
                         check=True).stdout
    return {f[0]: (f[1], f[2]) for f in (ln.split() for ln in out.splitlines()) if len(f) == 3}


def nodes_of(job_ids: list[str]) -> dict[str, str]:
    out = subprocess.run(["squeue", "--noheader", "--jobs", ",".join(job_ids),
                          "--format=%i %N"], capture_output=True, text=True, timeout=30,
                         check=True).stdout
    return dict(ln.split()[:2] for ln in out.splitlines() if len(ln.split()) >= 2)


def running(c: UserCluster) -> list[str]:
    return sorted(j for j, st in c.jobs() if st == "RUNNING")


@pytest.fixture(scope="module")
def pair(sandbox: Sandbox) -> Iterator[tuple[UserCluster, UserCluster]]:
    users = sandbox.users()
    if len(users) < 2 or not os.environ.get("DOCKER_HOST"):
        pytest.fail("these tests need the sandbox's users and dockerd: "
                    "`ray-slurm sandbox up --docker --users 2`")
    for user in users[:2]:  # the sandbox makes homes 0755, as at many sites
        assert os.stat(user.home).st_mode & 0o777 == 0o755, user.home
    venv = user_venv(sandbox)
    # The image copies /etc/passwd: build it now that the users exist.
    subprocess.run([str(ROOT / ".venv" / "bin" / "ray-slurm"), "sandbox", "image"],
                   check=True, timeout=300)
    # Workers stay while the tests look at them (no idle scale-down mid-test).
    config = load_config(CONFIG, idle_timeout_minutes=10)
    a, b = (UserCluster(u, venv, NAME, config, sandbox.env()) for u in users[:2])
    try:
        a.up()
        b.up()
        yield a, b
    finally:
        for c in (a, b):
            c.down()
            c.cleanup()


def test_both_heads_run_and_never_share_ports(pair: tuple[UserCluster, UserCluster]) -> None:
    a, b = pair
    ha, hb = a.head(), b.head()
    assert ha["job_id"] != hb["job_id"]
    assert running(a) == [str(ha["job_id"])] and running(b) == [str(hb["job_id"])]
    if ha["ip"] == hb["ip"]:  # same node: the second head moved to another block
        assert ha["gcs_port"] != hb["gcs_port"]
        assert ha["dashboard_port"] != hb["dashboard_port"]
    STATE["heads_share_node"] = ha["ip"] == hb["ip"]


def test_workloads_of_both_users_share_nodes(pair: tuple[UserCluster, UserCluster]) -> None:
    a, b = pair
    out: dict[str, str] = {}

    def submit(c: UserCluster) -> None:
        out[c.user.name] = c.submit(WORKLOAD, timeout=400)

    def start_workload(c: UserCluster) -> threading.Thread:
        """Submit in the background; return once the user's two worker containers run."""
        t = threading.Thread(target=submit, args=(c,))
        t.start()
        head = str(c.head()["job_id"])
        wait_for(lambda: len([j for j, uid in containers().values()
                              if uid == str(c.user.uid) and j != head]) >= 2, 180,
                 f"{c.user.name}'s two worker containers")
        return t

    # B's two worker containers run before A asks for workers: A's agents then start (and
    # sweep) on nodes where B's containers live.
    tb = start_workload(b)
    b_before = {cid for cid, (_, uid) in containers().items() if uid == str(b.user.uid)}
    ta = start_workload(a)
    # Both users' jobs on one node at the same time, every container owned by its job's user.
    jobs = {j: a.user.uid for j in running(a)} | {j: b.user.uid for j in running(b)}
    where = nodes_of(list(jobs))
    shared = [n for n in set(where.values())
              if {jobs[j] for j, node in where.items() if node == n} == {a.user.uid,
                                                                       b.user.uid}]
    assert shared, f"no node ran jobs of both users: {where}"
    now = containers()
    for job_id, uid in now.values():
        if job_id in jobs:
            assert uid == str(jobs[job_id]), (job_id, uid)
    assert b_before <= set(now), f"A's agents removed B's containers: {b_before - set(now)}"
    ta.join(420)
    tb.join(420)
    for user in (a.user.name, b.user.name):
        assert user in out, f"{user}'s workload did not finish"
        # The last occurrence: Ray echoes the entrypoint (with this marker) before its output.
        assert len(json.loads(out[user].rsplit("NODES=", 1)[1].splitlines()[0])) >= 1


def _probe(c: UserCluster, other: UserCluster) -> dict[str, str]:
    """As `c`'s user, try to reach into `other`'s cluster; what happened at each step."""
    h = other.head()
    code = f"""
import json, os
r = {{}}
def attempt(name, f):
    try:
        f()
        r[name] = "allowed"
    except OSError as e:
        r[name] = type(e).__name__
attempt("read token", lambda: open({str(other.token_path)!r}).read())
attempt("list cluster dir", lambda: os.listdir({str(other.cdir.root)!r}))
attempt("write temp dir", lambda: open(os.path.join({temp_dir('/tmp', str(h['job_id']),
                                                              other.user.uid)!r}, "x"), "w"))
attempt("list temp parent", lambda: os.listdir({f"/tmp/rsp-{other.user.uid}"!r}))
print(json.dumps(r))
"""
    result: dict[str, str] = c.python(code)
    cp = c.run(["scancel", str(h["job_id"])])
    result["scancel head"] = "allowed" if cp.returncode == 0 else cp.stderr.strip()
    # Ray itself: the other head's dashboard with this user's own token.
    cp = c.run([c.ray_bin, "job", "submit", "--address",
                f"http://{h['ip']}:{h['dashboard_port']}", "--", "true"], timeout=120)
    result["ray job submit"] = ("allowed" if cp.returncode == 0 else
                                "refused: " + ("token" if "authentication token" in
                                               cp.stdout + cp.stderr else cp.stderr[-300:]))
    return result


def test_each_user_is_kept_out_of_the_other_cluster(
        pair: tuple[UserCluster, UserCluster]) -> None:
    a, b = pair
    for c, other in ((a, b), (b, a)):
        result = _probe(c, other)
        assert result == {
            "read token": "PermissionError", "list cluster dir": "PermissionError",
            "write temp dir": "PermissionError", "list temp parent": "PermissionError",
            "scancel head": f"scancel: error: Kill job error on job id {other.head()['job_id']}"
                            ": Access/permission denied",
            "ray job submit": "refused: token"}, (c.user.name, result)
    assert running(a) and running(b)


def test_down_of_one_user_leaves_the_other_untouched(
        pair: tuple[UserCluster, UserCluster]) -> None:
    a, b = pair
    b_jobs = running(b)
    b_containers = {cid for cid, (_, uid) in containers().items() if uid == str(b.user.uid)}
    assert len(b_jobs) >= 3 and len(b_containers) >= 3, (b_jobs, b_containers)
    t0 = time.monotonic()
    a.down()
    wait_for(lambda: not a.jobs() and not any(uid == str(a.user.uid)
                                              for _, uid in containers().values()),
             90, "user A's jobs and containers to be gone")
    STATE["A gone after down (s)"] = round(time.monotonic() - t0, 1)
    assert running(b) == b_jobs
    assert {cid for cid, (_, uid) in containers().items() if uid == str(b.user.uid)} \
        == b_containers
    assert "B ALIVE" in b.submit("print('B ALIVE')")


def test_nothing_of_either_cluster_remains(pair: tuple[UserCluster, UserCluster]) -> None:
    a, b = pair
    b.down()
    wait_for(lambda: not a.jobs() and not b.jobs() and not containers(), 90,
             "both users' jobs and containers to be gone")
    for c in (a, b):  # every node's Ray temp dir went with its job
        parent = Path(temp_dir("/tmp", "0", c.user.uid)).parent
        # The agent's per-node image locks (agent/container.py) stay, as lock files do; the
        # user's container clusters (test_enroot_pyxis.py) leave one there too.
        locks = list(parent.glob(".rsp-image-*.lock")) if parent.exists() else []
        left = [p for p in parent.iterdir() if p not in locks] if parent.exists() else []
        assert left == [], left
        for lock in locks:
            lock.unlink()
        if parent.exists():
            parent.rmdir()  # the user is deleted with the sandbox: leave no dir of its uid
    print("TIMINGS", json.dumps(STATE))
