"""Ray in Apptainer containers, live, as an ordinary user: `cluster-configs/sandbox-apptainer.yaml`
on the Slurm 26.05 sandbox (`sandbox up --slurm 26.05 --users 1`), whose root packages
Apptainer 1.4.5. Apptainer runs in its user-namespace mode there, as at most sites (as root it
fails on this machine: CAP_SYS_RESOURCE is missing from the bounding set).

The image is a directory built here from the sandbox's tiny root filesystem (`ray-slurm sandbox
image --runtime apptainer`), no registry. Every `apptainer` call goes through a two-line
wrapper (`container.binary`) that records its argv and execs the real one, so the tests can
compare the flags of the node's container with those of `ray exec`'s.

Checks, as for Docker (test_containers.py): Ray runs inside the head's container; `ray exec`
enters a container with the node's binds and `--nv` (the head holds a fake GPU); an autoscaled
worker runs in its own container; a worker job cancelled by hand leaves no container process
within 15 s; `ray down` leaves no job and no container process of the user.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ray_slurm_provider.sandbox import Sandbox, roots
from ray_slurm_provider.sandbox.users import SandboxUser
from tests.e2e import procfs
from tests.e2e.harness import ROOT, brought_up, printed, wait_for
from tests.e2e.users import UserCluster, chown_tree, load_config, user_venv

pytestmark = [pytest.mark.e2e, pytest.mark.apptainer]
CONFIG = ROOT / "cluster-configs" / "sandbox-apptainer.yaml"
NAME = "e2e-apptainer"
STATE: dict[str, object] = {}


def container_procs(user: SandboxUser, image: str) -> dict[int, str]:
    """pid -> Slurm job id of the user's processes inside a container of `image` (Apptainer
    sets APPTAINER_CONTAINER in every process it starts; it needs no daemon)."""
    out = {}
    for pid, _ in procfs.cmdlines():
        if procfs.owner(pid) != user.uid:
            continue
        env = procfs.environ(pid)
        if env.get("APPTAINER_CONTAINER") == image:
            out[pid] = env.get("SLURM_JOB_ID", "")
    return out


def recorded_calls(log: Path) -> list[list[str]]:
    """The argv of every `apptainer` call so far (one tab-separated line each)."""
    text = log.read_text() if log.exists() else ""
    return [line.rstrip("\t").split("\t") for line in text.splitlines() if line]


def flags(call: list[str], image: str) -> tuple[str, ...]:
    """The options of an `apptainer exec` call, between `exec` and the image."""
    return tuple(call[call.index("exec") + 1:call.index(image)])


@pytest.fixture(scope="module")
def cluster(sandbox: Sandbox) -> Iterator[UserCluster]:
    root = roots.root_dir(sandbox.spec.slurm) if sandbox.spec.in_root else ""
    users = sandbox.users()
    if not (root and os.path.exists(f"{root}/usr/bin/apptainer") and users):
        pytest.fail("these tests need a sandbox whose Slurm root packages apptainer, and a "
                    "user: `ray-slurm sandbox up --slurm 26.05 --users 1`")
    user = users[0]
    image = os.path.join(sandbox.layout.shared_dir, "rsp-bind")
    subprocess.run([str(ROOT / ".venv" / "bin" / "ray-slurm"), "sandbox", "image",
                    "--runtime", "apptainer", "--tag", image], check=True, timeout=120)
    venv = user_venv(sandbox)
    home = Path(user.home)
    log = home / f"{NAME}-apptainer.calls"
    log.unlink(missing_ok=True)
    shim = home / "bin" / "apptainer"
    shim.parent.mkdir(exist_ok=True)
    shim.write_text(f"#!/bin/sh\nfor a in \"$@\"; do printf '%s\\t' \"$a\"; done >>{log}\n"
                    f"echo >>{log}\nexec /usr/bin/apptainer \"$@\"\n")
    shim.chmod(0o755)
    chown_tree(shim.parent, user)
    config = load_config(CONFIG, idle_timeout_minutes=10)
    for nt in config["available_node_types"].values():
        nt["node_config"]["container"] = {**nt["node_config"]["container"],
                                          "image": image, "binary": str(shim)}
    c = UserCluster(user, venv, NAME, config, sandbox.env())
    STATE.update(image=image, log=log)
    try:
        with brought_up(c) as took:
            STATE["ray up s"] = round(took, 1)
            yield c
    finally:
        print("STATE", STATE)


def test_ray_runs_inside_the_heads_container(cluster: UserCluster) -> None:
    head = str(cluster.head()["job_id"])
    image = str(STATE["image"])
    inside = container_procs(cluster.user, image)
    assert head in inside.values(), inside
    raylets = [p for p, j in inside.items() if j == head
               and "raylet" in dict(procfs.cmdlines()).get(p, "")]
    assert raylets, "no raylet inside the head's container"
    # The agent probes Slurm from inside the container in the background once Ray is up
    # (agent.mark_started): its line can come after `ray up` has returned.
    line = "Slurm is reachable from inside the head's container"
    log = cluster.cdir.log(head)
    wait_for(lambda: line in log.read_text() or "cannot reach Slurm" in log.read_text(), 60,
             "the agent's Slurm probe from inside the container")
    assert line in log.read_text(), log.read_text()[-3000:]


def test_ray_exec_enters_the_container_with_the_nodes_binds_and_nv(
        cluster: UserCluster) -> None:
    head = str(cluster.head()["job_id"])
    image = str(STATE["image"])
    out = cluster.ray("exec", str(cluster.path),
                      "echo C=$APPTAINER_CONTAINER JOB=$SLURM_JOB_ID; ray status").stdout
    assert f"C={image} JOB={head}" in out and "Active:" in out, out
    calls = [c for c in recorded_calls(Path(str(STATE["log"]))) if "exec" in c]
    node = [c for c in calls if "--block" in c]  # the agent's `ray start --block`
    execs = [c for c in calls if c[-3:-1] == ["bash", "-c"]]  # `ray exec`'s step
    assert node and execs, calls
    assert flags(execs[-1], image) == flags(node[0], image)
    assert "--nv" in flags(node[0], image)
    binds = {f for f in flags(node[0], image) if f != "--bind"}
    assert "/usr:/usr:ro" in binds and any(b.endswith(":ro") and "venv" in b for b in binds)


def test_an_autoscaled_worker_runs_in_its_own_container(cluster: UserCluster) -> None:
    image = str(STATE["image"])
    out = cluster.submit(
        "import ray, os; ray.init();"
        "f = ray.remote(num_cpus=1)(lambda: (os.environ.get('APPTAINER_CONTAINER'),"
        " os.environ['SLURM_JOB_ID']));"
        "print('WHERE', *ray.get(f.remote()))", timeout=600)
    where, job = printed(out, "WHERE")
    assert where == image
    assert job != str(cluster.head()["job_id"])
    assert job in container_procs(cluster.user, image).values()
    STATE["worker"] = job


def test_a_cancelled_worker_leaves_no_container_process(cluster: UserCluster) -> None:
    job = str(STATE["worker"])
    image = str(STATE["image"])
    t0 = time.monotonic()
    subprocess.run(["scancel", job], check=True, timeout=30)
    wait_for(lambda: job not in container_procs(cluster.user, image).values(), 15,
             f"the container processes of job {job} to end", every=0.2)
    STATE["scancel -> container gone s"] = round(time.monotonic() - t0, 1)


def test_ray_down_leaves_nothing(cluster: UserCluster) -> None:
    image = str(STATE["image"])
    cluster.down()
    assert cluster.jobs() == []
    wait_for(lambda: container_procs(cluster.user, image) == {}, 30,
             "no container process of the user", every=0.2)
