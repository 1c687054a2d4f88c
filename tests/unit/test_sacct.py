"""Accounting (sacct, sacctmgr) against recorded Slurm 22.05 answers, with and without
slurmdbd (tests/fixtures/record_accounting.py), and what `validate` and `status` make of
them: why a node ended, a wrong account or QOS, and a QOS job limit's refusal. Whether an
early end is its type's fault: tests/unit/test_early_ends.py."""

from __future__ import annotations

import pytest

from ray_slurm_provider import proc
from ray_slurm_provider.cli.findings import accounting_findings
from ray_slurm_provider.cli.status import ended_data, ended_lines
from ray_slurm_provider.cluster import NODE_TYPES_KEY, ClusterConfig, parse_provider_section
from ray_slurm_provider.provider.fit import check_account_qos
from ray_slurm_provider.slurm.client import PermanentSlurmError, classify
from ray_slurm_provider.slurm.sacct import (
    Accounting,
    NoAccounting,
    parse_associations,
)
from tests.unit.test_slurm_cli import FakeRun, recorded


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeRun:
    f = FakeRun()
    monkeypatch.setattr(proc, "run", f)
    return f


def test_ended_jobs_say_how_each_ended(fake: FakeRun) -> None:
    fake.set("sacct", "sacct_ended")
    jobs = Accounting().ended_jobs("rsp-record")
    assert [j.why for j in jobs] == ["COMPLETED", "FAILED (exit 3)", "CANCELLED"]
    assert all(j.end and j.node for j in jobs)
    argv = fake.calls[0].argv
    assert "--name=rsp-record" in argv and "-X" in argv and "--user=" in " ".join(argv)


def test_an_end_not_yet_recorded_is_none(fake: FakeRun) -> None:
    fake.set("sacct", "sacct_nothing")
    assert Accounting().ended_job("999999") is None


@pytest.mark.parametrize("name", ["sacct_disabled", "sacctmgr_disabled"])
def test_no_accounting_is_told_in_slurms_words(fake: FakeRun, name: str) -> None:
    fake.set("sacct", name)
    fake.set("sacctmgr", name)
    fake.set("scontrol show config", ("ClusterName = sandbox\n", "", 0))
    acct = Accounting()
    with pytest.raises(NoAccounting) as ei:
        acct.ended_job("1") if name.startswith("sacct_") else acct.associations()
    out, err, _ = recorded(name)
    assert ei.value.slurm_message.strip() in (err + "\n" + out).strip()


def test_associations_and_the_choices_named(fake: FakeRun) -> None:
    fake.set("sacctmgr", "sacctmgr_assoc")
    fake.set("scontrol show config", ("Configuration data as of 2026-12-02T00:08:00\n"
                                      "AccountingStorageType   = accounting_storage/slurmdbd\n"
                                      "ClusterName             = sandbox\n", "", 0))
    assocs = Accounting().associations("root")
    assert fake.calls[-1].argv[-3:] == ["user=root", "cluster=sandbox",
                                        "format=Account,Partition,QOS,DefaultQOS"]
    # root also has the association sacctmgr made with the cluster (account root).
    assert {a.account for a in assocs} == {"root", "team-a", "team-b"}
    assert all({"normal", "high", "scavenger", "limited"} <= set(a.qos)
               for a in assocs if a.account.startswith("team-"))
    where = "available_node_types.w.node_config"
    assert check_account_qos(assocs, "team-a", "limited", where) is None
    assert check_account_qos(assocs, None, None, where) is None
    bad = check_account_qos(assocs, "team-c", None, where)
    assert bad == (f"{where}.account: 'team-c' is not an account you may use on this "
                   "cluster; valid: root, team-a, team-b")
    bad = check_account_qos(assocs, "team-a", "gold", where)
    assert bad is not None and bad.startswith(f"{where}.qos: 'gold' is not a QOS of account "
                                              "'team-a'; valid: ") and "scavenger" in bad


def test_recorded_refusals_are_permanent_in_slurms_words() -> None:
    for name, words in [("sbatch_qos_limit", "QOSMaxSubmitJobPerUserLimit"),
                        ("sbatch_qos_limit_array", "QOSMaxSubmitJobPerUserLimit"),
                        ("sbatch_bad_account", "Invalid account"),
                        ("sbatch_bad_qos", "Invalid qos")]:
        _, err, rc = recorded(name)
        assert rc != 0 and words in err, (name, err)
        assert isinstance(classify(err, "sbatch"), PermanentSlurmError), name
    from tests.unit.test_job_arrays import QOS_LIMIT

    assert recorded("sbatch_qos_limit")[1].strip() == QOS_LIMIT  # the fake says it so too


def _cluster(**node_config: str) -> ClusterConfig:
    types = {"head": {"resources": {"CPU": 1}, "node_config": {}},
             "w": {"resources": {"CPU": 1}, "node_config": dict(node_config)}}
    return parse_provider_section({"type": "external", "python": "/py",
                                   NODE_TYPES_KEY: types}, "c", "head")


class Assocs:
    def __init__(self, err: Exception | None = None) -> None:
        self.err = err

    def associations(self, user: str | None = None) -> list[object]:
        if self.err:
            raise self.err
        return list(parse_associations("team-a||normal,limited|normal\n"))


def test_validate_names_a_wrong_account_or_qos_and_says_when_it_cannot() -> None:
    ok = accounting_findings(_cluster(account="team-a", qos="limited"), Assocs())  # type: ignore[arg-type]
    assert [f.level for f in ok] == ["ok"]
    bad = accounting_findings(_cluster(qos="high"), Assocs())  # type: ignore[arg-type]
    assert bad[0].level == "fail" and bad[0].what.endswith("w.node_config.qos")
    assert "valid: limited, normal" in bad[0].message
    assert accounting_findings(_cluster(), Assocs()) == []  # type: ignore[arg-type]
    off = NoAccounting("x", "Slurm accounting storage is disabled", "sacctmgr")
    (warn,) = accounting_findings(_cluster(qos="high"), Assocs(off))  # type: ignore[arg-type]
    assert warn.level == "warn" and "Slurm accounting storage is disabled" in warn.message


def test_status_shows_ended_nodes_or_why_it_cannot(fake: FakeRun) -> None:
    class C:
        job_name = "rsp-record"

    fake.set("sacct", "sacct_ended")
    data = {"ended": ended_data(C(), 2)}  # type: ignore[arg-type]
    lines = ended_lines(data)
    assert lines[0] == "ended nodes (last 2, from sacct):"
    assert "FAILED (exit 3)" in lines[2] and "CANCELLED" in lines[3]
    fake.set("sacct", "sacct_disabled")
    (line,) = ended_lines({"ended": ended_data(C(), 5)})  # type: ignore[arg-type]
    assert line.startswith("ended nodes: unknown (Slurm accounting storage is disabled")
    assert ended_lines({"ended": ended_data(C(), 0)}) == []  # type: ignore[arg-type]


def test_slurmctld_says_how_a_job_ended_before_accounting_has_it(fake: FakeRun) -> None:
    """The CLI back end asks slurmctld first (it keeps an ended job for MinJobAge): no wait
    for slurmdbd, which records the end a moment later, and no accounting needed."""
    from ray_slurm_provider.slurm.cli import CliSlurmClient
    from ray_slurm_provider.slurm.sacct import controller_end

    assert controller_end(recorded("scontrol_show_job_preempting")[0]) is None  # running
    end = controller_end(recorded("scontrol_show_job_preempted")[0])
    assert end is not None and end.state == "PREEMPTED" and end.why == "PREEMPTED (signal 15)"
    fake.set("scontrol show job", "scontrol_show_job_failed")
    fake.set("sacct", "sacct_disabled")
    end = CliSlurmClient().ended_job("43")
    assert end is not None and end.why == "FAILED (exit 3)" and end.node == "n1"
    assert [c.argv[0] for c in fake.calls] == ["scontrol"]  # sacct not asked


def test_a_job_slurmctld_has_forgotten_is_asked_of_accounting(fake: FakeRun) -> None:
    from ray_slurm_provider.slurm.cli import CliSlurmClient

    gone = ("", "slurm_load_jobs error: Invalid job id specified\n", 1)
    fake.set("scontrol show job", gone)
    fake.set("sacct", "sacct_preempted")
    end = CliSlurmClient().ended_job("45")
    assert end is not None and end.state == "PREEMPTED"
    fake.set("sacct", "sacct_disabled")
    with pytest.raises(NoAccounting):
        CliSlurmClient().ended_job("45")


def test_output_accounting_cannot_read_is_a_slurm_error(fake: FakeRun) -> None:
    from ray_slurm_provider.slurm.client import SlurmError

    fake.set("sacct", ("1\x1fonly two fields\n", "", 0))
    with pytest.raises(SlurmError, match="sacct: unexpected output"):
        Accounting().ended_jobs("x")
