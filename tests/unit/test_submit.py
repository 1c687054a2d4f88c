"""Rejected and failed launches: per-type backoff, errors.json, stray submissions, crash loops.

All on FakeSlurm with the injected clock: nothing sleeps.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import click
import pytest
from ray.autoscaler.node_launch_exception import NodeLaunchException
from ray.autoscaler.tags import NODE_KIND_WORKER, TAG_RAY_NODE_KIND, TAG_RAY_USER_NODE_TYPE

from ray_slurm_provider.provider.guard import MAX_DELAY_S, HeldBack, LaunchGuard, last_log_line
from ray_slurm_provider.provider.provider import SlurmNodeProvider
from ray_slurm_provider.provider.submit import SUBMIT_TAG, Strays
from ray_slurm_provider.slurm.client import SlurmError, TransientSlurmError, classify
from ray_slurm_provider.slurm.script import JobSpec
from ray_slurm_provider.state import RayUp
from tests.fakes import BAD_PARTITION, FakeClock, FakeSlurm
from tests.unit.test_provider import HEAD_TAGS, WORKER_TAGS

QOS_LIMIT = ("sbatch: error: QOSMaxSubmitJobPerUserLimit\nsbatch: error: Batch job submission "
             "failed: Job violates accounting/QOS policy (job submit limit, user's size and/or "
             "time limits)")


def make(tmp_path: Path) -> tuple[SlurmNodeProvider, FakeSlurm, FakeClock]:
    clock = FakeClock()
    p = SlurmNodeProvider({"type": "external", "state_dir": str(tmp_path / "state"),
                           "python": "/opt/venv/bin/python"}, "c1")
    f = FakeSlurm(clock)
    p._client = f
    p.guard = LaunchGuard(p.cluster_dir.root / "errors.json", clock)
    p.strays = Strays(clock)
    return p, f, clock


def errors(p: SlurmNodeProvider) -> dict[str, Any]:
    return dict(json.loads((p.cluster_dir.root / "errors.json").read_text()))


def test_guard_backs_off_doubling_and_clears_on_success(tmp_path: Path) -> None:
    clock = FakeClock()
    g = LaunchGuard(tmp_path / "errors.json", clock)
    g.check("w")  # nothing recorded: free to launch
    delays = [g.failed("w", "refused", "rejected") for _ in range(6)]
    assert delays == [60, 120, 240, 480, MAX_DELAY_S, MAX_DELAY_S]
    with pytest.raises(HeldBack, match=r"held back for 600s more after 6 failed.*refused"):
        g.check("w")
    g.check("other")  # per node type
    clock.advance(MAX_DELAY_S)
    g.check("w")
    g.succeeded("w")
    assert g.error("w") is None and json.loads((tmp_path / "errors.json").read_text()) == {}
    assert g.failed("w", "controller down", "unavailable") == 5  # transient: short


def test_guard_is_thread_safe(tmp_path: Path) -> None:
    g = LaunchGuard(None, FakeClock())

    def hammer() -> None:
        for _ in range(200):
            g.failed("w", "x", "rejected")
            try:
                g.check("w")
            except HeldBack:
                pass

    threads = [threading.Thread(target=hammer) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    err = g.error("w")
    assert err is not None and err.failures == 1600 and err.held_back == 1600


def test_rejected_worker_is_held_back_without_asking_slurm(tmp_path: Path) -> None:
    p, f, clock = make(tmp_path)
    with pytest.raises(NodeLaunchException, match="Invalid partition name specified") as e:
        p.create_node({"partition": "nope"}, WORKER_TAGS, 1)
    assert e.value.category == "SlurmRejected"
    assert f.calls["submit"] == 1
    entry = errors(p)["cpu_worker"]
    assert BAD_PARTITION.split(": ", 1)[1] in entry["message"]
    assert entry["kind"] == "rejected" and entry["failures"] == 1
    # The autoscaler asks again every tick (5 s): Slurm is not asked for a minute.
    for _ in range(11):
        clock.advance(5)
        with pytest.raises(NodeLaunchException, match="held back"):
            p.create_node({"partition": "nope"}, WORKER_TAGS, 1)
    assert f.calls["submit"] == 1
    clock.advance(5)
    with pytest.raises(NodeLaunchException):
        p.create_node({"partition": "nope"}, WORKER_TAGS, 1)
    assert f.calls["submit"] == 2 and errors(p)["cpu_worker"]["failures"] == 2
    # Other node types launch meanwhile, and the fixed type launches after its backoff.
    other = {**WORKER_TAGS, TAG_RAY_USER_NODE_TYPE: "gpu_worker"}
    assert p.create_node({"partition": "gpu"}, other, 1)
    clock.advance(120)
    assert p.create_node({"partition": "cpu"}, WORKER_TAGS, 1)
    assert "cpu_worker" not in errors(p)


def test_limit_message_is_quoted(tmp_path: Path) -> None:
    p, f, _ = make(tmp_path)
    f.fail_next("submit", classify(QOS_LIMIT, "sbatch"))
    with pytest.raises(NodeLaunchException, match="QOSMaxSubmitJobPerUserLimit"):
        p.create_node({}, WORKER_TAGS, 1)
    assert "job submit limit" in errors(p)["cpu_worker"]["message"]


def test_rejected_head_is_a_clean_cli_error(tmp_path: Path) -> None:
    p, _, _ = make(tmp_path)
    with pytest.raises(click.ClickException, match="Invalid partition name specified"):
        p.create_node({"partition": "nope"}, HEAD_TAGS, 1)
    assert errors(p)["head"]["kind"] == "rejected"


#: What the CLI back end raises when sbatch outlives its timeout: on a rate-limited
#: controller (rl_enable) sbatch backs off by itself, so a throttled sbatch is a slow one.
SBATCH_TIMEOUT = TransientSlurmError("sbatch: no answer within 30s", "", "sbatch")


def slow_submit(f: FakeSlurm, queue: list[bool]) -> list[str]:
    """Make `f.submit` time out: one entry of `queue` per call, True when the job was queued
    anyway before the timeout; calls past the list submit normally. Returns the comments of
    every call."""
    real = f.submit
    comments: list[str] = []

    def submit(spec: JobSpec, *, comment: str = "") -> str:
        comments.append(comment)
        if len(comments) > len(queue):
            return real(spec, comment=comment)
        if queue[len(comments) - 1]:
            real(spec, comment=comment)
        raise SBATCH_TIMEOUT

    f.submit = submit  # type: ignore[method-assign]
    return comments


def test_a_timed_out_sbatch_that_queued_is_found_by_its_tag_not_submitted_again(
        tmp_path: Path) -> None:
    p, f, clock = make(tmp_path)
    p._sleep = clock.advance
    comments = slow_submit(f, [True])
    (job,) = p.create_node({}, WORKER_TAGS, 1)
    assert len(comments) == 1 and list(f.jobs) == [job]  # no second sbatch: 0 duplicates
    assert p.non_terminated_nodes({}) == [job] and f.cancelled == []
    assert p.guard.error("cpu_worker") is None  # a success: the type is not held back


def test_a_timed_out_sbatch_that_did_not_queue_is_tried_again_with_a_new_tag(
        tmp_path: Path) -> None:
    p, f, clock = make(tmp_path)
    t0 = clock()
    p._sleep = clock.advance
    comments = slow_submit(f, [False])
    (job,) = p.create_node({}, WORKER_TAGS, 1)
    assert len(comments) == 2 and comments[0] != comments[1] and list(f.jobs) == [job]
    assert 1.6 <= clock() - t0 <= 2.4  # backed off (jittered 2 s) before the second sbatch
    # The first try's job shows up late after all: it is cancelled on sight, so one job lives.
    late = f.submit(JobSpec("ray-c1", ["true"]), comment=comments[0])
    assert p.non_terminated_nodes({}) == [job]
    assert f.cancelled == [[late]] and f.jobs[late].job.state == "CANCELLED"


def test_a_submission_slurm_never_answers_fails_after_its_tries(tmp_path: Path) -> None:
    p, f, clock = make(tmp_path)
    p._sleep = clock.advance
    comments = slow_submit(f, [False, False, False])
    with pytest.raises(NodeLaunchException) as e:
        p.create_node({}, WORKER_TAGS, 1)
    assert e.value.category == "SlurmUnavailable" and len(comments) == 3 and not f.jobs
    assert errors(p)["cpu_worker"]["kind"] == "unavailable"


def test_a_listing_that_fails_while_looking_for_the_job_leaves_it_a_stray(
        tmp_path: Path) -> None:
    p, f, clock = make(tmp_path)
    p._sleep = clock.advance
    comments = slow_submit(f, [True])
    f.fail_next("list_jobs", TransientSlurmError("squeue: no answer within 30s", "", "squeue"))
    (job,) = p.create_node({}, WORKER_TAGS, 1)
    (first,) = (j for j in f.jobs if j != job)
    assert len(comments) == 2
    assert p.non_terminated_nodes({}) == [job] and f.cancelled == [[first]]


def test_submission_nonce_never_reaches_ray(tmp_path: Path) -> None:
    p, f, _ = make(tmp_path)
    (job,) = p.create_node({}, WORKER_TAGS, 1)
    assert SUBMIT_TAG in f.jobs[job].job.comment
    p.non_terminated_nodes({})
    assert SUBMIT_TAG not in p.node_tags(job)


def test_worker_dying_before_ray_starts_holds_its_type_back(tmp_path: Path) -> None:
    p, f, clock = make(tmp_path)
    for _ in range(2):  # one such job is bad luck, not held against the type; two are
        (job,) = p.create_node({}, WORKER_TAGS, 1)
        f.start(job)
        p.non_terminated_nodes({})
        log = p.cluster_dir.log(job)
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text("[ray-slurm 01:02:03] running: module load nope\nmodule: not found\n"
                       "[ray-slurm 01:02:04] giving up: Ray never started on this node\n")
        f.finish(job, "FAILED")
        p.non_terminated_nodes({})
    entry = errors(p)["cpu_worker"]
    assert entry["failures"] == 2
    assert entry["kind"] == "crashed" and "giving up: Ray never started" in entry["message"]
    with pytest.raises(NodeLaunchException, match="held back") as e:
        p.create_node({}, WORKER_TAGS, 1)
    assert e.value.category == "JobDiedAtStart"
    # A worker whose Ray was up, then lost (scancel, node failure, walltime), is no crash.
    clock.advance(61)
    (job2,) = p.create_node({}, WORKER_TAGS, 1)
    f.start(job2)
    p.cluster_dir.node(job2).write_ray_up(RayUp(ip="x", job_id=job2))
    p.non_terminated_nodes({})
    f.finish(job2, "CANCELLED")
    p.non_terminated_nodes({})
    assert "cpu_worker" not in errors(p)
    # Nor is a worker the autoscaler terminated itself.
    (job3,) = p.create_node({}, WORKER_TAGS, 1)
    f.start(job3)
    p.non_terminated_nodes({})
    p.terminate_node(job3)
    p.non_terminated_nodes({})
    assert "cpu_worker" not in errors(p)


def test_last_log_line(tmp_path: Path) -> None:
    log = tmp_path / "1.out"
    assert last_log_line(log) == ""
    log.write_text("x" * 20000 + "\n[ray-slurm 1] a\nnoise\n[ray-slurm 2] b\ntrailing\n")
    assert last_log_line(log) == "[ray-slurm 2] b"
    log.write_text("line 3: module: command not found\n\n")  # died before the agent ran
    assert last_log_line(log) == "line 3: module: command not found"


def test_strays_expire(tmp_path: Path) -> None:
    clock = FakeClock()
    s = Strays(clock, keep_s=100)
    s.add("a")
    clock.advance(101)
    s.add("b")
    assert "a" not in s and "b" in s


def test_worker_tags_fixture_is_a_worker() -> None:
    assert WORKER_TAGS[TAG_RAY_NODE_KIND] == NODE_KIND_WORKER


def test_status_command_shows_the_launch_error(tmp_path: Path) -> None:
    from ray_slurm_provider.cli import status

    p, _, _ = make(tmp_path)
    with pytest.raises(NodeLaunchException):
        p.create_node({"partition": "nope"}, WORKER_TAGS, 1)
    data = {"cluster": "c1", "job_name": "ray-c1", "nodes": [], "other_jobs": 0, "head": None,
            "launch_errors": errors(p)}
    text = "\n".join(status.status_lines(data))
    assert "cpu_worker: launch failing (rejected, 1 in a row; held back until" in text
    assert "Invalid partition name specified" in text


def test_workers_that_die_between_two_listings_hold_their_type_back(tmp_path: Path) -> None:
    """Issue 14.1: a job whose prologue fails in under a second goes PENDING -> gone between
    two ticks, never seen RUNNING; five such crashes used to leave the sixth launch free."""
    p, f, _ = make(tmp_path)
    for _ in range(2):
        (job,) = p.create_node({}, WORKER_TAGS, 1)
        p.non_terminated_nodes({})  # seen PENDING
        log = p.cluster_dir.log(job)
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text("/var/spool/slurm/job01/slurm_script: line 9: module: command not found\n")
        f.start(job)
        f.finish(job, "FAILED")  # started and failed between two listings
        p.non_terminated_nodes({})
    entry = errors(p)["cpu_worker"]
    assert entry["failures"] == 2 and entry["kind"] == "crashed"
    assert "module: command not found" in entry["message"] and "PENDING" in entry["message"]
    with pytest.raises(NodeLaunchException, match="held back"):
        p.create_node({}, WORKER_TAGS, 1)


def test_a_pending_worker_we_cancelled_is_no_crash(tmp_path: Path) -> None:
    p, _, _ = make(tmp_path)
    for _ in range(3):
        (job,) = p.create_node({}, WORKER_TAGS, 1)
        p.non_terminated_nodes({})
        p.terminate_node(job)
        p.non_terminated_nodes({})
    assert "cpu_worker" not in (errors(p) if (p.cluster_dir.root / "errors.json").exists()
                                else {})


def test_errors_json_counts_each_launch_refused_locally(tmp_path: Path) -> None:
    """`ray-slurm status` and the hardening e2e read errors.json: the count of launches the
    guard refused must be there while the type is held back, not only after the next
    failure (it stayed 0 for the whole first back-off)."""
    clock = FakeClock()
    g = LaunchGuard(tmp_path / "errors.json", clock)
    g.failed("w", "sbatch: error: bad", "rejected")
    for _ in range(3):
        with pytest.raises(HeldBack):
            g.check("w")
    assert json.loads((tmp_path / "errors.json").read_text())["w"]["held_back"] == 3


def test_slurms_rate_limit_words_are_transient() -> None:
    # libslurm's text for SLURMCTLD_COMMUNICATIONS_BACKOFF (src/common/slurm_errno.c, 25.11):
    # a throttled request is worth trying again, never a refused node type.
    err = classify("Rate limit exceeded, please retry momentarily", "sbatch")
    assert isinstance(err, TransientSlurmError), err


def test_a_head_refused_for_a_missing_association_says_slurms_reason(tmp_path: Path) -> None:
    """Issue 29: with enforced associations, a user with no association to the account gets
    Slurm's own words from `ray up`, once: refused is not throttled, so no second try."""
    said = (Path(__file__).resolve().parent.parent / "fixtures" / "slurm-22.05" /
            "sbatch_bad_account.stderr.txt").read_text()
    p, f, clock = make(tmp_path)
    p._sleep = clock.advance
    f.fail_next("submit", classify(said, "sbatch"))
    with pytest.raises(click.ClickException,
                       match="Invalid account or account/partition combination specified"):
        p.create_node({"account": "team-z"}, HEAD_TAGS, 1)
    assert f.calls["submit"] == 1 and not f.jobs
    assert errors(p)["head"]["kind"] == "rejected"


def test_ray_ups_first_question_to_slurm_is_asked_again_when_not_answered(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 29: the partitions `ray up` checks the config against, from a controller that
    did not answer in time once, are asked for again (backing off) instead of failing."""
    from ray_slurm_provider.provider import bootstrap

    f = FakeSlurm(FakeClock())
    f.fail_next("cluster_info", TransientSlurmError("sinfo: no answer within 30s", "", "sinfo"))
    monkeypatch.setattr("ray_slurm_provider.slurm.factory.make_client", lambda *a, **k: f)
    naps: list[float] = []
    info = bootstrap._cluster_info({}, sleep=naps.append)
    assert info.partitions and f.calls["cluster_info"] == 2 and len(naps) == 1
    f.fail_next("cluster_info", classify("sinfo: error: Invalid partition name specified",
                                         "sinfo"))
    with pytest.raises(SlurmError):  # a refusal is not asked again
        bootstrap._cluster_info({}, sleep=naps.append)
    assert f.calls["cluster_info"] == 3


def test_a_head_launch_lists_the_old_runs_jobs_through_a_throttled_controller(
        tmp_path: Path) -> None:
    """Issue 29: the head's listing (which logs are an earlier run's) is asked again; a slow
    controller fails no `ray up`, and no listing that failed is read as "no jobs"."""
    p, f, clock = make(tmp_path)
    p._sleep = clock.advance
    live = f.submit(JobSpec("ray-c1", ["true"]))  # a worker of the running cluster
    p.cluster_dir.create()
    p.cluster_dir.log(live).write_text("still running\n")
    f.fail_next("list_jobs", TransientSlurmError("squeue: no answer within 30s", "", "squeue"))
    (head,) = p.create_node({}, HEAD_TAGS, 1)
    assert f.calls["list_jobs"] == 2 and head in f.jobs
    assert p.cluster_dir.log(live).read_text() == "still running\n"  # not moved aside
