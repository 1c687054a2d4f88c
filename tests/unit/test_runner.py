"""The srun command runner: what runs as a job step, what is handed to the agent, what never
runs at all (a bare `ray stop`)."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest
from ray.autoscaler._private.subprocess_output_util import ProcessRunnerError
from ray.autoscaler.tags import TAG_RAY_USER_NODE_TYPE

from ray_slurm_provider import proc, shellcmd
from ray_slurm_provider.config import NodeConfig, ProviderConfig, load
from ray_slurm_provider.provider import handoff
from ray_slurm_provider.provider.runner import NodeNotReady, SrunCommandRunner
from ray_slurm_provider.state import AgentInfo, ClusterDir, RayUp, StartResult, read_json
from tests.unit.test_agent import package_imports
from tests.unit.test_provider import HEAD_TAGS, make


def runner(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[SrunCommandRunner,
                                                                       list[list[str]]]:
    p, f = make(tmp_path)
    (head,) = p.create_node({}, HEAD_TAGS, 1)
    f.start(head, "n1")
    p.non_terminated_nodes({})
    r = p.get_command_runner("", head, {}, "c1", None, True)
    r.ndir.write_agent(AgentInfo(host="n1", pid=1, kind="head", job_id=head))
    calls: list[list[str]] = []

    def run(argv: list[str], **kw: Any) -> proc.Result:
        calls.append(list(argv))
        return proc.Result(list(argv), 0, "out", "")

    monkeypatch.setattr(proc, "run", run)
    monkeypatch.setattr(proc, "run_attached", lambda argv, **kw: calls.append(list(argv)) or 0)
    return r, calls


def test_commands_run_as_a_step_of_the_nodes_job(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    r, calls = runner(tmp_path, monkeypatch)
    assert r.run("uptime", with_output=True) == b"out"
    assert calls[0][:6] == ["srun", f"--jobid={r.node_id}", "--overlap", "--nodes=1",
                            "--ntasks=1", "--quiet"]
    assert calls[0][-3:] == ["bash", "-c", "uptime"]
    r.run("echo hi", environment_variables={"A": {"x": 1}})
    assert calls[1][-1] == """export A='{"x":1}'; echo hi"""


def test_rays_readiness_test_is_answered_by_the_agent_without_a_step(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 18 (P1b): Ray's updater runs `uptime` only to see that the node is up; the agent
    in the batch step already says so, and an srun step added its start-up to `ray up`.
    `ray exec CONFIG uptime` (exit_on_fail) still runs on the node."""
    r, calls = runner(tmp_path, monkeypatch)
    assert r.run("uptime", timeout=10, run_env="host") == 0
    assert calls == []
    r.run("uptime", exit_on_fail=True)
    assert calls and calls[0][-3:] == ["bash", "-c", "uptime"]


def test_step_env_drops_the_callers_job_variables(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    r, _ = runner(tmp_path, monkeypatch)
    monkeypatch.setenv("SLURM_JOB_ID", "1")
    monkeypatch.setenv("SLURM_CONF", "/etc/slurm/slurm.conf")
    env = r.step_env()
    assert "SLURM_JOB_ID" not in env and env["SLURM_CONF"] == "/etc/slurm/slurm.conf"
    assert env["RAY_AUTH_MODE"] == "token"


def test_ray_stop_never_runs_bare(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    r, calls = runner(tmp_path, monkeypatch)
    r.ndir.write_ray_up(RayUp(ip="x", job_id=r.node_id))

    def agent_stops() -> None:  # what the head agent does when it sees the stop file
        while not r.ndir.ray_stop_requested():
            pass
        r.ndir.clear_ray_up()

    t = threading.Thread(target=agent_stops)
    t.start()
    r.run("ray stop")
    t.join(5)
    assert calls == []  # nothing ran on the node: only this job's Ray was stopped


def test_ray_start_is_handed_to_the_agent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    r, calls = runner(tmp_path, monkeypatch)

    def agent_answers() -> None:
        while not (req := r.ndir.read_start()):
            pass
        r.ndir.write_result(StartResult(req.id, ok=True))

    t = threading.Thread(target=agent_answers)
    t.start()
    r.run("export RAY_CLOUD_INSTANCE_ID=5; ray start --head --port=1",
          environment_variables={"RAY_OVERRIDE_RESOURCES": {"CPU": 0}})
    t.join(5)
    req = read_json(r.ndir.path / "start.json")  # the JSON the agent reads
    assert req["ray_start"] == ["ray", "start", "--head", "--port=1"]
    assert req["exports"] == {"RAY_CLOUD_INSTANCE_ID": "5"}
    assert req["env"] == {"RAY_OVERRIDE_RESOURCES": '{"CPU":0}'}
    assert (r.ndir.path / "start.json").stat().st_mode & 0o777 == 0o600
    assert calls == []


def test_rsync_maps_the_bootstrap_config_per_cluster(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    r, _ = runner(tmp_path, monkeypatch)
    src = tmp_path / "boot.json"
    src.write_text("{}")
    r.run_rsync_up(str(src), "~/ray_bootstrap_config.yaml")
    assert r.cdir.bootstrap_config.read_text() == "{}"


# --- the runner needs only its view of the provider ----------------------------------------


class View:
    """A `ProviderView` that is not the provider: all the runner may use of it."""

    def __init__(self, tmp_path: Path, ncfg: NodeConfig) -> None:
        self.cluster_name = "c1"
        self.pcfg = ProviderConfig(state_dir=str(tmp_path), temp_dir_root="/t")
        self.cluster_dir = ClusterDir(self.pcfg.state_dir, "c1")
        self.ncfg = ncfg
        self.terminated: list[str] = []

    def node_tags(self, node_id: str) -> dict[str, str]:
        return {TAG_RAY_USER_NODE_TYPE: "gpu"}

    def non_terminated_nodes(self, tag_filters: dict[str, str]) -> list[str]:
        return []

    def describe_job(self, node_id: str) -> str:
        return f"Slurm job {node_id} is PENDING"

    def is_terminated(self, node_id: str) -> bool:
        return bool(self.terminated)

    def terminate_node(self, node_id: str) -> None:
        self.terminated.append(node_id)

    def node_config(self, node_type: str) -> NodeConfig:
        assert node_type == "gpu"
        return self.ncfg


def test_runner_works_on_its_view_alone(tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    ncfg = load(NodeConfig, {"container": {"runtime": "docker", "image": "img"}}, "node_config")
    view = View(tmp_path, ncfg)
    r = SrunCommandRunner(view, "7_1")
    with pytest.raises(NodeNotReady, match="Slurm job 7_1 is PENDING"):
        r.run("true")  # before its agent runs, no step can
    r.ndir.write_agent(AgentInfo(host="n1", pid=1, kind="worker", job_id="12"))
    argv = r.srun_argv("true", in_container=True)
    assert argv[1] == "--jobid=12" and "rsp-c1-12" in argv  # the container of job 12
    container = r.container()
    assert container is not None and container[1].temp_dir == f"/t/rsp-{os.getuid()}/12"
    monkeypatch.setattr(proc, "run_attached", lambda argv, **kw: 0)
    r.run("ray stop; sudo shutdown -h now")
    assert view.terminated == ["7_1"]


def test_ray_exec_enters_an_apptainer_node_with_the_nodes_binds_and_nv(
        tmp_path: Path) -> None:
    """`apptainer exec` starts a second container: it must get the binds and `--nv` the
    node's agent gave its own (Slurm's config, the bound Python, the job's GPUs), which only
    the agent knows; an older agent's record without them still gives the config's binds."""
    ncfg = load(NodeConfig, {"gpus": 1, "container": {
        "runtime": "apptainer", "image": "/img.sif", "mounts": ["/data:/data:ro"]}},
        "node_config")
    r = SrunCommandRunner(View(tmp_path, ncfg), "12")
    r.ndir.write_agent(AgentInfo(host="n1", pid=1, kind="worker", job_id="12",
                                 container_mounts=["/etc/slurm:/etc/slurm:ro"],
                                 container_gpus=["3"], container_path="/venv/bin:/usr/bin"))
    argv = r.srun_argv("ray status", in_container=True)
    inner = argv[argv.index("apptainer"):]
    assert inner[:5] == ["apptainer", "exec", "--nv", "--env", "PATH=/venv/bin:/usr/bin"]
    binds = [inner[i + 1] for i, a in enumerate(inner) if a == "--bind"]
    assert binds[2:] == ["/etc/slurm:/etc/slurm:ro", "/data:/data:ro"]
    assert inner[-4:] == ["/img.sif", "bash", "-c", "ray status"]
    r.ndir.write_agent(AgentInfo(host="n1", pid=1, kind="worker", job_id="12"))
    inner = r.srun_argv("true", in_container=True)
    assert "--nv" not in inner and "--env" not in inner and "/data:/data:ro" in inner


def test_a_step_on_a_gang_member_runs_on_that_members_node_in_its_container(
        tmp_path: Path) -> None:
    """Issue 16: member `<job>.<k>` is one node of a multi-node job: its step names the job's
    numeric id and the member's node, and enters the member's own container."""
    ncfg = load(NodeConfig, {"nodes": 2, "container": {"runtime": "docker", "image": "i"}},
                "node_config")
    r = SrunCommandRunner(View(tmp_path, ncfg), "12_3.1")
    r.ndir.write_agent(AgentInfo(host="n2", pid=1, kind="worker", job_id="15"))
    argv = r.srun_argv("true", in_container=True)
    assert argv[:2] == ["srun", "--jobid=15"] and "--nodelist=n2" in argv
    assert "rsp-c1-15.1" in argv
    container = r.container()
    assert container is not None and container[1].temp_dir.endswith("/15.1")  # as the agent
    single = SrunCommandRunner(View(tmp_path, ncfg), "16")
    assert not any(a.startswith("--nodelist") for a in single.srun_argv("true"))


def test_a_failed_or_lost_start_is_the_runners_error(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    view = View(tmp_path, NodeConfig())
    n = view.cluster_dir.node("7")
    prog = shellcmd.parse("ray start --head")
    req = handoff.request_start(n, prog, None)
    n.write_result(StartResult(req, ok=False, error="port in use"))
    with pytest.raises(ProcessRunnerError, match="ray start failed in job 7: port in use"):
        handoff.wait_started(n, req, timeout=60, node_id="7", log=tmp_path / "7.out",
                             job_gone=lambda: False)
    monkeypatch.setattr(handoff, "QUERY_EVERY_S", 0.0)
    monkeypatch.setattr(handoff.time, "sleep", lambda s: None)
    asked: list[bool] = []
    req = handoff.request_start(n, prog, None)
    with pytest.raises(ProcessRunnerError, match="Ray did not come up in job 7"):
        handoff.wait_started(n, req, timeout=60, node_id="7", log=tmp_path / "7.out",
                             job_gone=lambda: asked.append(True) or True)
    assert asked == [True]  # the job left Slurm: no waiting out the timeout


def test_the_runner_does_not_import_the_provider() -> None:
    for m in ("runner", "handoff", "transfer"):
        deps = package_imports(f"ray_slurm_provider.provider.{m}")
        assert "ray_slurm_provider.provider.provider" not in deps, m


def test_a_slurm_hiccup_while_the_head_starts_does_not_abort_ray_up(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 14.9: one failed listing while `ray up` waited for the head's Ray aborted it."""
    from ray_slurm_provider.slurm.client import TransientSlurmError

    r, _ = runner(tmp_path, monkeypatch)
    fake = r.provider._client  # type: ignore[attr-defined]
    fake.fail_next("list_jobs", TransientSlurmError("x", "Unable to contact slurm controller",
                                                    "squeue"))
    assert r._job_gone() is False  # unknown is not gone: keep waiting, within the deadline
    assert r._job_gone() is False  # and the next listing answers
    fake.finish(r.node_id, "FAILED")
    assert r._job_gone() is True


def test_copying_a_file_onto_itself_is_a_no_op(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 14.5: `ray submit` from the home directory, or a same-path file mount on the
    shared filesystem, raised shutil.SameFileError / a garbled shutil.Error."""
    from ray_slurm_provider.provider.transfer import copy

    f = tmp_path / "job.py"
    f.write_text("print(1)")
    copy(str(f), str(f))
    copy(str(f), str(tmp_path) + "/")  # the directory it is already in
    d = tmp_path / "pkg"
    d.mkdir()
    (d / "a.py").write_text("x = 1")
    copy(str(d) + "/", str(d))  # a directory mounted at its own path
    assert f.read_text() == "print(1)" and (d / "a.py").read_text() == "x = 1"


def test_the_closing_hints_name_the_real_config_and_log_locations(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 14.18: `ray up` printed the placeholder CLUSTER.yaml."""
    from ray_slurm_provider.state import HeadInfo

    r, _ = runner(tmp_path, monkeypatch)
    config = tmp_path / "my cluster.yaml"
    config.write_text("cluster_name: c1\n")
    monkeypatch.setattr("sys.argv", ["ray", "up", "-y", str(config)])
    r.cdir.write_head(HeadInfo(job_id=r.node_id, ip="10.0.0.5", gcs_port=24000,
                               dashboard_port=24001))
    from ray_slurm_provider.provider import handoff as h

    h.announce(r.cdir, r.node_id, r.provider.pcfg.temp_dir_root, r.log_prefix)
    out = capsys.readouterr().out
    assert "CLUSTER.yaml" not in out
    assert f"eval \"$(ray-slurm env '{config}')\"" in out
    assert f"ray-slurm logs '{config}' head" in out
    assert f"/rsp-{os.getuid()}/{r.node_id}/session_latest/logs" in out
    assert "/tmp/ray/" not in out


def test_ray_up_waits_for_a_queued_head_as_long_as_asked_then_cancels_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 14.7: `ray up` gave up on a queued head after Ray's 15 minutes and left the job
    queued, to hold an allocation for 30 minutes once it started. It now waits
    `provider.head_wait_s` inside the readiness probe, saying why, then cancels the job."""
    from tests.fakes import FakeClock

    p, f = make(tmp_path, head_wait_s=3600)
    (head,) = p.create_node({}, HEAD_TAGS, 1)
    f.set_state(head, "PENDING", "Priority")
    r = p.get_command_runner("", head, {}, "c1", None, True)
    clock = FakeClock()
    r._clock, r._sleep = clock.now, clock.advance
    with pytest.raises(NodeNotReady, match=r"is PENDING.*after a wait of 01:00:00.*cancelled"):
        r.run("uptime", timeout=10)
    out = capsys.readouterr().out
    assert "reason: Priority" in out and "provider.head_wait_s" in out
    assert f.jobs[head].job.state == "CANCELLED" and p.is_terminated(head)


def test_a_queued_head_that_starts_within_the_wait_is_taken(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.fakes import FakeClock

    p, f = make(tmp_path, head_wait_s=3600)
    (head,) = p.create_node({}, HEAD_TAGS, 1)
    r = p.get_command_runner("", head, {}, "c1", None, True)
    clock = FakeClock()

    def later(s: float) -> None:
        clock.advance(s)
        if clock.now() - t0 > 1200 and not r.ndir.agent_up():  # it starts after 20 minutes
            f.start(head, "n1")
            r.ndir.write_agent(AgentInfo(host="n1", pid=1, kind="head", job_id=head))

    t0 = clock.now()
    r._clock, r._sleep = clock.now, later
    monkeypatch.setattr(proc, "run", lambda argv, **kw: proc.Result(list(argv), 0, "up", ""))
    assert r.run("uptime", timeout=10, with_output=True) == b"up"
    assert f.jobs[head].job.state == "RUNNING"


def test_a_queued_heads_wait_shows_slurms_estimated_start(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 31 item 4: while `ray up` waits, Slurm's reason, the wait so far and the
    scheduler's estimated start (squeue's %S for a pending job: `squeue --start`'s)."""
    from dataclasses import replace

    from tests.fakes import FakeClock

    p, f = make(tmp_path, head_wait_s=120)
    (head,) = p.create_node({}, HEAD_TAGS, 1)
    f.set_state(head, "PENDING", "Resources")
    f.jobs[head].job = replace(f.jobs[head].job, start_time="2027-01-15T09:30:00")
    r = p.get_command_runner("", head, {}, "c1", None, True)
    clock = FakeClock()
    r._clock = clock.now
    r._sleep = clock.advance
    with pytest.raises(NodeNotReady):
        r.run("uptime", timeout=10)
    out = capsys.readouterr().out
    assert "reason: Resources, estimated start 2027-01-15T09:30:00 (Slurm's estimate)" in out
    assert "waited 01:00 of 02:00" in out
