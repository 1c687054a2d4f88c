"""The Python API (cli/api.py) with FakeSlurm, a recording `ray` and a fake job client: no
Slurm, no Ray cluster, no sleeping."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

import ray_slurm_provider
from ray_slurm_provider.cli.api import ClusterError, SlurmCluster
from ray_slurm_provider.jobs import encode_tags
from ray_slurm_provider.slurm.script import JobSpec
from ray_slurm_provider.state import HeadInfo, RayUp
from tests.fakes import FakeClock, FakeSlurm

SANDBOX_YAML = Path(__file__).resolve().parents[2] / "cluster-configs" / "sandbox.yaml"
HEAD_TAGS = {"ray-node-type": "head", "ray-user-node-type": "head"}
WORKER_TAGS = {"ray-node-type": "worker", "ray-user-node-type": "cpu_worker"}


class Ray:
    """A recording `ray` CLI: `up` submits and starts a head in the fake Slurm, `down`
    cancels the cluster's jobs."""

    def __init__(self, fake: FakeSlurm, codes: dict[str, int] | None = None) -> None:
        self.fake = fake
        self.codes = codes or {}
        self.calls: list[list[str]] = []
        self.c: SlurmCluster | None = None

    def __call__(self, args: list[str], timeout: float) -> int:
        self.calls.append(args)
        assert self.c is not None
        cdir = self.c.cluster.cdir
        if args[0] == "up":
            head = self.fake.submit(JobSpec("ray-sandbox", ["true"]),
                                    comment=encode_tags(HEAD_TAGS))
            self.fake.start(head, "n1")
            cdir.create()
            cdir.node(head).write_ray_up(RayUp(ip="127.0.0.2", job_id=head))
            cdir.write_head(HeadInfo(job_id=head, ip="127.0.0.2", gcs_port=24000,
                                     dashboard_port=24001, client_port=24002))
        elif args[0] == "down":
            self.fake.cancel(j.job_id for j in self.fake.list_jobs("ray-sandbox"))
            cdir.head_file.unlink(missing_ok=True)
        return self.codes.get(args[0], 0)


def make(tmp_path: Path, fake: FakeSlurm, **kw: Any) -> tuple[SlurmCluster, Ray]:
    config = yaml.safe_load(SANDBOX_YAML.read_text())
    config["provider"]["state_dir"] = str(tmp_path / "state")
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(config))
    ray = Ray(fake)
    c = SlurmCluster(path, ray=ray, **kw)
    c.cluster.client_factory = lambda pcfg: fake
    c.cluster.sleep = lambda s: None  # a throttled Slurm is asked again: never really wait
    ray.c = c
    return c, ray


def test_with_brings_the_cluster_up_and_takes_it_down(tmp_path: Path) -> None:
    fake = FakeSlurm()
    c, ray = make(tmp_path, fake)
    with c as inside:
        assert inside is c and c.created
        head = fake.list_jobs("ray-sandbox")[0].job_id
        assert c.dashboard_url == "http://127.0.0.2:24001"
        assert c.gcs_address == "127.0.0.2:24000"
        assert c.env["RAY_ADDRESS"] == "127.0.0.2:24000"  # `ray-slurm env`'s exports
        assert c.env["RAY_AUTH_TOKEN_PATH"] == str(c.cluster.cdir.root / "auth_token")
    assert ray.calls == [["up", "-y", "--no-config-cache", c.path], ["down", "-y", c.path]]
    assert fake.job(head).state == "CANCELLED" and not c.created


def test_address_is_ray_clients_and_points_this_processes_ray_at_the_token(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    used: list[dict[str, str]] = []
    monkeypatch.setattr("ray_slurm_provider.rayapi.use_auth", used.append)
    c, _ = make(tmp_path, FakeSlurm())
    with c:
        assert c.address == "ray://127.0.0.2:24002"
    assert used == [{"RAY_AUTH_MODE": "token",
                     "RAY_AUTH_TOKEN_PATH": str(c.cluster.cdir.root / "auth_token")}]


def test_a_cluster_already_up_is_refused_unless_reused_and_then_left_up(
        tmp_path: Path) -> None:
    fake = FakeSlurm()
    first, _ = make(tmp_path, fake)
    first.up()
    again, ray = make(tmp_path, fake)
    with pytest.raises(ClusterError, match=r"already up .*reuse=True"):
        again.up()
    reused, ray = make(tmp_path, fake, reuse=True)
    with reused:
        assert reused.dashboard_url.startswith("http://")
    assert ray.calls == [] and len(fake.list_jobs("ray-sandbox")) == 1


def test_a_starting_head_is_refused(tmp_path: Path) -> None:
    fake = FakeSlurm()
    fake.submit(JobSpec("ray-sandbox", ["true"]), comment=encode_tags(HEAD_TAGS))
    c, ray = make(tmp_path, fake, reuse=True)
    with pytest.raises(ClusterError, match="not up yet: its head job 1000 is PENDING"):
        c.up()
    assert ray.calls == []


def test_a_failed_ray_up_is_followed_by_ray_down(tmp_path: Path) -> None:
    fake = FakeSlurm()
    c, ray = make(tmp_path, fake)
    ray.codes["up"] = 1
    with pytest.raises(ClusterError, match="`ray up` failed with exit code 1"):
        with c:
            raise AssertionError("not reached")
    assert [a[0] for a in ray.calls] == ["up", "down"]
    assert fake.list_jobs("ray-sandbox") == []


def test_an_interrupted_ray_up_is_followed_by_ray_down(tmp_path: Path) -> None:
    c, ray = make(tmp_path, FakeSlurm())

    def interrupted(args: list[str], timeout: float) -> int:
        ray(args, timeout)
        if args[0] == "up":
            raise KeyboardInterrupt
        return 0

    c._ray = interrupted
    with pytest.raises(KeyboardInterrupt):
        c.up()
    assert [a[0] for a in ray.calls] == ["up", "down"]


def test_errors_are_typed_never_an_exit(tmp_path: Path) -> None:
    with pytest.raises(ClusterError, match=r"cannot read .*nope\.yaml"):
        SlurmCluster(tmp_path / "nope.yaml")
    fake = FakeSlurm()
    c, ray = make(tmp_path, fake)
    with pytest.raises(ClusterError, match=r"no running head .*run `ray up"):
        _ = c.address
    fake.set_outage(True)
    with pytest.raises(ClusterError, match=r"cannot ask Slurm .*Unable to contact"):
        c.up()
    with pytest.raises(ClusterError, match="cannot list the cluster's jobs"):
        c.status()
    fake.set_outage(False)
    ray.codes["down"] = 3
    with pytest.raises(ClusterError, match="`ray down` failed with exit code 3"):
        c.down()


def test_status_and_logs_are_the_commands(tmp_path: Path) -> None:
    fake = FakeSlurm()
    c, _ = make(tmp_path, fake)
    with c:
        worker = fake.submit(JobSpec("ray-sandbox", ["true"]), comment=encode_tags(WORKER_TAGS))
        head = c.cluster.cdir.read_head()
        assert head is not None
        rows = {r["job_id"]: r for r in c.status()["nodes"]}
        assert rows[head.job_id]["kind"] == "head" and rows[head.job_id]["ray_up"]
        assert rows[worker]["node_type"] == "cpu_worker" and rows[worker]["state"] == "PENDING"
        assert "dashboard: http://127.0.0.2:24001" in c.status_table()
        c.cluster.cdir.log(head.job_id).write_text("agent: start\nray: up\n")
        assert c.logs("head") == "agent: start\nray: up\n"
        assert c.logs(head.job_id, lines=1) == "ray: up"
        with pytest.raises(ClusterError, match="no log for job 1001"):
            c.logs(worker)
        with pytest.raises(ClusterError, match="not a Slurm job id"):
            c.logs("nope")


class JobClient:
    """Ray's JobSubmissionClient as request_resources uses it; the job ends after `polls`."""

    def __init__(self, end: str = "SUCCEEDED", polls: int = 3) -> None:
        self.end = end
        self.polls = polls
        self.entrypoints: list[str] = []

    def submit_job(self, *, entrypoint: str) -> str:
        self.entrypoints.append(entrypoint)
        return "raysubmit_1"

    def get_job_status(self, job: str) -> Any:
        from ray.job_submission import JobStatus

        self.polls -= 1
        return JobStatus(self.end) if self.polls <= 0 else JobStatus.RUNNING

    def get_job_logs(self, job: str) -> str:
        return "Traceback: boom"


def test_request_resources_runs_rays_call_in_a_driver_on_the_head(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock()
    client = JobClient()
    monkeypatch.setattr("ray_slurm_provider.agent.oneshot.job_client", lambda *a: client)
    c, _ = make(tmp_path, FakeSlurm(), sleep=clock.advance, clock=clock)
    with c:
        c.request_resources(num_cpus=2, bundles=[{"CPU": 1, "GPU": 1}])
    (entry,) = client.entrypoints
    python, flag, code, args = shlex.split(entry)
    assert python == sys.executable and flag == "-c"
    assert "from ray.autoscaler.sdk import request_resources" in code and "ray.init()" in code
    assert json.loads(args) == {"num_cpus": 2, "bundles": [{"CPU": 1, "GPU": 1}]}


def test_request_resources_says_why_it_failed_or_gave_up(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock()
    client = JobClient(end="FAILED")
    monkeypatch.setattr("ray_slurm_provider.agent.oneshot.job_client", lambda *a: client)
    c, _ = make(tmp_path, FakeSlurm(), sleep=clock.advance, clock=clock)
    with c:
        with pytest.raises(ClusterError, match="raysubmit_1 FAILED: Traceback: boom"):
            c.request_resources(num_cpus=1)
        client.end, client.polls = "SUCCEEDED", 1000
        with pytest.raises(ClusterError, match="did not end within 5s"):
            c.request_resources(num_cpus=1, timeout_s=5)


def test_the_package_exports_the_api_lazily() -> None:
    assert ray_slurm_provider.SlurmCluster is SlurmCluster
    assert ray_slurm_provider.ClusterError is ClusterError
    with pytest.raises(AttributeError):
        _ = ray_slurm_provider.Nope
    code = ("import sys, ray_slurm_provider; "
            "print(sorted(m for m in sys.modules if m.startswith('ray_slurm_provider.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    assert out.strip() == "[]"


# --- from a laptop (provider.ssh): the login node runs the commands, tunnels reach the head ---

class LoginNode:
    """What the login node answers over the connection (cli/remote.run_there) and the
    tunnels' exports (cli/tunnels.tunnel_env), recorded."""

    def __init__(self, heads: list[dict[str, Any]]) -> None:
        self.heads = heads
        self.argvs: list[list[str]] = []

    def run_there(self, cluster: Any, argv: list[str]) -> str:
        self.argvs.append(argv)
        if argv[0] == "status":
            return json.dumps({"nodes": self.heads})
        return "the head's log\n"

    def tunnel_env(self, cluster: Any) -> tuple[HeadInfo, dict[str, str], dict[str, int]]:
        head = HeadInfo(job_id="7", ip="10.0.0.5", gcs_port=24000, dashboard_port=24001,
                        client_port=24002)
        return head, {"RAY_ADDRESS": "ray://127.0.0.1:40002",
                      "RAY_DASHBOARD_URL": "http://127.0.0.1:40001",
                      "RAY_AUTH_MODE": "disabled"}, {"client": 40002, "dashboard": 40001}


def laptop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
           heads: list[dict[str, Any]]) -> tuple[SlurmCluster, LoginNode, list[list[str]]]:
    from ray_slurm_provider.cli import remote, tunnels

    config = yaml.safe_load(SANDBOX_YAML.read_text())
    config["provider"].update(python="/login/venv/bin/python",
                              ssh={"host": "login.example.org", "user": "me"})
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(config))
    login = LoginNode(heads)
    monkeypatch.setattr(remote, "run_there", login.run_there)
    monkeypatch.setattr(tunnels, "tunnel_env", login.tunnel_env)
    calls: list[list[str]] = []

    def ray(args: list[str], timeout: float) -> int:
        calls.append(args)
        return 0

    return SlurmCluster(path, reuse=True, ray=ray), login, calls


def test_from_a_laptop_the_login_node_answers_and_tunnels_reach_the_head(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    up = [{"kind": "head", "job_id": "7", "state": "RUNNING", "ray_up": True}]
    c, login, calls = laptop(tmp_path, monkeypatch, up)
    assert c.laptop
    assert c.up() is c and calls == []  # reuse: it is up (the login node said so)
    assert login.argvs[-1] == ["status", "{config}", "--json", "--ended", "0"]
    assert c.address == "ray://127.0.0.1:40002"  # the tunnel, not the head's own address
    assert c.dashboard_url == "http://127.0.0.1:40001"
    with pytest.raises(ClusterError, match="not reachable from a laptop"):
        _ = c.gcs_address
    assert c.logs("head", lines=5) == "the head's log\n"
    assert login.argvs[-1] == ["logs", "{config}", "head", "--lines", "5"]
    c.down()
    assert calls == [["down", "-y", str(tmp_path / "c.yaml")]]  # `ray down`, on the laptop


def test_from_a_laptop_a_head_still_starting_is_named(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    starting = [{"kind": "head", "job_id": "8", "state": "PENDING", "ray_up": False}]
    c, _, calls = laptop(tmp_path, monkeypatch, starting)
    with pytest.raises(ClusterError, match="its head job 8 is PENDING"):
        c.up()
    c, _, calls = laptop(tmp_path, monkeypatch, [])
    c.up()
    assert calls[0][:3] == ["up", "-y", "--no-config-cache"]  # none: `ray up` from the laptop
