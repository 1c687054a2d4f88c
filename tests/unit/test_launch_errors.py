"""A node type's launch errors where the user looks: `ray-slurm status` (issue 26 item 15),
`ray status`, the driver's autoscaler events and `ray-slurm run` (item 16).

Fakes and an injected clock: nothing sleeps, no Ray cluster runs.
"""

from __future__ import annotations

import json
from pathlib import Path

from ray_slurm_provider.cli import status
from ray_slurm_provider.provider.guard import LaunchGuard
from tests.fakes import FakeClock

LOG_LINE = "[ray-slurm 08:03:40] ERROR: command failed with exit code 127: module load cuda"


def status_text(path: Path, now: float) -> str:
    data = {"cluster": "c1", "job_name": "ray-c1", "nodes": [], "other_jobs": 0, "head": None,
            "launch_errors": json.loads(path.read_text())}
    return "\n".join(status.status_lines(data, now=now))


def test_a_lifted_hold_back_is_shown_as_past(tmp_path: Path) -> None:
    """`ray-slurm status` said "launch failing ... held back until 08:13:43" long after."""
    clock = FakeClock()
    g = LaunchGuard(tmp_path / "errors.json", clock.now)
    g.failed("cpu_worker", LOG_LINE, "crashed")
    g.failed("cpu_worker", LOG_LINE, "crashed")  # the second crash holds the type back 60 s
    text = status_text(tmp_path / "errors.json", clock.now())
    assert "cpu_worker: launch failing (crashed, 2 in a row; held back until" in text
    clock.advance(61)
    text = status_text(tmp_path / "errors.json", clock.now())
    assert "held back until" not in text and "launch failing" not in text
    assert "cpu_worker: last launch error" in text and "no longer held back" in text
    assert LOG_LINE in text


def test_ray_up_on_a_type_clears_an_earlier_autoscalers_error(tmp_path: Path) -> None:
    """After a crash-looping type was fixed and the cluster brought up again, the new head's
    autoscaler (a new LaunchGuard) saw the type's Ray come up, but errors.json kept the old
    autoscaler's entry: Ray coming up on the type clears it, a queued job clears a refusal."""
    path = tmp_path / "errors.json"
    old = LaunchGuard(path, FakeClock().now)
    old.failed("cpu_worker", LOG_LINE, "crashed")
    old.failed("gpu_worker", "sbatch: error: invalid partition", "rejected")
    new = LaunchGuard(path, FakeClock().now)  # the next head's autoscaler
    new.succeeded("cpu_worker")  # queued is not up: a crash at start stays recorded
    assert set(json.loads(path.read_text())) == {"cpu_worker", "gpu_worker"}
    new.ray_started("cpu_worker")
    new.succeeded("gpu_worker")
    assert json.loads(path.read_text()) == {}

