"""The node's Ray temp dir on a shared node (issue 26): a refused private parent is never read
or removed, another user's `rsp-<uid>` only moves the job to a fresh private dir, and the
dirs of jobs Slurm no longer lists are swept."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ray_slurm_provider.jobs import temp_dir
from tests.unit.test_agent import FakeChild, agent


def planted(tmp_path: Path) -> Path:
    """Another user's files, laid out as a job dir of job 9 with Ray's logs."""
    theirs = tmp_path / "planter" / "9"
    (theirs / "session_latest" / "logs").mkdir(parents=True)
    (theirs / "session_latest" / "logs" / "secret.log").write_text("theirs\n")
    (theirs / "data").write_text("keep me\n")
    return theirs


@pytest.mark.parametrize("how", ["parent is a link", "parent open, job dir a link"])
def test_nothing_is_read_or_removed_under_a_refused_parent(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    theirs = planted(tmp_path)
    parent = tmp_path / "tmp" / f"rsp-{os.getuid()}"
    parent.parent.mkdir()
    if how == "parent is a link":
        parent.symlink_to(theirs.parent)
    else:
        parent.mkdir(mode=0o777)
        parent.chmod(0o777)
        (parent / "9").symlink_to(theirs)
    a, _ = agent(tmp_path, monkeypatch, [FakeChild([], 1)], attempts=1)
    assert a.main() == 1
    assert (theirs / "data").read_text() == "keep me\n"
    assert (theirs / "session_latest" / "logs" / "secret.log").exists()
    assert not a.cdir.ray_logs("9").exists()  # nothing of theirs copied
    assert temp_dir(str(tmp_path / "tmp"), "9") == f"{parent}/9"


@pytest.mark.parametrize("how", ["another user's", "a link"])
def test_a_refused_parent_moves_the_job_to_a_fresh_private_dir_that_is_recorded(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        how: str) -> None:
    """Anyone can make `/tmp/rsp-<uid>` first, and the user cannot remove it from a sticky
    /tmp: the job runs in a fresh 0700 dir of its own below the same root, within Ray's
    socket-path budget, and agent.json says where (`logs` and cleanup read it there)."""
    import stat

    from ray_slurm_provider import shellcmd
    from ray_slurm_provider.cli import logs
    from tests.fakes import FakeSlurm
    from tests.unit.test_cmds import cluster

    root = tmp_path / "tmp"
    root.mkdir()
    uid = os.getuid()
    if how == "another user's":
        monkeypatch.setattr(os, "getuid", lambda: uid + 4242)  # ours is then uid's
    parent = root / f"rsp-{os.getuid()}"
    if how == "a link":
        parent.symlink_to(tmp_path / "elsewhere")
    else:
        parent.mkdir(mode=0o700)
    a, started = agent(tmp_path, monkeypatch, [FakeChild(["Ray runtime started.\n"], 0)])
    seen: list[os.stat_result] = []
    orig = a.mark_started

    def mark(argv: list[str], env: dict[str, str]) -> None:
        orig(argv, env)
        seen.append(os.lstat(shellcmd.get_flag(argv, "--temp-dir") or "-"))

    a.mark_started = mark  # type: ignore[method-assign]
    assert a.main() == 0
    info = a.ndir.read_agent()
    assert info is not None and info.temp_dir
    used = Path(info.temp_dir)
    assert used.parent == root and used.name.startswith(f"rsp-{os.getuid()}.")
    assert [shellcmd.get_flag(argv, "--temp-dir") for argv in started] == [str(used)]
    (st,) = seen
    assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700
    assert st.st_uid == uid  # the real owner: mkdtemp made it
    assert len(str(used)) <= len(temp_dir(str(root), "1234567890.999"))  # the socket budget
    assert not used.exists()  # removed with the job, as its own dir is
    assert parent.is_symlink() or parent.is_dir()  # the refused one is left alone
    out = capsys.readouterr().out
    assert f"{parent}" in out and f"using {used}" in out
    (tmp_path / "cli").mkdir()
    c = cluster(tmp_path / "cli", FakeSlurm())
    c.cdir.node("9").write_agent(info)
    assert logs.node_temp_dir(c, "9") == str(used)


def test_dirs_of_jobs_slurm_no_longer_lists_are_swept(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A job killed with SIGKILL leaves `rsp-<uid>/<job>` (spilled objects: GBs). The next
    agent removes its user's dirs of jobs Slurm lists in no state at all (the dir may be
    shared by nodes and clusters: not merely "not on this node", nor "not this cluster's"),
    named like a job id; never a link, a file, another user's dir, or its own."""
    from ray_slurm_provider.agent import tempdir
    from ray_slurm_provider.slurm.client import TransientSlurmError
    from ray_slurm_provider.slurm.spec import JobSpec
    from tests.fakes import FakeSlurm

    fake = FakeSlurm()
    other_cluster = fake.submit(JobSpec("ray-other", ["true"]))
    fake.start(other_cluster)
    ended = fake.submit(JobSpec("ray-c1", ["true"]))
    fake.finish(ended)  # still listed (COMPLETED): not yet the sweep's
    task = fake.submit_array(JobSpec("ray-c1", ["true"]), 2)[1]
    fake.start(task)
    numeric = fake.job(task).slurm_job_id  # an array task's dir is named by its own id
    mine = temp_dir(str(tmp_path / "tmp"), "9")
    parent = Path(mine).parent
    gone = ["77", "77.1", "78_3", "79_2.0", "80+1"]
    kept = ["9", other_cluster, f"{other_cluster}.1", ended, numeric, task, "notajob"]
    for name in gone + kept:
        (parent / name / "spilled").mkdir(parents=True)
    parent.chmod(0o700)
    (tmp_path / "theirs").mkdir()
    (parent / "55").symlink_to(tmp_path / "theirs")  # a link: never followed
    (parent / "57").write_text("a file")
    if os.getuid() == 0:  # another user's dir (only root can make one here)
        (parent / "58").mkdir()
        os.chown(parent / "58", 4242, 4242)
        kept.append("58")
    said: list[str] = []
    fake.fail_next("user_job_ids", TransientSlurmError("squeue: timed out"))
    assert tempdir.sweep(mine, fake, said.append) == []  # a failed query sweeps nothing
    assert all((parent / n).exists() for n in gone) and "cannot list" in said[-1]
    assert sorted(tempdir.sweep(mine, fake, said.append)) == sorted(gone)
    assert sorted(p.name for p in parent.iterdir()) == sorted([*kept, "55", "57"])
    assert (tmp_path / "theirs").is_dir()
    calls = fake.calls["user_job_ids"]
    alone = temp_dir(str(tmp_path / "tmp2"), "9")
    (Path(alone) / "spilled").mkdir(parents=True)
    assert tempdir.sweep(alone, fake, said.append) == []  # only its own: Slurm is not asked
    assert fake.calls["user_job_ids"] == calls and Path(alone).is_dir()
    # The agent sweeps as it starts, below its private parent only.
    (parent / "81" / "spilled").mkdir(parents=True)
    a, _ = agent(tmp_path, monkeypatch, [FakeChild([], 1)], attempts=1)
    a.slurm = fake
    a.main()
    assert not (parent / "81").exists() and (parent / other_cluster).exists()


def test_the_cli_back_end_lists_every_id_of_the_users_jobs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """One squeue, any name and any state, both ids of an array task; output it cannot read
    is an error (a shorter list would sweep the dirs of jobs that still run)."""
    from ray_slurm_provider import proc
    from ray_slurm_provider.slurm.cli import CliSlurmClient
    from ray_slurm_provider.slurm.client import PermanentSlurmError, UserJobs

    calls: list[list[str]] = []
    out = ["12 12\n13_1 14\n13_2 13\n15+0 15\n"]

    def run(argv: list[str], **kw: object) -> proc.Result:
        calls.append(list(argv))
        return proc.Result(list(argv), 0, out[0], "")

    monkeypatch.setattr(proc, "run", run)
    client = CliSlurmClient()
    assert isinstance(client, UserJobs)
    assert client.user_job_ids() == {"12", "13_1", "14", "13_2", "13", "15+0", "15"}
    assert calls[0][1:] == ["--me", "--array", "--noheader", "--states=all", "--format=%i %A"]
    out[0] = "12 12\n13_[1-3] 13\n"
    with pytest.raises(PermanentSlurmError, match="cannot parse squeue output"):
        client.user_job_ids()


def test_the_rest_back_end_lists_every_job_of_the_user() -> None:
    """Any name, any state (COMPLETED 504 too), not another user's (bob's 505)."""
    from ray_slurm_provider.slurm.client import UserJobs
    from tests.rest_fakes import client, v41_server

    c = client(v41_server(), user="alice", clock=1762940100 + 600)
    assert isinstance(c, UserJobs)
    assert c.user_job_ids() == {"501", "502", "503", "504", "506", "507"}


def test_a_temp_root_that_cannot_hold_a_dir_ends_the_job_clearly(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Neither the parent nor a fresh dir can be made (the root is a file): the job ends
    with the reason, agent.json is written, and nothing is removed."""
    (tmp_path / "tmp").write_text("not a dir")
    a, started = agent(tmp_path, monkeypatch, [])
    assert a.main() == 1 and started == []
    assert "ERROR" in capsys.readouterr().out
    info = a.ndir.read_agent()
    assert info is not None and info.temp_dir == ""
    assert (tmp_path / "tmp").read_text() == "not a dir"
