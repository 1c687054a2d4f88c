"""`ray down` (bench P6): one scancel for the whole cluster, and workers whose head is going
away stop Ray at once instead of draining towards a GCS that is gone."""

from __future__ import annotations

import signal
from pathlib import Path

from ray_slurm_provider.node import Agent
from ray_slurm_provider.nodespec import NodeSpec
from ray_slurm_provider.state import write_json
from tests.unit.test_provider import HEAD_TAGS, WORKER_TAGS, make


def test_cancelling_the_head_marks_a_teardown_and_is_one_scancel(tmp_path: Path) -> None:
    p, f = make(tmp_path)
    (head,) = p.create_node({}, HEAD_TAGS, 1)
    workers = list(p.create_node({}, WORKER_TAGS, 3))
    p.non_terminated_nodes({})
    p.terminate_nodes(workers[:1])  # scaling down: no teardown
    assert not p.cluster_dir.teardown.exists()
    p.terminate_nodes([head, *workers[1:]])
    assert p.cluster_dir.teardown.exists()
    assert f.cancelled == [workers[:1], sorted([head, *workers[1:]])]
    assert f.calls["cancel"] == 2
    # A new head (the next `ray up`) clears it before its workers can start.
    p.create_node({}, HEAD_TAGS, 1)
    assert not p.cluster_dir.teardown.exists()


class Child:
    def __init__(self) -> None:
        self.got: list[str] = []

    def poll(self) -> int | None:
        return None

    def kill(self) -> None:
        self.got.append("kill")

    def send_signal(self, sig: int) -> None:
        self.got.append(signal.Signals(sig).name)


def agent(tmp_path: Path, kind: str = "worker") -> tuple[Agent, Child]:
    spec = NodeSpec(kind=kind, node_type="w", cluster_name="c1", state_dir=str(tmp_path),
                    ports_base=25000, temp_dir_root=str(tmp_path / "tmp"))
    a = Agent(spec, {"SLURM_JOB_ID": "9", "HOME": str(tmp_path)})
    write_json(a.cdir.head_info, {"ip": "127.0.0.2", "gcs_port": 25000, "job_id": "1"})
    a.head_job = "1"  # as build() records it when the worker joins
    a.child = Child()
    return a, a.child


def test_worker_drains_while_its_head_is_there(tmp_path: Path) -> None:
    a, child = agent(tmp_path)
    a.on_term(signal.SIGTERM, None)
    assert child.got == ["SIGTERM"] and a.terminating


def test_worker_skips_the_drain_when_its_head_is_gone(tmp_path: Path) -> None:
    a, child = agent(tmp_path)
    a.cdir.head_info.unlink()
    a.on_term(signal.SIGTERM, None)
    assert child.got == ["kill"]


def test_worker_skips_the_drain_when_another_head_took_over(tmp_path: Path) -> None:
    a, child = agent(tmp_path)
    write_json(a.cdir.head_info, {"ip": "127.0.0.4", "gcs_port": 25000, "job_id": "7"})
    a.on_term(signal.SIGTERM, None)
    assert child.got == ["kill"]


def test_worker_skips_the_drain_during_ray_down(tmp_path: Path) -> None:
    a, child = agent(tmp_path)
    a.cdir.create()
    a.cdir.mark_teardown()  # the provider cancels the head with its workers
    a.on_term(signal.SIGTERM, None)
    assert child.got == ["kill"]


def test_head_always_stops_its_ray_gracefully(tmp_path: Path) -> None:
    a, child = agent(tmp_path, kind="head")
    a.cdir.create()
    a.cdir.mark_teardown()
    a.on_term(signal.SIGTERM, None)
    assert child.got == ["SIGTERM"]
