"""A node type's launch errors where the user looks: `ray-slurm status` (issue 26 item 15),
`ray status`, the driver's autoscaler events and `ray-slurm run` (item 16).

Fakes and an injected clock: nothing sleeps, no Ray cluster runs.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ray_slurm_provider.cli import status
from ray_slurm_provider.provider.guard import HeldBack, LaunchGuard, last_log_line
from ray_slurm_provider.provider.provider import SlurmNodeProvider
from tests.fakes import FakeClock
from tests.unit.test_submit import make

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


# --- item 16: the cause of a held-back type where the user looks ---------------------------

CAUSE = "module load cuda"  # from the job's last log line (guard.last_log_line)


def held_back_provider(tmp_path: Path) -> SlurmNodeProvider:
    """A provider whose cpu_worker jobs died twice before Ray started: the type is held
    back, its error carries the job's last log line (as provider/ends.py words it)."""
    p, _, _ = make(tmp_path)
    log = tmp_path / "1001.out"
    log.write_text(f"{LOG_LINE} {{'CPU': 1}}\n")  # braces: Ray's v1 formats its messages
    for _ in range(2):
        p.guard.failed("cpu_worker", f"Slurm job 1001 (last seen RUNNING) ended before Ray "
                       f"started on it; {last_log_line(log)} ({log})", "crashed")
    return p


class ConfigReader:
    """What NodeProviderAdapter reads of the autoscaling config."""

    def get_cached_autoscaling_config(self) -> ConfigReader:
        return self

    def get_cloud_node_config(self, node_type: str) -> dict[str, Any]:
        return {}

    def get_node_resources(self, node_type: str) -> dict[str, float]:
        return {"CPU": 1.0}

    def get_node_labels(self, node_type: str) -> dict[str, str]:
        return {}

    def get_config(self, key: str, default: Any = None) -> Any:
        return {"cluster_name": "c1"}.get(key, default)


def test_ray_status_v2_shows_why_a_held_back_type_fails(tmp_path: Path) -> None:
    """Autoscaler v2 (Ray 2.60): NodeProviderAdapter turns the provider's exception into a
    LaunchNodeError with empty details (the exception only as its __cause__), the reconciler
    records `launch failed with {error}`, and `ray status -v` shows that: the cause was lost."""
    from ray.autoscaler.v2.instance_manager.node_provider import NodeProviderAdapter
    from ray.autoscaler.v2.instance_manager.reconciler import Reconciler
    from ray.autoscaler.v2.schema import ClusterStatus
    from ray.autoscaler.v2.utils import ClusterStatusFormatter, ClusterStatusParser
    from ray.core.generated.autoscaler_pb2 import AutoscalingState, FailedInstanceRequest
    from ray.core.generated.instance_manager_pb2 import Instance

    adapter = NodeProviderAdapter(held_back_provider(tmp_path), ConfigReader())  # type: ignore[arg-type]
    adapter.launch({"cpu_worker": 2}, "req-1")
    adapter._main_executor.shutdown(wait=True)
    adapter._node_launcher_executors.shutdown(wait=True)
    (error,) = adapter.poll_errors()
    requested = Instance(instance_id="i-1", instance_type="cpu_worker",
                         status=Instance.REQUESTED, launch_request_id="req-1")
    update = Reconciler._try_resolve_pending_allocation(
        requested, {}, {("req-1", "cpu_worker"): error}, {("req-1", "cpu_worker"): 2})
    assert update is not None and update.new_instance_status == Instance.ALLOCATION_FAILED
    state = AutoscalingState(failed_instance_requests=[FailedInstanceRequest(
        ray_node_type_name="cpu_worker", count=1, reason=update.details)])
    _, failed = ClusterStatusParser._parse_launch_requests(state)
    report = ClusterStatusFormatter._failed_node_report(
        ClusterStatus(failed_launches=failed), verbose=True)
    assert "cpu_worker: LaunchFailed" in report
    assert "(JobDiedAtStart)" in report and "held back" in report and CAUSE in report


def test_ray_status_v1_and_its_driver_events_show_why_a_held_back_type_fails(
        tmp_path: Path) -> None:
    """Autoscaler v1: NodeLauncher records the exception's category and description in the
    availability tracker (`ray status -v`) and in its event summary (printed on the driver:
    `(autoscaler +Ns) Failed to launch ...`); a description is never a format string."""
    from ray.autoscaler._private.autoscaler import AutoscalerSummary
    from ray.autoscaler._private.event_summarizer import EventSummarizer
    from ray.autoscaler._private.node_launcher import BaseNodeLauncher
    from ray.autoscaler._private.node_provider_availability_tracker import (
        NodeProviderAvailabilityTracker,
    )
    from ray.autoscaler._private.util import (
        ConcurrentCounter,
        LoadMetricsSummary,
        format_info_string,
    )

    events = EventSummarizer()
    tracker = NodeProviderAvailabilityTracker()
    launcher = BaseNodeLauncher(held_back_provider(tmp_path), ConcurrentCounter(), events,
                                tracker)
    config = {"cluster_name": "c1", "auth": {}, "available_node_types": {
        "cpu_worker": {"node_config": {}, "resources": {"CPU": 1}}}}
    launcher.pending.inc("cpu_worker", 2)
    launcher.launch_node(config, 2, "cpu_worker")
    (line,) = events.summary()  # what the driver prints
    assert line.startswith("Failed to launch 2 node(s) of type cpu_worker. (JobDiedAtStart): ")
    assert "held back" in line and CAUSE in line
    summary = AutoscalerSummary(active_nodes={}, idle_nodes={}, pending_nodes=[],
                                pending_launches={}, failed_nodes=[],
                                node_availability_summary=tracker.summary())
    lm = LoadMetricsSummary(usage={}, resource_demand=[], pg_demand=[], request_demand=[],
                            node_types=[])
    report = format_info_string(lm, summary, verbose=True)
    assert " cpu_worker: JobDiedAtStart (latest_attempt: " in report and CAUSE in report


@pytest.fixture
def autoscaler_events(tmp_path: Path) -> Iterator[Path]:
    """The autoscaler's event stream as Ray's monitor makes it; its file."""
    from ray._private.event import event_logger
    from ray.core.generated.event_pb2 import Event

    event_logger.get_event_logger(Event.SourceType.AUTOSCALER, str(tmp_path))
    try:
        yield tmp_path / "events" / "event_AUTOSCALER.log"
    finally:
        adapter = event_logger._event_logger.pop("AUTOSCALER")
        for handler in adapter.logger.handlers[:]:
            adapter.logger.removeHandler(handler)
            handler.close()


def test_the_driver_is_told_why_a_type_is_held_back_under_autoscaler_v2(
        tmp_path: Path, autoscaler_events: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Autoscaler v2 prints only its own events on the driver (`Adding 2 node(s) of type
    cpu_worker.` every 5 s while the type was held back): the hold-back and its cause go into
    the same stream, once when the type fails and at most once a minute while refused."""
    from ray._private import worker

    clock = FakeClock()
    g = LaunchGuard(None, clock.now)
    for _ in range(3):  # held back 0 s, 60 s, then 120 s
        g.failed("cpu_worker", LOG_LINE, "crashed")
    for _ in range(13):  # one refused launch every 5 s for a minute
        with pytest.raises(HeldBack):
            g.check("cpu_worker")
        clock.advance(5)
    monkeypatch.setattr("ray.autoscaler.v2.utils.is_autoscaler_v2", lambda: True)
    printed = list(worker.filter_autoscaler_events(autoscaler_events.read_text().splitlines()))
    told = [line for line in printed if "cpu_worker" in line]
    assert len(told) == 4, told  # three failures, one reminder a minute later
    assert all(LOG_LINE in line for line in told)
    assert "held back until" in told[2] and "held back for 60s more" in told[3]
