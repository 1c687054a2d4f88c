"""Pure parsers: recorded Slurm 22.05 output (tests/fixtures/slurm-22.05) plus edge cases."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from ray_slurm_provider.slurm import parse
from ray_slurm_provider.slurm.parse import DELIM
from ray_slurm_provider.units import parse_duration

FIX = Path(__file__).resolve().parent.parent / "fixtures" / "slurm-22.05"


def fixture(name: str) -> str:
    return (FIX / name).read_text()


# --- durations ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("UNLIMITED", None),
        ("INFINITE", None),
        ("NOT_SET", None),
        ("INVALID", None),
        ("NONE", None),
        ("  unlimited ", None),
        ("0", 0),
        ("5", 300),
        ("90", 5400),  # MM
        ("0:00", 0),
        ("4:59", 299),
        ("10:00", 600),  # MM:SS
        ("1:00:00", 3600),
        ("23:59:59", 86399),  # HH:MM:SS
        ("1-0", 86400),
        ("2-03", 2 * 86400 + 3 * 3600),  # D-HH
        ("1-01:30", 86400 + 3600 + 1800),  # D-HH:MM
        ("7-00:00:00", 7 * 86400),
        ("1-02:03:04", 93784),  # D-HH:MM:SS
    ],
)
def test_parse_duration(text: str, seconds: int | None) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "abc", "1:2:3:4", "-5", "1-", "1.5", "1-2-3"])
def test_parse_duration_rejects_garbage(text: str) -> None:
    with pytest.raises(ValueError):
        parse_duration(text)


# --- sbatch ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("out", "job_id"),
    [
        ("123\n", "123"),
        ("123;cluster\n", "123"),
        ("  77 \n", "77"),
    ],
)
def test_parse_sbatch(out: str, job_id: str) -> None:
    assert parse.parse_sbatch(out) == job_id


@pytest.mark.parametrize("out", ["", "\n", "Submitted batch job 12\n", "abc;x"])
def test_parse_sbatch_rejects(out: str) -> None:
    with pytest.raises(ValueError):
        parse.parse_sbatch(out)


def test_parse_sbatch_recorded() -> None:
    assert parse.parse_sbatch(fixture("sbatch_parsable.txt")).isdigit()


# --- GRES -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("gres", "gpus"),
    [
        ("gpu:2", 2),
        ("gpu:a100:8(S:0-1)", 8),
        ("gpu:2,shard:4", 2),
        ("(null)", 0),
        ("", 0),
        ("gpu:a100:4,gpu:v100:2", 6),
        ("gpu", 1),
        ("gpu:a100", 1),
        ("shard:8", 0),
        ("gpu:tesla:2(S:0,1),mps:100", 2),
        ("gres/gpu:3", 3),
    ],
)
def test_parse_gres_gpus(gres: str, gpus: int) -> None:
    assert parse.parse_gres_gpus(gres) == gpus


# --- versions, host lists, key=value lines ---------------------------------------------------


def test_parse_version() -> None:
    assert parse.parse_version("slurm 22.05.8\n") == "22.05.8"
    assert parse.parse_version("slurm-wlm 23.11.4\n") == "23.11.4"
    assert parse.parse_version(fixture("sinfo_version.txt")).startswith("22.05.")
    with pytest.raises(ValueError):
        parse.parse_version("nothing here")


@pytest.mark.parametrize(
    ("text", "names"),
    [
        ("n1", ["n1"]),
        ("n[1-3]", ["n1", "n2", "n3"]),
        ("n[1-2,5],gpu1", ["n1", "n2", "n5", "gpu1"]),
        ("gpu[08-10]", ["gpu08", "gpu09", "gpu10"]),
        ("r[1-2]-n[1-2]", ["r1-n1", "r1-n2", "r2-n1", "r2-n2"]),
        ("", []),
    ],
)
def test_expand_hostlist(text: str, names: list[str]) -> None:
    assert parse.expand_hostlist(text) == names


def test_kv_line_values_with_spaces_and_equals() -> None:
    line = (
        "NodeName=n1 Arch=x86_64 OS=Linux 6.1.0-13-amd64 #1 SMP PREEMPT_DYNAMIC Debian "
        "6.1.55-1 (2023-09-29)  RealMemory=4000 State=IDLE+DRAIN "
        "CfgTRES=cpu=2,mem=4000M,billing=2,gres/gpu=2 "
        "Reason=Kill task failed; see log [root@2026-11-29T10:00:00] Comment=(null)"
    )
    kv = parse.parse_kv_line(line)
    assert kv["NodeName"] == "n1"
    assert kv["OS"] == "Linux 6.1.0-13-amd64 #1 SMP PREEMPT_DYNAMIC Debian 6.1.55-1 (2023-09-29)"
    assert kv["CfgTRES"] == "cpu=2,mem=4000M,billing=2,gres/gpu=2"
    assert kv["Reason"] == "Kill task failed; see log [root@2026-11-29T10:00:00]"
    assert kv["State"] == "IDLE+DRAIN" and kv["Comment"] == "(null)"


# --- squeue ---------------------------------------------------------------------------------


def line(*fields: str) -> str:
    return DELIM.join(fields)


def test_parse_squeue_synthetic_edge_cases() -> None:
    comment = f"a{DELIM}b ; with=delims"
    out = "\n".join(
        [
            line(
                "UNLIMITED",
                "7",
                "ray-x",
                "PENDING",
                "Priority",
                "",
                "n/a",
                "UNLIMITED",
                "2026-11-29T10:00:00",
                "N/A",
                "cpu",
                "7",
                comment,
            ),
            line(
                "2026-11-29T11:00:01",
                "8",
                "ray-x",
                "RUNNING",
                "None",
                "n2",
                "n2",
                "1:00:00",
                "2026-11-29T10:00:00",
                "2026-11-29T10:00:01",
                "gpu",
                "8",
                "(null)",
            ),
            "",
        ]
    )
    pend, run = parse.parse_squeue(out)
    assert (pend.job_id, pend.state, pend.reason, pend.batch_host) == (
        "7",
        "PENDING",
        "Priority",
        "",
    )
    assert pend.time_limit_s is None and pend.start_time == "" and pend.comment == comment
    assert (run.nodes, run.batch_host, run.reason, run.comment) == ("n2", "n2", "", "")
    assert (run.time_limit_s, run.end_time) == (3600, "2026-11-29T11:00:01")
    # The time left is counted from the end time (fixed: the same line every listing).
    end = time.mktime(time.strptime("2026-11-29T11:00:01", "%Y-%m-%dT%H:%M:%S"))
    assert run.left_s(now=end - 3570) == 3570 and run.left_s(now=end + 5) == 0
    assert pend.left_s() is None  # unlimited, and not started


@pytest.mark.parametrize(
    "bad",
    [
        "garbage line",
        line("7", "x", "PENDING"),
        line("", *["x"] * 12),
        line("1:00", "7", "x", "RUNNING", "None", "n1", "n1", "soon", "t", "t", "cpu", "7", ""),
    ],
)
def test_parse_squeue_rejects_bad_lines(bad: str) -> None:
    with pytest.raises(ValueError):
        parse.parse_squeue(bad + "\n")


def test_parse_squeue_empty() -> None:
    assert parse.parse_squeue("") == []


def test_parse_squeue_recorded() -> None:
    """Held, begin-time, resources-pending, running and completing jobs from real squeue."""
    jobs = {j.reason or j.state: j for j in parse.parse_squeue(fixture("squeue_jobs.txt"))}
    assert set(jobs) == {"JobHeldUser", "BeginTime", "Resources", "RUNNING", "COMPLETING"}
    held = jobs["JobHeldUser"]
    assert (held.name, held.state, held.active, held.batch_host, held.nodes) == (
        "rsp-record",
        "PENDING",
        True,
        "",
        "",
    )
    assert held.comment == '{"cluster": "c1", "note": "a;b c=d"}'
    assert held.time_limit_s is None and held.left_s() is None and held.start_time == ""
    assert held.submit_time.startswith("20") and "T" in held.submit_time
    assert jobs["BeginTime"].start_time  # the expected start is known
    run = jobs["RUNNING"]
    assert (run.nodes, run.batch_host, run.partition, run.comment) == ("n2", "n2", "gpu", "running")
    assert run.time_limit_s == 600 and run.end_time.startswith("20")
    left = run.left_s(now=time.mktime(time.strptime(run.start_time, "%Y-%m-%dT%H:%M:%S")))
    assert left == 600  # recorded: the end time is the start plus the limit
    assert run.running and run.reason == ""
    done = jobs["COMPLETING"]
    assert not done.active and done.batch_host == "n3"


def test_parse_squeue_recorded_empty() -> None:
    assert parse.parse_squeue(fixture("squeue_empty.txt")) == []


def test_parse_scontrol_nodes_recorded() -> None:
    nodes = parse.parse_scontrol_records(fixture("scontrol_show_node.txt"), "NodeName")
    assert [n["NodeName"] for n in nodes] == ["n1", "n2", "n3"]
    assert [n["NodeAddr"] for n in nodes] == ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
    n1 = nodes[0]
    assert n1["Reason"].startswith("maintenance window; see ticket #42 [")
    assert n1["State"] == "IDLE+DRAIN" and n1["Partitions"] == "cpu,gpu"
    assert n1["OS"].startswith("Linux ") and " " in n1["OS"]
    assert all(parse.parse_gres_gpus(n["Gres"]) == 2 for n in nodes)
    assert nodes[1]["AllocTRES"] == "cpu=1,mem=2000M" and n1["AllocTRES"] == ""


def test_parse_scontrol_partitions_recorded() -> None:
    parts = parse.parse_scontrol_records(fixture("scontrol_show_partition.txt"), "PartitionName")
    assert [(p["PartitionName"], p["Default"]) for p in parts] == [("cpu", "YES"), ("gpu", "NO")]
    cpu = parts[0]
    assert parse_duration(cpu["MaxTime"]) is None
    assert parse_duration(cpu["DefaultTime"]) is None
    assert parse.expand_hostlist(cpu["Nodes"]) == ["n1", "n2", "n3"]
    assert cpu["TRES"].startswith("cpu=6,")


def test_parse_scontrol_skips_non_records() -> None:
    assert parse.parse_scontrol_records("No partitions in the system\n", "PartitionName") == []
