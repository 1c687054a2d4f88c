"""Issue 26.7 over the real ray.json hand-off, without Slurm (FakeSlurm lists the jobs).

The node agent's own code starts a head and a worker with `provider.node_ip_interface` set:
it takes the interface's address, puts it in `ray start --node-ip-address` and, once Ray says
it started, writes ray.json; only `ray start` itself is a stand-in. While both "run", the real
provider is driven by Ray's own autoscaler v1 (StandardAutoscaler, whose heartbeats carry the
address each raylet bound) and read by v2's NodeProviderAdapter, and `ray-slurm status` reads
the cluster. Both agents run in this process, so `ib0` has each node's address through a
stand-in for `ip`, in the order they ask: 127.0.1.1 on the head's node (n2), 127.0.1.3 on
the worker's (n1), loopback addresses the head's port check can bind; Slurm's NodeAddr of
these nodes is 127.0.0.3 and 127.0.0.2. Four addresses: each node's is told apart from the
other's and from its NodeAddr.
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from ray.autoscaler.tags import NODE_KIND_HEAD, NODE_KIND_WORKER, TAG_RAY_NODE_KIND
from ray.autoscaler.tags import TAG_RAY_USER_NODE_TYPE as TYPE

from ray_slurm_provider import proc, shellcmd
from ray_slurm_provider.agent import head as head_role
from ray_slurm_provider.agent.agent import STARTED_MARKER
from ray_slurm_provider.agent.head import HeadAgent
from ray_slurm_provider.agent.worker import WorkerAgent
from ray_slurm_provider.cli import status
from ray_slurm_provider.jobs import encode_tags, job_name
from ray_slurm_provider.nodespec import NodeSpec
from ray_slurm_provider.slurm.script import JobSpec
from ray_slurm_provider.state import StartRequest
from tests.fakes import FakeSlurm
from tests.unit.test_cmds import cluster
from tests.unit.test_launch_errors import ConfigReader
from tests.unit.test_rayapi import V1

CLUSTER = "sandbox"  # tests.unit.test_cmds.cluster's config (for `status`)
INTERFACE = "ib0"
#: ib0's address on the head's node, then on the worker's (the head's agent asks first).
IB0 = ["127.0.1.1", "127.0.1.3"]
PROVIDER = "ray_slurm_provider.provider.SlurmNodeProvider"


class RayStart:
    """`ray start --block` as the agent runs it: prints Ray's started line, runs `meanwhile`
    (what happens while this Ray is up), then exits 0."""

    def __init__(self, meanwhile: Callable[[], None]) -> None:
        self.meanwhile = meanwhile
        self.pid = -1
        self.code: int | None = None

    @property
    def stdout(self) -> Iterator[str]:
        yield f"{STARTED_MARKER}.\n"
        self.meanwhile()
        self.code = 0

    def wait(self) -> int:
        return 0

    def poll(self) -> int | None:
        return self.code

    def send_signal(self, sig: int) -> None:
        pass


def test_v1_keeps_a_node_of_an_interface_address_v2_and_status_agree(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeSlurm()
    name = job_name(CLUSTER)
    head = fake.submit(JobSpec(name, ["true"]), comment=encode_tags(
        {TAG_RAY_NODE_KIND: NODE_KIND_HEAD, TYPE: "head"}))
    worker = fake.submit(JobSpec(name, ["true"]), comment=encode_tags(
        {TAG_RAY_NODE_KIND: NODE_KIND_WORKER, TYPE: "w"}))
    fake.start(head, "n2")
    fake.start(worker, "n1")
    cli = cluster(tmp_path, fake, node_ip_interface=INTERFACE)
    state = str(cli.cdir.root.parent)

    def agent(role: type[HeadAgent] | type[WorkerAgent], job: str, node: str) -> Any:
        kind = "head" if role is HeadAgent else "worker"
        spec = NodeSpec(kind=kind, node_type="head" if kind == "head" else "w",
                        cluster_name=CLUSTER, state_dir=state, ports_base=25000,
                        temp_dir_root=str(tmp_path / "tmp"), node_ip_interface=INTERFACE)
        a = role(spec, {"SLURM_JOB_ID": job, "SLURMD_NODENAME": node,
                        "SLURM_CPUS_ON_NODE": "1", "HOME": str(tmp_path)})
        a.slurm = fake  # whatever it asks Slurm, it asks the fake
        return a

    addresses = list(IB0)
    real_run = proc.run

    def run(argv: list[str], **kwargs: Any) -> proc.Result:
        """`ip -4 -o addr show dev ib0`, answered on the node that asks."""
        if argv[:2] != ["ip", "-4"]:
            return real_run(argv, **kwargs)
        assert argv[-2:] == ["dev", INTERFACE]
        line = f"4: ib0    inet {addresses.pop(0)}/24 scope global ib0\n"
        return proc.Result(list(argv), 0, line, "")

    started: list[tuple[list[str], dict[str, str]]] = []
    children: list[RayStart] = []

    def start(argv: list[str], env: dict[str, str] | None = None,
              new_session: bool = False) -> RayStart:
        started.append((list(argv), dict(env or {})))
        return children.pop(0)

    seen: dict[str, Any] = {}

    def while_both_are_up() -> None:
        (head_argv, head_env), (worker_argv, worker_env) = started
        bound = [shellcmd.get_flag(a, "--node-ip-address") for a in (head_argv, worker_argv)]
        assert bound == IB0  # ib0's on each node, not its NodeAddr
        v1 = V1(monkeypatch, {"type": "external", "module": PROVIDER, "state_dir": state,
                              "node_ip_interface": INTERFACE}, cluster_name=CLUSTER)
        v1.provider._client = fake
        # Each raylet's heartbeats carry the address it bound.
        seen["v1"] = v1.kept(IB0)
        seen["ips"] = [v1.provider.internal_ip(i) for i in (head, worker)]
        from ray.autoscaler.v2.instance_manager.node_provider import NodeProviderAdapter

        cloud = NodeProviderAdapter(v1.provider, ConfigReader()).get_non_terminated()  # type: ignore[arg-type]
        seen["v2"] = {i: c.is_running for i, c in cloud.items()}
        seen["instance ids"] = [e["RAY_CLOUD_INSTANCE_ID"] for e in (head_env, worker_env)]
        seen["status"] = {r["job_id"]: (r["address"], r["ray_up"])
                          for r in status.status_data(cli)["nodes"]}

    head_agent = agent(HeadAgent, head, "n2")
    worker_agent = agent(WorkerAgent, worker, "n1")
    children += [RayStart(worker_agent.main), RayStart(while_both_are_up)]
    monkeypatch.setattr(proc, "start", start)
    monkeypatch.setattr(proc, "run", run)
    monkeypatch.setattr(head_role, "wait_port_free", lambda *args: None)
    monkeypatch.setattr(HeadAgent, "watch", lambda self, req_id: None)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        assert head_agent.head_once(StartRequest(id="r1", ray_start=["ray", "start",
                                                                     "--head"])) == 0
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    assert children == [] and "v1" in seen, "the worker's Ray never came up"
    # v1: neither node is terminated as "lost contact with raylet" (at 30 s it was).
    assert seen["v1"] == [60.0, 60.0]
    assert seen["ips"] == IB0
    # v2: matched by instance id, which the interface does not touch.
    assert seen["v2"] == {head: True, worker: True}
    assert seen["instance ids"] == [head, worker]
    assert seen["status"] == {head: ("127.0.1.1", True), worker: ("127.0.1.3", True)}
    assert addresses == []  # each agent asked once
    assert not (cli.cdir.node(worker).path / "ray.json").exists()  # Ray gone: unmarked
