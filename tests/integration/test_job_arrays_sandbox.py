"""Job arrays through the CLI back end on the real sandbox (Slurm 22.05): one sbatch for N
nodes, each task listed, addressed and cancelled on its own (bench P5)."""

from __future__ import annotations

import uuid

import pytest

from ray_slurm_provider import proc
from ray_slurm_provider.sandbox import Sandbox
from ray_slurm_provider.slurm.cli import CliSlurmClient
from tests.integration.test_slurm_cli_sandbox import sleep, wait_for

pytestmark = pytest.mark.integration


def test_array_submit_list_srun_cancel_one_task(sandbox: Sandbox) -> None:
    client = CliSlurmClient(timeout=60)
    name = f"rsp-it-{uuid.uuid4().hex[:10]}"
    # Small, so it fits beside whatever else runs on the sandbox.
    ids = client.submit_array(sleep(name, time="10", mem="100"), 3, comment='{"tag": "array"}')
    array_id = ids[0].split("_")[0]
    try:
        assert ids == [f"{array_id}_{i}" for i in range(3)] and array_id.isdigit()
        # Every task is listed on its own at once, pending ones included.
        assert sorted(j.job_id for j in client.list_jobs(name)) == ids
        jobs = wait_for(client, name, lambda js: any(j.running for j in js), timeout=90)
        by_id = {j.job_id: j for j in jobs}
        assert set(by_id) == set(ids)
        assert all(j.comment == '{"tag": "array"}' and j.active for j in jobs)
        run = next(j for j in jobs if j.running)
        assert run.numeric_id.isdigit() and run.node_addr
        # srun of 22.05 needs the task's numeric id (it refuses `<array>_<task>`; later
        # releases take both), and the step sees the array variables the node agent derives
        # its node id from.
        env = client.command_env()
        res = proc.run(["srun", f"--jobid={run.numeric_id}", "--overlap", "--quiet",
                        "bash", "-c", "echo $SLURM_JOB_ID"], env=env, timeout=60,
                       check=False)
        assert res.returncode == 0 and res.stdout.strip() == run.numeric_id, res.stderr
        refused = proc.run(["srun", f"--jobid={run.job_id}", "--overlap", "true"], env=env,
                           timeout=60, check=False)
        assert (refused.returncode != 0) == (sandbox.spec.slurm == "22.05"), refused.stderr

        # Cancelling one task leaves the others.
        client.cancel([run.job_id])
        left = wait_for(client, name, lambda js: not any(
            j.job_id == run.job_id and j.active for j in js), timeout=90)
        active = sorted(j.job_id for j in left if j.active)
        assert active == sorted(set(ids) - {run.job_id})
    finally:
        client.cancel([array_id])  # the whole array
    assert not any(j.active for j in wait_for(
        client, name, lambda js: not any(j.active for j in js), timeout=90))
