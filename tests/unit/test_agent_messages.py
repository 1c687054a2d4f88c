"""What the node agent's log says when Ray ends (issue 26 item 18): a stop the job was told
of reads as a stop, not as a failure. In-process, fake `ray start` children, no Slurm."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ray_slurm_provider.agent.worker import WorkerAgent
from tests.unit.test_agent import FakeChild, agent


class StoppedWhileUp(FakeChild):
    """`ray start --block` that comes up, then ends with 1 after `stop` is done to the job."""

    def __init__(self, a: WorkerAgent, stop: str) -> None:
        super().__init__([], 1)
        self.a, self.stop = a, stop
        self.stdout = self.lines()  # type: ignore[assignment]

    def lines(self) -> Iterator[str]:
        yield "Ray runtime started.\n"
        if self.stop == "term":  # scancel, the autoscaler's terminate, the time limit
            self.a.on_signal(15, None)
            self.a.on_term(15, None)  # what the terminator thread does on the TERM
        else:
            self.a.on_head_gone("the head's Ray stopped")


@pytest.mark.parametrize(("stop", "left_s", "said"), [
    ("term", None, "Ray stopped: the job was cancelled (terminated by the autoscaler, scancel "
     "or `ray down`)"),
    ("term", -5000, "Ray stopped: the job reached its time limit"),
    # Slurm sends `--signal=B:TERM@60` up to a minute early (its event resolution).
    ("term", 110, "Ray stopped: the job is 2 min from its time limit (drain_before_limit_s: "
     "60)"),
    ("head", None, "Ray stopped: the head's Ray stopped"),
])
def test_a_worker_told_to_stop_says_so_and_ends_its_job_cleanly(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        stop: str, left_s: int | None, said: str) -> None:
    """A worker the autoscaler terminated logged "Ray exited with code 1", and its job
    ended with that code: FAILED in accounting (247 when its head was gone), a failure in
    `ray-slurm report` and on the site's dashboards, for a stop the job was told of."""
    a, _ = agent(tmp_path, monkeypatch, [])
    a.spec.drain_before_limit_s = 60
    if left_s is not None:
        a.env["SLURM_JOB_END_TIME"] = str(int(time.time()) + left_s)
    monkeypatch.setattr("ray_slurm_provider.proc.start",
                        lambda argv, env=None, new_session=False: StoppedWhileUp(a, stop))
    assert a.run() == 0
    out = capsys.readouterr().out
    assert f"{said}; the job ends" in out
    assert "exited with code" not in out


def test_ray_ending_on_its_own_ends_the_job_with_its_code(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a, _ = agent(tmp_path, monkeypatch, [FakeChild(["Ray runtime started.\n"], 3)])
    assert a.run() == 3


def test_ray_ending_on_its_own_still_says_its_exit_code(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a, _ = agent(tmp_path, monkeypatch, [])
    assert a.ray_ended(1) == "Ray exited with code 1"


class HeadGoneBeforeUp(FakeChild):
    """`ray start --block` that never comes up (it cannot reach its head), then the head's
    watch ends the worker."""

    def __init__(self, a: WorkerAgent) -> None:
        super().__init__([], 1)
        self.a = a
        self.stdout = self.lines()  # type: ignore[assignment]

    def lines(self) -> Iterator[str]:
        yield "Waiting for the GCS...\n"
        self.a.on_head_gone("the head's Ray stopped")


def test_a_worker_whose_head_went_before_its_ray_came_up_still_fails(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its job must stay FAILED: a type whose nodes never join their head is held back
    (provider/ends.py), and an exit 0 would hide it."""
    a, _ = agent(tmp_path, monkeypatch, [])
    monkeypatch.setattr("ray_slurm_provider.proc.start",
                        lambda argv, env=None, new_session=False: HeadGoneBeforeUp(a))
    assert a.run() == 1


@pytest.mark.parametrize("when", ["waiting", "running"])
def test_a_head_told_to_stop_ends_its_job_cleanly(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, when: str) -> None:
    """`ray down`, or the drain before the head's limit: the head's job ended FAILED (Ray's
    exit code 1, or 1 for a TERM while it waited for `ray up`'s start command)."""
    from ray_slurm_provider.agent.head import HeadAgent
    from ray_slurm_provider.nodespec import NodeSpec
    from ray_slurm_provider.state import StartRequest

    spec = NodeSpec(kind="head", node_type="head", cluster_name="c1", state_dir=str(tmp_path),
                    ports_base=25000, temp_dir_root=str(tmp_path / "tmp"))
    a = HeadAgent(spec, {"SLURM_JOB_ID": "5", "HOME": str(tmp_path)})

    def wait(handled: str) -> StartRequest | None:
        if when == "waiting":
            a.terminating = True
            return None
        return StartRequest(id="r1", ray_start=["ray", "start", "--head"])

    def once(req: StartRequest) -> int:
        a.terminating = True  # the TERM came while Ray ran; `ray start --block` exits 1
        return 1

    monkeypatch.setattr(a, "wait_for_request", wait)
    monkeypatch.setattr(a, "head_once", once)
    assert a.run() == 0
