"""`ray down` (bench P6): one scancel for the whole cluster, and workers whose head is going
away stop Ray at once instead of draining towards a GCS that is gone."""

from __future__ import annotations

import os
import select
import signal
import subprocess
from pathlib import Path

import pytest

from ray_slurm_provider import proc
from ray_slurm_provider.agent.__main__ import agent_for
from ray_slurm_provider.agent.agent import Agent
from ray_slurm_provider.nodespec import NodeSpec
from ray_slurm_provider.state import HeadInfo
from tests.unit.test_provider import HEAD_TAGS, WORKER_TAGS, make

REAL_KILL_TREE = proc.kill_tree  # the fixture below replaces it for the agent tests


def test_cancelling_the_head_marks_a_teardown_and_is_one_scancel(tmp_path: Path) -> None:
    p, f = make(tmp_path)
    (head,) = p.create_node({}, HEAD_TAGS, 1)
    workers = list(p.create_node({}, WORKER_TAGS, 3))
    p.non_terminated_nodes({})
    p.terminate_nodes(workers[:1])  # scaling down: no teardown
    assert not p.cluster_dir.teardown_marked()
    p.terminate_nodes([head, *workers[1:]])
    assert p.cluster_dir.teardown_marked()
    assert f.cancelled == [workers[:1], sorted([head, *workers[1:]])]
    assert f.calls["cancel"] == 2
    # A new head (the next `ray up`) clears it before its workers can start.
    p.create_node({}, HEAD_TAGS, 1)
    assert not p.cluster_dir.teardown_marked()


def test_ray_down_returns_once_slurm_has_ended_the_jobs(tmp_path: Path) -> None:
    """Issue 18 (P6): `ray down` returned before the jobs ended (their processes and
    containers lived on for seconds), and then slept Ray's 5 s anyway. Cancelling the head
    now waits until Slurm lists none of the jobs, COMPLETING included, with an injected
    clock; scaling down (no head) never waits."""
    from tests.fakes import FakeClock

    p, f = make(tmp_path)
    clock = FakeClock()
    p._clock = clock.now
    (head,) = p.create_node({}, HEAD_TAGS, 1)
    workers = list(p.create_node({}, WORKER_TAGS, 2))
    for i, job in enumerate([head, *workers]):
        f.start(job, f"n{i + 1}")
    p.non_terminated_nodes({})
    real_cancel, naps = f.cancel, []

    def cancel(ids: list[str]) -> None:  # Slurm: COMPLETING while the agents stop Ray
        real_cancel(ids)
        for i in ids:
            f.set_state(i, "COMPLETING")

    def nap(s: float) -> None:
        naps.append(s)
        clock.advance(s)
        if len(naps) == 3:
            for i in (head, *workers):
                f.set_state(i, "CANCELLED")

    f.cancel, p._sleep = cancel, nap  # type: ignore[method-assign]
    p.terminate_nodes(workers[:1])  # the autoscaler scaling down: no wait
    assert naps == []
    p.terminate_nodes([head, workers[1]])
    assert len(naps) == 3 and f.calls["list_jobs"] >= 4
    assert p.non_terminated_nodes({}) == []


def test_the_wait_for_the_jobs_to_end_is_bounded_and_outlasts_slurm_errors() -> None:
    from ray_slurm_provider.provider.teardown import wait_ended
    from ray_slurm_provider.slurm.client import Job, TransientSlurmError
    from tests.fakes import FakeClock

    clock = FakeClock()
    answers: list[Exception | list[Job]] = [
        TransientSlurmError("squeue: error: Socket timed out", "Socket timed out", "squeue"),
        [Job(job_id="7", name="ray-c", state="COMPLETING")], []]
    def listing() -> list[Job]:
        a = answers.pop(0)
        if isinstance(a, Exception):
            raise a
        return a

    assert wait_ended(listing, ["7", "8"], clock=clock.now, sleep=clock.advance) == []
    # A worker that ended on its own when the head's Ray stopped (the first step of `ray
    # down`) is COMPLETING, so Ray's listing never handed it to terminate_nodes: the wait
    # covers it too (seen on the sandbox: `ray down` returned with it still listed).
    ending = [[Job(job_id="9", name="ray-c", state="COMPLETING"),
               Job(job_id="10", name="ray-c", state="RUNNING")],
              [Job(job_id="10", name="ray-c", state="RUNNING")]]
    naps: list[float] = []
    assert wait_ended(lambda: ending.pop(0), ["7"], clock=clock.now,
                      sleep=lambda s: naps.append(s)) == []
    assert len(naps) == 1  # job 10 is not ending, and not ours to wait for
    stuck = [Job(job_id="7", name="ray-c", state="COMPLETING")]
    left = wait_ended(lambda: stuck, ["7"], timeout=60, clock=clock.now, sleep=clock.advance)
    assert left == ["7"]


def test_ray_down_waits_for_a_head_that_was_cancelled_before_its_teardown_listed_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Seen on the sandbox with a podman head: Ray's teardown listed no node at all (the head
    was already going), so terminate_nodes never ran, and `ray down` returned with the head
    job COMPLETING. Its cleanup now waits for the cluster's COMPLETING jobs too."""
    from ray.autoscaler._private import commands

    from tests.fakes import FakeClock

    monkeypatch.setattr(commands, "POLL_INTERVAL", commands.POLL_INTERVAL)  # restored after
    p, f = make(tmp_path)
    clock = FakeClock()
    naps: list[float] = []
    (head,) = p.create_node({}, HEAD_TAGS, 1)
    f.start(head, "n1")
    f.set_state(head, "COMPLETING")

    def nap(s: float) -> None:
        naps.append(s)
        clock.advance(s)
        f.set_state(head, "CANCELLED")

    p._clock, p._sleep = clock.now, nap
    assert p.nodes_for_teardown({}) == []  # a COMPLETING job is no node: nothing to cancel
    p.cleanup_cluster_resources()
    assert len(naps) == 1 and f.list_jobs("ray-c1") == []


def test_ray_down_ends_with_no_head_and_no_node_state(tmp_path: Path) -> None:
    """`cleanup_cluster_resources` (the last step of `ray down`): a head.json its agent could
    not remove (killed after KillWait, its node dead) must not name a dead head afterwards."""
    p, _ = make(tmp_path)
    (head,) = p.create_node({}, HEAD_TAGS, 1)
    p.cluster_dir.write_head(HeadInfo(job_id=head, ip="127.0.0.2", gcs_port=25000))
    p.set_node_tags(head, {"ray-node-status": "up-to-date"})
    p.terminate_nodes([head])
    p.cleanup_cluster_resources()
    assert p.cluster_dir.read_head() is None and p.cluster_dir.known_nodes() == []


def test_ray_downs_loop_sleeps_the_short_poll_on_this_provider(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ray's own `ray down` loop, run on this provider: after its terminate call it sleeps
    teardown.SHORT_POLL_S, not Ray's 5 s, and then finds the cancelled workers gone."""
    from ray.autoscaler._private import commands

    from ray_slurm_provider.provider import teardown
    from tests.unit.test_rayapi import ray_down

    monkeypatch.setattr(commands, "POLL_INTERVAL", commands.POLL_INTERVAL)  # restored after
    p, f = make(tmp_path)
    workers = p.create_node({}, WORKER_TAGS, 2)
    for i, job in enumerate(workers):
        f.start(job, f"n{i + 1}")
    assert ray_down(tmp_path, monkeypatch, p) == [teardown.SHORT_POLL_S]
    assert f.cancelled == [sorted(workers)]


class Child:
    pid = 4242
    last: Child | None = None

    def __init__(self) -> None:
        self.got: list[str] = []

    def poll(self) -> int | None:
        return None

    def send_signal(self, sig: int) -> None:
        self.got.append(signal.Signals(sig).name)


@pytest.fixture(autouse=True)
def no_kills(monkeypatch: pytest.MonkeyPatch) -> None:
    def kill_tree(pid: int) -> int:
        child = Child.last
        assert pid == Child.pid and child is not None
        child.got.append("kill tree")
        return 1

    monkeypatch.setattr(proc, "kill_tree", kill_tree)


def agent(tmp_path: Path, kind: str = "worker") -> tuple[Agent, Child]:
    spec = NodeSpec(kind=kind, node_type="w", cluster_name="c1", state_dir=str(tmp_path),
                    ports_base=25000, temp_dir_root=str(tmp_path / "tmp"))
    a = agent_for(spec, {"SLURM_JOB_ID": "9", "HOME": str(tmp_path)})
    a.cdir.write_head(HeadInfo(job_id="1", ip="127.0.0.2", gcs_port=25000))
    a.head_job = "1"  # as build() records it when the worker joins
    a.child = Child.last = Child()
    return a, a.child


def test_worker_drains_while_its_head_is_there(tmp_path: Path) -> None:
    a, child = agent(tmp_path)
    a.on_term(signal.SIGTERM, None)
    assert child.got == ["SIGTERM"] and a.terminating


def test_worker_skips_the_drain_when_its_head_is_gone(tmp_path: Path) -> None:
    a, child = agent(tmp_path)
    a.cdir.clear_head()
    a.on_term(signal.SIGTERM, None)
    assert child.got == ["kill tree"]


def test_worker_skips_the_drain_when_another_head_took_over(tmp_path: Path) -> None:
    a, child = agent(tmp_path)
    a.cdir.write_head(HeadInfo(job_id="7", ip="127.0.0.4", gcs_port=25000))
    a.on_term(signal.SIGTERM, None)
    assert child.got == ["kill tree"]


def test_worker_skips_the_drain_during_ray_down(tmp_path: Path) -> None:
    a, child = agent(tmp_path)
    a.cdir.create()
    a.cdir.mark_teardown()  # the provider cancels the head with its workers
    a.on_term(signal.SIGTERM, None)
    assert child.got == ["kill tree"]


def test_head_always_stops_its_ray_gracefully(tmp_path: Path) -> None:
    a, child = agent(tmp_path, kind="head")
    a.cdir.create()
    a.cdir.mark_teardown()
    a.on_term(signal.SIGTERM, None)
    assert child.got == ["SIGTERM"]


def test_kill_tree_reaches_grandchildren() -> None:
    """A real process tree: bash, and a sleep it started (which outlives bash otherwise)."""
    p = subprocess.Popen(["bash", "-c", "sleep 60 & echo $!; wait"], stdout=subprocess.PIPE,
                         text=True)
    assert p.stdout is not None
    grandchild = int(p.stdout.readline())
    assert REAL_KILL_TREE(p.pid) == 2
    assert p.wait(timeout=30) == -signal.SIGKILL
    # The signal is delivered asynchronously: wait on a pidfd (readable once the process
    # has exited), not in a loop (issue 14.22: this busy-waited on a 2-core machine).
    try:
        fd = os.pidfd_open(grandchild)
    except ProcessLookupError:
        fd = None  # already gone and reaped
    if fd is not None:
        try:
            assert select.select([fd], [], [], 30)[0] == [fd], "still running after 30 s"
        finally:
            os.close(fd)
    assert _state(grandchild) in ("Z", "X", "gone")  # killed (a zombie until init reaps it)


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "gone"


def test_the_heads_own_autoscaler_never_cancels_the_head(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Seen on the 24.11 and 26.05 sandboxes: a second `ray up` restarts Ray on the head; the
    head's own v2 autoscaler, still running, saw the head's Ray node stop and terminated its
    instance, so the provider cancelled the head job and the cluster with it. The provider
    in the head's autoscaler (its Ray carries RAY_CLOUD_INSTANCE_ID, raystart.py) spares the
    job it runs in; `ray up`/`ray down` on the login node still cancel it."""
    p, f = make(tmp_path)
    (head,) = p.create_node({}, HEAD_TAGS, 1)
    (worker,) = p.create_node({}, WORKER_TAGS, 1)
    monkeypatch.setenv("RAY_CLOUD_INSTANCE_ID", head)
    p.terminate_nodes([head, worker])
    assert f.cancelled == [[worker]]
    assert {j.job_id for j in f.list_jobs("ray-c1")} == {head}
    monkeypatch.delenv("RAY_CLOUD_INSTANCE_ID")
    p._sleep = lambda s: f.set_state(head, "CANCELLED")  # type: ignore[assignment]
    p.terminate_nodes([head])
    assert f.cancelled[-1] == [head]


def test_a_scancel_slurm_did_not_answer_is_tried_again(tmp_path: Path) -> None:
    """Issue 29: on a rate-limited controller scancel (one RPC per job) can outlive its
    timeout; cancelling again is safe, so one lost answer is no failed terminate."""
    from ray_slurm_provider.slurm.client import TransientSlurmError

    p, f = make(tmp_path)
    naps: list[float] = []
    p._sleep = naps.append  # type: ignore[assignment]
    (job,) = p.create_node({}, WORKER_TAGS, 1)
    p.non_terminated_nodes({})
    f.fail_next("cancel", TransientSlurmError("scancel: no answer within 30s", "", "scancel"))
    p.terminate_nodes([job])
    assert f.cancelled == [[job]] and len(naps) == 1 and 1.6 <= naps[0] <= 2.4
    assert p.non_terminated_nodes({}) == []
