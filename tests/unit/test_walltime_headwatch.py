"""Walltime (drain signal, the head's time left) and workers ending when their head is gone."""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path

import pytest

from ray_slurm_provider.agent.headwatch import HeadWatch
from ray_slurm_provider.cluster import NodeType
from ray_slurm_provider.config import NodeConfig, ProviderConfig
from ray_slurm_provider.jobs import build_job
from ray_slurm_provider.provider.walltime import HeadWalltime, warn_below_s
from ray_slurm_provider.slurm.client import Job
from ray_slurm_provider.slurm.script import JobSpec, render
from ray_slurm_provider.state import ClusterDir, HeadInfo, RayUp
from ray_slurm_provider.units import fmt_duration
from tests.fakes import FakeClock, FakeSlurm
from tests.unit.test_provider import HEAD_TAGS, WORKER_TAGS
from tests.unit.test_submit import make


def spec(ncfg: NodeConfig) -> str:
    return render(build_job(ProviderConfig(state_dir="/s"), "c",
                            NodeType("w", ncfg, resources={"CPU": 1}), kind="worker",
                            python="/py"))


def test_workers_get_the_drain_signal_before_their_limit() -> None:
    script = spec(NodeConfig(time="2:00:00"))
    assert "#SBATCH --signal=B:TERM@60\n" in script and "#SBATCH --time=2:00:00\n" in script
    assert "--signal=B:TERM@300" in spec(NodeConfig(time="1:00:00", drain_before_limit_s=300))
    assert "--signal" not in spec(NodeConfig(drain_before_limit_s=0))


def test_fmt_and_warning_window() -> None:
    assert fmt_duration(3725) == "01:02:05" and fmt_duration(90061) == "1-01:01:01"
    assert warn_below_s(None) == 300 and warn_below_s(600) == 300
    assert warn_below_s(10 * 3600) == 1800 and warn_below_s(2 * 3600) == 720


def head_job(left: int | None, limit: int | None = 7200) -> Job:
    return Job("7", "ray-c", "RUNNING", time_limit_s=limit, time_left_s=left)


def test_head_time_left_logged_and_warned(tmp_path: Path, caplog: pytest.LogCaptureFixture
                                          ) -> None:
    clock = FakeClock()
    path = tmp_path / "walltime.json"
    w = HeadWalltime(path, clock)
    caplog.set_level(logging.INFO, "ray_slurm_provider.provider.walltime")
    assert not w.observe(head_job(3600))
    assert "Head job 7: 01:00:00 left of its time limit 02:00:00" in caplog.text
    assert json.loads(path.read_text())["time_left_s"] == 3600
    caplog.clear()
    clock.advance(5)
    w.observe(head_job(3595))  # every tick is not logged
    assert caplog.text == ""
    clock.advance(5)
    assert w.observe(head_job(700))  # inside the 12-minute window of a 2-hour limit
    assert "WARNING" in caplog.text and "ends in 11:40" in caplog.text
    assert "scontrol update JobId=7 TimeLimit" in caplog.text
    assert json.loads(path.read_text())["warning"] is True
    caplog.clear()
    clock.advance(30)
    w.observe(head_job(670))
    assert caplog.text == ""  # a warning a minute, not per tick
    clock.advance(30)
    w.observe(head_job(640))
    assert "ends in 10:40" in caplog.text
    # Extended: out of the window at once.
    clock.advance(5)
    assert not w.observe(head_job(20000, 30000))
    data = json.loads(path.read_text())
    assert data["warning"] is False and data["time_limit_s"] == 30000


def test_unlimited_and_pending_heads(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "ray_slurm_provider.provider.walltime")
    w = HeadWalltime(None, FakeClock())
    assert not w.observe(replace(head_job(None, None), state="PENDING"))
    assert caplog.text == ""
    assert not w.observe(head_job(None, None))
    assert "has no time limit" in caplog.text


def test_provider_reports_the_head_time_from_its_listing(tmp_path: Path) -> None:
    p, f, clock = make(tmp_path)
    p.head_time = HeadWalltime(p.cluster_dir.root / "walltime.json", clock)
    (head,) = p.create_node({"time": "1:00:00"}, HEAD_TAGS, 1)
    f.start(head)
    clock.advance(3300)
    f.calls.clear()
    p.non_terminated_nodes({})
    assert sum(f.calls.values()) == 1  # no extra scheduler query
    data = json.loads((p.cluster_dir.root / "walltime.json").read_text())
    assert data["head_job_id"] == head and data["time_left_s"] == 300 and data["warning"]


# --- head watch ------------------------------------------------------------------------------

class Port:
    def __init__(self) -> None:
        self.open = True
        self.timeout = False  # the network does not answer at all (a blip, a switch reboot)
        self.calls = 0

    def __call__(self, ip: str, port: int) -> str:
        self.calls += 1
        return "timeout" if self.timeout else "open" if self.open else "refused"


def watch(tmp_path: Path, clock: FakeClock, port: Port) -> tuple[HeadWatch, ClusterDir]:
    cdir = ClusterDir(str(tmp_path), "c1")
    head = HeadInfo(job_id="7", ip="127.0.0.2", gcs_port=24000)
    cdir.write_head(head)
    return HeadWatch(cdir, head, node=cdir.node("9"), grace_s=60, clock=clock,
                     connect=port), cdir


def test_head_json_removed_or_replaced(tmp_path: Path) -> None:
    clock, port = FakeClock(), Port()
    w, cdir = watch(tmp_path, clock, port)
    assert w.check() is None
    cdir.write_head(HeadInfo(job_id="8", ip="127.0.0.3", gcs_port=24000))
    assert "another head (job 8) replaced head job 7" in (w.check() or "")
    cdir.clear_head()
    assert "was removed" in (w.check() or "")


def test_unreachable_gcs_counts_only_after_grace(tmp_path: Path) -> None:
    clock, port = FakeClock(), Port()
    w, _ = watch(tmp_path, clock, port)
    port.open = False
    assert w.check() is None
    clock.advance(50)
    assert w.check() is None
    port.open = True  # it answered again: the count starts again
    clock.advance(5)
    assert w.check() is None
    port.open = False
    clock.advance(5)
    assert w.check() is None
    clock.advance(60)
    assert "refused connections for 60s" in (w.check() or "")


def test_a_network_blip_is_no_evidence_the_head_is_gone(tmp_path: Path) -> None:
    """Issue 14.8: connect timeouts counted like refusals, so a 30 s blip ended every worker.
    Only a refusal (the head's host answers, nothing listens) counts, for Ray's own 60 s."""
    clock, port = FakeClock(), Port()
    w, _ = watch(tmp_path, clock, port)
    port.timeout = True
    for _ in range(60):  # ten minutes without an answer
        assert w.check() is None
        clock.advance(10)
    port.timeout, port.open = False, False
    assert w.check() is None
    clock.advance(30)
    assert w.check() is None  # 30 s of refusals is within Ray's own 60 s
    clock.advance(31)
    assert "refused connections" in (w.check() or "")


def test_gcs_is_probed_at_most_every_5s(tmp_path: Path) -> None:
    clock, port = FakeClock(), Port()
    w, _ = watch(tmp_path, clock, port)
    for _ in range(10):  # 2-second checks of the files
        assert w.check() is None
        clock.advance(2)
    assert port.calls == 4  # t = 0, 6, 12, 18


def test_stop_file_from_the_provider_ends_the_worker(tmp_path: Path) -> None:
    clock, port = FakeClock(), Port()
    w, cdir = watch(tmp_path, clock, port)
    assert w.check() is None
    cdir.node("9").path.mkdir(parents=True)
    cdir.node("9").mark_orphan()
    assert "Slurm no longer counts this job as running" in (w.check() or "")


@pytest.mark.parametrize(("marker", "reason"), [
    ("release", "the autoscaler released this gang member"),
    ("request_ray_stop", "`ray stop` was asked for this node")])
def test_a_released_member_or_a_ray_stop_ends_the_worker(tmp_path: Path, marker: str,
                                                        reason: str) -> None:
    clock, port = FakeClock(), Port()
    w, cdir = watch(tmp_path, clock, port)
    cdir.node("9").path.mkdir(parents=True)
    getattr(cdir.node("9"), marker)()
    assert w.check() == reason


def test_a_legacy_stop_file_still_ends_the_worker(tmp_path: Path) -> None:
    """Written by a provider of the previous release (remove after the next release)."""
    clock, port = FakeClock(), Port()
    w, cdir = watch(tmp_path, clock, port)
    cdir.node("9").path.mkdir(parents=True)
    (cdir.node("9").path / "stop").touch()
    assert "Slurm no longer counts this job as running" in (w.check() or "")


def test_provider_stops_the_orphaned_ray_of_an_ended_job(tmp_path: Path) -> None:
    """A node set DOWN: Slurm ends the job (NODE_FAIL) but its processes run on."""
    p, f, _ = make(tmp_path)
    (job,) = p.create_node({}, WORKER_TAGS, 1)
    f.start(job)
    p.cluster_dir.node(job).write_ray_up(RayUp(ip="x", job_id=job))
    p.non_terminated_nodes({})
    f.finish(job, "NODE_FAIL")
    assert p.non_terminated_nodes({}) == []
    assert p.cluster_dir.node(job).orphaned()
    assert (p.cluster_dir.node(job).path / "stop").exists()  # for an agent of the last release
    assert p.guard.error("cpu_worker") is None  # Ray was up: not a crash at start


def test_run_calls_on_gone_once_and_stops(tmp_path: Path) -> None:
    clock, port = FakeClock(), Port()
    w, cdir = watch(tmp_path, clock, port)
    reasons: list[str] = []
    sleeps: list[float] = []

    def sleep(s: float) -> None:
        sleeps.append(s)
        clock.advance(s)
        if len(sleeps) == 3:
            cdir.clear_head()

    w.run(lambda: True, reasons.append, period_s=5, sleep=sleep)
    assert len(reasons) == 1 and "removed" in reasons[0] and sleeps == [5, 5, 5]
    # A worker that stops by itself stops watching.
    w2, _ = watch(tmp_path / "b", clock, port)
    w2.run(lambda: False, reasons.append, sleep=sleep)
    assert len(reasons) == 1


def test_unreadable_head_json_is_no_evidence(tmp_path: Path) -> None:
    clock, port = FakeClock(), Port()
    w, cdir = watch(tmp_path, clock, port)
    cdir.head_file.write_text("{not json")
    assert w.check() is None


def test_fake_slurm_reports_time_left() -> None:
    clock = FakeClock()
    f = FakeSlurm(clock)
    job = f.submit(JobSpec("x", ["true"], time="10"))
    f.start(job)
    clock.advance(120)
    assert f.job(job).time_left_s == 480
