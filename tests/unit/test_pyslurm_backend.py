"""The pyslurm back end against a fake of pyslurm's API (no pyslurm builds here)."""

from __future__ import annotations

import importlib
import logging
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from ray_slurm_provider.cli import doctor, validate
from ray_slurm_provider.config import parse_provider
from ray_slurm_provider.slurm import pyslurm as pyslurm_backend
from ray_slurm_provider.slurm.client import (
    PermanentSlurmError,
    SlurmClient,
    TransientSlurmError,
    job_environment,
)
from ray_slurm_provider.slurm.factory import make_client
from ray_slurm_provider.slurm.pyslurm import PyslurmSlurmClient, major_minor
from ray_slurm_provider.slurm.script import JobSpec, render
from tests import pyslurm_fake
from tests.pyslurm_fake import FakeJob, make_module
from tests.unit.test_cmds import cluster


@pytest.fixture
def mod(monkeypatch: pytest.MonkeyPatch) -> Any:
    m = make_module()
    monkeypatch.setenv("USER", "root")
    return m


def test_factory_builds_it_without_importing_pyslurm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "pyslurm", raising=False)
    client = make_client(parse_provider({"slurm_api": "pyslurm"}))
    assert isinstance(client, PyslurmSlurmClient) and isinstance(client, SlurmClient)
    assert "pyslurm" not in sys.modules


def test_missing_pyslurm_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.import_module

    def fake_import(name: str, *a: Any) -> Any:
        if name == "pyslurm":
            raise ModuleNotFoundError("No module named 'pyslurm'")
        return real(name, *a)

    monkeypatch.setattr(importlib, "import_module", fake_import)
    monkeypatch.setattr(pyslurm_backend, "probe_import", lambda: None)
    with pytest.raises(PermanentSlurmError, match=r"not installed.*works only with Slurm X\.Y"):
        PyslurmSlurmClient().list_jobs("x")


def test_pyslurm_built_for_another_libslurm(monkeypatch: pytest.MonkeyPatch) -> None:
    def fake_import(name: str, *a: Any) -> Any:
        raise ImportError("libslurmfull.so: cannot open shared object file")

    monkeypatch.setattr(importlib, "import_module", fake_import)
    monkeypatch.setattr(pyslurm_backend, "probe_import", lambda: None)
    with pytest.raises(PermanentSlurmError, match="cannot load against this machine's libslurm"):
        PyslurmSlurmClient().cluster_info()


@pytest.mark.parametrize(("child", "error", "words"), [
    ("echo 'slurm_load_ctl_conf: Could not establish a configuration source' >&2; exit 1",
     PermanentSlurmError, r"exits the process: .*configuration source.*SLURM_CONF"),
    ("echo \"ModuleNotFoundError: No module named 'pyslurm'\" >&2; exit 1",
     PermanentSlurmError, r"not installed"),
    ("echo 'ImportError: libslurm.so.44: cannot open shared object file' >&2; exit 1",
     PermanentSlurmError, r"cannot load against this machine's libslurm"),
])
def test_pyslurm_is_imported_in_a_child_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              child: str, error: type, words: str) -> None:
    """`import pyslurm` exits the process when it finds no Slurm config (measured on 25.11):
    a child imports it first, and its failure is an error, never the caller's exit."""
    fake_python = tmp_path / "python"
    fake_python.write_text(f"#!/bin/sh\n{child}\n")
    fake_python.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(fake_python))
    with pytest.raises(error, match=words):
        PyslurmSlurmClient().cluster_info()
    fake_python.write_text("#!/bin/sh\nexit 0\n")
    pyslurm_backend.probe_import()  # a child that imports it: nothing to say


def test_loading_says_which_pyslurm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                    caplog: pytest.LogCaptureFixture) -> None:
    """The monitor log names the pyslurm the head's autoscaler loaded (the e2e test on the
    real pyslurm reads this line)."""
    (tmp_path / "pyslurm.py").write_text('__version__ = "25.11.2"\n')
    fake_python = tmp_path / "python"
    fake_python.write_text("#!/bin/sh\nexit 0\n")
    fake_python.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(fake_python))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "pyslurm", raising=False)
    caplog.set_level(logging.INFO, logger=pyslurm_backend.__name__)
    assert PyslurmSlurmClient().lib().__version__ == "25.11.2"
    assert f"pyslurm 25.11.2 loaded from {tmp_path / 'pyslurm.py'}" in caplog.text


def test_release_mismatch_is_refused() -> None:
    client = PyslurmSlurmClient(module=make_module("25.11.2"))
    with pytest.raises(PermanentSlurmError,
                       match=r"pyslurm 25\.11\.2 is for Slurm 25\.11, but this cluster runs "
                             r"Slurm 22\.05"):
        client.node_addresses()


@pytest.mark.parametrize(("given", "sent"), [
    ("B:TERM@60", "B:SIGTERM@60"), ("TERM@90", "SIGTERM@90"), ("SIGUSR1@5", "SIGUSR1@5"),
    ("10@30", "10@30"), ("RB:INT", "RB:SIGINT"),
])
def test_signal_in_pythons_names(mod: Any, given: str, sent: str) -> None:
    """sbatch takes `--signal=B:TERM@60`; pyslurm 25.11.2 looks the name up in Python's
    `signal.Signals` and refused "TERM" (found by the e2e test on the real pyslurm)."""
    PyslurmSlurmClient(module=mod).submit(JobSpec("ray-c", ["true"], signal=given))
    assert mod.state["submitted"][-1]["signal"] == sent


def test_major_minor() -> None:
    assert major_minor("24.5.1") == "24.05" == major_minor("24.05.3")
    assert major_minor("slurm") == ""


def test_submit_list_cancel(mod: Any) -> None:
    client = PyslurmSlurmClient(module=mod)
    spec = JobSpec("ray-c", ["true"], partition="gpu")
    job_id = client.submit(spec, comment="ray-slurm:{}")
    (kw,) = mod.state["submitted"]
    assert kw == {"script": render(spec), "environment": job_environment(os.environ),
                  "name": "ray-c", "comment": "ray-slurm:{}", "partitions": "gpu", "nodes": 1,
                  "ntasks": 1}
    mod.state["jobs"][999] = FakeJob(999, "ray-c", user_name="bob", state="RUNNING")
    mod.state["jobs"][998] = FakeJob(998, "ray-c", state="COMPLETED")
    mod.state["jobs"][997] = FakeJob(997, "ray-c", state="RUNNING", batch_host="n2",
                                     allocated_nodes="n2", time_limit=10,
                                     run_time_remaining=300, start_time=1796000905)
    jobs = {j.job_id: j for j in client.list_jobs("ray-c")}
    assert set(jobs) == {job_id, "997"}
    pending, running = jobs[job_id], jobs["997"]
    assert (pending.state, pending.reason, pending.partition, pending.comment) == (
        "PENDING", "", "gpu", "ray-slurm:{}")
    assert pending.time_limit_s is None and pending.node_addr == ""
    assert (running.node_addr, running.time_limit_s, running.time_left_s) == (
        "127.0.0.3", 600, 300)
    client.cancel([job_id, "12345"])  # one unknown: fine
    client.cancel([job_id])  # already cancelled: fine
    assert mod.state["cancelled"] == [int(job_id)]


def test_errors_are_typed_by_slurms_words(mod: Any) -> None:
    client = PyslurmSlurmClient(module=mod)
    with pytest.raises(PermanentSlurmError, match="Invalid partition name specified"):
        client.submit(JobSpec("j", ["true"], partition="nope"))
    mod.state["fail"]["jobs"] = "Unable to contact slurm controller (connect failure)"
    with pytest.raises(TransientSlurmError):
        client.list_jobs("x")
    mod.state["fail"]["cancel"] = "Access/permission denied"
    mod.state["jobs"][5] = FakeJob(5, "x")
    with pytest.raises(PermanentSlurmError, match="permission denied"):
        client.cancel(["5"])


def test_cluster_info_matches_the_sandbox(mod: Any) -> None:
    info = PyslurmSlurmClient(module=mod).cluster_info()
    assert info.version == "22.05.8"
    cpu, gpu = info.partition("cpu"), info.partition("gpu")
    assert cpu is not None and gpu is not None and info.partition(None) == cpu
    assert gpu.gpus_per_node == 2 and cpu.max_time_s is None
    assert {n.addr for n in cpu.nodes} == {"127.0.0.2", "127.0.0.3", "127.0.0.4"}
    mod.state["parts"][0].max_time = 120
    assert PyslurmSlurmClient(module=mod).cluster_info().partitions[0].max_time_s == 7200


def test_every_field_is_an_attribute(mod: Any) -> None:
    """Typed fields and the user's options become JobSubmitDescription attributes; an option
    without one is refused, naming it, before pyslurm is asked."""
    spec = JobSpec("ray-c", ["ray", "start"], partition="gpu", account="a", qos="q",
                   time="1:00:00", nodes=2, ntasks=2, cpus_per_task=4, mem="16G",
                   gres="gpu:2", gpus_per_node="a100:1", constraint="ib", exclusive=True,
                   reservation="r", nodelist="n[1-2]", exclude="n3", signal="B:TERM@120",
                   output="/s/%j.out", error="/s/%j.err", open_mode="append", requeue=False,
                   sbatch_options={"hold": None, "mail-type": "END"},
                   extra_directives=["#SBATCH --comment=mine", "--mem-per-cpu=1G"])
    client = PyslurmSlurmClient(module=mod)
    client.submit(spec, comment="tags")
    (kw,) = mod.state["submitted"]
    assert kw == {
        "script": render(spec), "environment": job_environment(os.environ), "name": "ray-c",
        "partitions": "gpu",
        "account": "a", "qos": "q", "time_limit": 60, "nodes": 2, "ntasks": 2,
        "cpus_per_task": 4, "memory_per_node": "16G", "gres_per_node": "gpu:2,gpu:a100:1",
        "constraints": "ib", "resource_sharing": "no", "reservations": "r",
        "required_nodes": "n[1-2]", "excluded_nodes": "n3", "signal": "B:SIGTERM@120",
        "standard_output": "/s/%j.out", "standard_error": "/s/%j.err",
        "log_files_open_mode": "append", "is_requeueable": False, "priority": 0,
        "mail_types": "END", "comment": "tags", "memory_per_cpu": "1G"}
    for bad, match in (({"no-kill": None}, "--no-kill: no translation"),
                       ({"hold": "x"}, "--hold=x: a flag takes no value"),
                       ({"wckey": None}, "--wckey: needs a value")):
        with pytest.raises(PermanentSlurmError, match=match) as ei:
            client.submit(JobSpec("j", ["true"], sbatch_options=bad))
        assert "slurm_api: cli" in str(ei.value)
    assert len(mod.state["submitted"]) == 1


def test_a_job_starts_with_the_scrubbed_environment_never_the_autoscalers_own(
        mod: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The head's autoscaler submits worker jobs from inside the head's job: its RAY_*
    settings and sbatch's input variables must not become the workers' (as with the CLI and
    REST back ends). pyslurm's "ALL" copies the whole process environment as it is."""
    for k, v in {"RAY_OVERRIDE_RESOURCES": '{"CPU": 64}', "SBATCH_PARTITION": "other",
                 "SLURM_CPUS_PER_TASK": "8", "SLURM_CONF": "/etc/slurm/slurm.conf",
                 "BASH_FUNC_module%%": "() { :; }", "MY_VAR": "kept"}.items():
        monkeypatch.setenv(k, v)
    PyslurmSlurmClient(module=mod).submit(JobSpec("ray-c", ["true"]))
    env = mod.state["job_env"][0]  # pyslurm adds the process's SLURM_* to a dict: not here
    assert env["MY_VAR"] == "kept" and env["SLURM_CONF"] == "/etc/slurm/slurm.conf"
    assert not [k for k in env if k.startswith(("RAY_", "SBATCH_", "SLURM_CPUS", "BASH_FUNC"))]
    assert pyslurm_fake.pyenviron is os.environ  # put back


def test_pyslurm_says_how_a_job_ended_as_the_cli_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 26 item 8 on pyslurm: slurmctld's record (scontrol, as the CLI back end reads
    it), else accounting; so a setup that failed before the agent still counts."""
    from ray_slurm_provider import proc
    from ray_slurm_provider.slurm.client import EndReader
    from ray_slurm_provider.slurm.sacct import NoAccounting
    from tests.unit.test_slurm_cli import FakeRun

    run = FakeRun()
    run.set("scontrol show job", "scontrol_show_job_failed",
            ("", "slurm_load_jobs error: Invalid job id specified\n", 1))
    run.set("sacct", "sacct_disabled")
    monkeypatch.setattr(proc, "run", run)
    client = PyslurmSlurmClient(module=make_module("25.11.2"))
    assert isinstance(client, EndReader)
    end = client.ended_job("7")
    assert end is not None and end.state == "FAILED"
    with pytest.raises(NoAccounting):
        client.ended_job("8")


def test_the_fake_has_the_real_pyslurm_s_names() -> None:
    """The fake's classes and JobSubmitDescription's attributes against pyslurm 25.11.2 built
    on the sandbox's Slurm 25.11.7 (tests/fixtures/pyslurm-25.11/attributes.json): every
    name the fake offers is real, and the back end's `pyenviron` hook is there."""
    import dataclasses
    import json

    real = json.loads((Path(__file__).parent.parent / "fixtures" / "pyslurm-25.11" /
                       "attributes.json").read_text())
    for cls, name in ((pyslurm_fake.FakeJob, "Job"), (pyslurm_fake.FakeNode, "Node"),
                      (pyslurm_fake.FakePartition, "Partition")):
        fields = {f.name for f in dataclasses.fields(cls)}
        assert fields <= set(real[name]), (name, fields - set(real[name]))
    assert pyslurm_fake.ATTRIBUTES <= set(real["JobSubmitDescription"]), \
        pyslurm_fake.ATTRIBUTES - set(real["JobSubmitDescription"])
    assert real["submission_module_has_pyenviron"]


@pytest.mark.parametrize(("time", "minutes"), [("10", 10), ("1:00:00", 60), ("0:30", 1),
                                               ("1-00:00:00", 1440), ("UNLIMITED", None)])
def test_time_limit_is_whole_minutes(time: str, minutes: int | None) -> None:
    """pyslurm 25.11.2 refuses a string ("TypeError: an integer is required", measured on
    25.11.7): the limit goes as minutes, rounded up; unlimited is left unset."""
    kw = pyslurm_backend.description(JobSpec("j", ["true"], time=time))
    assert kw.get("time_limit") == minutes


def test_doctor_and_validate_refuse_a_pyslurm_for_another_release(tmp_path: Path) -> None:
    """After a site upgrade the installed pyslurm no longer matches the controller: `doctor`
    and `validate` fail on it, with the fix, before `ray up` submits anything."""
    client = PyslurmSlurmClient(module=make_module("25.11.2"))
    c = cluster(tmp_path, client, slurm_api="pyslurm")  # type: ignore[arg-type]
    found, info = doctor.slurm_findings(c)
    assert info is None
    (f,) = [f for f in found if f.level == "fail"]
    assert f.what == "Slurm via pyslurm"
    assert "pyslurm 25.11.2 is for Slurm 25.11, but this cluster runs Slurm 22.05" in f.message
    assert "install the pyslurm release matching your Slurm" in f.fix
    failed = [f for f in validate.validate_findings(c) if f.level == "fail"]
    assert any("is for Slurm 25.11" in f.message for f in failed)


def _recorded() -> dict[str, Any]:
    import json

    return dict(json.loads((Path(__file__).parent.parent / "fixtures" / "pyslurm-25.11" /
                            "records.json").read_text()))


def _types(obj: Any, recorded: dict[str, Any]) -> tuple[dict[str, str], dict[str, str]]:
    """(the fake's, the real pyslurm's) type names of the fields recorded."""
    return ({f: type(getattr(obj, f)).__name__ for f in recorded},
            {f: v["type"] for f, v in recorded.items()})


def test_the_fake_answers_as_the_recorded_pyslurm_did() -> None:
    """What pyslurm 25.11.2 returned on the sandbox's Slurm 25.11.7 for the calls the back end
    makes (tests/fixtures/record_pyslurm.py, tests/fixtures/pyslurm-25.11/records.json): the
    fake's records have the same fields of the same types, and it refuses and accepts what
    the real one did."""
    rec = _recorded()
    mod = make_module(rec["version"])
    env = {"PATH": "/usr/bin"}
    held = mod.JobSubmitDescription(name="r", script="#!/bin/sh\n", partitions="cpu",
                                    time_limit=10, priority=0, comment="held",
                                    environment=env).submit()
    running = mod.JobSubmitDescription(name="r", script="#!/bin/sh\n", partitions="cpu",
                                       time_limit=10, comment="running",
                                       environment=env).submit()
    mod.state["jobs"][held].state_reason = "JobHeldUser"
    mod.start(running, "n1")
    jobs = mod.Jobs.load()
    for job_id, kind in ((held, "held"), (running, "running")):
        fake, real = _types(jobs[job_id], rec[kind])
        assert fake == real, kind
    # The values the back end reads differently for a pending job.
    for field in ("start_time", "run_time_remaining", "time_limit", "allocated_nodes",
                  "batch_host", "state", "state_reason"):
        assert getattr(jobs[held], field) == rec["held"][field]["value"], field
    node = next(iter(mod.Nodes.load().values()))
    assert _types(node, rec["nodes"][0])[0] == _types(node, rec["nodes"][0])[1]
    for part in mod.Partitions.load().values():
        fake, real = _types(part, rec["partitions"][0])
        assert fake == real, part.name
        assert part.default_time == rec["partitions"][0]["default_time"]["value"]
    errors = rec["errors"]
    with pytest.raises(mod.RPCError) as ei:
        mod.JobSubmitDescription(name="r", script="#!/bin/sh\ntrue\n", partitions="nosuch",
                                 environment=env).submit()
    assert errors["bad_partition"] == f"RPCError: {ei.value}"
    with pytest.raises(AttributeError) as ai:
        mod.JobSubmitDescription(nosuch=1)
    assert errors["unknown_attribute"] == f"AttributeError: {ai.value}"
    # The real pyslurm cancels an unknown id, and a job cancelled before, without an error.
    assert errors["cancel_unknown"] == errors["cancel_cancelled"] == "no error"
    mod.Job(999999).cancel()
    mod.Job(held).cancel()
    mod.Job(held).cancel()
    assert rec["has_pyenviron"] and rec["submission_module"] == "pyslurm.core.job.submission"
