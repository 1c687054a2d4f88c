"""The fakes behave like the real client where tests rely on it."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from ray_slurm_provider.slurm.client import PermanentSlurmError, SlurmClient, TransientSlurmError
from ray_slurm_provider.slurm.script import JobSpec, ScriptError
from tests.fakes import BAD_PARTITION, OUTAGE_MESSAGES, FakeClock, FakeSlurm

FIX = Path(__file__).resolve().parent.parent / "fixtures" / "slurm-22.05"


def job(name: str = "j", **fields: object) -> JobSpec:
    return JobSpec(name, ["true"], **fields)  # type: ignore[arg-type]


def test_clock() -> None:
    clock = FakeClock(100.0)
    clock.advance(2.5)
    assert clock.now() == clock() == 102.5


def test_lifecycle_and_time_left() -> None:
    clock = FakeClock()
    slurm = FakeSlurm(clock)
    assert isinstance(slurm, SlurmClient)
    spec = JobSpec("ray-c-w", ["sleep", "1"], partition="gpu", time="10")
    jid = slurm.submit(spec, comment="tags")
    (job,) = slurm.list_jobs("ray-c-w")
    assert (job.job_id, job.state, job.partition, job.comment) == (jid, "PENDING", "gpu", "tags")
    assert job.time_limit_s == 600 and job.node_addr == ""
    assert slurm.submitted == [spec] and slurm.list_jobs("other") == []
    assert slurm.jobs[jid].spec is spec

    slurm.start(jid, node="n2")
    clock.advance(60)
    (job,) = slurm.list_jobs("ray-c-w")
    assert (job.state, job.batch_host, job.node_addr, job.time_left_s) == (
        "RUNNING",
        "n2",
        "127.0.0.3",
        540,
    )

    slurm.finish(jid, "COMPLETING")
    assert [j.active for j in slurm.list_jobs("ray-c-w")] == [False]
    slurm.finish(jid)
    assert slurm.list_jobs("ray-c-w") == []
    assert slurm.job(jid).state == "COMPLETED"


def test_cancel_is_idempotent_and_counted() -> None:
    slurm = FakeSlurm()
    a = slurm.submit(job("x"))
    slurm.cancel([])
    slurm.cancel([a, "999"])
    slurm.cancel([a])
    assert slurm.job(a).state == "CANCELLED" and slurm.list_jobs("x") == []
    assert slurm.calls["cancel"] == 2 and slurm.cancelled == [["1000", "999"], ["1000"]]


def test_unknown_partition_is_permanent_with_real_words() -> None:
    slurm = FakeSlurm()
    with pytest.raises(PermanentSlurmError) as ei:
        slurm.submit(job(partition="nosuchpartition"))
    assert ei.value.slurm_message.endswith(BAD_PARTITION)
    # Exactly what the CLI client makes of the recorded sbatch answer.
    recorded = (FIX / "sbatch_bad_partition.stderr.txt").read_text().strip()
    assert ei.value.slurm_message == str(ei.value) == recorded
    assert slurm.submit(job()).isdigit()  # default partition cpu
    with pytest.raises(ScriptError, match=r"JobSpec\.time"):  # as every real back end
        slurm.submit(job(time="soon"))


def test_outage_and_fail_next() -> None:
    slurm = FakeSlurm()
    slurm.set_outage(True)
    with pytest.raises(TransientSlurmError) as ei:
        slurm.list_jobs("x")
    recorded = (FIX / "squeue_ctld_down.stderr.txt").read_text().strip()
    assert ei.value.slurm_message == recorded and ei.value.command == "squeue"
    for call in (
        lambda: slurm.list_jobs("x"),
        lambda: slurm.submit(job()),
        lambda: slurm.cancel(["1"]),
        slurm.cluster_info,
        slurm.node_addresses,
    ):
        with pytest.raises(TransientSlurmError, match="Unable to contact slurm controller"):
            call()
    slurm.set_outage(False)
    boom = TransientSlurmError(OUTAGE_MESSAGES["list_jobs"])
    slurm.fail_next("list_jobs", boom)
    with pytest.raises(TransientSlurmError):
        slurm.list_jobs("x")
    assert slurm.list_jobs("x") == []
    assert slurm.calls["list_jobs"] == 4


def test_cluster_info_defaults() -> None:
    info = FakeSlurm().cluster_info()
    cpu, gpu = info.partition(None), info.partition("gpu")
    assert cpu is not None and cpu.name == "cpu" and gpu is not None
    assert gpu.gpus_per_node == 2 and [n.addr for n in gpu.nodes] == [
        "127.0.0.2",
        "127.0.0.3",
        "127.0.0.4",
    ]
    assert FakeSlurm().node_addresses()["n3"] == "127.0.0.4"


def test_configurable_partitions_and_limits() -> None:
    slurm = FakeSlurm(partitions={"short": {"default": True, "max_time_s": 3600, "nodes": ["n1"]}})
    (short,) = slurm.cluster_info().partitions
    assert short.max_time_s == 3600 and [n.name for n in short.nodes] == ["n1"]
    jid = slurm.submit(job("j"))
    assert slurm.job(jid).time_limit_s == 3600


def test_thread_safe_ids() -> None:
    slurm = FakeSlurm()
    ids: list[str] = []
    lock = threading.Lock()

    def work() -> None:
        for _ in range(50):
            jid = slurm.submit(job("t"))
            with lock:
                ids.append(jid)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(ids)) == 200 and len(slurm.list_jobs("t")) == 200
