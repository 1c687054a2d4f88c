"""Job arrays (bench P5): N nodes of one type in ONE sbatch, each task its own Ray node.

Parsers against real Slurm 22.05 output (tests/fixtures/slurm-22.05/*array*), the CLI client
with `proc.run` replaced, and the provider, agent and runner against FakeSlurm.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from ray_slurm_provider.nodespec import NodeSpec, node_id
from ray_slurm_provider.provider.runner import SrunCommandRunner
from ray_slurm_provider.slurm import parse
from ray_slurm_provider.slurm.cli import CliSlurmClient
from ray_slurm_provider.slurm.client import ArraySubmitter, ClusterInfo, Job
from ray_slurm_provider.slurm.script import JobSpec, render
from ray_slurm_provider.state import AgentInfo
from tests.fakes import FakeSlurm
from tests.unit.test_provider import HEAD_TAGS, WORKER_TAGS, make
from tests.unit.test_slurm_cli import FakeRun, recorded

# --- parsing real output -------------------------------------------------------------------


def test_parse_recorded_array_every_task_on_its_own_line() -> None:
    (array_id,) = recorded("sbatch_array")[0].split()
    jobs = {j.job_id: j for j in parse.parse_squeue(recorded("squeue_array")[0])}
    assert set(jobs) == {f"{array_id}_{i}" for i in range(4)}
    running = [j for j in jobs.values() if j.running]
    pending = [j for j in jobs.values() if j.state == "PENDING"]
    assert len(running) == 2 and len(pending) == 2
    # Pending tasks share the array's numeric id; running ones got their own.
    assert {j.slurm_job_id for j in pending} == {array_id}
    assert len({j.slurm_job_id for j in running} | {array_id}) == 3
    assert all(j.numeric_id.isdigit() for j in jobs.values())
    assert {j.comment for j in jobs.values()} == {'{"cluster": "c1"}'}


def test_parse_recorded_array_after_cancelling_one_running_and_one_pending_task() -> None:
    (array_id,) = recorded("sbatch_array")[0].split()
    assert recorded("scancel_array_tasks") == ("", "", 0)
    jobs = parse.parse_squeue(recorded("squeue_array_after_cancel")[0])
    assert sorted(j.job_id for j in jobs) == [f"{array_id}_1", f"{array_id}_2"]
    # The last task Slurm splits off keeps the array's own id.
    assert {j.slurm_job_id for j in jobs if j.job_id == f"{array_id}_2"} == {array_id}


def test_without_array_flag_squeue_folds_pending_tasks() -> None:
    """Why the client passes --array: otherwise pending tasks are one `A_[2-3]` line."""
    ids = [j.job_id for j in parse.parse_squeue(recorded("squeue_array_folded")[0])]
    assert len(ids) == 3 and any("[" in i for i in ids)


def test_plain_job_numeric_id_is_its_job_id() -> None:
    for j in parse.parse_squeue(recorded("squeue_jobs")[0]):
        assert j.slurm_job_id == j.job_id == j.numeric_id


# --- the CLI client ------------------------------------------------------------------------


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeRun:
    from ray_slurm_provider import proc

    f = FakeRun()
    monkeypatch.setattr(proc, "run", f)
    return f


def test_cli_submit_array_is_one_sbatch(fake: FakeRun) -> None:
    fake.set("sbatch", "sbatch_array")
    (array_id,) = recorded("sbatch_array")[0].split()
    client = CliSlurmClient(env={"PATH": "/bin"})
    assert isinstance(client, ArraySubmitter)
    spec = JobSpec("ray-x", ["true"])
    ids = client.submit_array(spec, 3, comment="c")
    assert ids == [f"{array_id}_0", f"{array_id}_1", f"{array_id}_2"]
    (call,) = fake.calls
    assert call.argv == ["sbatch", "--parsable", "--array=0-2", "--comment=c"]
    assert call.input == render(spec)  # named by its own #SBATCH --job-name=ray-x
    with pytest.raises(ValueError):
        client.submit_array(spec, 0)


def test_cli_cancel_takes_task_ids(fake: FakeRun) -> None:
    fake.set("scancel", "scancel_array_tasks")
    CliSlurmClient().cancel(["7_3", "7_0"])
    assert fake.calls[0].argv == ["scancel", "7_0", "7_3"]


# --- FakeSlurm models arrays as Slurm does ---------------------------------------------------


def test_fake_slurm_arrays() -> None:
    f = FakeSlurm()
    ids = f.submit_array(JobSpec("ray-c", ["true"]), 3, comment="x")
    assert ids == ["1000_0", "1000_1", "1000_2"] and f.calls["submit_array"] == 1
    assert {j.numeric_id for j in f.list_jobs("ray-c")} == {"1000"}
    f.start("1000_1")
    assert f.job("1000_1").numeric_id not in ("1000", "")
    f.cancel(["1000_0"])
    assert [j.job_id for j in f.list_jobs("ray-c")] == ["1000_1", "1000_2"]
    f.cancel(["1000"])  # the whole array
    assert f.list_jobs("ray-c") == []


# --- the provider --------------------------------------------------------------------------


def test_burst_is_one_array_submit_and_every_task_a_node(tmp_path: Path) -> None:
    p, f = make(tmp_path)
    created = list(p.create_node({}, WORKER_TAGS, 4))
    assert f.calls["submit_array"] == 1 and f.calls["submit"] == 0
    assert created == [f"1000_{i}" for i in range(4)]
    # Listed at once, before Slurm is asked; then from squeue, task by task.
    assert p.non_terminated_nodes({}) == created
    assert all(p.node_tags(i) == WORKER_TAGS for i in created)
    f.start("1000_2", "n2")
    assert sorted(p.non_terminated_nodes({})) == created
    assert p.is_running("1000_2") and p.internal_ip("1000_2") == "127.0.0.3"
    assert not p.is_running("1000_0")
    # Every task logs to its own file, named by its node id.
    (spec,) = f.submitted
    script = render(spec)
    assert "/c1/logs/%A_%a.out" in script and "%j" not in script
    p.terminate_node("1000_2")
    assert f.cancelled == [["1000_2"]]
    assert sorted(p.non_terminated_nodes({})) == ["1000_0", "1000_1", "1000_3"]


def test_single_node_is_a_plain_job(tmp_path: Path) -> None:
    p, f = make(tmp_path)
    (job_id,) = p.create_node({}, WORKER_TAGS, 1)
    assert job_id == "1000" and f.calls["submit"] == 1 and f.calls["submit_array"] == 0
    assert "%j.out" in render(f.submitted[0])


class NoArrays:
    """A back end without arrays (REST, pyslurm): FakeSlurm minus submit_array."""

    def __init__(self) -> None:
        self.fake = FakeSlurm()

    def submit(self, spec: JobSpec, *, comment: str = "") -> str:
        return self.fake.submit(spec, comment=comment)

    def list_jobs(self, job_name: str) -> list[Job]:
        return self.fake.list_jobs(job_name)

    def cancel(self, job_ids: Any) -> None:
        self.fake.cancel(job_ids)

    def cluster_info(self) -> ClusterInfo:
        return self.fake.cluster_info()

    def node_addresses(self) -> Any:
        return self.fake.node_addresses()


def test_back_end_without_arrays_submits_one_job_per_node(tmp_path: Path) -> None:
    p, _ = make(tmp_path)
    client = NoArrays()
    p._client = client  # type: ignore[assignment]
    created = list(p.create_node({}, WORKER_TAGS, 3))
    assert created == ["1000", "1001", "1002"] and client.fake.calls["submit"] == 3


def test_failed_array_submit_marks_every_task_a_stray(tmp_path: Path) -> None:
    """A lost answer to the one sbatch, and the array not listed: it is submitted again, and
    the first array is cancelled as a whole when it shows up."""
    from ray_slurm_provider.slurm.client import TransientSlurmError

    p, f = make(tmp_path)
    p._sleep = lambda _s: None
    f.fail_next("submit_array", TransientSlurmError("sbatch: timed out"))
    created = p.create_node({}, WORKER_TAGS, 2)
    assert len(created) == 2
    # It was queued after all (the fake raised first, so queue one with that nonce by hand).
    nonce = next(iter(p.strays._failed))
    from ray_slurm_provider.jobs import encode_tags
    from ray_slurm_provider.provider.submit import SUBMIT_TAG

    ids = f.submit_array(JobSpec("ray-c1", ["true"]), 2,
                         comment=encode_tags({**WORKER_TAGS, SUBMIT_TAG: nonce}))
    assert sorted(p.non_terminated_nodes({})) == sorted(created)
    assert f.cancelled == [sorted(ids)]


def test_a_timed_out_array_that_queued_is_adopted_whole(tmp_path: Path) -> None:
    from ray_slurm_provider.slurm.client import TransientSlurmError

    p, f = make(tmp_path)
    real = f.submit_array
    calls: list[str] = []

    def queued_then_timed_out(spec: JobSpec, count: int, *, comment: str = "") -> list[str]:
        calls.append(comment)
        real(spec, count, comment=comment)
        raise TransientSlurmError("sbatch: no answer within 30s", "", "sbatch")

    f.submit_array = queued_then_timed_out  # type: ignore[method-assign]
    created = p.create_node({}, WORKER_TAGS, 3)
    assert len(calls) == 1 and sorted(created) == sorted(f.jobs) and len(created) == 3
    assert sorted(p.non_terminated_nodes({})) == sorted(created) and f.cancelled == []


# --- agent and runner agree on the node id -------------------------------------------------


def test_agent_node_id_from_slurm_environment(tmp_path: Path) -> None:
    from ray_slurm_provider.agent.worker import WorkerAgent

    assert node_id({"SLURM_JOB_ID": "12"}) == "12"
    env = {"SLURM_JOB_ID": "15", "SLURM_ARRAY_JOB_ID": "11", "SLURM_ARRAY_TASK_ID": "3"}
    assert node_id(env) == "11_3"
    spec = NodeSpec(kind="worker", node_type="w", cluster_name="c1", state_dir=str(tmp_path),
                    ports_base=25000, temp_dir_root=str(tmp_path / "tmp"))
    a = WorkerAgent(spec, {**env, "HOME": str(tmp_path)})
    assert a.ndir == a.cdir.node("11_3")  # what the provider lists
    # numeric, as containers name it
    assert a.job_id == "15" and a.temp_dir.endswith(f"/rsp-{os.getuid()}/15")


def test_runner_sruns_into_the_task_by_its_numeric_id(tmp_path: Path) -> None:
    p, f = make(tmp_path)
    p.create_node({}, WORKER_TAGS, 2)
    f.start("1000_1")
    p.non_terminated_nodes({})
    r = SrunCommandRunner(p, "1000_1")
    r.ndir.write_agent(AgentInfo(host="n1", pid=1, kind="worker", job_id="1003"))
    assert "--jobid=1003" in r.srun_argv("true")
    (hid,) = p.create_node({}, HEAD_TAGS, 1)
    assert f"--jobid={hid}" in SrunCommandRunner(p, hid).srun_argv("true")


def test_status_orders_array_tasks_by_array_then_task() -> None:
    from ray_slurm_provider.cli.status import _order

    ids = ["12_10", "9", "12_2", "100", "12_0"]
    jobs = [Job(job_id=i, name="ray-c", state="RUNNING") for i in ids]
    assert [j.job_id for j in sorted(jobs, key=_order)] == ["9", "12_0", "12_2", "12_10", "100"]


def test_a_site_that_refuses_arrays_gets_single_jobs_without_a_back_off(tmp_path: Path) -> None:
    """Issue 14.11: a refused array held the type back for minutes; the provider now falls
    back to one job per node, at once and for the rest of its life."""
    from ray_slurm_provider.provider.provider import SlurmNodeProvider
    from ray_slurm_provider.slurm.client import PermanentSlurmError
    from tests.unit.test_provider import WORKER_TAGS

    class NoArrays(FakeSlurm):
        def submit_array(self, spec: Any, count: int, *, comment: str = "") -> list[str]:
            self.calls["submit_array"] += 1
            raise PermanentSlurmError(
                "sbatch failed", "sbatch: error: Batch job submission failed: Invalid job "
                "array specification", "sbatch")

    p = SlurmNodeProvider({"type": "external", "state_dir": str(tmp_path / "state"),
                           "python": "/py"}, "c1")
    f = NoArrays()
    p._client = f
    first = p.create_node_with_resources_and_labels({}, WORKER_TAGS, 3, {"CPU": 1}, {})
    second = p.create_node_with_resources_and_labels({}, WORKER_TAGS, 2, {"CPU": 1}, {})
    assert len(first) == 3 and len(second) == 2 and all("_" not in j for j in [*first, *second])
    # Asked until an array of 2 was refused too (3, then 2); single jobs from then on.
    assert f.calls["submit_array"] == 2
    # A refused array is no launch error: the type is never held back, and `ray-slurm
    # status` has no error to show (errors.json is written only for one).
    assert p.guard.arrays_refused and p.guard.error("cpu_worker") is None
    assert not (p.cluster_dir.root / "errors.json").exists()


def test_arrays_over_the_sites_max_array_size_are_split_not_given_up(tmp_path: Path) -> None:
    """Issue 18 (P5): the head hands over whole launches (up to 1000 nodes); a site whose
    MaxArraySize is smaller refuses such an array. The provider halves the array until Slurm
    takes it and keeps that size, instead of falling back to one job per node."""
    from ray_slurm_provider.provider.provider import SlurmNodeProvider
    from ray_slurm_provider.slurm.client import PermanentSlurmError
    from tests.unit.test_provider import WORKER_TAGS

    class MaxArraySize(FakeSlurm):
        def submit_array(self, spec: Any, count: int, *, comment: str = "") -> list[str]:
            if count > 100:
                self.calls["refused_array"] += 1
                raise PermanentSlurmError(
                    "sbatch failed", "sbatch: error: Batch job submission failed: Invalid job "
                    "array specification", "sbatch")
            return super().submit_array(spec, count, comment=comment)

    p = SlurmNodeProvider({"type": "external", "state_dir": str(tmp_path / "state"),
                           "python": "/py"}, "c1")
    f = MaxArraySize()
    p._client = f
    first = p.create_node_with_resources_and_labels({}, WORKER_TAGS, 256, {"CPU": 1}, {})
    assert len(first) == 256 and len(set(first)) == 256 and all("_" in j for j in first)
    assert f.calls["refused_array"] == 2 and f.calls["submit_array"] == 4  # 256, 128; 4 x 64
    second = p.create_node_with_resources_and_labels({}, WORKER_TAGS, 100, {"CPU": 1}, {})
    assert len(second) == 100 and f.calls["refused_array"] == 2  # 64 + 36: no refusal again
    assert f.calls["submit"] == 0 and not p.guard.arrays_refused
    assert set(p.non_terminated_nodes({})) == {*first, *second}


#: What sbatch 22.05 says (stderr) when a QOS's MaxSubmitJobsPerUser would be passed
#: (recorded on the accounting sandbox: tests/fixtures/slurm-22.05/sbatch_qos_limit*).
QOS_LIMIT = ("sbatch: error: QOSMaxSubmitJobPerUserLimit\nsbatch: error: Batch job submission "
             "failed: Job violates accounting/QOS policy (job submit limit, user's size and/or "
             "time limits)")


class JobLimit(FakeSlurm):
    """Slurm under a per-user job-count limit: every array task counts, so an array that
    would pass the limit is refused whole."""

    limit = 2

    def _queue(self, spec: JobSpec, comment: str, tasks: int | None) -> list[str]:
        from ray_slurm_provider.slurm.client import classify

        active = sum(1 for fj in self.jobs.values() if fj.job.active)
        if active + (tasks or 1) > self.limit:
            raise classify(QOS_LIMIT, "sbatch")
        return super()._queue(spec, comment, tasks)


def test_a_job_count_limit_queues_what_it_allows_and_says_why_not_the_rest(
        tmp_path: Path) -> None:
    """Issue 15: a demand for 5 under a QOS of 2 jobs per user. The array of 5 is refused
    whole; single jobs are then submitted until Slurm refuses one: 2 nodes queued, the launch
    fails with Slurm's reason, and the type is held back (no sbatch on every tick)."""
    from ray.autoscaler.node_launch_exception import NodeLaunchException

    p, _ = make(tmp_path)
    f = JobLimit()
    p._client = f
    with pytest.raises(NodeLaunchException) as ei:
        p.create_node_with_resources_and_labels({}, WORKER_TAGS, 5, {"CPU": 1}, {})
    msg = ei.value.description
    assert "Slurm queued 2 of 5 nodes of type cpu_worker" in msg, msg
    assert "QOSMaxSubmitJobPerUserLimit" in msg and ei.value.category == "SlurmRejected"
    assert f.calls["submit_array"] == 1 and f.calls["submit"] == 3
    assert sorted(p.non_terminated_nodes({})) == ["1000", "1001"]
    with pytest.raises(NodeLaunchException, match="held back"):
        p.create_node_with_resources_and_labels({}, WORKER_TAGS, 3, {"CPU": 1}, {})
    assert f.calls["submit_array"] == 1 and f.calls["submit"] == 3  # Slurm not asked
    errors = json.loads((p.cluster_dir.root / "errors.json").read_text())
    assert "QOSMaxSubmitJobPerUserLimit" in errors["cpu_worker"]["message"]
    assert not p.guard.arrays_refused  # a limit says nothing about arrays


def test_the_nodes_a_limit_let_through_are_recorded_and_logged(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The 2 jobs queued before Slurm refused the rest were neither logged as submitted nor
    recorded as created (so a listing in flight could drop them); the launch still fails."""
    from ray.autoscaler.node_launch_exception import NodeLaunchException

    p, _ = make(tmp_path)
    p._client = JobLimit()
    with caplog.at_level("INFO"), pytest.raises(NodeLaunchException):
        p.create_node_with_resources_and_labels({}, WORKER_TAGS, 5, {"CPU": 1}, {})
    assert "Submitted Slurm job(s) 1000, 1001 for workers of node type cpu_worker" in caplog.text
    from ray_slurm_provider.provider.nodes import Phase

    assert {i for i, r in p._nodes.items() if r.phase is Phase.CREATED} == {"1000", "1001"}
    assert set(p._nodes) == {"1000", "1001"}
