"""Issue 16: the job and the node agent of a gang type. One step runs an agent per node; each
member is its own Ray node (id, temp dir, labels); a released member ends with exit 0 (its
group lives on), a member whose Ray dies on its own ends with an error (srun then ends the
group)."""

from __future__ import annotations

import json
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ray_slurm_provider import proc
from ray_slurm_provider.agent.agent import Agent
from ray_slurm_provider.agent.worker import WorkerAgent
from ray_slurm_provider.cluster import parse_cluster
from ray_slurm_provider.jobs import build_job
from ray_slurm_provider.nodespec import GROUP_LABEL, INDEX_LABEL, NodeSpec, node_id
from ray_slurm_provider.provider.gangs import Gangs
from ray_slurm_provider.slurm.script import render
from ray_slurm_provider.state import ClusterDir, HeadInfo
from tests.fakes import FakeSlurm
from tests.unit.test_agent import FakeChild

ENV = {"SLURM_JOB_ID": "9", "SLURM_NODEID": "1", "SLURM_CPUS_ON_NODE": "2"}


def test_a_gang_job_runs_one_agent_per_node_with_the_nodes_share() -> None:
    cluster = parse_cluster({
        "cluster_name": "c1", "provider": {"type": "external", "module": "x"},
        "head_node_type": "head", "upscaling_speed": 2,
        "available_node_types": {
            "head": {"node_config": {}},
            "g": {"max_workers": 4, "resources": {"CPU": 2, "GPU": 1},
                  "node_config": {"nodes": 2, "mem": "8G", "prologue": ["module load x"]},
                  "worker_setup_commands": ["pip install y"]}}})
    spec = build_job(cluster.provider, "c1", cluster.node_type("g"), kind="worker",
                     python="/venv/bin/python")
    script = render(spec)
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks=2", "#SBATCH --cpus-per-task=2",
                 "#SBATCH --mem=8G", "#SBATCH --gres=gpu:1",
                 "#SBATCH --signal=TERM@60",  # the tasks drain; srun itself would kill them
                 "module load x"):  # the environment, which srun hands to every task
        assert line in script.splitlines(), line
    assert "pip install y" not in script.split("exec srun")[0]  # the setup runs on every node
    last = script.splitlines()[-1]
    assert last.startswith("exec srun --nodes=2 --ntasks=2 --ntasks-per-node=1 "
                           "--kill-on-bad-exit=1 --wait=0 --cpus-per-task=2 bash -c ")
    assert spec.command[7:11] == ["bash", "-c", 'set -eo pipefail\npip install y\nexec "$@"',
                                  "bash"]
    assert spec.command[11:15] == ["/venv/bin/python", "-m", "ray_slurm_provider.agent",
                                   "--spec"]
    assert json.loads(spec.command[-1])["group_size"] == 2
    single = build_job(cluster.provider, "c1", cluster.node_type("head"), kind="head",
                       python="/venv/bin/python")
    assert single.command[0] == "/venv/bin/python" and single.nodes == 1


def test_member_ids_come_from_slurms_node_index() -> None:
    assert node_id(ENV) == "9"
    assert node_id(ENV, 2) == "9.1"
    assert node_id({**ENV, "SLURM_ARRAY_JOB_ID": "7", "SLURM_ARRAY_TASK_ID": "3"}, 2) == "7_3.1"


def member(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, children: list[Any],
           watch: bool = False) -> tuple[WorkerAgent, list[dict[str, str]]]:
    """Member 1 of gang job 9 on a fake Ray; with `watch`, its real head watch runs."""
    spec = NodeSpec(kind="worker", node_type="g", cluster_name="c1", state_dir=str(tmp_path),
                    ports_base=25000, attempts=1, temp_dir_root=str(tmp_path / "tmp"),
                    group_size=2, labels={"zone": "a"})
    a = WorkerAgent(spec, {**ENV, "HOME": str(tmp_path)})
    a.cdir.write_head(HeadInfo(job_id="1", ip="127.0.0.2", gcs_port=25000))
    envs: list[dict[str, str]] = []

    def start(argv: list[str], env: Any = None, new_session: bool = False) -> FakeChild:
        envs.append(dict(env or {}))
        return children.pop(0)

    monkeypatch.setattr(proc, "start", start)
    monkeypatch.setattr(Agent, "node_ip", lambda self: "127.0.0.3")
    if not watch:
        monkeypatch.setattr(WorkerAgent, "watch_head", lambda self: None)
    return a, envs


class BlockingRay:
    """`ray start --block`: says it started, calls `on_up` (the autoscaler lets the member
    go), then runs until it gets a signal (at most `limit_s`) and exits 1 as Ray does."""

    def __init__(self, on_up: Callable[[], None], limit_s: float = 5.0) -> None:
        self.on_up = on_up
        self.limit_s = limit_s
        self.signals: list[int] = []
        self.stopped = threading.Event()
        self.stdout = self.lines()
        self.pid = 0  # no session end_session would end

    def lines(self) -> Iterator[str]:
        yield "Ray runtime started.\n"
        self.on_up()
        self.stopped.wait(self.limit_s)
        self.stopped.set()  # no signal came: it exits on its own

    def wait(self) -> int:
        self.stopped.wait(self.limit_s)
        return 1

    def poll(self) -> int | None:
        return 1 if self.stopped.is_set() else None

    def send_signal(self, sig: int) -> None:
        self.signals.append(sig)
        self.stopped.set()

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def test_a_released_member_stops_ray_through_its_head_watch_and_exits_0(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """The real path: the provider's release marker (Gangs.release), the agent's own head
    watch (a 1 ms period, the GCS probe faked open) sends Ray TERM, and the task ends with 0
    so `srun --kill-on-bad-exit` leaves the other members be."""
    gangs = Gangs(ClusterDir(str(tmp_path), "c1"), slurm=FakeSlurm)
    ray = BlockingRay(on_up=lambda: gangs.release("9.1"))
    a, envs = member(tmp_path, monkeypatch, [ray], watch=True)
    a.watch_period_s = 0.001
    a.watch_connect = lambda ip, port: "open"
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        assert a.main() == 0
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    assert ray.signals == [signal.SIGTERM] and len(envs) == 1
    assert "the autoscaler released this gang member; ending this worker" in (
        capsys.readouterr().out)


def test_a_member_is_its_own_ray_node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a, envs = member(tmp_path, monkeypatch, [FakeChild(["Ray runtime started.\n"], 0)])
    assert a.node_id == "9.1" and a.ndir.path.name == "9.1"
    assert a.temp_dir.endswith("/9.1")  # two members may share a host (the sandbox)
    # Released while Ray runs (the fake Ray has exited by the time this is checked).
    monkeypatch.setattr(WorkerAgent, "released", lambda self: bool(envs))
    assert a.main() == 0  # exit 0 leaves the other members be
    (env,) = envs
    assert env["RAY_CLOUD_INSTANCE_ID"] == "9.1"
    assert json.loads(env["RAY_OVERRIDE_LABELS"]) == {"zone": "a", GROUP_LABEL: "9",
                                                      INDEX_LABEL: "1"}


def test_a_member_whose_ray_dies_ends_with_an_error(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    a, _ = member(tmp_path, monkeypatch, [FakeChild(["Ray runtime started.\n"], 0)])
    assert a.main() == 1  # Ray ended on its own (even with 0): srun ends the whole group


def test_a_member_released_before_its_ray_started_never_starts_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a, envs = member(tmp_path, monkeypatch, [])
    a.ndir.path.mkdir(parents=True)
    a.ndir.release()
    assert a.main() == 0 and envs == []


def test_a_member_released_by_the_previous_release_never_starts_either(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A provider of the previous release wrote only `stop` (remove after the next release)."""
    a, envs = member(tmp_path, monkeypatch, [])
    a.ndir.path.mkdir(parents=True)
    (a.ndir.path / "stop").touch()
    assert a.main() == 0 and envs == []
