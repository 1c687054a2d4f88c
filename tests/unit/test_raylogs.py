"""Ray's logs outlive the job (issue 17.3): the agent keeps them in the cluster dir when its job
ends, capped; `ray-slurm logs CONFIG JOB --ray [FILE]` reads them; a new run keeps them apart."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from ray_slurm_provider import proc
from ray_slurm_provider.agent import raylogs
from ray_slurm_provider.agent.agent import Agent
from ray_slurm_provider.agent.worker import WorkerAgent
from ray_slurm_provider.cli import logs
from ray_slurm_provider.cli.common import CliError
from ray_slurm_provider.config import ConfigError, parse_provider
from ray_slurm_provider.jobs import temp_dir
from ray_slurm_provider.nodespec import NodeSpec
from ray_slurm_provider.provider import runs
from ray_slurm_provider.state import HeadInfo
from tests.fakes import FakeSlurm
from tests.unit.test_cmds import cluster


def session(tmp: Path, files: dict[str, int]) -> Path:
    """A Ray temp dir as Ray 2.60 leaves it: session_latest -> session_<time>/logs/..."""
    real = tmp / "session_2026-12-01_10-00-00_000000_1"
    for name, size in files.items():
        p = real / "logs" / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(bytes(65 + i % 26 for i in range(size)))
    (tmp / "session_latest").symlink_to(real)
    return real / "logs"


def test_small_files_first_big_ones_keep_their_end(tmp_path: Path) -> None:
    src = session(tmp_path / "t", {"raylet.out": 300, "gcs_server.out": 100,
                                   "events/event_RAYLET.log": 50, "python-core-worker.log": 5000,
                                   "huge.log": 9000})
    os.symlink("/etc/passwd", src / "link.log")  # never followed
    dest = tmp_path / "kept"
    count, copied = raylogs.keep(str(tmp_path / "t"), dest, max_bytes=1000)
    assert (dest / "events" / "event_RAYLET.log").read_bytes() == \
        (src / "events" / "event_RAYLET.log").read_bytes()
    assert (dest / "raylet.out").read_bytes() == (src / "raylet.out").read_bytes()
    tail = (dest / "python-core-worker.log").read_bytes()
    assert tail.startswith(b"[ray-slurm: the first 4450 bytes were cut")
    assert tail.endswith((src / "python-core-worker.log").read_bytes()[-550:])
    assert not (dest / "huge.log").exists() and not (dest / "link.log").exists()
    cut = (dest / raylogs.CUT_FILE).read_text()
    assert "huge.log (9000 bytes): not kept" in cut
    assert "python-core-worker.log (5000 bytes): only the last 550 kept" in cut
    assert (count, copied) == (4, 1000)
    assert (dest / "raylet.out").stat().st_mode & 0o777 == 0o600
    assert (dest / "events").stat().st_mode & 0o777 == 0o700


def test_nothing_to_keep_and_the_off_switch(tmp_path: Path) -> None:
    assert raylogs.keep(str(tmp_path / "missing"), tmp_path / "d", 1 << 20) == (0, 0)
    session(tmp_path / "t", {"raylet.out": 10})
    assert raylogs.keep(str(tmp_path / "t"), tmp_path / "d", 0) == (0, 0)
    assert not (tmp_path / "d").exists()


def test_the_agent_keeps_rays_logs_before_it_deletes_the_temp_dir(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = NodeSpec(kind="worker", node_type="w", cluster_name="c1", state_dir=str(tmp_path),
                    ports_base=25000, attempts=1, temp_dir_root=str(tmp_path / "tmp"),
                    ray_logs_max_mb=1)
    a = WorkerAgent(spec, {"SLURM_JOB_ID": "9", "SLURM_CPUS_ON_NODE": "1",
                           "SLURM_ARRAY_JOB_ID": "8", "SLURM_ARRAY_TASK_ID": "1",
                           "HOME": str(tmp_path)})
    a.cdir.write_head(HeadInfo(job_id="1", ip="127.0.0.2", gcs_port=25000))

    class Ray:
        """`ray start --block` that wrote its logs, then ended (scancel, walltime, ...)."""

        pid = 0  # no session end_session would end

        def __init__(self, argv: list[str], env: Any = None, new_session: bool = False) -> None:
            session(Path(a.temp_dir), {"raylet.out": 20})
            self.stdout: list[str] = ["Ray runtime started.\n"]

        def poll(self) -> int:
            return 0

        def wait(self, timeout: float | None = None) -> int:
            return 0

        def send_signal(self, sig: int) -> None: ...

        def kill(self) -> None: ...

    monkeypatch.setattr(proc, "start", Ray)
    monkeypatch.setattr(Agent, "node_ip", lambda self: "127.0.0.3")
    a.main()
    assert a.temp_dir == temp_dir(str(tmp_path / "tmp"), "9")
    assert not Path(a.temp_dir).exists()
    kept = tmp_path / "c1" / "ray-logs" / "8_1" / "raylet.out"  # by node id, as `logs` lists
    assert kept.read_bytes() == bytes(65 + i for i in range(20))


def test_logs_ray_lists_and_prints_kept_files(tmp_path: Path) -> None:
    c = cluster(tmp_path, FakeSlurm())
    with pytest.raises(CliError, match=r"no Ray logs kept for job 42.*while it runs they are on"):
        logs.ray_logs(c, "42", None)
    kept = c.cdir.ray_logs("42")
    (kept / "events").mkdir(parents=True)
    (kept / "raylet.out").write_text("one\ntwo\n")
    (kept / "events" / "e.log").write_text("x")
    listing = logs.ray_logs(c, "42", None)
    assert listing[1].split() == ["events/e.log", "1"]
    assert listing[2].split() == ["raylet.out", "8"]
    assert logs.ray_logs(c, "42", "raylet.out") == ["one", "two"]
    for bad in ("../../auth_token", "/etc/passwd", "nope.log"):
        with pytest.raises(CliError, match="no file"):
            logs.ray_logs(c, "42", bad)


def test_a_new_run_moves_kept_ray_logs_aside_and_they_stay_readable(tmp_path: Path) -> None:
    c = cluster(tmp_path, FakeSlurm())
    c.cdir.create()
    (c.cdir.ray_logs("1")).mkdir(parents=True)
    (c.cdir.ray_logs("1") / "raylet.out").write_text("first run\n")
    (c.cdir.ray_logs("2.1")).mkdir(parents=True)  # a member of gang job 2, still listed
    dest = runs.new_run(c.cdir, ["2"])
    assert dest is not None and (dest / "ray-logs" / "1" / "raylet.out").exists()
    assert c.cdir.ray_logs("2.1").is_dir()
    assert not c.cdir.ray_logs("1").exists()
    assert logs.ray_logs(c, "1", "raylet.out") == ["first run"]  # the newest earlier run's


def test_ray_logs_max_mb_is_checked() -> None:
    assert parse_provider({"type": "external"}).ray_logs_max_mb == 100
    assert parse_provider({"type": "external", "ray_logs_max_mb": 0}).ray_logs_max_mb == 0
    with pytest.raises(ConfigError, match="ray_logs_max_mb"):
        parse_provider({"type": "external", "ray_logs_max_mb": -1})


def test_cli_logs_ray(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from ray_slurm_provider.cli.main import main

    c = cluster(tmp_path, FakeSlurm())
    c.cdir.ray_logs("42").mkdir(parents=True)
    (c.cdir.ray_logs("42") / "raylet.out").write_text("a\nb\nc\n")
    config = str(tmp_path / "c.yaml")
    assert main(["logs", config, "42", "--ray", "raylet.out", "-n", "1"]) == 0
    assert capsys.readouterr().out == "c\n"
    assert main(["logs", config, "42", "--ray"]) == 0
    assert "raylet.out" in capsys.readouterr().out
    assert main(["logs", config, "--ray"]) != 0
    assert "--ray needs a job id" in capsys.readouterr().err


def test_follow_a_gang_member_while_its_job_runs_and_name_its_own_temp_dir(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """`logs CONFIG J.k -f` follows while job J runs (squeue lists J, not J.k), and the hint
    names the member's own temp dir `.../J.k`, not its job's."""
    from ray_slurm_provider.cli.main import main
    from ray_slurm_provider.slurm.spec import JobSpec
    from ray_slurm_provider.state import AgentInfo

    fake = FakeSlurm()
    c = cluster(tmp_path, fake)
    c.cdir.create()
    job = fake.submit(JobSpec(c.job_name, ["true"]))
    fake.start(job, "n[1-2]")
    c.cdir.log(job).write_text("up\n")
    c.cdir.node(f"{job}.1").write_agent(AgentInfo(host="n2", pid=1, kind="worker", job_id=job))
    answers: list[bool] = []

    def follow(path: Path, alive: Any, out: Any) -> None:
        answers.append(alive())
        fake.finish(job)
        answers.append(alive())

    monkeypatch.setattr(logs, "load_cluster", lambda path: c)
    monkeypatch.setattr(logs, "follow", follow)
    assert main(["logs", str(tmp_path / "c.yaml"), f"{job}.1", "-f"]) == 0
    assert answers == [True, False]
    tmp = temp_dir(c.pcfg.temp_dir_root, f"{job}.1")
    assert f"in {tmp}/session_latest/logs/" in capsys.readouterr().err


def test_a_file_that_grows_during_the_copy_stays_under_the_cap(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ray's daemons may still write while the logs are kept: what is read is capped, not only
    what was sized."""
    src = session(tmp_path / "t", {"raylet.out": 300, "gcs_server.out": 2000})
    sized = raylogs._files

    def then_grown(root: Path) -> list[tuple[int, Path]]:
        found = sized(root)
        for name in ("raylet.out", "gcs_server.out"):
            with (src / name).open("ab") as f:
                f.write(b"x" * 5000)
        return found

    monkeypatch.setattr(raylogs, "_files", then_grown)
    dest = tmp_path / "kept"
    _, copied = raylogs.keep(str(tmp_path / "t"), dest, max_bytes=1000)
    bodies = [p.read_bytes().split(b"provider.ray_logs_max_mb]\n")[-1]
              for p in dest.iterdir() if p.name != raylogs.CUT_FILE]
    assert copied <= 1000 and sum(map(len, bodies)) == copied
    assert (dest / "raylet.out").read_bytes().startswith((src / "raylet.out").read_bytes()[:300])
    assert "raylet.out" in (dest / raylogs.CUT_FILE).read_text()  # said to be cut
