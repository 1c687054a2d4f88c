"""CliSlurmClient with `proc.run` replaced by recorded Slurm 22.05 answers."""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from ray_slurm_provider import proc
from ray_slurm_provider.slurm.cli import CliSlurmClient
from ray_slurm_provider.slurm.client import (
    ACTIVE_STATES,
    LIST_STATES,
    PermanentSlurmError,
    SlurmClient,
    TransientSlurmError,
)
from ray_slurm_provider.slurm.parse import DELIM, SQUEUE_FORMAT
from ray_slurm_provider.slurm.script import JobSpec, ScriptError, render

FIX = Path(__file__).resolve().parent.parent / "fixtures" / "slurm-22.05"
CODES = dict(ln.split() for ln in (FIX / "exit_codes.txt").read_text().splitlines())
TRUE = JobSpec("ray-x", ["true"])


def recorded(name: str) -> tuple[str, str, int]:
    err = FIX / f"{name}.stderr.txt"
    return (
        (FIX / f"{name}.txt").read_text(),
        err.read_text() if err.exists() else "",
        int(CODES[name]),
    )


@dataclass
class Call:
    argv: list[str]
    input: str | None
    env: dict[str, str]
    timeout: float


Answer = tuple[str, str, int] | BaseException


@dataclass
class FakeRun:
    """Stands in for proc.run: answers by command ("squeue", "scontrol show node", ...)."""

    answers: dict[str, list[Answer]] = field(default_factory=dict)
    calls: list[Call] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def set(self, key: str, *answers: str | Answer) -> None:
        self.answers[key] = [recorded(a) if isinstance(a, str) else a for a in answers]

    def __call__(
        self,
        argv: Sequence[str],
        *,
        timeout: float = 60,
        input: str | None = None,
        env: Mapping[str, str] | None = None,
        check: bool = True,
        cwd: str | None = None,
    ) -> proc.Result:
        args = list(argv)
        key = " ".join(args[:3]) if args[0].endswith("scontrol") else args[0].rsplit("/")[-1]
        with self.lock:
            self.calls.append(Call(args, input, dict(env or {}), timeout))
            queue = self.answers[key]
            answer = queue.pop(0) if len(queue) > 1 else queue[0]  # the last one sticks
        if isinstance(answer, BaseException):
            raise answer
        out, err, rc = answer
        if check and rc:
            raise proc.CommandFailed(args, err.strip() or f"exit code {rc}", rc, out, err)
        return proc.Result(args, rc, out, err)

    def commands(self) -> list[str]:
        return [c.argv[0] if c.argv[0] != "scontrol" else " ".join(c.argv[:3]) for c in self.calls]


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeRun:
    f = FakeRun()
    f.set("sinfo", "sinfo_version")
    f.set("scontrol show node", "scontrol_show_node")
    f.set("scontrol show partition", "scontrol_show_partition")
    f.set("squeue", "squeue_jobs")
    f.set("sbatch", "sbatch_parsable")
    f.set("scancel", "scancel_live")
    # A cluster in no federation: recorded on the 25.11 sandbox, nothing at all, exit 0.
    f.set("scontrol show federation", ("", "", 0))
    monkeypatch.setattr(proc, "run", f)
    return f


def test_is_a_slurm_client_and_init_runs_nothing(fake: FakeRun) -> None:
    client = CliSlurmClient()
    assert isinstance(client, SlurmClient)
    assert fake.calls == []


def test_env_is_scrubbed() -> None:
    base = {
        "PATH": "/usr/bin",
        "HOME": "/h",
        "SLURM_CONF": "/etc/slurm/x.conf",
        "SLURM_JOB_ID": "7",
        "SLURM_TIME_FORMAT": "relative",
        "SBATCH_PARTITION": "p",
        "SQUEUE_FORMAT": "%i",
        "SQUEUE_SORT": "-t",
        "SINFO_FORMAT": "%P",
        "SCONTROL_ALL": "1",
        "SRUN_CPUS_PER_TASK": "4",
        "SLURMD_NODENAME": "n1",
        "RAY_ADDRESS": "127.0.0.2:6379",
    }
    env = CliSlurmClient(env=base).command_env()
    assert env == {
        "PATH": "/usr/bin",
        "HOME": "/h",
        "SLURM_CONF": "/etc/slurm/x.conf",
        "SLURM_TIME_FORMAT": "standard",
        "SLURMD_NODENAME": "n1",
    }


def test_submit(fake: FakeRun) -> None:
    client = CliSlurmClient(timeout=7, env={"SLURM_JOB_ID": "1", "PATH": "/bin"})
    spec = JobSpec("ray-x", ["sleep", "1"], time="10")
    job_id = client.submit(spec, comment='{"a": "b c"}')
    assert job_id == recorded("sbatch_parsable")[0].strip()
    (call,) = fake.calls
    # The name is the script's own #SBATCH --job-name; the comment goes on the command line.
    assert call.argv == ["sbatch", "--parsable", '--comment={"a": "b c"}']
    assert call.input == render(spec) and call.timeout == 7
    assert "#SBATCH --job-name=ray-x\n" in call.input
    assert call.env == {"PATH": "/bin", "SLURM_TIME_FORMAT": "standard"}


def test_submit_minimal_argv_and_cluster_suffix(fake: FakeRun) -> None:
    fake.set("sbatch", ("42;cluster\n", "", 0))
    assert CliSlurmClient().submit(TRUE) == "42"
    assert fake.calls[0].argv == ["sbatch", "--parsable"]


def test_submit_rejects_multiline_comment(fake: FakeRun) -> None:
    with pytest.raises(ValueError):
        CliSlurmClient().submit(TRUE, comment="a\nb")
    with pytest.raises(ScriptError, match="job_name"):
        CliSlurmClient().submit(JobSpec("a\nb", ["true"]))
    assert fake.calls == []


def test_submit_bad_partition_keeps_slurms_words(fake: FakeRun) -> None:
    fake.set("sbatch", "sbatch_bad_partition")
    with pytest.raises(PermanentSlurmError) as ei:
        CliSlurmClient().submit(TRUE)
    # Both of sbatch's lines, and no "sbatch: sbatch: error:".
    assert str(ei.value) == recorded("sbatch_bad_partition")[1].strip()
    assert "Invalid partition name specified" in ei.value.slurm_message
    assert ei.value.command == "sbatch"


def test_submit_bad_gres_is_permanent(fake: FakeRun) -> None:
    fake.set("sbatch", "sbatch_bad_gres")
    with pytest.raises(PermanentSlurmError, match="Requested node configuration"):
        CliSlurmClient().submit(TRUE)


def test_submit_controller_down_is_transient(fake: FakeRun) -> None:
    fake.set("sbatch", "sbatch_ctld_down")
    with pytest.raises(TransientSlurmError, match="Unable to contact slurm controller"):
        CliSlurmClient().submit(TRUE)


def test_submit_garbage_output_is_an_error(fake: FakeRun) -> None:
    fake.set("sbatch", ("Submitted batch job 5\n", "", 0))
    with pytest.raises(PermanentSlurmError, match="unexpected sbatch"):
        CliSlurmClient().submit(TRUE)


def test_list_jobs_one_squeue_then_cached_addresses(fake: FakeRun) -> None:
    client = CliSlurmClient()
    jobs = {j.reason or j.state: j for j in client.list_jobs("rsp-record")}
    assert fake.commands() == ["squeue", "scontrol show federation", "scontrol show node"]
    argv = fake.calls[0].argv
    # --array: every task of a job array on its own line, pending ones too.
    assert argv[:5] == ["squeue", "--me", "--array", "--noheader", "--name=rsp-record"]
    states = set(argv[5].removeprefix("--states=").split(","))
    assert states == ACTIVE_STATES | {"COMPLETING"}
    assert argv[6] == f"--format={SQUEUE_FORMAT}" and DELIM in argv[6] and len(argv) == 7
    assert argv[6].endswith("%A" + DELIM + "%k")  # numeric id, then the free-text comment
    assert fake.calls[0].env["SLURM_TIME_FORMAT"] == "standard"

    assert (jobs["RUNNING"].batch_host, jobs["RUNNING"].node_addr) == ("n2", "127.0.0.3")
    assert (jobs["COMPLETING"].node_addr, jobs["COMPLETING"].active) == ("127.0.0.4", False)
    assert jobs["JobHeldUser"].node_addr == "" and jobs["JobHeldUser"].active

    client.list_jobs("rsp-record")
    assert fake.commands() == ["squeue", "scontrol show federation", "scontrol show node",
                               "squeue", "scontrol show federation"]
    client.list_jobs("rsp-record")
    # No federation, said twice: later listings skip squeue's REQUEST_FED_INFO (P7, issue 29).
    assert fake.commands()[-1] == "squeue"
    assert fake.calls[-1].argv[:5] == ["squeue", "--me", "--array", "--noheader", "--local"]


def test_list_jobs_without_hosts_needs_no_node_table(fake: FakeRun) -> None:
    fake.set("squeue", "squeue_empty")
    assert CliSlurmClient().list_jobs("nobody") == []
    assert fake.commands() == ["squeue", "scontrol show federation"]


def test_list_jobs_fetches_node_table_once_across_threads(fake: FakeRun) -> None:
    client = CliSlurmClient()
    results: list[int] = []
    threads = [
        threading.Thread(target=lambda: results.append(len(client.list_jobs("x"))))
        for _ in range(8)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [5] * 8
    assert fake.commands().count("scontrol show node") == 1


@pytest.mark.parametrize(
    "node_answer", ["scontrol_show_node_ctld_down", proc.CommandTimeout(["scontrol"], "t")]
)
def test_list_jobs_raises_when_node_table_fails(fake: FakeRun, node_answer: str | Answer) -> None:
    fake.set("scontrol show node", node_answer)
    with pytest.raises(TransientSlurmError):
        CliSlurmClient().list_jobs("rsp-record")


def test_list_jobs_controller_down_raises_not_empty(fake: FakeRun) -> None:
    fake.set("squeue", "squeue_ctld_down")
    with pytest.raises(TransientSlurmError) as ei:
        CliSlurmClient().list_jobs("rsp-record")
    assert ei.value.slurm_message == (
        "slurm_load_jobs error: Unable to contact slurm controller (connect failure)"
    )


def test_list_jobs_unparsable_line_is_an_error(fake: FakeRun) -> None:
    good = recorded("squeue_jobs")[0]
    fake.set("squeue", (good + "something else entirely\n", "", 0))
    with pytest.raises(PermanentSlurmError, match="cannot parse squeue"):
        CliSlurmClient().list_jobs("rsp-record")


@pytest.mark.parametrize("name", ["", "a,b"])
def test_list_jobs_rejects_bad_names(fake: FakeRun, name: str) -> None:
    with pytest.raises(ValueError):
        CliSlurmClient().list_jobs(name)


def test_cancel_is_one_call_and_empty_is_none(fake: FakeRun) -> None:
    client = CliSlurmClient()
    client.cancel([])
    assert fake.calls == []
    client.cancel(["12", "11", "12", "13_2"])
    assert [c.argv for c in fake.calls] == [["scancel", "11", "12", "13_2"]]


def test_cancel_gone_jobs_is_quiet(fake: FakeRun) -> None:
    fake.set("scancel", "scancel_gone", "scancel_gone_verbose")
    CliSlurmClient().cancel(["11", "999999"])  # 22.05: exit 0, no words
    CliSlurmClient().cancel(["11", "999999"])  # -v words (and other versions' output)
    verbose_out, verbose_err, _ = recorded("scancel_gone_verbose")
    fake.set("scancel", (verbose_out, verbose_err, 1))  # as if the exit code said failure
    CliSlurmClient().cancel(["11", "999999"])


def test_cancel_controller_down_is_transient(fake: FakeRun) -> None:
    fake.set("scancel", "scancel_ctld_down")
    with pytest.raises(TransientSlurmError, match="Unable to contact slurm controller"):
        CliSlurmClient().cancel(["123", "124"])


def test_cancel_other_errors_are_raised(fake: FakeRun) -> None:
    err = (
        "scancel: error: Kill job error on job id 5: Invalid job id specified\n"
        "scancel: error: Kill job error on job id 6: Access/permission denied\n"
    )
    fake.set("scancel", ("", err, 1))
    with pytest.raises(PermanentSlurmError) as ei:
        CliSlurmClient().cancel(["5", "6"])
    assert ei.value.slurm_message.endswith("Access/permission denied")


@pytest.mark.parametrize("bad", ["abc", "1 2", "", "-1"])
def test_cancel_rejects_non_ids(fake: FakeRun, bad: str) -> None:
    with pytest.raises(ValueError):
        CliSlurmClient().cancel(["1", bad])
    assert fake.calls == []


def test_cluster_info(fake: FakeRun) -> None:
    info = CliSlurmClient().cluster_info()
    assert sorted(fake.commands()) == ["scontrol show node", "scontrol show partition", "sinfo"]
    assert info.version == "22.05.8"
    cpu, gpu = info.partition("cpu"), info.partition("gpu")
    assert cpu is not None and gpu is not None and info.partition(None) is cpu
    assert info.partition("nope") is None
    assert (cpu.default, gpu.default, cpu.state) == (True, False, "UP")
    assert [n.name for n in gpu.nodes] == ["n1", "n2", "n3"]
    assert [n.addr for n in gpu.nodes] == ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
    assert (gpu.cpus_per_node, gpu.memory_mb_per_node, gpu.gpus_per_node, gpu.gres) == (
        2,
        4000,
        2,
        "gpu:2",
    )
    assert cpu.max_time_s is None and cpu.default_time_s is None
    assert gpu.nodes[0].state == "IDLE+DRAIN"


def test_cluster_info_limits_and_hostlist_fallback(fake: FakeRun) -> None:
    nodes = "".join(
        f"NodeName={n} NodeAddr=10.0.0.{i} CPUTot={c} RealMemory=8000 "
        f"Gres=gpu:a100:{g}(S:0-1) State=IDLE\n"
        for i, (n, c, g) in enumerate([("g01", 8, 4), ("g02", 16, 8)])
    )
    part = (
        "PartitionName=big Default=NO DefaultTime=01:00:00 MaxTime=2-00:00:00 "
        "Nodes=g[01-02] State=UP\n"
    )
    fake.set("scontrol show node", (nodes, "", 0))
    fake.set("scontrol show partition", (part, "", 0))
    (big,) = CliSlurmClient().cluster_info().partitions
    assert (big.max_time_s, big.default_time_s) == (2 * 86400, 3600)
    assert (big.cpus_per_node, big.gpus_per_node, big.gres) == (8, 4, "gpu:a100:4(S:0-1)")
    assert [n.name for n in big.nodes] == ["g01", "g02"]


def test_cluster_info_controller_down(fake: FakeRun) -> None:
    fake.set("scontrol show node", "scontrol_show_node_ctld_down")
    with pytest.raises(TransientSlurmError, match="slurm_load_node"):
        CliSlurmClient().cluster_info()


def test_node_addresses_refreshes_cache(fake: FakeRun) -> None:
    client = CliSlurmClient()
    assert client.node_addresses() == {"n1": "127.0.0.2", "n2": "127.0.0.3", "n3": "127.0.0.4"}
    client.list_jobs("rsp-record")  # the table is cached already
    assert fake.commands() == ["scontrol show node", "squeue", "scontrol show federation"]


def test_missing_binary_is_permanent_with_hint(fake: FakeRun) -> None:
    fake.set("squeue", proc.CommandNotFound(["squeue"], "squeue: command not found"))
    with pytest.raises(PermanentSlurmError) as ei:
        CliSlurmClient().list_jobs("x")
    msg = str(ei.value)
    assert "squeue" in msg and "apt-get install slurm-client" in msg and "REST" in msg


def test_missing_binary_for_real() -> None:
    client = CliSlurmClient(binaries={"sinfo": "/nonexistent/bin/sinfo"})
    with pytest.raises(PermanentSlurmError, match="/nonexistent/bin/sinfo: command not found"):
        client.cluster_info()


def test_timeout_is_transient_and_keeps_what_it_said(fake: FakeRun) -> None:
    said = "squeue: error: s_p_parse_file: cannot stat file slurm.conf, retrying in 1sec"
    fake.set("squeue", proc.CommandTimeout(["squeue"], "timed out", None, "", said))
    with pytest.raises(TransientSlurmError) as ei:
        CliSlurmClient(timeout=3).list_jobs("x")
    assert "no answer within 3s" in str(ei.value) and said in str(ei.value)


def test_binaries_override(fake: FakeRun) -> None:
    CliSlurmClient(binaries={"sbatch": "/opt/slurm/bin/sbatch"}).submit(TRUE)
    assert fake.calls[0].argv[0] == "/opt/slurm/bin/sbatch"


def test_list_states_cover_active_and_completing() -> None:
    assert set(LIST_STATES.split(",")) == ACTIVE_STATES | {"COMPLETING"}


def test_node_address_asks_for_one_node(fake: FakeRun) -> None:
    """Issue 14.2: a starting node asks for its own record, not the whole node table."""
    assert CliSlurmClient().node_address("n2") == "127.0.0.3"
    assert fake.calls[-1].argv[1:5] == ["show", "node", "n2", "--oneliner"]


@pytest.mark.parametrize("answer", [
    ("Federation: fed1\nSelf:       c1:127.0.0.1:6817 ID:1 FedState:ACTIVE\n", "", 0),
    ("", "slurm_load_federation error: Unable to contact slurm controller\n", 0),
    TransientSlurmError("scontrol: no answer within 30s", "", "scontrol"),
])
def test_squeue_asks_the_federation_unless_the_cluster_is_in_none(
        fake: FakeRun, answer: Answer) -> None:
    """In a federation a job may run on a sibling (REVOKED here): never --local there, nor
    while it is not known."""
    fake.set("scontrol show federation", answer)
    client = CliSlurmClient()
    for _ in range(4):
        client.list_jobs("rsp-record")
    assert all("--local" not in c.argv for c in fake.calls)


def test_an_empty_federation_answer_once_is_not_enough(fake: FakeRun) -> None:
    """scontrol prints nothing, exit 0, both when the cluster is in no federation and when
    the controller's answer was lost (Slurm 25.11 scontrol_print_federation): a lost answer
    followed by the federation's name never makes squeue skip the federation."""
    federation = "Federation: fed1\nSelf:       c1:127.0.0.1:6817 ID:1 FedState:ACTIVE\n"
    fake.set("scontrol show federation", ("", "", 0))
    client = CliSlurmClient()
    client.list_jobs("rsp-record")
    fake.set("scontrol show federation", (federation, "", 0))
    for _ in range(3):
        client.list_jobs("rsp-record")
    assert all("--local" not in c.argv for c in fake.calls)
