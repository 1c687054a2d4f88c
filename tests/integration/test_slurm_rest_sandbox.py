"""What only the REST back end does, against the sandbox's real slurmrestd (v0.0.38)."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from ray_slurm_provider import proc
from ray_slurm_provider.config import parse_provider
from ray_slurm_provider.sandbox import Sandbox
from ray_slurm_provider.slurm.cli import CliSlurmClient
from ray_slurm_provider.slurm.client import (
    Job,
    PermanentSlurmError,
    SlurmError,
    TransientSlurmError,
)
from ray_slurm_provider.slurm.factory import make_client
from ray_slurm_provider.slurm.rest.client import RestSlurmClient
from ray_slurm_provider.slurm.script import JobSpec
from tests.rest_fakes import make_jwt

pytestmark = pytest.mark.integration


@pytest.fixture
def name() -> str:
    return f"rsp-rest-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def rest(sandbox: Sandbox) -> Iterator[RestSlurmClient]:
    c = RestSlurmClient(timeout=60)
    yield c


def _wait(client: RestSlurmClient | CliSlurmClient, name: str, state: str,
          timeout: float = 60) -> list[Job]:
    deadline = time.monotonic() + timeout
    while True:
        jobs = client.list_jobs(name)
        if any(j.state == state for j in jobs) or time.monotonic() > deadline:
            return jobs
        time.sleep(0.3)


def test_factory_selects_rest_and_both_back_ends_see_the_same_jobs(
        rest: RestSlurmClient, name: str, tmp_path: Path) -> None:
    client = make_client(parse_provider({"slurm_api": "rest"}))
    assert isinstance(client, RestSlurmClient)
    out = tmp_path / "out"
    out.mkdir()
    job_id = client.submit(
        JobSpec(name, ["sleep", "120"], time="10", mem="100", output=f"{out}/%j.out",
                setup=["env | sort"]), comment="ray-slurm:{}")
    try:
        via_rest = _wait(rest, name, "RUNNING")
        via_cli = CliSlurmClient(timeout=60).list_jobs(name)
        assert [j.job_id for j in via_rest] == [job_id]
        # Same record through both transports. The time left is the REST record's own field
        # and the CLI's end time (%e); both say the same within the seconds between calls.
        assert [replace(j, time_left_s=None, end_time="") for j in via_rest] == \
            [replace(j, time_left_s=None, end_time="") for j in via_cli]
        rest_left, cli_left = via_rest[0].left_s(), via_cli[0].left_s()
        assert rest_left is not None and cli_left is not None
        assert abs(rest_left - cli_left) <= 5, (rest_left, cli_left)
        assert via_rest[0].time_limit_s == 600 and via_rest[0].node_addr.startswith("127.0.0.")
        log = out / f"{job_id}.out"
        deadline = time.monotonic() + 30
        while "SLURM_JOB_ID" not in (log.read_text() if log.exists() else ""):
            assert time.monotonic() < deadline, "the job's output never appeared"
            time.sleep(0.3)
    finally:
        rest.cancel([job_id])
    env = dict(line.split("=", 1) for line in log.read_text().splitlines() if "=" in line)
    # The spec's fields were sent (slurmrestd itself ignores #SBATCH lines), and the job got the
    # submitting process's scrubbed environment: PATH and HOME, its own SLURM_* only.
    assert env["PATH"] == os.environ["PATH"]
    assert env["SLURM_JOB_ID"] == job_id and env["SLURM_JOB_NAME"] == name
    assert "RAY_SLURM_JWT_FILE" not in env and "SLURM_JWT" not in env


def test_requeue_false_is_ignored_by_slurmrestd_2205(rest: RestSlurmClient, name: str,
                                                     sandbox: Sandbox) -> None:
    """Canary for a Slurm 22.05 slurmrestd bug the REST back end documents and logs (only
    for v0.0.38); later releases keep requeue=false."""
    job_id = rest.submit(JobSpec(name, ["true"], output="/dev/null", requeue=False,
                                 sbatch_options={"hold": None}))
    try:
        shown = proc.run(["scontrol", "show", "job", job_id], timeout=30).stdout
    finally:
        rest.cancel([job_id])
    assert f"Requeue={int(sandbox.spec.slurm == '22.05')}" in shown


def test_slurmrestd_down_is_transient(sandbox: Sandbox, name: str) -> None:
    rest = RestSlurmClient(timeout=30)
    rest.api_version()
    sandbox.stop_daemon("slurmrestd")
    try:
        with pytest.raises(TransientSlurmError, match="connection refused"):
            rest.list_jobs(name)
        with pytest.raises(TransientSlurmError, match="connection refused"):
            RestSlurmClient(timeout=30).api_version()  # negotiation too
    finally:
        sandbox.start_daemon("slurmrestd")
    assert rest.list_jobs(name) == []


def test_tokens_slurm_refuses(sandbox: Sandbox, name: str, tmp_path: Path) -> None:
    tok = tmp_path / "jwt"
    tok.write_text(make_jwt())  # well-formed, not signed with the cluster's key
    tok.chmod(0o600)
    forged = RestSlurmClient(jwt_file=str(tok), timeout=60)
    # slurmrestd 22.05 answers a forged token with "Unspecified error" (reads) or "Zero Bytes
    # were transmitted" (submit), the words of an outage: it raises, typed as transient.
    with pytest.raises(SlurmError):
        forged.submit(JobSpec(name, ["true"]))
    with pytest.raises(SlurmError):
        forged.list_jobs(name)
    with pytest.raises(PermanentSlurmError, match="expired"):
        RestSlurmClient(env={**os.environ, "RAY_SLURM_JWT_FILE": "",
                             "SLURM_JWT": make_jwt(exp=1)}).list_jobs(name)


def test_cancel_one_array_task_by_its_id(rest: RestSlurmClient, name: str) -> None:
    """Issue 14.11: `<array>_<task>` ids (how the listing names array tasks) are cancelled
    one task at a time, as scancel does; they used to raise ValueError and abort `ray down`."""
    cli = CliSlurmClient()
    (first, second) = cli.submit_array(JobSpec(name, ["sleep", "60"], time="5", mem="100",
                                               output="/dev/null",
                                               extra_directives=["--hold"]), 2)
    try:
        assert {j.job_id for j in cli.list_jobs(name)} == {first, second}
        rest.cancel([second])
        assert [j.job_id for j in cli.list_jobs(name) if j.active] == [first]
    finally:
        cli.cancel([first, second])
