"""The local Slurm sandbox itself: nodes, partitions, fake GPUs, REST + JWT, idempotent `up`,
single-daemon outages, and a second throwaway sandbox whose `down` must leave nothing."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from ray_slurm_provider.sandbox import Sandbox, roots
from ray_slurm_provider.sandbox.probes import node_ready
from ray_slurm_provider.sandbox.procs import exists, job_processes, owned_processes

pytestmark = pytest.mark.integration
#: For `sbatch --wrap`: Slurm would write slurm-<job>.out into the directory the suite runs in.
NO_OUTPUT = ("-o", "/dev/null")


def run(*argv: str, env: dict[str, str] | None = None, timeout: float = 120) -> str:
    res = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout,
                         env=env, check=False)
    assert res.returncode == 0, f"{argv}: rc={res.returncode} {res.stderr}"
    return res.stdout


def rest(sandbox: Sandbox, token: str | None, path: str = "ping") -> int:
    version = roots.rest_version(sandbox.spec.slurm)
    req = urllib.request.Request(f"{sandbox.env()['RAY_SLURM_REST_URL']}/slurm/{version}/{path}")
    if token is not None:
        req.add_header("X-SLURM-USER-NAME", "root")
        req.add_header("X-SLURM-USER-TOKEN", token)
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as e:
        return int(e.code)


def test_nodes_are_up_with_their_own_addresses(sandbox: Sandbox) -> None:
    nodes = {}
    for line in run("scontrol", "show", "node", "-o").splitlines():
        fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
        nodes[fields["NodeName"]] = (fields["NodeAddr"], fields["Port"])
    assert nodes == {"n1": ("127.0.0.2", str(6831 + sandbox.spec.port_offset)),
                     "n2": ("127.0.0.3", str(6832 + sandbox.spec.port_offset)),
                     "n3": ("127.0.0.4", str(6833 + sandbox.spec.port_offset))}
    states = sandbox.status().nodes
    assert sorted(states) == ["n1", "n2", "n3"]
    assert all(node_ready(s) for s in states.values()), states  # idle (or busy with tests)


def test_partitions(sandbox: Sandbox) -> None:
    lines = run("sinfo", "-h", "-o", "%P %a %l %N %G").splitlines()
    assert sorted(lines) == ["cpu* up infinite n[1-3] gpu:2", "gpu up infinite n[1-3] gpu:2"]


@pytest.mark.parametrize(("gres", "expected"), [("gpu:2", "0,1"), ("gpu:1", "0")])
def test_gres_sets_cuda_visible_devices(sandbox: Sandbox, gres: str, expected: str) -> None:
    out = run("srun", "-p", "gpu", f"--gres={gres}", "-N1", "-n1", "-t", "5",
              "bash", "-c", "echo CVD=$CUDA_VISIBLE_DEVICES")
    assert out.strip() == f"CVD={expected}"


def test_too_many_gpus_or_too_much_memory_is_refused(sandbox: Sandbox) -> None:
    for opt in ("--gres=gpu:3", "--mem=5000"):
        res = subprocess.run(["sbatch", *NO_OUTPUT, "-p", "gpu", opt, "--wrap", "true"],
                             capture_output=True, text=True, timeout=60, check=False)
        assert res.returncode != 0
        assert "Requested node configuration is not available" in res.stderr


def test_rest_accepts_the_token_and_rejects_anything_else(sandbox: Sandbox) -> None:
    path = sandbox.env()["RAY_SLURM_JWT_FILE"]
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    with open(path) as f:
        token = f.read().strip()
    assert rest(sandbox, token) == 200
    assert rest(sandbox, token, "jobs") == 200
    assert rest(sandbox, None) == 401
    # A forged token passes slurmrestd (it does not check signatures) and slurmctld refuses
    # it: 22.05 then answers 500 "slurmctld config is unable to load"; later releases answer
    # a ping (which says the controller is DOWN) and refuse the rest with 511 "Protocol
    # authentication error".
    forged = token[:-4] + "AAAA"
    if sandbox.spec.slurm == "22.05":
        assert rest(sandbox, forged) == 500
    else:
        assert rest(sandbox, forged, "jobs") == 511
    assert "SLURM_JWT" not in sandbox.env() and "SLURM_JWT" not in os.environ


def test_up_again_is_a_no_op(sandbox: Sandbox) -> None:
    # The shape that runs now, as `sandbox up` with no new flags reads it: an earlier test
    # (login_sandbox) may have added the login node to the session's sandbox.
    sb = Sandbox.from_state_dir(sandbox.state_dir)
    before = sb.status().daemons
    assert all(pid is not None for pid in before.values())
    t0 = time.monotonic()
    env = sb.up()
    assert time.monotonic() - t0 < 5
    assert sb.status().daemons == before
    assert env == sb.env()


def test_controller_outage_and_restart(sandbox: Sandbox) -> None:
    sandbox.stop_daemon("slurmctld")
    try:
        assert sandbox.status().daemons["slurmctld"] is None
        res = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=60,
                             check=False)
        assert "DOWN" in res.stdout
    finally:
        sandbox.start_daemon("slurmctld")
    status = sandbox.status()
    assert status.running, status
    assert "is UP" in run("scontrol", "ping")
    assert run("srun", "-N1", "-t", "5", "true") == ""


def _mini_image(docker_env: dict[str, str], tmp: str) -> str:
    """A ~1 KB image: an empty rootfs whose /usr comes from the host at run time."""
    root = os.path.join(tmp, "rootfs")
    for d in ("usr", "etc", "tmp", "proc", "sys", "dev"):
        os.makedirs(os.path.join(root, d))
    for link in ("bin", "lib", "lib64", "sbin"):
        os.symlink(f"usr/{link}", os.path.join(root, link))
    tar = os.path.join(tmp, "rootfs.tar")
    with tarfile.open(tar, "w") as t:
        t.add(root, arcname=".")
    run("docker", "import", tar, "rsp-test-mini:latest", env=docker_env)
    return "rsp-test-mini:latest"


@pytest.fixture
def throwaway(sandbox: Sandbox) -> Iterator[Sandbox]:
    """A second, small sandbox beside the session's one (other ports, own state dir)."""
    state = tempfile.mkdtemp(prefix="rsp-down-", dir="/tmp")
    sb = Sandbox(state, nodes=2, gpus_per_node=1,
                 docker=not sandbox.spec.in_root and shutil.which("dockerd") is not None,
                 port_offset=sandbox.spec.port_offset + 300, slurm=sandbox.spec.slurm)
    try:
        yield sb
    finally:
        sb.down()


def _queue(env: dict[str, str]) -> str:
    """squeue and sinfo as a failure message shows them."""
    return (run("squeue", "-h", "-o", "%i %T %r %N %C", env=env)
            + run("sinfo", "-N", "-h", "-o", "%N %t %C", env=env))


def test_down_leaves_nothing_behind(throwaway: Sandbox) -> None:
    env = {**os.environ, **throwaway.up()}
    assert throwaway.status().running
    image = _mini_image(env, throwaway.state_dir) if throwaway.spec.docker else None
    script = "sleep 600"
    if image is not None:  # a container that only the Epilog or `down` would remove
        script = (f"docker run -d --label slurm.job_id=$SLURM_JOB_ID -v /usr:/usr:ro {image}"
                  " /usr/bin/sleep 600; sleep 600")
    jobs = [run("sbatch", "--parsable", *NO_OUTPUT, "-w", node, "--wrap", script,
                env=env).strip()
            for node in ("n1", "n2")]
    deadline = time.monotonic() + 120
    while set(run("squeue", "-h", "-t", "R", "-o", "%i", env=env).split()) != set(jobs):
        assert time.monotonic() < deadline, "jobs did not start:\n" + _queue(env)
        time.sleep(0.2)
    # Submitted only now: from 23.11 on, equal priorities (priority/multifactor by default)
    # could let a 2-CPU job submitted beside them take n1 first and keep job 1 pending.
    run("sbatch", "--parsable", *NO_OUTPUT, "-w", "n1", "-c", "2", "--wrap", "sleep 600",
        env=env)  # pends
    pids = [p for p in throwaway.status().daemons.values() if p is not None]
    assert len(pids) == 5 + (1 if image else 0)
    t0 = time.monotonic()
    throwaway.down()
    took = time.monotonic() - t0
    assert [p for p in pids if exists(p)] == []
    assert owned_processes(throwaway.state_dir) == []
    assert job_processes(throwaway.layout.slurm_conf) == []
    assert not os.path.exists(throwaway.state_dir)
    assert took < 30, f"down took {took:.1f}s"
