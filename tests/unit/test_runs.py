"""Runs of a cluster and their logs (provider/runs.py, `ray-slurm logs`): issue 26 item 14."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ray_slurm_provider.cli.main import main
from ray_slurm_provider.provider import runs
from ray_slurm_provider.state import HeadInfo, RayUp
from tests.fakes import FakeSlurm
from tests.unit.test_cmds import cluster


def test_a_running_jobs_log_never_moves_when_a_new_run_starts(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A second `ray-slurm sbatch` (or `ray up`) moved every log of the cluster to
    `logs/runs/<time>/`, the log a still-running job writes too: `ray-slurm logs CFG <id>`,
    as sbatch printed it, then said "no log for job <id>"."""
    from ray_slurm_provider.provider.provider import SlurmNodeProvider
    from tests.unit.test_provider import HEAD_TAGS, WORKER_TAGS

    fake = FakeSlurm()
    c = cluster(tmp_path, fake)
    p = SlurmNodeProvider({"type": "external", "state_dir": str(tmp_path / "state"),
                           "python": "/py"}, c.name)
    p._client = fake
    (first,) = p.create_node({}, HEAD_TAGS, 1)
    (still,) = p.create_node({}, WORKER_TAGS, 1)
    fake.start(first)
    fake.start(still)
    c.cdir.log(first).write_text("run one's head\n")
    c.cdir.log(still).write_text("still running\n")
    fake.finish(first)  # the first run's head ended; a job of that run still runs
    c.cdir.write_head(HeadInfo(job_id=first, ip="127.0.0.2", gcs_port=24000))
    c.cdir.clear_head()
    p.create_node({}, HEAD_TAGS, 1)  # the second run
    assert c.cdir.log(still).read_text() == "still running\n"  # where Slurm writes it
    (old,) = c.cdir.logs.glob(f"runs/*/{first}.out")  # the ended job's log moved aside
    assert old.read_text() == "run one's head\n"
    assert main(["logs", str(tmp_path / "c.yaml"), still]) == 0
    assert capsys.readouterr().out == "still running\n"


def test_a_new_run_removes_the_node_dirs_of_the_jobs_slurm_no_longer_lists(
        tmp_path: Path) -> None:
    """Ids repeat: a new job must not find an ended job's hand-off files (ray.json, markers,
    a start request: test_provider.py). A listed job's dirs stay, a gang's members' too."""
    c = cluster(tmp_path, FakeSlurm())
    c.cdir.create()
    for node_id in ("7", "8", "9.0", "9.1", "10_2", "11.0"):
        c.cdir.node(node_id).write_ray_up(RayUp(ip="10.1.2.3", job_id=node_id))
    assert runs.new_run(c.cdir, ["8", "9", "10_2"]) is None  # no log to move aside
    assert c.cdir.known_nodes() == ["10_2", "8", "9.0", "9.1"]


def test_logs_finds_a_job_in_an_earlier_run_the_newest_log_of_its_id_first(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Job ids repeat (a controller's state reset): the newest log with the id wins, and
    `logs` says which run it came from."""
    c = cluster(tmp_path, FakeSlurm())
    c.cdir.create()
    config = str(tmp_path / "c.yaml")
    older = c.cdir.logs / "runs" / "20260101-080000"
    newer = c.cdir.logs / "runs" / "20260102-080000"
    for d, text, t in ((older, "oldest\n", 1000), (newer, "newer\n", 2000)):
        d.mkdir(parents=True)
        (d / "21.out").write_text(text)
        os.utime(d / "21.out", (t, t))
    assert main(["logs", config, "21"]) == 0
    got = capsys.readouterr()
    assert got.out == "newer\n"
    assert f"an earlier run's log ({newer / '21.out'})" in got.err
    c.cdir.log("21").write_text("this run\n")  # this run's job 21 is newer still
    assert main(["logs", config, "21"]) == 0
    got = capsys.readouterr()
    assert got.out == "this run\n" and "earlier run" not in got.err
    assert runs.find_log(c.cdir, "22") is None
    assert main(["logs", config, "22"]) != 0
    assert "no log for job 22" in capsys.readouterr().err


def test_the_tenth_run_of_one_second_is_newer_than_the_second(tmp_path: Path) -> None:
    """Runs of one second are `<time>`, `<time>.1`, ... `<time>.10`: names sorted as text
    put `.10` before `.2`, and an older run's Ray logs were taken for the newest's."""
    c = cluster(tmp_path, FakeSlurm())
    c.cdir.create()
    name = c.cdir.ray_logs("5").parent.name
    for run in ("20260101-080000", "20260101-080000.2", "20260101-080000.10"):
        (c.cdir.logs / "runs" / run / name / "5").mkdir(parents=True)
    assert [r.name for r in runs.earlier_runs(c.cdir)] == [
        "20260101-080000", "20260101-080000.2", "20260101-080000.10"]
    assert runs.ray_logs_of(c.cdir, "5") == c.cdir.logs / "runs" / "20260101-080000.10" / name / "5"
