"""The CLI back end's parsers on what every Slurm release recorded here really printed
(tests/fixtures/slurm-<release>/, written by tests/fixtures/record.py on the sandbox of that
release: `ray-slurm sandbox up --slurm 24.11`), and the REST client's on what each
slurmrestd answered (slurmrestd-<release>/<version>/, record_rest.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ray_slurm_provider.slurm import parse
from ray_slurm_provider.slurm.client import classify, is_job_gone
from ray_slurm_provider.slurm.rest import parse as rest_parse

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
RELEASES = sorted(p.name.removeprefix("slurm-") for p in FIXTURES.glob("slurm-*"))
REST = sorted(FIXTURES.glob("slurmrestd-[0-9]*/v0.0.*"))  # recorded, not the shapes


def test_every_release_of_the_sandbox_is_recorded() -> None:
    assert {"22.05", "24.11", "26.05"} <= set(RELEASES)
    assert {p.parent.name.removeprefix("slurmrestd-") for p in REST} >= {"22.05", "24.11",
                                                                         "26.05"}


def text(release: str, name: str) -> str:
    return (FIXTURES / f"slurm-{release}" / f"{name}.txt").read_text()


def stderr(release: str, name: str) -> str:
    path = FIXTURES / f"slurm-{release}" / f"{name}.stderr.txt"
    return path.read_text() if path.exists() else ""


@pytest.mark.parametrize("release", RELEASES)
def test_squeue_listings(release: str) -> None:
    jobs = {j.reason or j.state: j for j in parse.parse_squeue(text(release, "squeue_jobs"))}
    assert {"JobHeldUser", "BeginTime", "Resources", "RUNNING", "COMPLETING"} <= set(jobs)
    assert jobs["JobHeldUser"].comment == '{"cluster": "c1", "note": "a;b c=d"}'
    run = jobs["RUNNING"]
    assert (run.nodes, run.batch_host, run.partition, run.time_limit_s) == ("n2", "n2", "gpu",
                                                                            600)
    assert run.end_time.startswith("20") and not jobs["COMPLETING"].active
    assert parse.parse_squeue(text(release, "squeue_empty")) == []
    tasks = parse.parse_squeue(text(release, "squeue_array"))
    assert len(tasks) == 4 and all("_" in t.job_id for t in tasks)
    assert sum(t.running for t in tasks) == 2


@pytest.mark.parametrize("release", RELEASES)
def test_scontrol_and_version(release: str) -> None:
    nodes = parse.parse_scontrol_records(text(release, "scontrol_show_node"), "NodeName")
    assert [n["NodeAddr"] for n in nodes] == ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
    assert all(parse.parse_gres_gpus(n["Gres"]) == 2 for n in nodes)
    parts = parse.parse_scontrol_records(text(release, "scontrol_show_partition"),
                                         "PartitionName")
    assert [(p["PartitionName"], p["Default"]) for p in parts] == [("cpu", "YES"),
                                                                   ("gpu", "NO")]
    assert parse.parse_version(text(release, "sinfo_version")).startswith(release + ".")
    assert parse.parse_sbatch(text(release, "sbatch_array")).isdigit()


@pytest.mark.parametrize("release", RELEASES)
def test_errors_in_slurms_words(release: str) -> None:
    err = classify(stderr(release, "sbatch_bad_partition"), "sbatch")
    assert "invalid partition" in err.slurm_message.lower() and type(err).__name__ == \
        "PermanentSlurmError"
    down = classify(stderr(release, "squeue_ctld_down"), "squeue")
    assert type(down).__name__ == "TransientSlurmError", down.slurm_message
    verbose = stderr(release, "scancel_gone_verbose") + text(release, "scancel_gone_verbose")
    assert is_job_gone(verbose), verbose


def rest(path: Path, name: str) -> object:
    return json.loads((path / f"{name}.json").read_text())["body"]


@pytest.mark.parametrize("path", REST, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_rest_answers(path: Path) -> None:
    body = rest(path, "jobs")
    assert isinstance(body, dict)
    jobs = [rest_parse.job(j, now=0.0) for j in body["jobs"]]
    mine = [j for j in jobs if j.name == "rsp-record-rest"]
    assert {j.state for j in mine} >= {"PENDING", "RUNNING"}, [j.state for j in mine]
    nodes = rest(path, "nodes")
    assert isinstance(nodes, dict)
    addrs = sorted(rest_parse.node(n)[0].addr for n in nodes["nodes"])
    assert addrs == ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
    assert rest_parse.version(body).startswith(path.parent.name.removeprefix("slurmrestd-"))
