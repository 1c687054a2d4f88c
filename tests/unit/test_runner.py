"""The srun command runner: what runs as a job step, what is handed to the agent, what never
runs at all (a bare `ray stop`)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from ray_slurm_provider import proc
from ray_slurm_provider.provider.runner import SrunCommandRunner
from ray_slurm_provider.state import AgentInfo, RayUp, StartResult, read_json
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
        while not r.ndir.stop_requested():
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

