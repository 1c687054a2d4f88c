"""The Slurm back ends against the real local Slurm sandbox, on whichever release it runs
(22.05 from Debian 12, 24.11 or 26.05 from a Debian root, 25.11 built from source:
`ray-slurm sandbox up --slurm`).

Every test that takes `client` runs through the CLI back end (sbatch, squeue, ...), through
the REST back end (the sandbox's real slurmrestd at the newest API version both sides know,
JWT from RAY_SLURM_JWT_FILE) and, on a sandbox started with --pyslurm (25.11), through the
pyslurm back end, so all pass the same suite.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from ray_slurm_provider.sandbox import Sandbox, SandboxError
from ray_slurm_provider.slurm.cli import CliSlurmClient
from ray_slurm_provider.slurm.client import (
    Job,
    PermanentSlurmError,
    SlurmClient,
    TransientSlurmError,
)
from ray_slurm_provider.slurm.pyslurm import PyslurmSlurmClient
from ray_slurm_provider.slurm.rest.client import RestSlurmClient
from ray_slurm_provider.slurm.script import JobSpec

pytestmark = pytest.mark.integration


def sleep(name: str, **fields: object) -> JobSpec:
    """A job that sleeps for 5 minutes and writes no log."""
    return JobSpec(name, ["sleep", "300"], output="/dev/null", **fields)  # type: ignore[arg-type]


def make(kind: str) -> SlurmClient:
    if kind == "pyslurm":
        return PyslurmSlurmClient()
    return CliSlurmClient(timeout=60) if kind == "cli" else RestSlurmClient(timeout=60)


def backends() -> list[str]:
    """cli and rest; pyslurm too on a sandbox started with --pyslurm (known at collection:
    CI starts the sandbox before pytest, and a skip there is a failure)."""
    try:
        pyslurm = Sandbox.from_state_dir().spec.pyslurm
    except (SandboxError, ValueError, OSError):
        pyslurm = False
    return ["cli", "rest", *(["pyslurm"] if pyslurm else [])]


@pytest.fixture(params=backends())
def client(sandbox: Sandbox, request: pytest.FixtureRequest) -> SlurmClient:
    return make(request.param)


@pytest.fixture
def name() -> str:
    return f"rsp-it-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def submitted(client: SlurmClient) -> Iterator[list[str]]:
    """Job ids submitted by a test; all are cancelled afterwards, whatever happened."""
    ids: list[str] = []
    yield ids
    if ids:
        client.cancel(ids)


def wait_for(client: SlurmClient, name: str, pred: Callable[[list[Job]], bool],
             timeout: float = 30) -> list[Job]:
    deadline = time.monotonic() + timeout
    while True:
        jobs = client.list_jobs(name)
        if pred(jobs) or time.monotonic() > deadline:
            return jobs
        time.sleep(0.3)


def test_submit_list_cancel(client: SlurmClient, name: str, submitted: list[str],
                            monkeypatch: pytest.MonkeyPatch) -> None:
    # As if the provider ran inside a Slurm job of a user with their own squeue defaults:
    # none of it may reach the commands (or the jobs they submit).
    for var, value in {"SBATCH_PARTITION": "nosuchpartition", "SQUEUE_FORMAT": "%i",
                       "SLURM_JOB_ID": "1", "SLURM_TIME_FORMAT": "relative"}.items():
        monkeypatch.setenv(var, value)
    held = client.submit(sleep(name, sbatch_options={"hold": None}),
                         comment='{"tag": "held; with spaces"}')
    submitted.append(held)
    # Small, so it fits beside whatever other tests run on the shared sandbox.
    run = client.submit(sleep(name, time="10", mem="100"), comment="running")
    submitted.append(run)
    assert held.isdigit() and run.isdigit()

    jobs = wait_for(client, name, lambda js: any(j.state == "RUNNING" for j in js), 90)
    by_id = {j.job_id: j for j in jobs}
    assert by_id[run].state == "RUNNING", f"never started: {by_id[run]}"
    assert set(by_id) == {held, run}

    p = by_id[held]
    assert (p.state, p.reason, p.active, p.running) == ("PENDING", "JobHeldUser", True, False)
    assert p.comment == '{"tag": "held; with spaces"}'
    assert p.batch_host == "" and p.node_addr == ""

    r = by_id[run]
    assert r.state == "RUNNING" and r.running
    assert r.nodes == r.batch_host and r.batch_host in ("n1", "n2", "n3")
    assert r.node_addr == client.node_addresses()[r.batch_host]
    assert r.node_addr == f"127.0.0.{int(r.batch_host[1:]) + 1}"
    assert r.time_limit_s == 600
    left = r.left_s()  # the CLI's from the end time (%e), the other back ends' as listed
    assert left is not None and 0 < left <= 600
    assert r.start_time and r.submit_time and r.partition == "cpu" and r.comment == "running"

    client.cancel([held, run])
    client.cancel([held, run])  # already gone or completing: still no error
    jobs = wait_for(client, name, lambda js: not any(j.active for j in js))
    assert not any(j.active for j in jobs)


def test_a_job_gets_the_submitters_environment_scrubbed(
        client: SlurmClient, name: str, submitted: list[str], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """As the head's autoscaler submits a worker from inside the head's job: the worker gets
    the submitting process's environment, but none of the head's SLURM_* or RAY_* (pyslurm
    would copy every SLURM_* of the process into the job: slurm/pyslurm.py)."""
    head = {"SLURM_JOB_ID": "1", "SLURM_JOBID": "1", "SLURM_JOB_NAME": "ray-head-of-it",
            "SLURM_CPUS_ON_NODE": "64", "SBATCH_PARTITION": "nosuchpartition",
            "RAY_ADDRESS": "127.0.0.9:6379", "RAY_OVERRIDE_RESOURCES": '{"CPU": 64}',
            "RSP_PLAIN": "kept"}
    for var, value in head.items():
        monkeypatch.setenv(var, value)
    out = tmp_path / "out"
    out.mkdir()
    job_id = client.submit(JobSpec(name, ["true"], output=f"{out}/%j.out", time="2",
                                   mem="100", setup=["env | sort", "echo ENV_DONE"]))
    submitted.append(job_id)
    log = out / f"{job_id}.out"
    deadline = time.monotonic() + 60
    while "ENV_DONE" not in (log.read_text() if log.exists() else ""):
        assert time.monotonic() < deadline, "the job's output never appeared"
        time.sleep(0.3)
    env = dict(ln.split("=", 1) for ln in log.read_text().splitlines() if "=" in ln)
    assert env["SLURM_JOB_ID"] == env["SLURM_JOBID"] == job_id
    assert env["SLURM_JOB_NAME"] == name and env["SLURM_CPUS_ON_NODE"] != "64"
    assert not [k for k in env if k.startswith("RAY_")], sorted(env)
    assert env["RSP_PLAIN"] == "kept" and env["PATH"] == os.environ["PATH"]
    assert env["SLURM_CONF"] == os.environ["SLURM_CONF"]


def test_cancel_unknown_job_is_a_noop(client: SlurmClient) -> None:
    client.cancel(["999999"])
    client.cancel([])


def test_list_jobs_empty(client: SlurmClient, name: str) -> None:
    assert client.list_jobs(name) == []


def test_cluster_info(client: SlurmClient, sandbox: Sandbox) -> None:
    info = client.cluster_info()
    assert info.version.startswith(sandbox.spec.slurm + ".")
    cpu, gpu = info.partition("cpu"), info.partition("gpu")
    assert cpu is not None and gpu is not None
    if isinstance(client, RestSlurmClient) and sandbox.spec.slurm != "22.05":
        # data_parser (v0.0.40+) drops partition flags: which one is the default is unknown
        # with two partitions (rest/parse.py).
        assert info.partition(None) is None and not cpu.default and not gpu.default
    else:
        assert info.partition(None) == cpu and cpu.default and not gpu.default
    assert gpu.gpus_per_node == 2 and gpu.gres.startswith("gpu")
    assert [n.name for n in cpu.nodes] == ["n1", "n2", "n3"]
    assert {n.addr for n in cpu.nodes} == {"127.0.0.2", "127.0.0.3", "127.0.0.4"}
    assert cpu.cpus_per_node >= 1 and cpu.memory_mb_per_node > 0
    assert client.node_addresses() == {"n1": "127.0.0.2", "n2": "127.0.0.3", "n3": "127.0.0.4"}
    assert client.node_address("n2") == "127.0.0.3"  # `scontrol show node n2` alone


def test_bad_partition_is_permanent(client: SlurmClient, name: str) -> None:
    with pytest.raises(PermanentSlurmError) as ei:
        client.submit(JobSpec(name, ["true"], partition="nosuchpartition"))
    assert "Invalid partition name specified" in ei.value.slurm_message


def test_controller_down_is_transient(sandbox: Sandbox, name: str) -> None:
    """One outage of slurmctld, seen through every back end (slurmrestd keeps running and
    answers with Slurm's words)."""
    client = CliSlurmClient(timeout=60)
    rest = RestSlurmClient(timeout=60)
    rest.api_version()  # negotiated while the controller is up
    sandbox.stop_daemon("slurmctld")
    try:
        # Each call takes about 9 s to give up on a dead controller: run them side by side.
        with ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(c.list_jobs, name) for c in (client, rest)]
            futures += [pool.submit(c.submit, sleep(name)) for c in (client, rest)]
            for i, fut in enumerate(futures):
                with pytest.raises(TransientSlurmError) as ei:
                    fut.result()
                if i == 1 and sandbox.spec.slurm == "22.05":
                    # slurmrestd 22.05's job list loses the reason (rest_http.py)
                    assert ei.value.slurm_message.endswith("Unspecified error")
                    assert "slurmctld is unreachable" in str(ei.value)
                else:
                    assert "Unable to contact slurm controller" in ei.value.slurm_message
        if "pyslurm" in backends():  # its import works without slurmctld; each call fails
            with pytest.raises(TransientSlurmError) as ei:
                PyslurmSlurmClient().list_jobs(name)
            assert "Unable to contact slurm controller" in ei.value.slurm_message
    finally:
        sandbox.start_daemon("slurmctld")
    deadline = time.monotonic() + 30
    while True:  # the controller answers again once it has reloaded its state
        try:
            assert client.list_jobs(name) == []
            break
        except TransientSlurmError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
