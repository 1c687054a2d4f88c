"""Rendered batch scripts -> slurmrestd job descriptions (rest_job.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ray_slurm_provider.slurm.client import PermanentSlurmError
from ray_slurm_provider.slurm.rest.job import directives, job_description
from ray_slurm_provider.slurm.script import JobSpec, render

GOLDEN = Path(__file__).resolve().parent.parent / "golden"
ENV = {"PATH": "/usr/bin:/bin", "HOME": "/h"}


def desc(script: str, version: str = "v0.0.38", **kw: str) -> dict[str, object]:
    body = job_description(script, api_version=version, environment=ENV, cwd="/w", **kw)
    job = body["job"]
    assert isinstance(job, dict)
    return job


def test_directives_follow_sbatchs_scan() -> None:
    script = ("#!/bin/bash\n#SBATCH --time=10 --mem=100   # a comment\n\n# note\n"
              "#SBATCH -p cpu -J name\n#SBATCH --hold\n#SBATCH --qos high\n"
              "echo hi\n#SBATCH --partition=never\n")
    assert directives(script) == [("time", "10"), ("mem", "100"), ("partition", "cpu"),
                                  ("job-name", "name"), ("hold", None), ("qos", "high")]


def test_every_rendered_field_translates_for_v41() -> None:
    spec = JobSpec(job_name="ray-c", command=["python", "-m", "x"], partition="gpu",
                   account="acct", qos="q", time="2-00:00:00", cpus_per_task=4, mem="16G",
                   gres="gpu:a100:2", constraint="ib", exclusive=True, reservation="r",
                   nodelist="n[1-2]", exclude="n3", signal="B:TERM@120",
                   output="/s/%j.out", error="/s/%j.err", open_mode="append", requeue=False,
                   sbatch_options={"mail-type": "END,FAIL", "mail-user": "a@b", "wckey": "w"})
    job = desc(render(spec), "v0.0.41")
    assert job["name"] == "ray-c" and job["partition"] == "gpu" and job["account"] == "acct"
    assert job["time_limit"] == {"set": True, "infinite": False, "number": 2880}
    assert job["memory_per_node"] == {"set": True, "infinite": False, "number": 16384}
    assert (job["minimum_nodes"], job["maximum_nodes"], job["tasks"]) == (1, 1, 1)
    assert job["cpus_per_task"] == 4 and job["tres_per_node"] == "gres/gpu:a100:2"
    assert job["constraints"] == "ib" and job["shared"] == ["none"]
    assert (job["required_nodes"], job["excluded_nodes"]) == ("n[1-2]", "n3")
    assert job["kill_warning_signal"] == "TERM" and job["kill_warning_flags"] == ["BATCH_JOB"]
    assert job["kill_warning_delay"] == {"set": True, "infinite": False, "number": 120}
    assert (job["standard_output"], job["standard_error"]) == ("/s/%j.out", "/s/%j.err")
    assert job["open_mode"] == ["APPEND"] and job["requeue"] is False
    assert job["mail_type"] == ["END", "FAIL"] and job["mail_user"] == "a@b"
    assert job["environment"] == ["HOME=/h", "PATH=/usr/bin:/bin"]
    assert job["current_working_directory"] == "/w"


def test_provider_shaped_job_translates_for_v38() -> None:
    spec = JobSpec(job_name="ray-c", command=["python"], partition="cpu", time="4:00:00",
                   cpus_per_task=1, mem="1500M", gres="gpu:1", output="/s/%j.out",
                   open_mode="append", requeue=False, environment={"A": "1"})
    job = desc(render(spec))
    assert job["time_limit"] == 240 and job["memory_per_node"] == 1500
    assert job["nodes"] == [1, 1] and job["gres"] == "gpu:1" and job["open_mode"] == "append"
    assert job["requeue"] is False and job["environment"] == ENV


def test_golden_scripts() -> None:
    job = desc((GOLDEN / "minimal_cpu.sbatch").read_text())
    assert job["name"] == "ray-worker" and job["nodes"] == [1, 1]
    with pytest.raises(PermanentSlurmError, match="--nodelist"):
        desc((GOLDEN / "full_gpu.sbatch").read_text())
    with pytest.raises(PermanentSlurmError, match="--no-kill"):
        desc((GOLDEN / "full_gpu.sbatch").read_text(), "v0.0.41")


@pytest.mark.parametrize(("script_opt", "match"), [
    ("--signal=X:TERM@60", "not a signal specification"),
    ("--time=UNLIMITED", "cannot say UNLIMITED"),
    ("--export=ALL", "--export"),
    ("--mem=lots", "not a memory size"),
    ("--nodes=1-2:4", "node counts"),
    ("--ntasks=x", "whole number"),
    ("-z", "not an sbatch option"),
])
def test_untranslatable_options_name_themselves(script_opt: str, match: str) -> None:
    with pytest.raises(PermanentSlurmError, match=match) as ei:
        desc(f"#!/bin/bash\n#SBATCH {script_opt}\ntrue\n")
    assert "slurm_api: cli" in str(ei.value)


def test_v38_signal_and_unlimited_time_v41() -> None:
    assert desc("#!/bin/bash\n#SBATCH --signal=TERM@60\ntrue\n")["signal"] == "TERM@60"
    notes: list[str] = []
    body = job_description("#!/bin/bash\n#SBATCH --signal=B:TERM@60 --no-requeue\ntrue\n",
                           api_version="v0.0.38", environment=ENV, cwd="/", notes=notes)
    assert "signal" not in body["job"] and body["job"]["requeue"] is False
    assert "cannot send --signal=B:TERM@60" in notes[0] and "ignores requeue" in notes[1]
    job = desc("#!/bin/bash\n#SBATCH --time=UNLIMITED\ntrue\n", "v0.0.42")
    assert job["time_limit"] == {"set": True, "infinite": True, "number": 0}


def test_script_placement_per_version() -> None:
    for version, top in (("v0.0.38", True), ("v0.0.40", True), ("v0.0.41", False),
                         ("v0.0.44", False)):
        body = job_description("#!/bin/bash\ntrue\n", api_version=version, environment=ENV,
                               cwd="/")
        assert ("script" in body) is top
        assert ("script" in body["job"]) is not top


def test_name_and_comment_arguments_win() -> None:
    job = desc("#!/bin/bash\n#SBATCH --job-name=a --comment=b\ntrue\n", job_name="n",
               comment="c")
    assert (job["name"], job["comment"]) == ("n", "c")


@pytest.mark.parametrize("config_name", ["sandbox.yaml", "sandbox-rest.yaml", "slurm-cpu.yaml",
                                         "slurm-gpu.yaml", "sandbox-docker.yaml"])
@pytest.mark.parametrize("version", ["v0.0.38", "v0.0.41"])
def test_every_script_the_provider_renders_translates(
        config_name: str, version: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The REST back end can submit every job of the shipped cluster configs."""
    from ray_slurm_provider.cli.common import load_cluster
    from ray_slurm_provider.cli.validate import rendered_scripts
    from ray_slurm_provider.slurm.client import Node
    from tests.fakes import FakeSlurm

    nodes = [Node(f"n{i}", f"10.0.0.{i}", "IDLE", 64, 512000, "gpu:a100:4") for i in (1, 2)]
    fake = FakeSlurm(nodes=nodes)
    monkeypatch.setattr("ray_slurm_provider.provider.bootstrap._cluster_info",
                        lambda *_: fake.cluster_info())
    src = GOLDEN.parent.parent / "cluster-configs" / config_name
    text = src.read_text().replace("~/.ray_slurm", str(tmp_path))
    path = tmp_path / config_name
    path.write_text(text)
    for _, _, script in rendered_scripts(load_cluster(str(path))):
        notes: list[str] = []
        job = job_description(script, api_version=version, environment=ENV, cwd="/",
                              notes=notes)["job"]
        assert job["name"].startswith("ray-") and job["standard_output"].endswith("%j.out")
        assert (job["open_mode"] == "append") if version == "v0.0.38" else \
            job["open_mode"] == ["APPEND"]
        assert job["requeue"] is False
        if version == "v0.0.41":
            assert job["kill_warning_flags"] == ["BATCH_JOB"] and not notes
