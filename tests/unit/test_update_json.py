"""state.update_json: read-modify-write of shared JSON files under a lock (issue 25.7), with
flock where the filesystem has it and lock files where it has not."""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from ray_slurm_provider import state
from ray_slurm_provider.state import ClusterDir, update_json

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(state, "_flockless", set())
    monkeypatch.setattr(state, "_SOFT_TRY_S", 0.05)


def no_flock(monkeypatch: pytest.MonkeyPatch, err: int = errno.ENOLCK) -> None:
    """A filesystem without flock (NFSv3 without lockd says ENOLCK)."""
    def refuse(fd: Any, op: int) -> None:
        raise OSError(err, os.strerror(err))

    monkeypatch.setattr(fcntl, "flock", refuse)


def test_update_json_reads_changes_and_writes_beside_its_lock(tmp_path: Path) -> None:
    path = tmp_path / "d" / "x.json"
    seen: list[Any] = []

    def add(key: str) -> Any:
        def fn(old: Any) -> Any:
            seen.append(old)
            return {**(old or {}), key: 1}
        return fn

    assert update_json(path, add("a")) == {"a": 1}
    assert update_json(path, add("b")) == {"a": 1, "b": 1}
    assert seen == [None, {"a": 1}]
    assert json.loads(path.read_text()) == {"a": 1, "b": 1}
    assert (tmp_path / "d" / ".x.json.lock").exists()


def test_set_tags_merges_under_the_lock(tmp_path: Path) -> None:
    cdir = ClusterDir(str(tmp_path), "c")
    cdir.set_tags("7", {"a": "1"})
    gen = cdir.tags_generation()
    cdir.set_tags("7", {"b": "2"})
    assert cdir.tags("7") == {"a": "1", "b": "2"} and cdir.tags_generation() != gen


@pytest.mark.filterwarnings("ignore:flock not supported")  # filelock 4's own ENOSYS fallback
@pytest.mark.parametrize("err", [errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP])
def test_without_flock_it_takes_a_lock_file_and_says_so_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        err: int) -> None:
    no_flock(monkeypatch, err)
    path = tmp_path / "x.json"
    with caplog.at_level(logging.WARNING, logger="ray_slurm_provider.state"):
        for k in range(3):
            update_json(path, lambda old, k=k: {**(old or {}), str(k): k})
        update_json(tmp_path / "node" / "tags.json", lambda old: {"a": "1"})  # same filesystem
    assert json.loads(path.read_text()) == {"0": 0, "1": 1, "2": 2}
    said = [r.getMessage() for r in caplog.records if "cannot lock" in r.getMessage()]
    # filelock 4 falls back to its own lock file on ENOSYS without telling: nothing to say.
    assert len(said) == (0 if err == errno.ENOSYS and state._flockless == set() else 1)
    assert not (tmp_path / ".x.json.softlock").exists()  # gone once released


def test_a_stale_lock_file_is_broken_and_a_fresh_one_waited_for(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    no_flock(monkeypatch)
    path, lock = tmp_path / "x.json", tmp_path / ".x.json.softlock"
    lock.write_text("")  # its holder died on another node long ago
    old = time.time() - state.STALE_LOCK_S - 5
    os.utime(lock, (old, old))
    with caplog.at_level(logging.WARNING, logger="ray_slurm_provider.state"):
        assert update_json(path, lambda _: {"a": 1}) == {"a": 1}
    assert any("broke the stale lock" in r.getMessage() for r in caplog.records)
    lock.write_text("")  # a live holder
    monkeypatch.setattr(state, "LOCK_WAIT_S", 0.2)
    with pytest.raises(OSError, match="held for over"):
        update_json(path, lambda _: {"b": 2})
    assert json.loads(path.read_text()) == {"a": 1}


UPDATER = """
import errno, fcntl, os, sys
from pathlib import Path
from ray_slurm_provider import state
if sys.argv[3] == "soft":
    def refuse(fd, op):
        raise OSError(errno.ENOLCK, "no locks")
    fcntl.flock = refuse
    state._SOFT_TRY_S = 0.01
for k in range(int(sys.argv[2])):
    state.update_json(Path(sys.argv[1]), lambda old: {**(old or {}), f"{os.getpid()}-{k}": k})
"""


@pytest.mark.parametrize(("kind", "n"), [("flock", 300), ("soft", 100)])
def test_two_processes_updating_one_file_lose_no_entry(tmp_path: Path, kind: str,
                                                       n: int) -> None:
    path = tmp_path / "shared.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-c", UPDATER, str(path), str(n), kind],
                              env=env) for _ in range(2)]
    try:
        codes = [p.wait(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert codes == [0, 0]
    data = json.loads(path.read_text())
    assert len(data) == 2 * n, f"{2 * n - len(data)} updates lost"
