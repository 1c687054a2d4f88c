"""Workers that leave the queue before Ray came up on them (issue 26 item 8): only an end the
job caused itself counts against its node type, it is judged once the end is final, and where
the end cannot be known, by the job's own log.

The provider runs on FakeSlurm with an injected clock (nothing sleeps). How a job ended is
what Slurm 22.05 printed on the accounting sandbox (tests/fixtures/record_accounting.py
--ends), read by the CLI and REST back ends' own code; the agent's lines are the agent's own.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from ray_slurm_provider import proc
from ray_slurm_provider.agent.worker import WorkerAgent
from ray_slurm_provider.provider import ends
from ray_slurm_provider.provider.guard import LaunchGuard
from ray_slurm_provider.provider.provider import SlurmNodeProvider
from ray_slurm_provider.provider.submit import Strays
from ray_slurm_provider.slurm.cli import CliSlurmClient
from ray_slurm_provider.slurm.client import EndedJob, PermanentSlurmError
from ray_slurm_provider.slurm.rest import parse as rest_parse
from ray_slurm_provider.slurm.sacct import NoAccounting, controller_end, parse_sacct
from tests.fakes import FakeSlurm
from tests.rest_fakes import V38, FakeRest, client, recorded
from tests.unit.test_agent import FakeChild, agent
from tests.unit.test_provider import WORKER_TAGS
from tests.unit.test_slurm_cli import FIX, FakeRun

#: What scontrol printed for a job in each state (slurm-22.05/).
SCONTROL = {"COMPLETING": "scontrol_show_job_completing",
            "PREEMPTED": "scontrol_show_job_preempted_late",
            "CANCELLED": "scontrol_show_job_cancelled",
            "FAILED": "scontrol_show_job_failed"}
#: scontrol about a job slurmctld no longer keeps (MinJobAge passed).
FORGOTTEN = ("", "slurm_load_jobs error: Invalid job id specified\n", 1)


class Recorded(FakeSlurm):
    """FakeSlurm whose `ended_job` is the CLI back end's own, over what scontrol printed for a
    job in the state this fake holds it in, and sacct on a cluster without accounting."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: list[str] = []
        self.forgotten: set[str] = set()  # jobs slurmctld no longer keeps

    def ended_job(self, job_id: str) -> EndedJob | None:
        self.asked.append(job_id)
        run = FakeRun()
        state = self.jobs[job_id].job.state
        run.set("scontrol show job", FORGOTTEN if job_id in self.forgotten else SCONTROL[state])
        run.set("sacct", "sacct_disabled")
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(proc, "run", run)
            return CliSlurmClient().ended_job(job_id)


class Ends(FakeSlurm):
    """FakeSlurm that says how a job ended in Slurm's state names (a final state only)."""

    def ended_job(self, job_id: str) -> EndedJob | None:
        state = self.jobs[job_id].job.state
        return None if state == "COMPLETING" else EndedJob(job_id, state, "0:0")


def make(tmp_path: Path, slurm: FakeSlurm) -> SlurmNodeProvider:
    p = SlurmNodeProvider({"type": "external", "state_dir": str(tmp_path / "state"),
                           "python": "/opt/venv/bin/python"}, "c1")
    p._client = slurm
    p._clock = slurm.clock.now
    p.guard = LaunchGuard(p.cluster_dir.root / "errors.json", slurm.clock)
    p.strays = Strays(slurm.clock)
    return p


def setting_up(p: SlurmNodeProvider, f: FakeSlurm, count: int, log: str = "") -> list[str]:
    """`count` workers running their setup (Ray not up), each with `log` as its output."""
    jobs = list(p.create_node({}, WORKER_TAGS, count))
    for job in jobs:
        f.start(job)
        path = p.cluster_dir.log(job)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(log)
    p.non_terminated_nodes({})
    return jobs


def tick(p: SlurmNodeProvider, f: FakeSlurm, seconds: float = 5.0) -> None:
    f.clock.advance(seconds)
    p.non_terminated_nodes({})


def test_two_workers_preempted_in_setup_leave_their_type_free(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Preempted together while they set up: COMPLETING for KillWait (their setup ignores
    TERM), then PREEMPTED. Neither counts; the type keeps scaling."""
    caplog.set_level(logging.INFO)
    f = Recorded()
    p = make(tmp_path, f)
    a, b = setting_up(p, f, 2, "setting up: pip install -r requirements.txt\n")
    for job in (a, b):
        f.set_state(job, "COMPLETING")
    for _ in range(3):  # KillWait: the jobs are listed, COMPLETING
        tick(p, f)
    assert f.asked == []  # nobody asks Slurm about a job it still lists
    for job in (a, b):
        f.finish(job, "PREEMPTED")
    tick(p, f)
    assert sorted(f.asked) == [a, b]  # once each, when the end is final
    tick(p, f)
    assert sorted(f.asked) == [a, b]
    for job in (a, b):  # judged: not held against the type
        assert f"Slurm job {job} of node type cpu_worker ended PREEMPTED" in caplog.text
    assert p.guard.error("cpu_worker") is None
    (c,) = p.create_node({}, WORKER_TAGS, 1)  # not held back
    assert f.jobs[c].job.state == "PENDING"


@pytest.mark.parametrize(("state", "counts"), [
    ("FAILED", True),
    ("OUT_OF_MEMORY", True),
    ("PREEMPTED", False),
    ("CANCELLED", False),
    ("NODE_FAIL", False),
    ("BOOT_FAIL", False),
    ("DEADLINE", False),
    ("TIMEOUT", False),
    ("COMPLETED", False),
])
def test_only_an_end_the_job_caused_counts(tmp_path: Path, state: str, counts: bool) -> None:
    f = Ends()
    p = make(tmp_path, f)
    (job,) = setting_up(p, f, 1, "[ray-slurm 10:00:01] running: pip install torch\n")
    f.finish(job, state)
    tick(p, f)
    err = p.guard.error("cpu_worker")
    assert (err is not None) == counts
    if err is not None:
        assert f"Slurm says {state}" in err.message and "pip install torch" in err.message


def test_recorded_ends_are_read_as_slurm_said_them(tmp_path: Path) -> None:
    """The recorded scontrol answers, through the provider: FAILED counts, in Slurm's words;
    a job an admin cancelled does not."""
    f = Recorded()
    p = make(tmp_path, f)
    failed, cancelled = setting_up(p, f, 2, "[ray-slurm 10:00:01] running: module load x\n")
    f.finish(failed, "FAILED")
    f.finish(cancelled, "CANCELLED")
    tick(p, f)
    err = p.guard.error("cpu_worker")
    assert err is not None and err.failures == 1
    assert f"Slurm job {failed} " in err.message and "Slurm says FAILED (exit 3)" in err.message


# --- where the end cannot be known: the job's own log --------------------------------------------

class TermedWhileStarting(FakeChild):
    """`ray start` still starting when the job's TERM comes; it exits with 1 after it."""

    def __init__(self, a: WorkerAgent) -> None:
        super().__init__([], 1)
        self.a = a
        self.stdout = self.lines()  # type: ignore[assignment]

    def lines(self) -> Iterator[str]:
        yield "Local node IP: 127.0.0.3\n"
        self.a.on_signal(15, None)
        self.a.on_term(15, None)  # what the terminator thread does on the TERM


def agent_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
              capsys: pytest.CaptureFixture[str], how: str) -> str:
    """What the node agent itself printed when its job ended `how`."""
    children: list[FakeChild] = []
    a, _ = agent(tmp_path, monkeypatch, children, attempts=2)
    if how == "gave up":
        children += [FakeChild([], 1), FakeChild([], 1)]
    elif how == "told to stop":
        a.terminating = True  # the TERM came before `ray start`
    else:
        children.append(TermedWhileStarting(a))
    a.main()
    return capsys.readouterr().out


def forgotten_end_counts(tmp_path: Path, log: str) -> bool:
    """Whether a worker that died before Ray counts, once slurmctld forgot it on a cluster
    without accounting and only its log can tell."""
    f = Recorded()
    p = make(tmp_path / "p", f)
    (job,) = setting_up(p, f, 1, log)
    f.finish(job, "CANCELLED")
    f.forgotten.add(job)
    tick(p, f)
    return p.guard.error("cpu_worker") is not None


def test_without_an_end_an_agent_that_gave_up_counts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A crash loop is held back without accounting too."""
    log = agent_log(tmp_path, monkeypatch, capsys, "gave up")
    assert "giving up: Ray never started" in log
    assert forgotten_end_counts(tmp_path, log)
    log = "[ray-slurm 10:00:01] ERROR: /tmp/rsp-0 is not yours; the job ends\n"
    assert forgotten_end_counts(tmp_path / "error", log)


@pytest.mark.parametrize("how", ["told to stop", "TERM in ray start"])
def test_without_an_end_an_agent_told_to_stop_does_not_count(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        how: str) -> None:
    log = agent_log(tmp_path, monkeypatch, capsys, how)
    assert "the job ends" in log
    assert not forgotten_end_counts(tmp_path, log)


@pytest.mark.parametrize("name", ["log_preempted_in_setup", "log_preempted_stubborn",
                                  "log_cancelled_in_setup", "log_failed_in_setup"])
def test_without_an_end_a_setup_that_never_reached_the_agent_does_not_count(
        tmp_path: Path, name: str) -> None:
    """The recorded logs of jobs ended in their setup (before the agent ran): slurmstepd's
    line when Slurm took the job away; nothing at all when the setup failed."""
    log = (FIX / f"{name}.txt").read_text()
    assert log.startswith("setting up")
    assert not forgotten_end_counts(tmp_path, log)


def test_without_an_end_slurmstepds_cancel_line_wins(tmp_path: Path) -> None:
    """slurmstepd signals every process of the job: Ray may see the TERM before the agent
    does and exit "on its own". The cancel line slurmstepd wrote says who ended it."""
    taken = (FIX / "log_preempted_in_setup.txt").read_text().splitlines()[-1]
    assert "CANCELLED AT" in taken and "DUE TO PREEMPTION" in taken
    ray_failed = "[ray-slurm 10:00:05] Ray exited with code 1; the job ends\n"
    assert forgotten_end_counts(tmp_path / "alone", ray_failed)
    assert not forgotten_end_counts(tmp_path, f"{ray_failed}{taken}\n")


def test_a_job_stuck_completing_is_judged_by_its_log_at_last(tmp_path: Path) -> None:
    """A node that never finishes the job's end (stuck COMPLETING): no question to Slurm
    meanwhile, and in the end the log decides."""
    f = Recorded()
    p = make(tmp_path, f)
    (job,) = setting_up(p, f, 1, "[ray-slurm 10:00:09] giving up: Ray never started on "
                                 "this node; ending the job so the autoscaler can replace it\n")
    f.set_state(job, "COMPLETING")
    tick(p, f, 60)
    assert p.guard.error("cpu_worker") is None
    tick(p, f, 3600)
    err = p.guard.error("cpu_worker")
    assert err is not None and "giving up: Ray never started" in err.message
    assert f.asked == []


# --- the back ends ----------------------------------------------------------------------------

def test_the_cli_back_end_says_nothing_final_while_a_job_is_completing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 26 item 19: the COMPLETING window, as scontrol printed it."""
    run = FakeRun()
    run.set("scontrol show job", "scontrol_show_job_completing", "scontrol_show_job_preempted_late")
    run.set("sacct", "sacct_completing")
    monkeypatch.setattr(proc, "run", run)
    assert CliSlurmClient().ended_job("7") is None
    end = CliSlurmClient().ended_job("7")
    assert end is not None and end.state == "PREEMPTED"
    assert [c.argv[0] for c in run.calls] == ["scontrol", "scontrol"]  # sacct not asked



def test_a_stubborn_preempted_job_is_not_final_until_it_leaves_and_sacct_names_its_end(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A preempted job whose setup ignores TERM stays COMPLETING for KillWait: scontrol has no
    final end for it, while sacct already names each taken-away job's end (recorded together:
    the stubborn one, a plain preemption, an admin's scancel, a setup that failed)."""
    assert controller_end((FIX / "scontrol_show_job_still_completing.txt").read_text()) is None
    ended = {e.job_id: e.state for e in parse_sacct((FIX / "sacct_taken_away.txt").read_text())}
    assert sorted(ended.values()) == ["CANCELLED", "FAILED", "PREEMPTED", "PREEMPTED"]
    assert [s for s in ended.values() if s in ends.ITS_OWN] == ["FAILED"]

def rest_job_id(name: str) -> str:
    """The id a recorded GET job/<id> asked about (an array task's: <array>_<task>; for one
    task slurmrestd 22.05 answers with the whole array's, that task first)."""
    first = json.loads((V38 / f"{name}.json").read_text())["body"]["jobs"][0]
    array = first.get("array_job_id")
    return f"{array}_{first['array_task_id']}" if array else str(first["job_id"])


def test_the_rest_back_end_says_how_a_job_ended_as_the_cli_does(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """slurmrestd 22.05's answers to GET job/<id> (recorded): nothing final while COMPLETING,
    the end in sacct's terms after; a job it forgot is asked of accounting."""
    server = FakeRest("v0.0.38")
    server.set("GET ping", recorded(V38, "ping"))
    stubborn = rest_job_id("job_completing")
    assert rest_job_id("job_preempted") == stubborn
    server.set(f"GET job/{stubborn}", recorded(V38, "job_completing"),
               recorded(V38, "job_preempted"))
    for name in ("job_failed", "job_cancelled", "job_array_task"):
        server.set(f"GET job/{rest_job_id(name)}", recorded(V38, name))
    server.set("GET job/999999", recorded(V38, "job_unknown"))
    rest = client(server)
    assert rest.ended_job(stubborn) is None  # COMPLETING: KillWait for its setup
    end = rest.ended_job(stubborn)
    assert end is not None and end.state == "PREEMPTED" and end.node == "n3"
    ends = {name: rest.ended_job(rest_job_id(name))
            for name in ("job_failed", "job_cancelled", "job_array_task")}
    assert {k: v.why if v else None for k, v in ends.items()} == {
        "job_failed": "FAILED (exit 3)", "job_cancelled": "CANCELLED (signal 15)",
        "job_array_task": "FAILED (exit 3)"}
    assert ends["job_array_task"] is not None
    assert ends["job_array_task"].job_id == rest_job_id("job_array_task")
    run = FakeRun()
    run.set("sacct", "sacct_disabled")
    monkeypatch.setattr(proc, "run", run)
    with pytest.raises(NoAccounting):
        rest.ended_job("999999")  # slurmctld forgot it; no accounting either
    assert [c.argv[0] for c in run.calls] == ["sacct"]


@pytest.mark.parametrize("directory", [FIX.parent / "slurmrestd-24.11" / "v0.0.42",
                                       FIX.parent / "slurmrestd-26.05" / "v0.0.44"])
def test_newer_slurmrestd_ends_read_as_sacct_says_them(directory: Path) -> None:
    """v0.0.40+ give the exit code as a return code and a signal (their recorded job lists:
    the same records GET job/<id> answers with)."""
    records = json.loads((directory / "jobs.json").read_text())["body"]["jobs"]
    whys = {i: rest_parse.ended(records, i, 0.0) for i in ("3", "6", "7_2", "11")}
    assert {i: e.why if e else None for i, e in whys.items()} == {
        "3": "CANCELLED (signal 15)", "6": "FAILED (signal 1)", "7_2": "CANCELLED (signal 15)",
        "11": None}  # 11 is RUNNING


# --- review: errors, non-final ends, requeues -------------------------------------------------

class Raising(Ends):
    """Ends whose `ended_job` raises the queued exception of a job first, one per call."""

    def __init__(self) -> None:
        super().__init__()
        self.raises: dict[str, list[BaseException]] = {}
        self.asked: list[str] = []

    def ended_job(self, job_id: str) -> EndedJob | None:
        self.asked.append(job_id)
        queued = self.raises.get(job_id)
        if queued:
            raise queued.pop(0)
        return super().ended_job(job_id)


def test_an_unexpected_error_keeps_the_job_waiting_and_the_tick_going(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A ValueError about one job neither fails the listing nor loses the other jobs due; the
    job is asked again RETRY_S later."""
    f = Raising()
    p = make(tmp_path, f)
    a, b = setting_up(p, f, 2, "[ray-slurm 10:00:01] running: pip install torch\n")
    f.raises[a] = [ValueError("bad sacct line")]
    f.finish(a, "FAILED")
    f.finish(b, "FAILED")
    tick(p, f)  # must not raise
    err = p.guard.error("cpu_worker")
    assert err is not None and err.failures == 1 and f"Slurm job {b} " in err.message
    assert "bad sacct line" in caplog.text
    tick(p, f, ends.RETRY_S)
    err = p.guard.error("cpu_worker")
    assert err is not None and err.failures == 2
    assert f.asked.count(a) == 2


def failed_while_asking_raises(tmp_path: Path, log: str, errors: list[Exception],
                               ) -> tuple[SlurmNodeProvider, Raising, str]:
    """A worker setting up (its log ends with `log`) that ends FAILED, and asking how it ended
    raises `errors` in turn: after the first tick nothing is counted yet."""
    f = Raising()
    p = make(tmp_path, f)
    (job,) = setting_up(p, f, 1, log)
    f.raises[job] = errors
    f.finish(job, "FAILED")
    tick(p, f)
    assert p.guard.error("cpu_worker") is None
    return p, f, job


def test_an_error_that_persists_ends_in_the_log_deciding(tmp_path: Path) -> None:
    """SETTLE_S bounds the retries of a job whose every question raises."""
    p, f, job = failed_while_asking_raises(
        tmp_path, "[ray-slurm 10:00:09] giving up: Ray never started\n", [KeyError("JobId")] * 100)
    tick(p, f, ends.SETTLE_S)
    err = p.guard.error("cpu_worker")
    assert err is not None and "giving up" in err.message
    assert job not in p.ends._waiting


def test_only_missing_accounting_makes_an_end_unknowable(tmp_path: Path) -> None:
    """Output sacct cannot read (a PermanentSlurmError, not NoAccounting) is "not yet": the job
    is asked again and its final end decides."""
    p, f, _ = failed_while_asking_raises(
        tmp_path, "[ray-slurm 10:00:01] running: pip install torch\n",
        [PermanentSlurmError("sacct: unexpected output", "bad line", "sacct")])
    tick(p, f, ends.RETRY_S)
    err = p.guard.error("cpu_worker")
    assert err is not None and "Slurm says FAILED" in err.message


@pytest.mark.parametrize("state", ["STAGE_OUT", "REVOKED", "UNKNOWN_NEW_STATE"])
def test_only_slurms_final_states_are_an_end(state: str) -> None:
    """A state outside Slurm's final ones (a burst buffer's STAGE_OUT, a federation's REVOKED,
    a name this code does not know) is no end yet, in both back ends' readers."""
    line = (f"JobId=7 JobName=w JobState={state} Reason=None ExitCode=0:0 "
            "EndTime=2026-12-02T00:27:30 NodeList=n3\n")
    assert controller_end(line) is None
    record = {"job_id": 7, "name": "w", "job_state": [state], "exit_code": 0}
    assert rest_parse.ended([record], "7", 0.0) is None
    if state != "UNKNOWN_NEW_STATE":  # a flag Slurm names the job by, over its base state
        record["job_state"] = ["FAILED", state]
        assert rest_parse.ended([record], "7", 0.0) is None


def test_a_requeued_job_is_no_longer_waiting(tmp_path: Path) -> None:
    """COMPLETING, then PENDING and RUNNING again (Slurm requeued it): it did not end, so it
    is not judged, even SETTLE_S later."""
    f = Raising()
    p = make(tmp_path, f)
    (job,) = setting_up(p, f, 1, "[ray-slurm 10:00:09] giving up: Ray never started\n")
    f.set_state(job, "COMPLETING")
    tick(p, f)
    assert job in p.ends._waiting
    f.set_state(job, "PENDING")
    tick(p, f)
    assert job not in p.ends._waiting
    f.set_state(job, "RUNNING")
    tick(p, f, ends.SETTLE_S)
    tick(p, f, ends.SETTLE_S)
    assert p.guard.error("cpu_worker") is None
    assert f.asked == []
