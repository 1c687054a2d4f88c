"""`ray-slurm sbatch` (issue 17.2) with fakes: what the login side prepares and submits, and
the head agent that runs the entrypoint, cancels its workers and ends with the entrypoint's
exit code. The sandbox test is tests/e2e/test_oneshot.py."""

from __future__ import annotations

import io
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from ray.job_submission import JobStatus

from ray_slurm_provider import proc
from ray_slurm_provider.agent import head as head_role
from ray_slurm_provider.agent import oneshot
from ray_slurm_provider.agent.agent import Agent
from ray_slurm_provider.agent.head import HeadAgent
from ray_slurm_provider.cli import sbatch
from ray_slurm_provider.cli.main import main
from ray_slurm_provider.cli.run import Plan
from ray_slurm_provider.cluster import NAME_RE
from ray_slurm_provider.nodespec import NodeSpec
from ray_slurm_provider.provider.provider import SlurmNodeProvider
from ray_slurm_provider.slurm.client import SlurmError
from ray_slurm_provider.slurm.spec import JobSpec
from ray_slurm_provider.state import ClusterDir, HeadInfo, StartRequest
from tests.fakes import FakeSlurm
from tests.unit.test_cmds import cluster as make_cluster


def offline(config: Any = None) -> Any:
    raise SlurmError("offline")


def test_sbatch_prepares_the_head_and_hands_it_the_entrypoint(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("ray_slurm_provider.provider.bootstrap._cluster_info", offline)
    fake = FakeSlurm()
    c = make_cluster(tmp_path, fake)

    def provider(config: dict[str, Any], name: str) -> SlurmNodeProvider:
        p = SlurmNodeProvider(config, name)
        p._client = fake
        return p

    work = tmp_path / "work"
    work.mkdir()
    (work / "train.py").write_text("print(1)\n")
    head = sbatch.submit(c, Plan(c.path, ["python", "train.py"],
                                 {"working_dir": str(work), "env_vars": {"A": "1"}}),
                         provider_cls=provider)
    (job,) = fake.list_jobs(c.job_name)
    assert job.job_id == head and job.state == "PENDING"
    req = c.cdir.node(head).read_start()
    assert req is not None and req.entrypoint == ["python", "train.py"]
    assert req.ray_start is not None and req.ray_start[:3] == ["ray", "start", "--head"]
    assert "--autoscaling-config=~/ray_bootstrap_config.yaml" in req.ray_start
    staged = Path(req.runtime_env["working_dir"])
    assert staged.parent == c.cdir.root / "oneshot" and (staged / "train.py").exists()
    assert req.runtime_env["env_vars"] == {"A": "1"}
    assert req.env["RAY_OVERRIDE_RESOURCES"] == '{"CPU": 0}'
    boot = c.cdir.bootstrap_config.read_text()
    assert '"_node_types"' in boot and '"cpu_worker"' in boot  # the head's autoscaler config


def test_sbatch_runs_the_head_commands_once_in_rays_order(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 26.2: Ray's config preparation already puts setup_commands in front of
    head_setup_commands; the head runs them as Ray's updater does (initialization, setup,
    head setup, start), each once."""
    monkeypatch.setattr("ray_slurm_provider.provider.bootstrap._cluster_info", offline)
    fake = FakeSlurm()
    c = make_cluster(tmp_path, fake)
    c.config.update({"initialization_commands": ["echo init"],
                     "setup_commands": ["mkdir /tmp/x"], "head_setup_commands": ["echo h"]})

    def provider(config: dict[str, Any], name: str) -> SlurmNodeProvider:
        p = SlurmNodeProvider(config, name)
        p._client = fake
        return p

    head = sbatch.submit(c, Plan(c.path, ["true"], {}), provider_cls=provider)
    req = c.cdir.node(head).read_start()
    assert req is not None
    assert req.before == ["echo init", "mkdir /tmp/x", "echo h"]
    assert req.ray_start is not None and req.ray_start[:3] == ["ray", "start", "--head"]


def test_sbatch_takes_a_config_whose_cluster_is_up_and_refuses_bad_input(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A run is its own cluster (issue 26.1): the config's `ray up` cluster being up does not
    matter (it was refused, pointing to `run --reuse`, which does not apply: issue 26.18)."""
    fake = FakeSlurm()
    c = make_cluster(tmp_path, fake)
    head = fake.submit(JobSpec(job_name=c.job_name, command=["x"]))
    fake.start(head)
    c.cdir.write_head(HeadInfo(job_id=head, ip="127.0.0.2", gcs_port=1))
    assert sbatch_cli(c, fake, monkeypatch, "--", "python", "x.py") == 0
    out = capsys.readouterr()
    assert "--reuse" not in out.err and out.out.strip() != head
    monkeypatch.setattr(sbatch, "submit", lambda *a, **k: pytest.fail("submitted"))
    assert main(["sbatch", str(c.path)]) == 2
    assert "no entrypoint" in capsys.readouterr().err
    # `run`'s own options mean nothing to a one-shot cluster: refused, not ignored.
    assert main(["sbatch", str(c.path), "--reuse", "--", "python", "x.py"]) == 2
    assert "unknown options before `--`: --reuse" in capsys.readouterr().err


class RayChild:
    """`ray start --block`: says Ray started, then blocks until it gets a signal."""

    def __init__(self, limit_s: float = 30) -> None:
        self.stopped = threading.Event()
        self.signalled = False  # stopped by the agent, not by `limit_s` running out
        self.pid, self.limit_s = 0, limit_s

    @property
    def stdout(self) -> Any:
        yield "Ray runtime started.\n"
        self.stopped.wait(self.limit_s)

    def poll(self) -> int | None:
        return 0 if self.stopped.is_set() else None

    def wait(self, timeout: float | None = None) -> int:
        return 0

    def send_signal(self, sig: int) -> None:
        self.signalled = True
        self.stopped.set()

    def kill(self) -> None:
        self.stopped.set()


def test_the_head_runs_the_entrypoint_cancels_its_workers_and_ends_with_its_code(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = NodeSpec(kind="head", node_type="head", cluster_name="c1", state_dir=str(tmp_path),
                    ports_base=25000, attempts=1, temp_dir_root=str(tmp_path / "tmp"))
    fake = FakeSlurm()
    head_id = fake.submit(JobSpec(job_name="ray-c1", command=["x"]))
    worker = fake.submit(JobSpec(job_name="ray-c1", command=["x"]))
    fake.start(head_id)
    fake.start(worker)
    a = HeadAgent(spec, {"SLURM_JOB_ID": head_id, "HOME": str(tmp_path)})
    a.slurm = fake
    staged = oneshot.staged_dir(a.cdir, "abc")
    staged.mkdir(parents=True)
    a.ndir.write_start(StartRequest(id="r1", ray_start=["ray", "start", "--head"],
                                    entrypoint=["python", "train.py"],
                                    runtime_env={"working_dir": str(staged)}))
    monkeypatch.setattr(proc, "start", lambda argv, env=None, new_session=False: RayChild())
    monkeypatch.setattr(Agent, "node_ip", lambda self: "127.0.0.2")
    monkeypatch.setattr(head_role, "wait_port_free", lambda *args: None)
    seen: list[StartRequest] = []

    def entrypoint(cdir: Any, head: HeadInfo, mode: str, req: StartRequest, out: Any,
                   say: Any, stopping: Any) -> int:
        seen.append(req)
        return 3

    monkeypatch.setattr(oneshot, "run_entrypoint", entrypoint)
    assert a.main() == 3
    assert seen and seen[0].entrypoint == ["python", "train.py"]
    assert [j.job_id for j in fake.list_jobs("ray-c1") if j.active] == [head_id]
    assert a.cdir.teardown_marked() and not staged.exists()


@dataclass
class Info:
    status: JobStatus
    driver_exit_code: int | None = None
    message: str = ""


@pytest.mark.parametrize(("info", "code"), [
    (Info(JobStatus.SUCCEEDED), 0), (Info(JobStatus.FAILED, 3), 3),
    (Info(JobStatus.FAILED, -9), 137), (Info(JobStatus.FAILED, None), None),
    (Info(JobStatus.STOPPED), None)])
def test_exit_codes(info: Info, code: int | None) -> None:
    assert oneshot.exit_code(info) == code


def test_follow_streams_the_output_and_returns_the_final_status() -> None:
    class Client:
        polls = 0

        def get_job_info(self, job_id: str) -> Info:
            self.polls += 1
            if self.polls == 2:
                raise ConnectionError("dashboard restarting")
            return Info(JobStatus.RUNNING if self.polls < 4 else JobStatus.FAILED, 5)

        async def tail_job_logs(self, job_id: str) -> Any:
            yield "line 1\n"
            yield "line 2\n"

    answered: list[bool] = []
    out = io.StringIO()
    info = oneshot.follow(Client(), "j", out, sleep=lambda s: None, check=answered.append)
    assert info.driver_exit_code == 5 and answered == [True, False, True]
    assert out.getvalue() == "line 1\nline 2\n"


def head_agent(tmp_path: Path) -> HeadAgent:
    """A one-shot cluster's head agent, its job running on FakeSlurm."""
    spec = NodeSpec(kind="head", node_type="head", cluster_name="c1", state_dir=str(tmp_path),
                    ports_base=25000, attempts=1, temp_dir_root=str(tmp_path / "tmp"))
    fake = FakeSlurm()
    head_id = fake.submit(JobSpec(job_name="ray-c1", command=["x"]))
    fake.start(head_id)
    a = HeadAgent(spec, {"SLURM_JOB_ID": head_id, "HOME": str(tmp_path)})
    a.slurm = fake
    return a


def test_a_failing_submission_still_ends_the_one_shot_head(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Found on review: an exception in the one-shot thread (Ray refusing the submission, a
    working dir it cannot upload) left Ray, and so the head job and its cluster, running."""
    a = head_agent(tmp_path)
    a.ndir.write_start(StartRequest(id="r1", ray_start=["ray", "start", "--head"],
                                    entrypoint=["python", "train.py"]))
    ray = RayChild(limit_s=10)
    monkeypatch.setattr(proc, "start", lambda argv, env=None, new_session=False: ray)
    monkeypatch.setattr(Agent, "node_ip", lambda self: "127.0.0.2")
    monkeypatch.setattr(head_role, "wait_port_free", lambda *args: None)

    class Refusing:
        def submit_job(self, **kw: Any) -> str:
            raise RuntimeError("working_dir upload failed")

    monkeypatch.setattr(oneshot, "job_client", lambda *a: Refusing())
    assert a.main() == oneshot.CLUSTER_FAILED
    assert ray.signalled  # the agent stopped Ray itself: the job ends now, not at walltime


def sbatch_cli(c: Any, fake: FakeSlurm, monkeypatch: pytest.MonkeyPatch, *argv: str) -> int:
    """`ray-slurm sbatch CONFIG ARGV...` against FakeSlurm (Slurm offline for bootstrap)."""
    monkeypatch.setattr("ray_slurm_provider.provider.bootstrap._cluster_info", offline)
    monkeypatch.setattr("ray_slurm_provider.provider.provider.make_client", lambda pcfg: fake)
    for cmd in ("sbatch", "status", "logs"):
        monkeypatch.setattr(f"ray_slurm_provider.cli.{cmd}.load_cluster",
                            lambda path, **kw: c)
    monkeypatch.setenv("PATH", os.environ["PATH"])  # cmd_sbatch prepends to it
    return main(["sbatch", str(c.path), *argv])


def run_ids(err: str) -> list[str]:
    return re.findall(r"ray-slurm sbatch: run (\S+) ", err)


def test_each_sbatch_run_is_its_own_cluster_and_runs_queue_side_by_side(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 26.1: a second `sbatch` of one YAML while the first head is PENDING was taken
    under the same cluster name, so the first run's end cancelled the second's head."""
    fake = FakeSlurm()
    c = make_cluster(tmp_path, fake)
    assert sbatch_cli(c, fake, monkeypatch, "--", "python", "a.py") == 0
    assert sbatch_cli(c, fake, monkeypatch, "--", "python", "b.py") == 0
    out = capsys.readouterr()
    heads, rids = out.out.split(), run_ids(out.err)
    assert len(heads) == 2 and len(set(rids)) == 2, out
    names = [fake.job(h).name for h in heads]
    assert names == [f"{c.job_name}-{r}" for r in rids]  # its own jobs, its own teardown
    for head, rid, entry in zip(heads, rids, ("a.py", "b.py"), strict=True):
        cdir = ClusterDir(str(tmp_path / "state"), f"{c.name}-{rid}")
        req = cdir.node(head).read_start()
        assert req is not None and req.entrypoint == ["python", entry]
    assert not c.cdir.node(heads[0]).path.exists()  # nothing in the config's own dir
    # The first run's head ends its cluster: the second run's queued head stays.
    spec = NodeSpec(kind="head", node_type="head", cluster_name=f"{c.name}-{rids[0]}",
                    state_dir=str(tmp_path / "state"), ports_base=25000)
    a = HeadAgent(spec, {"SLURM_JOB_ID": heads[0], "HOME": str(tmp_path)})
    a.slurm = fake
    a.end_cluster(StartRequest(id="r", ray_start=["ray"], entrypoint=["python", "a.py"]))
    assert fake.job(heads[1]).state == "PENDING"


def test_a_run_name_fits_the_cluster_name_rules(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    fake = FakeSlurm()
    c = make_cluster(tmp_path, fake)
    c.config["cluster_name"] = "x" * 63
    assert sbatch_cli(c, fake, monkeypatch, "--", "true") == 0
    out = capsys.readouterr()
    (rid,) = run_ids(out.err)
    name = fake.job(out.out.strip()).name.removeprefix("ray-")
    assert NAME_RE.match(name) and name.endswith(f"-{rid}") and len(name) == 63


def test_status_and_logs_name_a_run_by_its_id(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    fake = FakeSlurm()
    c = make_cluster(tmp_path, fake)
    assert sbatch_cli(c, fake, monkeypatch, "--", "true") == 0
    out = capsys.readouterr()
    head, (rid,) = out.out.strip(), run_ids(out.err)
    assert f"ray-slurm logs {c.path} head --run {rid} -f" in out.err
    assert main(["status", str(c.path), "--run", rid, "--ended", "0"]) == 0
    assert head in capsys.readouterr().out
    ClusterDir(str(tmp_path / "state"), f"{c.name}-{rid}").log(head).write_text("RUN LOG\n")
    for ref in (rid, f"{c.name}-{rid}"):  # the run id or the run's cluster name
        assert main(["logs", str(c.path), "head", "--run", ref]) == 0
        assert "RUN LOG" in capsys.readouterr().out
    assert main(["status", str(c.path), "--run", "nosuch"]) == 2
    assert f"no one-shot run 'nosuch' of {c.name!r}" in capsys.readouterr().err


def test_a_pinned_port_base_is_refused_while_another_run_lives(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    fake = FakeSlurm()
    c = make_cluster(tmp_path, fake, ports={"base": 30000})
    assert sbatch_cli(c, fake, monkeypatch, "--", "true") == 0
    head = capsys.readouterr().out.strip()
    assert sbatch_cli(c, fake, monkeypatch, "--", "true") == 2
    err = capsys.readouterr().err
    assert "provider.ports.base" in err and f"head job {head} PENDING" in err, err
    assert len(fake.submitted) == 1
    fake.finish(head)
    assert sbatch_cli(c, fake, monkeypatch, "--", "true") == 0


def test_only_the_newest_ended_runs_are_kept(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    fake = FakeSlurm()
    c = make_cluster(tmp_path, fake, oneshot_runs_kept=2)
    for _ in range(4):
        assert sbatch_cli(c, fake, monkeypatch, "--", "true") == 0
        fake.clock.advance(1)
    out = capsys.readouterr()
    heads, rids = out.out.split(), run_ids(out.err)
    for h in heads[:3]:  # the last one still runs
        fake.finish(h)
    assert main(["status", str(c.path), "--ended", "0"]) == 0
    left = {p.name for p in (tmp_path / "state").iterdir()}
    assert {f"{c.name}-{r}" for r in rids[1:]} <= left
    assert f"{c.name}-{rids[0]}" not in left


def oneshot_head(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                 staged: bool = True) -> tuple[HeadAgent, Path]:
    """A one-shot head agent on FakeSlurm with a staged working dir; Ray itself faked."""
    a = head_agent(tmp_path)
    wd = oneshot.staged_dir(a.cdir, "abc")
    wd.mkdir(parents=True)
    a.ndir.write_start(StartRequest(id="r1", ray_start=["ray", "start", "--head"],
                                    before=["setup"], entrypoint=["python", "train.py"],
                                    runtime_env={"working_dir": str(wd)}))
    monkeypatch.setattr(Agent, "node_ip", lambda self: "127.0.0.2")
    monkeypatch.setattr(head_role, "wait_port_free", lambda *args: None)
    return a, wd


@pytest.mark.parametrize("step", ["setup", "ray start"])
def test_a_one_shot_head_whose_setup_or_ray_start_fails_ends_with_125(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, step: str) -> None:
    """Issue 26.3: exit 1 could not be told from an entrypoint that exits 1."""
    a, wd = oneshot_head(tmp_path, monkeypatch)
    if step == "setup":
        def fail(self: Any, before: list[str], env: dict[str, str]) -> None:
            raise proc.CommandError(["mkdir", "x"], "mkdir: cannot create directory")

        monkeypatch.setattr(HeadAgent, "run_before", fail)
    else:
        monkeypatch.setattr(HeadAgent, "run_before", lambda self, before, env: None)
        monkeypatch.setattr(HeadAgent, "run_ray", lambda self, argv, env, up: 1)
    monkeypatch.setattr(oneshot, "run_entrypoint", lambda *a: pytest.fail("ran"))
    assert a.main() == oneshot.CLUSTER_FAILED
    assert not wd.exists()


def test_a_head_slurm_refuses_is_one_line_and_leaves_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 26.3: Slurm's refusal (a ClickException) escaped `sbatch` as a traceback, and the
    copied working dir stayed."""
    fake = FakeSlurm()
    c = make_cluster(tmp_path, fake)
    head_type = c.config["head_node_type"]
    c.config["available_node_types"][head_type].setdefault("node_config", {})[
        "partition"] = "nope"
    work = tmp_path / "work"
    work.mkdir()
    assert sbatch_cli(c, fake, monkeypatch, "--working-dir", str(work), "--", "true") == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]  # Ray's progress lines above it
    assert last.startswith("ray-slurm: Slurm did not take the job of node type head: "), last
    assert "invalid partition specified: nope" in last
    assert fake.submitted == []
    assert not list((tmp_path / "state").glob("*/oneshot/*"))  # the staged working dir went


def test_the_staged_dir_of_a_head_cancelled_while_pending_goes_at_the_next_status(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 26.3: a head scancelled while pending never runs to remove its working dir."""
    fake = FakeSlurm()
    c = make_cluster(tmp_path, fake)
    work = tmp_path / "work"
    work.mkdir()
    assert sbatch_cli(c, fake, monkeypatch, "--working-dir", str(work), "--", "true") == 0
    head = capsys.readouterr().out.strip()
    (staged,) = (tmp_path / "state").glob("*/oneshot/*")
    assert main(["status", str(c.path), "--ended", "0"]) == 0
    assert staged.exists()  # still queued
    fake.finish(head, "CANCELLED")
    assert main(["status", str(c.path), "--ended", "0"]) == 0
    assert not staged.exists()
