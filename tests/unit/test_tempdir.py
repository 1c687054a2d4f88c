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
