"""JobSpecs -> slurmrestd job descriptions (slurm/rest/job.py, fields.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ray_slurm_provider.slurm.client import PermanentSlurmError
from ray_slurm_provider.slurm.rest.job import job_description
from ray_slurm_provider.slurm.script import JobSpec, ScriptError, render
from tests.unit.test_script import CASES

GOLDEN = Path(__file__).resolve().parent.parent / "golden"
ENV = {"PATH": "/usr/bin:/bin", "HOME": "/h"}


def true_job(**fields: object) -> JobSpec:
    return JobSpec("j", ["true"], **fields)  # type: ignore[arg-type]


def desc(spec: JobSpec, version: str = "v0.0.38", **kw: str) -> dict[str, object]:
    body = job_description(spec, api_version=version, environment=ENV, cwd="/w", **kw)
    job = body["job"]
    assert isinstance(job, dict)
    return job


def test_every_rendered_field_translates_for_v41() -> None:
    spec = JobSpec(job_name="ray-c", command=["python", "-m", "x"], partition="gpu",
                   account="acct", qos="q", time="2-00:00:00", cpus_per_task=4, mem="16G",
                   gres="gpu:a100:2", constraint="ib", exclusive=True, reservation="r",
                   nodelist="n[1-2]", exclude="n3", signal="B:TERM@120",
                   output="/s/%j.out", error="/s/%j.err", open_mode="append", requeue=False,
                   sbatch_options={"mail-type": "END,FAIL", "mail-user": "a@b", "wckey": "w"})
    job = desc(spec, "v0.0.41")
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
    job = desc(spec)
    assert job["time_limit"] == 240 and job["memory_per_node"] == 1500
    assert job["nodes"] == [1, 1] and job["gres"] == "gpu:1" and job["open_mode"] == "append"
    assert job["requeue"] is False and job["environment"] == ENV


def test_golden_scripts() -> None:
    job = desc(CASES["minimal_cpu"])
    assert job["name"] == "ray-worker" and job["nodes"] == [1, 1]
    with pytest.raises(PermanentSlurmError, match="--nodelist"):
        desc(CASES["full_gpu"])
    with pytest.raises(PermanentSlurmError, match="--no-kill"):
        desc(CASES["full_gpu"], "v0.0.41")
    # The script sent is the golden one, byte for byte (full_gpu cannot be sent).
    for name in ("minimal_cpu", "env_metachars"):
        body = job_description(CASES[name], api_version="v0.0.38", environment=ENV, cwd="/")
        assert body["script"] == (GOLDEN / f"{name}.sbatch").read_text()


@pytest.mark.parametrize(("fields", "match"), [
    ({"time": "UNLIMITED"}, "cannot say UNLIMITED"),
    ({"sbatch_options": {"gpu-bind": "closest"}}, "--gpu-bind"),
    ({"extra_directives": ["--mem-per-cpu=lots"]}, "not a memory size"),
    ({"sbatch_options": {"ntasks-per-node": "x"}}, "whole number"),
    ({"sbatch_options": {"wckey": None}}, "--wckey: needs a value"),
    ({"sbatch_options": {"hold": "x"}}, "--hold=x: a flag takes no value"),
    ({"nodelist": "n1"}, "--nodelist"),
])
def test_untranslatable_options_name_themselves(fields: dict[str, object], match: str) -> None:
    with pytest.raises(PermanentSlurmError, match=match) as ei:
        desc(true_job(**fields))
    assert "slurm_api: cli" in str(ei.value)


@pytest.mark.parametrize(("fields", "match"), [
    ({"signal": "X:TERM@60"}, r"JobSpec\.signal"),
    ({"mem": "lots"}, r"JobSpec\.mem"),
    ({"nodes": "1-2:4"}, r"JobSpec\.nodes"),
    ({"ntasks": "x"}, r"JobSpec\.ntasks"),
    ({"extra_directives": ["-z"]}, r"JobSpec\.extra_directives\[0\]"),
])
def test_what_a_jobspec_cannot_hold_is_refused_before_translation(
        fields: dict[str, object], match: str) -> None:
    """Values the typed fields refuse (the CLI back end refuses them too) never reach the
    translation: the error names the field."""
    with pytest.raises(ScriptError, match=match):
        desc(true_job(**fields))


def test_v38_signal_and_unlimited_time_v41() -> None:
    assert desc(true_job(signal="TERM@60"))["signal"] == "TERM@60"
    notes: list[str] = []
    body = job_description(true_job(signal="B:TERM@60", requeue=False),
                           api_version="v0.0.38", environment=ENV, cwd="/", notes=notes)
    assert "signal" not in body["job"] and body["job"]["requeue"] is False
    assert "cannot send --signal=B:TERM@60" in notes[0] and "ignores requeue" in notes[1]
    job41 = desc(true_job(time="UNLIMITED"), "v0.0.42")
    assert job41["time_limit"] == {"set": True, "infinite": True, "number": 0}


def test_script_placement_per_version() -> None:
    for version, top in (("v0.0.38", True), ("v0.0.40", True), ("v0.0.41", False),
                         ("v0.0.44", False)):
        body = job_description(true_job(), api_version=version, environment=ENV, cwd="/")
        assert ("script" in body) is top
        assert ("script" in body["job"]) is not top
        assert (body if top else body["job"])["script"] == render(true_job())


def test_comment_argument_wins_over_the_users_option() -> None:
    spec = JobSpec("n", ["true"], extra_directives=["--comment=b"])
    assert desc(spec)["comment"] == "b"
    assert (desc(spec, comment="c")["name"], desc(spec, comment="c")["comment"]) == ("n", "c")


def test_users_options_in_both_shapes() -> None:
    spec = true_job(sbatch_options={"hold": None, "mem-per-cpu": "2G", "gpus": "a100:2",
                               "mail-type": "END,FAIL", "ntasks-per-node": "1"},
               extra_directives=["#SBATCH --wckey=w", "--chdir=/x"])
    old, new = desc(spec), desc(spec, "v0.0.41")
    assert old["hold"] is new["hold"] is True
    assert (old["memory_per_cpu"], new["memory_per_cpu"]) == (
        2048, {"set": True, "infinite": False, "number": 2048})
    assert (old["gpus"], new["tres_per_job"]) == ("a100:2", "gres/gpu:a100:2")
    assert (old["mail_type"], new["mail_type"]) == ("END,FAIL", ["END", "FAIL"])
    assert old["tasks_per_node"] == new["tasks_per_node"] == 1
    assert old["wckey"] == "w" and old["current_working_directory"] == "/x"


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
    specs: list[JobSpec] = []

    def capture(spec: JobSpec) -> str:  # the specs `ray-slurm validate` renders
        specs.append(spec)
        return render(spec)

    monkeypatch.setattr("ray_slurm_provider.cli.validate.render", capture)
    assert len(rendered_scripts(load_cluster(str(path)))) == len(specs) > 0
    for spec in specs:
        notes: list[str] = []
        job = job_description(spec, api_version=version, environment=ENV, cwd="/",
                              notes=notes)["job"]
        assert job["name"].startswith("ray-") and job["standard_output"].endswith("%j.out")
        assert (job["open_mode"] == "append") if version == "v0.0.38" else \
            job["open_mode"] == ["APPEND"]
        assert job["requeue"] is False
        if version == "v0.0.41":
            assert job["kill_warning_flags"] == ["BATCH_JOB"] and not notes
