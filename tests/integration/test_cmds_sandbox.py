"""`ray-slurm validate|render|status|logs|doctor` against the sandbox's real Slurm.

The clusters here exist only as a config plus jobs these tests submit with the cluster's job
name and creation tags (what `ray up` would submit); no Ray is started.
"""

from __future__ import annotations

import json
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from ray_slurm_provider.cli import main as cli
from ray_slurm_provider.jobs import encode_tags
from ray_slurm_provider.ports import port_block
from ray_slurm_provider.sandbox import Sandbox
from ray_slurm_provider.slurm.cli import CliSlurmClient
from ray_slurm_provider.slurm.script import JobSpec

pytestmark = pytest.mark.integration
SANDBOX_YAML = Path(__file__).resolve().parents[2] / "cluster-configs" / "sandbox.yaml"
APIS = ["cli", "rest"]


@pytest.fixture
def slurm(sandbox: Sandbox) -> Iterator[CliSlurmClient]:
    client = CliSlurmClient(timeout=60)
    ids: list[str] = []
    client.submitted = ids  # type: ignore[attr-defined]
    yield client
    if ids:
        client.cancel(ids)


def write_config(tmp_path: Path, api: str = "cli", **node_types: Any) -> tuple[str, str]:
    config = yaml.safe_load(SANDBOX_YAML.read_text())
    name = f"rsp-cmd-{uuid.uuid4().hex[:8]}"
    config["cluster_name"] = name
    config["provider"].update({"state_dir": str(tmp_path / "state"), "slurm_api": api})
    for t, nc in node_types.items():
        config["available_node_types"][t]["node_config"].update(nc)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path), name


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = cli.main(list(argv))
    cap = capsys.readouterr()
    return code, cap.out + cap.err


def submit(slurm: CliSlurmClient, name: str, kind: str, node_type: str, command: list[str],
           **fields: Any) -> str:
    job_id = slurm.submit(JobSpec(f"ray-{name}", command, **fields), comment=encode_tags(
        {"ray-node-type": kind, "ray-user-node-type": node_type}))
    slurm.submitted.append(job_id)  # type: ignore[attr-defined]
    return job_id


@pytest.mark.parametrize("api", APIS)
def test_validate(tmp_path: Path, capsys: pytest.CaptureFixture[str], api: str,
                  sandbox: Sandbox) -> None:
    path, _ = write_config(tmp_path, api)
    code, out = run(capsys, "validate", path)
    assert code == 0, out
    assert f"Slurm {sandbox.spec.slurm}." in out and "partition cpu: 3 nodes" in out
    path, _ = write_config(tmp_path, api, gpu_worker={"gpus": 3},
                           cpu_worker={"partition": "nosuch"})
    code, out = run(capsys, "validate", path)
    assert code == 1
    assert "3 is more than the 2 GPUs of any node of partition 'gpu'" in out
    assert "'nosuch' is not a partition of this cluster" in out and "fix: use one of" in out


def test_render_submits_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                slurm: CliSlurmClient) -> None:
    path, name = write_config(tmp_path)
    code, out = run(capsys, "render", path)
    assert code == 0, out
    assert out.count("#!/bin/bash") == 3 and out.count(f"--job-name=ray-{name}") >= 3
    assert "gpu_worker" in out and "#SBATCH --gres=gpu:1" in out
    assert slurm.list_jobs(f"ray-{name}") == []
    code, out = run(capsys, "render", path, "--node-type", "nope")
    assert code == 2 and "no node type 'nope'" in out


@pytest.mark.parametrize("api", APIS)
def test_status(tmp_path: Path, capsys: pytest.CaptureFixture[str], slurm: CliSlurmClient,
                api: str) -> None:
    path, name = write_config(tmp_path, api)
    code, out = run(capsys, "status", path)
    assert code == 0 and "the cluster is down" in out
    head = submit(slurm, name, "head", "head", ["sleep", "120"], time="10", mem="100",
                  output="/dev/null")
    worker = submit(slurm, name, "worker", "cpu_worker", ["sleep", "120"],
                    output="/dev/null", sbatch_options={"hold": None})
    deadline = time.monotonic() + 60
    while True:
        code, out = run(capsys, "status", path, "--json")
        rows = {r["job_id"]: r for r in json.loads(out)["nodes"]}
        if rows[head]["state"] == "RUNNING" or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert rows[head]["state"] == "RUNNING" and rows[head]["address"].startswith("127.0.0.")
    assert rows[head]["kind"] == "head" and 0 < rows[head]["time_left_s"] <= 600
    assert (rows[worker]["state"], rows[worker]["reason"]) == ("PENDING", "JobHeldUser")
    assert rows[worker]["node_type"] == "cpu_worker" and not rows[worker]["ray_up"]
    code, out = run(capsys, "status", path)
    assert code == 0 and "JobHeldUser" in out and "TIME LEFT" in out


def test_logs(tmp_path: Path, capsys: pytest.CaptureFixture[str],
              slurm: CliSlurmClient) -> None:
    path, name = write_config(tmp_path)
    logs = tmp_path / "state" / name / "logs"
    logs.mkdir(parents=True)
    job = submit(slurm, name, "worker", "cpu_worker",
                 ["bash", "-c", "for i in 1 2 3; do echo line-$i; sleep 1; done"],
                 time="5", mem="100", output=f"{logs}/%j.out")
    t0 = time.monotonic()
    code, out = run(capsys, "logs", path, job, "--follow")
    assert code == 0 and "line-1\nline-2\nline-3" in out, out
    assert time.monotonic() - t0 < 60
    code, out = run(capsys, "logs", path)
    assert code == 0 and f"{logs}/{job}.out" in out
    code, out = run(capsys, "logs", path, job, "--lines", "1")
    assert "line-3" in out and "line-1" not in out
    code, out = run(capsys, "logs", path, "99999999")
    assert code == 2 and "no log for job" in out


@pytest.mark.parametrize("api", APIS)
def test_doctor(tmp_path: Path, capsys: pytest.CaptureFixture[str], api: str) -> None:
    path, name = write_config(tmp_path, api)
    code, out = run(capsys, "doctor", path)
    assert code == 0, out
    assert "[OK  ] Slurm via " + api in out
    assert ("munge -n | unmunge works" in out) if api == "cli" else ("expires in" in out)
    block = port_block(name)
    with socket.socket() as s:  # someone else's process on the GCS port of node n2
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.3", block.gcs))
        s.listen()
        code, out = run(capsys, "doctor", path)
    assert code == 0 and f"n2:{block.gcs} (GCS)" in out and "provider.ports.base" in out
    token = tmp_path / "state" / name / "auth_token"
    token.parent.mkdir(parents=True)
    token.write_text("x")
    token.chmod(0o644)
    code, out = run(capsys, "doctor", path)
    assert code == 1 and f"chmod 600 {token}" in out
