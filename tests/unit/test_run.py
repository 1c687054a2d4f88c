"""`ray-slurm run` (issue 17.1) with fakes: Slurm (FakeSlurm), `ray up`/`ray down` (a fake CLI
that submits and cancels the head), Ray's job client, and real signals raised at chosen steps.
The sandbox test is tests/e2e/test_oneshot.py."""

from __future__ import annotations

import io
import signal
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from ray.autoscaler.tags import NODE_KIND_HEAD, TAG_RAY_NODE_KIND
from ray.job_submission import JobStatus

from ray_slurm_provider.cli import run
from ray_slurm_provider.cli.common import CliError, Cluster
from ray_slurm_provider.cli.main import main
from ray_slurm_provider.jobs import encode_tags
from ray_slurm_provider.slurm.client import SlurmError
from ray_slurm_provider.slurm.script import JobSpec
from ray_slurm_provider.state import HeadInfo
from tests.fakes import FakeSlurm
from tests.unit.test_cmds import cluster as make_cluster


@dataclass
class Info:
    status: JobStatus
    driver_exit_code: int | None = None
    message: str = ""


class FakeJobs:
    """Ray's JobSubmissionClient: a scripted status per poll; the last one repeats."""

    def __init__(self, statuses: list[Info], logs: str = "hello from the entrypoint\n") -> None:
        self.statuses, self.logs = statuses, logs
        self.submitted: list[dict[str, Any]] = []
        self.stopped: list[str] = []

    def submit_job(self, **kw: Any) -> str:
        self.submitted.append(kw)
        return "raysubmit_1"

    def get_job_info(self, job_id: str) -> Info:
        if self.stopped:
            return Info(JobStatus.STOPPED)
        return self.statuses.pop(0) if len(self.statuses) > 1 else self.statuses[0]

    def stop_job(self, job_id: str) -> bool:
        self.stopped.append(job_id)
        return True

    async def tail_job_logs(self, job_id: str) -> AsyncIterator[str]:
        yield self.logs


class World:
    """The cluster, FakeSlurm behind it, the fake `ray` CLI and what each step did."""

    def __init__(self, tmp: Path, jobs: FakeJobs, up_rc: int = 0) -> None:
        self.slurm = FakeSlurm()
        self.cluster: Cluster = make_cluster(tmp, self.slurm)
        self.jobs, self.up_rc = jobs, up_rc
        self.calls: list[str] = []
        self.on_poll: dict[int, Callable[[], None]] = {}
        self.on_up: Callable[[], None] | None = None
        self.polls = 0
        self.out, self.err = io.StringIO(), io.StringIO()

    def ray(self, args: list[str], timeout: float) -> int:
        self.calls.append(args[0])
        if args[0] == "up":
            if self.on_up:
                self.on_up()
            if self.up_rc:
                return self.up_rc
            head = self.slurm.submit(JobSpec(job_name=self.cluster.job_name, command=["x"]))
            self.slurm.start(head)
            self.cluster.cdir.write_head(HeadInfo(job_id=head, ip="127.0.0.2", gcs_port=1))
        else:
            self.slurm.cancel([j.job_id for j in self.slurm.list_jobs(self.cluster.job_name)])
            self.cluster.cdir.clear_head()
        return 0

    def sleep(self, s: float) -> None:
        self.polls += 1
        if self.polls in self.on_poll:
            self.on_poll[self.polls]()

    def runner(self, **plan: Any) -> run.Runner:
        p = run.Plan(str(self.cluster.path), ["python", "train.py"], **plan)
        return run.Runner(self.cluster, p, ray=self.ray, client=lambda c: self.jobs,
                          sleep=self.sleep, out=self.out, err=self.err)

    def leftovers(self) -> list[str]:
        return [j.job_id for j in self.slurm.list_jobs(self.cluster.job_name) if j.active]


def test_the_entrypoints_exit_code_and_nothing_remains(tmp_path: Path) -> None:
    w = World(tmp_path, FakeJobs([Info(JobStatus.RUNNING), Info(JobStatus.FAILED, 3)]))
    assert w.runner().run() == 3
    assert w.calls == ["up", "down"]
    assert w.jobs.submitted == [{"entrypoint": "python train.py", "runtime_env": None}]
    assert "hello from the entrypoint" in w.out.getvalue()
    assert w.jobs.stopped == [] and w.leftovers() == []


def test_success_is_zero(tmp_path: Path) -> None:
    w = World(tmp_path, FakeJobs([Info(JobStatus.SUCCEEDED)]))
    assert w.runner().run() == 0 and w.calls == ["up", "down"]


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143),
                                           (signal.SIGHUP, 129)])
def test_a_signal_mid_run_stops_the_job_and_downs_the_cluster(tmp_path: Path,
                                                              sig: signal.Signals,
                                                              code: int) -> None:
    before = signal.getsignal(sig)
    w = World(tmp_path, FakeJobs([Info(JobStatus.RUNNING)]))
    w.on_poll[3] = lambda: signal.raise_signal(sig)
    assert w.runner().run() == code
    assert w.jobs.stopped == ["raysubmit_1"]
    assert w.calls == ["up", "down"] and w.leftovers() == []
    assert signal.getsignal(sig) == before
    assert f"{sig.name}: stopping the job and the cluster" in w.err.getvalue()


def test_a_signal_during_ray_up_still_downs_what_was_started(tmp_path: Path) -> None:
    w = World(tmp_path, FakeJobs([Info(JobStatus.RUNNING)]))
    w.on_up = lambda: signal.raise_signal(signal.SIGTERM)
    assert w.runner().run() == 143
    assert w.calls == ["up", "down"] and w.jobs.submitted == []


def test_the_heads_end_is_the_clusters_failure_not_the_entrypoints(tmp_path: Path) -> None:
    w = World(tmp_path, FakeJobs([Info(JobStatus.RUNNING)]))

    def walltime() -> None:
        head = w.cluster.cdir.read_head()
        assert head is not None
        w.slurm.finish(head.job_id, "TIMEOUT")

    w.on_poll[2] = walltime
    assert w.runner().run() == run.CLUSTER_FAILED
    assert "ended while the entrypoint ran" in w.err.getvalue()
    assert w.calls == ["up", "down"]


def test_a_failed_ray_up_is_the_clusters_failure(tmp_path: Path) -> None:
    w = World(tmp_path, FakeJobs([Info(JobStatus.RUNNING)]), up_rc=1)
    assert w.runner().run() == run.CLUSTER_FAILED
    assert w.calls == ["up", "down"] and w.jobs.submitted == []


def test_ray_failing_to_run_the_entrypoint_is_the_clusters_failure(tmp_path: Path) -> None:
    w = World(tmp_path, FakeJobs([Info(JobStatus.FAILED, None, "runtime_env setup failed")]))
    assert w.runner().run() == run.CLUSTER_FAILED
    assert "runtime_env setup failed" in w.err.getvalue()


def test_a_cluster_already_up_is_refused_unless_reused(tmp_path: Path) -> None:
    w = World(tmp_path, FakeJobs([Info(JobStatus.SUCCEEDED)]))
    w.ray(["up"], 1)
    w.calls.clear()
    with pytest.raises(CliError, match=r"is already up .*add --reuse"):
        w.runner().run()
    assert w.calls == [] and w.jobs.submitted == []
    assert w.runner(reuse=True).run() == 0
    assert w.calls == [] and len(w.leftovers()) == 1  # a reused cluster stays up


def test_no_down_leaves_the_cluster(tmp_path: Path) -> None:
    w = World(tmp_path, FakeJobs([Info(JobStatus.SUCCEEDED)]))
    assert w.runner(down=False).run() == 0
    assert w.calls == ["up"] and len(w.leftovers()) == 1


@pytest.mark.parametrize(("argv", "message"), [
    ([], "no entrypoint: put the command after `--`"),
    (["--"], "no entrypoint: put the command after `--`"),
    (["--no-down", "python"], "no entrypoint: put the command after `--`"),
    (["--working-dir", "/no/such/dir", "--", "python"], "--working-dir /no/such/dir: no such"),
    (["--runtime-env-json", "{", "--", "python"], "--runtime-env-json is not valid JSON"),
    (["--runtime-env-json", "[1]", "--", "python"], "must be a JSON object"),
    (["--bogus", "--", "python"], "unknown options before `--`: --bogus"),
])
def test_bad_input_is_refused_before_anything_runs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        argv: list[str], message: str) -> None:
    w = World(tmp_path, FakeJobs([Info(JobStatus.SUCCEEDED)]))
    monkeypatch.setattr(run.Runner, "run", lambda self: pytest.fail("ran"))
    assert main(["run", str(w.cluster.path), *argv]) == 2
    assert message in capsys.readouterr().err


def test_options_before_and_after_the_config(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    w = World(tmp_path, FakeJobs([Info(JobStatus.SUCCEEDED)]))
    seen: list[run.Plan] = []
    monkeypatch.setattr(run.Runner, "run", lambda self: seen.append(self.plan) or 0)
    assert main(["run", "--no-down", str(w.cluster.path), "--working-dir", str(tmp_path),
                 "--runtime-env-json", '{"env_vars": {"A": "1"}}', "--", "python", "-c",
                 "x", "--flag"]) == 0
    assert seen[0].entrypoint == ["python", "-c", "x", "--flag"]
    assert seen[0].runtime_env == {"env_vars": {"A": "1"}, "working_dir": str(tmp_path)}
    assert seen[0].down is False and seen[0].reuse is False
    assert main(["run", str(w.cluster.path), "--", "python", "x.py"]) == 0
    assert seen[1].entrypoint == ["python", "x.py"] and seen[1].down is True


def test_a_client_error_is_the_clusters_failure_and_still_downs_it(tmp_path: Path) -> None:
    w = World(tmp_path, FakeJobs([Info(JobStatus.RUNNING)]))

    def refuse(c: Cluster) -> Any:
        raise RuntimeError("Authentication required: Missing authentication token")

    r = w.runner()
    r.client = refuse
    assert r.run() == run.CLUSTER_FAILED
    assert "RuntimeError: Authentication required" in w.err.getvalue()
    assert w.calls == ["up", "down"] and w.leftovers() == []


def test_the_job_client_carries_the_clusters_token_in_its_header(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Found on the sandbox: Ray reads RAY_AUTH_MODE when first imported, so exporting it in
    `ray-slurm run` came too late and the dashboard answered 401."""
    import ray.job_submission

    from ray_slurm_provider.agent import oneshot

    made: list[tuple[str, dict[str, str]]] = []
    monkeypatch.setattr(ray.job_submission, "JobSubmissionClient",
                        lambda address, headers: made.append((address, headers)))
    w = World(tmp_path, FakeJobs([Info(JobStatus.RUNNING)]))
    w.cluster.cdir.create()
    (w.cluster.cdir.root / "auth_token").write_text("s3cret\n")
    head = HeadInfo(job_id="1", ip="127.0.0.2", gcs_port=1, dashboard_port=8265)
    oneshot.job_client(w.cluster.cdir, head, "token")
    oneshot.job_client(w.cluster.cdir, head, "disabled")
    assert made == [("http://127.0.0.2:8265", {"Authorization": "Bearer s3cret"}),
                    ("http://127.0.0.2:8265", {})]


@pytest.mark.parametrize("state", ["PENDING", "CONFIGURING", "RUNNING"])
def test_a_head_not_up_yet_is_refused_with_its_job_and_state(tmp_path: Path,
                                                             state: str) -> None:
    """Issue 26.1: `running_head` saw a head only once head.json existed (Ray up), so a second
    `run` while the first head was still queued brought up the same cluster twice."""
    w = World(tmp_path, FakeJobs([Info(JobStatus.SUCCEEDED)]))
    head = w.slurm.submit(JobSpec(job_name=w.cluster.job_name, command=["x"]),
                          comment=encode_tags({TAG_RAY_NODE_KIND: NODE_KIND_HEAD}))
    if state != "PENDING":
        w.slurm.start(head)
        w.slurm.set_state(head, state)
    for reuse in (False, True):
        with pytest.raises(CliError, match=rf"head job {head} is {state}"):
            w.runner(reuse=reuse).run()
    assert w.calls == [] and w.jobs.submitted == []


def test_run_resolves_the_config_afresh_like_sbatch(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 26.4: `ray up` reused Ray's cached resolution of the YAML, so after an edit of
    only a site defaults file `run` kept the old values; `sbatch` resolves afresh. `ray down`
    has no --no-config-cache: the cache entry for the YAML goes before it runs."""
    import tempfile

    from ray.autoscaler._private.commands import _bootstrap_config

    monkeypatch.setattr("ray_slurm_provider.provider.bootstrap._cluster_info",
                        lambda config=None: (_ for _ in ()).throw(SlurmError("offline")))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    w = World(tmp_path, FakeJobs([Info(JobStatus.SUCCEEDED)]))
    _bootstrap_config(yaml.safe_load(Path(w.cluster.path).read_text()))  # Ray caches it
    cached = list(tmp_path.glob("ray-config-*"))
    assert cached
    argvs: list[list[str]] = []
    plain = w.ray

    def ray(args: list[str], timeout: float) -> int:
        argvs.append(args)
        if args[0] == "down":
            assert not any(p.exists() for p in cached)
        return plain(args, timeout)

    r = w.runner()
    r.ray = ray
    assert r.run() == 0
    assert argvs[0][:2] == ["up", "-y"] and "--no-config-cache" in argvs[0]
    assert argvs[1][0] == "down"


def test_run_filters_rays_hints_that_do_not_apply() -> None:
    """Issue 26.18: `ray up`'s closing hints tell the user to `ray down` the cluster (`run`
    does) and to tail monitor logs under /tmp/ray (not where this provider's Ray logs)."""
    tail = ("Useful commands:\n"
            "  To terminate the cluster:\n"
            "    \x1b[1mray down /x/c.yaml\x1b[0m\n"
            "\n"
            "  To retrieve the IP address of the cluster head:\n"
            "    ray get-head-ip /x/c.yaml\n"
            "\n"
            "  To monitor autoscaling:\n"
            "    ray exec /x/c.yaml 'tail -n 100 -f /tmp/ray/session_latest/logs/monitor*'\n"
            "\n"
            "  it is recommended to restart this head node with:   ray down  /x/c.yaml\n")
    out = io.StringIO()
    run.relay(io.StringIO(tail), out)
    text = out.getvalue()
    assert "ray down" not in text and "monitor" not in text, text
    assert "To terminate" not in text and "To monitor" not in text
    assert "  To retrieve the IP address of the cluster head:\n    ray get-head-ip" in text


def test_ray_cli_passes_rays_output_to_stderr_through_the_filter(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capfd: pytest.CaptureFixture[str]) -> None:
    ray = tmp_path / "ray"
    ray.write_text("#!/bin/sh\necho \"args: $*\"\necho '  To terminate the cluster:'\n"
                   "echo '    ray down /x/c.yaml'\necho\necho done\nexit 4\n")
    ray.chmod(0o755)
    monkeypatch.setattr(run.sys, "executable", str(tmp_path / "python"))
    assert run.ray_cli(["up", "-y"], 30) == 4
    out, err = capfd.readouterr()
    assert out == "" and err == "args: up -y\ndone\n"


def test_a_throttled_listing_after_ray_up_is_asked_again(tmp_path: Path) -> None:
    """Issue 29: Slurm not answering once after `ray up` is no failed cluster (torn down)."""
    from ray_slurm_provider.slurm.client import TransientSlurmError

    w = World(tmp_path, FakeJobs([Info(JobStatus.SUCCEEDED)]))
    w.on_up = lambda: w.slurm.fail_next("list_jobs", TransientSlurmError(
        "squeue: error: slurm_load_jobs: Socket timed out on send/recv operation"))
    assert w.runner().run() == 0, w.err.getvalue()
    assert w.calls == ["up", "down"] and len(w.jobs.submitted) == 1
