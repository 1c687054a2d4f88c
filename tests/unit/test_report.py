"""A run's records (provider/history.py) and `ray-slurm report` (cli/report.py, report_html.py):
issue 31 items 1 and 2. Fakes and an injected clock; the page in a real browser is
tests/e2e/test_ray_up.py's."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from ray_slurm_provider.cli.main import main
from ray_slurm_provider.cli.report import build, summary, text_lines
from ray_slurm_provider.cli.report_html import render
from ray_slurm_provider.provider import history
from ray_slurm_provider.provider.history import Event, History, fold
from ray_slurm_provider.slurm.client import SlurmError
from ray_slurm_provider.slurm.sacct import NoAccounting, Usage, parse_usage
from ray_slurm_provider.state import RayUp
from tests.fakes import FakeClock, FakeSlurm
from tests.unit.test_cmds import cluster

T0 = 1_800_000_000.0


class FakeAccounting:
    """`Accounting.usage` from a table, or Slurm's words for no accounting."""

    def __init__(self, usage: list[Usage] | None) -> None:
        self._usage = usage
        self.calls = 0

    def usage(self, job_name: str, since: str, user: str | None = None) -> list[Usage]:
        self.calls += 1
        if self._usage is None:
            raise NoAccounting("sacct: no accounting", "Slurm accounting storage is disabled")
        return self._usage


def _provider(tmp_path: Path, fake: FakeSlurm, clock: FakeClock) -> Any:
    from ray_slurm_provider.provider.provider import SlurmNodeProvider
    from tests.unit.test_provider import HEAD_TAGS, WORKER_TAGS

    c = cluster(tmp_path, fake)
    p = SlurmNodeProvider({"type": "external", "state_dir": str(tmp_path / "state"),
                           "python": "/py"}, c.name)
    p._client = fake
    p.records.clock = clock
    return p, c, HEAD_TAGS, WORKER_TAGS


def _one_worker(tmp_path: Path) -> tuple[Any, Any, FakeSlurm, FakeClock, str]:
    """A provider with a head and one running worker, listed once."""
    clock = FakeClock(T0)
    fake = FakeSlurm(clock)
    p, c, head_tags, worker_tags = _provider(tmp_path, fake, clock)
    p.create_node({}, head_tags, 1)
    (w,) = p.create_node({}, worker_tags, 1)
    fake.start(w)
    p.non_terminated_nodes({})
    return p, c, fake, clock, w


def test_the_provider_records_each_transition_once_and_who_ended_each_job(
        tmp_path: Path) -> None:
    """Submitted (type, resources), listed pending then running, Ray up (ray.json's time),
    cancelled by the autoscaler, scancelled by someone else (no cancel of ours: its end is
    Slurm's to tell), and `ray down`; an unchanged listing appends nothing."""
    clock = FakeClock(T0)
    fake = FakeSlurm(clock)
    p, c, head_tags, worker_tags = _provider(tmp_path, fake, clock)
    (head,) = p.create_node({}, head_tags, 1)
    w1, w2, w3 = p.create_node({}, worker_tags, 3)
    p.non_terminated_nodes({})
    path = History(c.cdir.root).path(History(c.cdir.root).current() or "")
    size = path.stat().st_size
    p.non_terminated_nodes({})
    assert path.stat().st_size == size  # nothing moved: nothing appended
    clock.advance(30)
    for j in (head, w1, w2, w3):
        fake.start(j)
    p.non_terminated_nodes({})
    c.cdir.node(w1).write_ray_up(RayUp(ip="10.0.0.2", job_id=w1))
    p.non_terminated_nodes({})
    p.non_terminated_nodes({})
    clock.advance(60)
    p.terminate_nodes([w1])  # the autoscaler
    fake.finish(w2, "CANCELLED")  # scancel by the user
    p.non_terminated_nodes({})
    p.terminate_nodes([head, w3])  # `ray down`: the head goes too
    p.non_terminated_nodes({})
    events = [json.loads(line) for line in path.read_text().splitlines()]
    kinds = [(e["ev"], e.get("job", "")) for e in events]
    assert kinds.count(("ray_up", w1)) == 1
    assert [e["state"] for e in events if e["ev"] == "listed" and e["job"] == w2] == [
        "PENDING", "RUNNING"]
    sub = next(e for e in events if e["ev"] == "submitted" and e["job"] == w1)
    assert sub["type"] == "cpu_worker" and sub["kind"] == "worker"
    recs = History(c.cdir.root).read(History(c.cdir.root).current() or "")
    assert {j: r.by for j, r in recs.jobs.items()} == {
        head: "ray down", w1: "autoscaler", w2: "", w3: "ray down"}
    assert all(r.ended for r in recs.jobs.values())
    assert recs.jobs[w1].ray_up > 0 and recs.jobs[head].type == "head"


def _events(*jobs: tuple[str, str, float, float | None, float | None, float | None, str]
            ) -> list[str]:
    """Lines of a run: (job, type, submitted, started, ray up, ended, cancelled by)."""
    out = [Event("run", T0).line()]
    for job, node_type, sub, start, up, end, by in jobs:
        out.append(Event("submitted", T0 + sub, job=job, type=node_type, kind="worker",
                         nodes=1, cpus=2, gpus=1 if node_type == "gpu" else 0).line())
        if start is not None:
            out.append(Event("listed", T0 + start, job=job, type=node_type,
                             state="RUNNING").line())
        if up is not None:
            out.append(Event("ray_up", T0 + up, job=job).line())
        if by:
            out.append(Event("cancel", T0 + (end or 0), job=job, by=by).line())
        if end is not None:
            out.append(Event("gone", T0 + end, job=job, state="RUNNING").line())
    return out


RUN = _events(("1", "cpu", 0, 10, 15, 3610, "autoscaler"),
              ("2", "cpu", 0, 30, 40, 7230, "ray down"),
              ("3", "gpu", 5, 65, 70, 1865, ""),
              ("4", "gpu", 5, None, None, 100, "autoscaler"))


def test_the_summary_per_type_waits_startups_hours_and_ends() -> None:
    recs = fold("r", RUN)
    recs.jobs["3"].state = "TIMEOUT"  # from sacct
    data = summary(recs, now=T0 + 8000)
    cpu, gpu = data["types"]["cpu"], data["types"]["gpu"]
    assert (cpu["jobs"], cpu["queue_wait_median_s"], cpu["queue_wait_max_s"]) == (2, 20, 30)
    assert cpu["startup_median_s"] == 7.5
    assert cpu["node_hours"] == pytest.approx((3600 + 7200) / 3600)
    assert gpu["gpu_hours"] == pytest.approx(0.5) and gpu["queue_wait_max_s"] == 60
    assert cpu["ended_by"] == {"autoscaler": 1, "ray down": 1}
    assert gpu["ended_by"] == {"walltime": 1, "autoscaler": 1}
    assert data["ended"] == T0 + 7230 and data["wall_s"] == 7230
    assert data["types"]["gpu"]["billing_hours"] is None
    lines = text_lines(data)
    assert lines[1].split()[:2] == ["TYPE", "JOBS"]
    assert any(line.startswith("cpu ") and "autoscaler 1, ray down 1" in line for line in lines)


def test_while_the_run_lasts_its_allocation_grows_with_the_clock() -> None:
    recs = fold("r", _events(("1", "cpu", 0, 10, 20, None, "")))
    assert summary(recs, now=T0 + 3610)["types"]["cpu"]["node_hours"] == pytest.approx(1.0)
    assert summary(recs, now=T0 + 7210)["types"]["cpu"]["node_hours"] == pytest.approx(2.0)
    assert summary(recs, now=T0 + 7210)["ended"] is None


def _run_dir(tmp_path: Path, lines: list[str]) -> tuple[Any, History, str]:
    c = cluster(tmp_path, FakeSlurm())
    h = History(c.cdir.root)
    run = h.start_run(T0)
    with open(h.path(run), "a") as f:
        f.writelines(lines[1:])
    return c, h, run


def test_sacct_gives_final_states_and_billing(tmp_path: Path) -> None:
    c, _, _ = _run_dir(tmp_path, RUN)
    acct = FakeAccounting([Usage("3", "TIMEOUT", "", "", {"billing": "4", "gres/gpu": "1"}),
                           Usage("9", "COMPLETED", "", "", {})])
    data = build(c, None, now=lambda: T0 + 8000, acct=acct)  # type: ignore[arg-type]
    assert data["types"]["gpu"]["ended_by"]["walltime"] == 1
    assert data["types"]["gpu"]["billing_hours"] == pytest.approx(4 * 1800 / 3600)
    assert data["notes"] == []


def test_without_accounting_the_controller_tells_and_the_records_keep_it(
        tmp_path: Path) -> None:
    """No sacct: a note, and the controller's end (scontrol, while it keeps the job) is
    appended, so a later report (after MinJobAge) still knows it."""
    fake = FakeSlurm()
    c, h, run = _run_dir(tmp_path, _events(("1000", "cpu", 0, 10, 15, 60, "")))
    fake.jobs.clear()
    from ray_slurm_provider.slurm.client import EndedJob

    c.client_factory = lambda pcfg: _Ends({"1000": EndedJob("1000", "CANCELLED", "0:15")})
    data = build(c, None, now=lambda: T0 + 100, acct=FakeAccounting(None))  # type: ignore
    assert data["types"]["cpu"]["ended_by"] == {"scancel": 1}
    assert "no accounting" in data["notes"][0]
    assert h.read(run).jobs["1000"].state == "CANCELLED"  # kept


class _Ends(FakeSlurm):
    def __init__(self, ends: dict[str, Any]) -> None:
        super().__init__()
        self._ends = ends

    def ended_job(self, job_id: str) -> Any:
        if job_id not in self._ends:
            raise SlurmError("gone")
        return self._ends[job_id]


def test_a_corrupt_record_file_gives_a_partial_report(tmp_path: Path) -> None:
    lines = [*RUN[:3], "{not json\n", '{"ev": 3}\n', "\x00\x00garbage\n",
             '{"ev": "submitted", "t": 1, "job": "9", "nodes": "x"}\n', "[]\n",
             '{"ev": "job", "t": 1, "job": "1", "data": {"nodes": "x", "gpus": 2}}\n', *RUN[3:]]
    c, _, _ = _run_dir(tmp_path, lines)
    data = build(c, None, now=lambda: T0 + 8000,
                 acct=FakeAccounting(None))  # type: ignore[arg-type]
    assert data["bad_lines"] == 5 and len(data["jobs"]) == 4
    assert "5 unreadable lines of the records were skipped" in text_lines(data)
    assert [j["nodes"] for j in data["jobs"] if j["job"] == "1"] == [1]  # "x" not taken


def test_bad_input_gives_a_clear_line_never_a_traceback(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    c = cluster(tmp_path, FakeSlurm())  # an older cluster dir: no records at all
    c.cdir.create()
    cfg = str(tmp_path / "c.yaml")
    assert main(["report", cfg]) == 2
    err = capsys.readouterr().err
    assert "no records of" in err and "older ray-slurm" in err and "Traceback" not in err
    h = History(c.cdir.root)
    h.start_run(T0)  # a run with no node job recorded
    assert main(["report", cfg]) == 0
    assert "no node jobs recorded" in capsys.readouterr().out
    assert main(["report", cfg, "--run", "nope"]) == 2
    assert "no run 'nope'" in capsys.readouterr().err
    assert main(["report", cfg, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["notes"] == ["the run has no node jobs recorded"]


def test_records_are_bounded_older_jobs_fold_into_totals(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past COMPACT_BYTES the file is rewritten: the newest KEEP_JOBS jobs in full, the
    older ended ones folded into totals that keep their node-hours and ends."""
    monkeypatch.setattr(history, "KEEP_JOBS", 50)
    monkeypatch.setattr(history, "COMPACT_BYTES", 20_000)
    h = History(tmp_path)
    run = h.start_run(T0)
    for i in range(400):
        t = T0 + i
        h.append([Event("submitted", t, job=str(i), type="cpu", nodes=1, cpus=1),
                  Event("listed", t, job=str(i), type="cpu", state="RUNNING"),
                  Event("cancel", t + 3600, job=str(i), by="autoscaler"),
                  Event("gone", t + 3600, job=str(i))])
    assert h.path(run).stat().st_size < 2 * 20_000
    recs = h.read(run)
    folded = sum(t.jobs for t in recs.folded.values())
    assert folded + len(recs.jobs) == 400 and len(recs.jobs) <= 50 + 100
    data = summary(recs, now=T0 + 9000)
    assert data["types"]["cpu"]["jobs"] == 400
    assert data["types"]["cpu"]["node_hours"] == pytest.approx(400.0)
    assert data["types"]["cpu"]["ended_by"] == {"autoscaler": 400}
    assert any("folded into the totals" in line for line in text_lines(data))


def test_the_page_has_one_bar_per_job_and_fetches_nothing() -> None:
    recs = fold("r", RUN)
    page = render({**summary(recs, now=T0 + 8000), "cluster": "c"})
    assert page.count('<g class="job"') == 4
    assert not re.search(r"https?://|<script|<link|@import|url\(", page)
    bar = re.search(r'<g class="job" data-job="1".*?</g>', page)
    assert bar and {"queued", "starting", "up"} <= set(re.findall(r'class="(\w+)"', bar[0]))
    assert 'data-end="ray down"' in page and "node-hours" in page


def test_usage_lines_from_sacct() -> None:
    out = parse_usage("5\x1fCANCELLED by 1000\x1f2026-12-01T10:00:00\x1fUnknown\x1f"
                      "billing=2,cpu=2,gres/gpu=1,node=1\n")
    assert out == [Usage("5", "CANCELLED", "2026-12-01T10:00:00", "",
                         {"billing": "2", "cpu": "2", "gres/gpu": "1", "node": "1"})]


class _Out:
    def __init__(self, tty: bool) -> None:
        self.text = ""
        self.tty = tty

    def write(self, s: str) -> None:
        self.text += s

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return self.tty


@pytest.mark.parametrize("tty", [True, False])
def test_status_watch_refreshes_in_place_on_a_terminal_only(tty: bool) -> None:
    """Issue 31 item 4: `ray-slurm status --watch`."""
    from ray_slurm_provider.cli.status import watch

    n = iter(range(10))
    slept: list[float] = []
    out = _Out(tty)
    watch(lambda: [f"table {next(n)}"], out, 2.0, sleep=slept.append, rounds=3)  # type: ignore
    assert slept == [2.0, 2.0] and "table 2" in out.text
    assert (out.text.count("\x1b[2J") == 3) is tty
    assert (out.text.count("\n# ") + out.text.startswith("# ") == 3) is not tty


def test_a_cancel_after_slurm_ended_the_job_is_not_who_ended_it(tmp_path: Path) -> None:
    """A user scancels a worker; Ray then terminates its dead node. The provider records no
    cancel for a job it no longer lists, and one sent after Slurm's end (the job still
    listed a moment) does not count; a preemption or time limit is Slurm's whatever follows."""
    p, c, fake, _, w = _one_worker(tmp_path)
    fake.finish(w, "CANCELLED")  # the user's scancel
    p.non_terminated_nodes({})
    p.terminate_nodes([w])  # Ray's terminate call for the dead node
    h = History(c.cdir.root)
    assert h.read(h.current() or "").jobs[w].by == ""
    from ray_slurm_provider.cli.report import end_of
    from ray_slurm_provider.provider.history import JobRecord

    rec = JobRecord("1", by="autoscaler", cancelled=T0 + 10, slurm_end=T0 + 5,
                    state="CANCELLED", ended=T0 + 12)
    assert end_of(rec) == "scancel"
    rec.slurm_end = T0 + 10.5  # ended by our cancel
    assert end_of(rec) == "autoscaler"
    rec.state = "PREEMPTED"
    assert end_of(rec) == "preemption"


def test_a_job_that_failed_as_we_stopped_it_was_ended_by_us() -> None:
    """Slurm says FAILED for a worker whose agent ended the job with an error code while
    `ray down` or the autoscaler stopped it (seen on 25.11 with accounting): the stop ended
    it. A failure before our cancel is the job's own."""
    from ray_slurm_provider.cli.report import end_of
    from ray_slurm_provider.provider.history import JobRecord

    rec = JobRecord("1", by="ray down", cancelled=T0 + 10, slurm_end=T0 + 10.3,
                    state="FAILED", ended=T0 + 12)
    assert end_of(rec) == "ray down"
    rec.state = "OUT_OF_MEMORY"
    assert end_of(rec) == "ray down"
    rec.slurm_end = T0 + 5  # it failed first; the cancel found it ending
    assert end_of(rec) == "failure"
    rec.by = ""
    rec.slurm_end = T0 + 10.3
    assert end_of(rec) == "failure"


def test_a_slow_cancel_is_stamped_when_it_was_sent(tmp_path: Path) -> None:
    """On a throttled controller scancel returns seconds after Slurm took it (and stamped
    the job's end): the records keep the time the cancel was sent, so the report still says
    the autoscaler ended the job, not someone's scancel."""
    from ray_slurm_provider.cli.report import end_of
    from ray_slurm_provider.provider.history import History

    p, c, fake, clock, w = _one_worker(tmp_path)
    taken = fake.cancel

    def throttled(job_ids: Any) -> None:
        taken(job_ids)  # Slurm ends the job now...
        clock.advance(5.0)  # ...and scancel returns 5 s later

    fake.cancel = throttled  # type: ignore[method-assign]
    p.terminate_node(w)
    rec = History(c.cdir.root).read(History(c.cdir.root).current() or "").jobs[w]
    rec.state, rec.slurm_end = "CANCELLED", T0  # what sacct says
    assert rec.cancelled == T0 and end_of(rec) == "autoscaler"


def test_a_clean_end_just_before_our_cancel_was_our_stop() -> None:
    """At `ray down` the head's Ray stops first; each worker's agent sees its head gone and
    ends its job cleanly (COMPLETED) seconds before the provider's cancel reaches it."""
    from ray_slurm_provider.cli.report import end_of
    from ray_slurm_provider.provider.history import JobRecord

    rec = JobRecord("1", by="ray down", cancelled=T0 + 10, slurm_end=T0 + 4,
                    state="COMPLETED", ended=T0 + 12)
    assert end_of(rec) == "ray down"
    rec.slurm_end = T0 - 60  # long before: it ended by itself (a drain, a one-shot's end)
    assert end_of(rec) == "completed"
    rec.state, rec.slurm_end = "CANCELLED", T0 + 4  # a user's scancel just before ours
    assert end_of(rec) == "scancel"


def test_workers_that_ended_as_ray_down_stopped_their_head_were_ended_by_it() -> None:
    """`ray down` stops the head's Ray first; each worker's agent then ends its job within
    seconds, often before the provider lists it for the cancel (no cancel of ours is
    recorded). A clean end in the moments before `ray down`'s first cancel is `ray down`'s."""
    from ray_slurm_provider.cli.report import down_at, end_of
    from ray_slurm_provider.provider.history import JobRecord, RunRecords

    head = JobRecord("1", kind="head", by="ray down", cancelled=T0 + 20, slurm_end=T0 + 21,
                     state="CANCELLED", ended=T0 + 22)
    worker = JobRecord("2", state="COMPLETED", slurm_end=T0 + 12, ended=T0 + 13)
    drained = JobRecord("3", state="COMPLETED", slurm_end=T0 - 600, ended=T0 - 599)
    recs = RunRecords("r", jobs={r.job: r for r in (head, worker, drained)})
    at = down_at(recs)
    assert at == T0 + 20
    assert [end_of(r, at) for r in (head, worker, drained)] == [
        "ray down", "ray down", "completed"]
    assert end_of(worker) == "completed"  # without `ray down` in the run
