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
