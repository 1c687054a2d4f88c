"""What the node agent's log says when Ray ends (issue 26 item 18): a stop the job was told
of reads as a stop, not as a failure. In-process, fake `ray start` children, no Slurm."""

from __future__ import annotations

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


@pytest.mark.parametrize(("stop", "end_time", "said"), [
    ("term", None, "Ray stopped: the job was cancelled (terminated by the autoscaler, scancel "
     "or `ray down`)"),
    ("term", "1000", "Ray stopped: the job reached its time limit"),
    ("head", None, "Ray stopped: the head's Ray stopped"),
])
def test_a_worker_told_to_stop_says_so_not_that_ray_failed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        stop: str, end_time: str | None, said: str) -> None:
    """A worker the autoscaler terminated logged "Ray exited with code 1"."""
    a, _ = agent(tmp_path, monkeypatch, [])
    if end_time is not None:
        a.env["SLURM_JOB_END_TIME"] = end_time  # long past: Slurm's TERM at the time limit
    monkeypatch.setattr("ray_slurm_provider.proc.start",
                        lambda argv, env=None, new_session=False: StoppedWhileUp(a, stop))
    a.run()
    out = capsys.readouterr().out
    assert f"{said}; the job ends" in out
    assert "exited with code" not in out


def test_ray_ending_on_its_own_still_says_its_exit_code(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a, _ = agent(tmp_path, monkeypatch, [])
    assert a.ray_ended(1) == "Ray exited with code 1"
