"""Issue 25: the provider's one state model (provider/nodes.py), row by row of the transition
table in its docstring; and the provider built by composition, not mixins."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest
from ray.autoscaler.node_provider import NodeProvider
from ray.autoscaler.tags import TAG_RAY_NODE_KIND as KIND

from ray_slurm_provider.jobs import GROUP_TAG, encode_tags
from ray_slurm_provider.provider.nodes import Group, Node, Phase, Rules, Tick, advance
from ray_slurm_provider.provider.provider import SlurmNodeProvider
from ray_slurm_provider.slurm.client import Job, SlurmError
from ray_slurm_provider.slurm.script import JobSpec
from tests.unit.test_provider import WORKER_TAGS, make

TTL = 120.0


def job(job_id: str, state: str = "RUNNING", kind: str = "worker", size: int = 1) -> Job:
    tags = {KIND: kind, **({GROUP_TAG: str(size)} if size > 1 else {})}
    return Job(job_id=job_id, name="ray-c", state=state, comment=encode_tags(tags))


def stub(job_id: str) -> Job:
    """What create_node records before any listing: no comment yet."""
    return Job(job_id=job_id, name="ray-c", state="PENDING")


@dataclass
class Dir:
    up: set[str] = field(default_factory=set)
    released_ids: set[str] = field(default_factory=set)

    def tags(self, job_id: str) -> dict[str, str]:
        return {}

    def ray_up(self, job_id: str) -> bool:
        return job_id in self.up

    def released(self, node_id: str) -> bool:
        return node_id in self.released_ids


def run(prev: dict[str, Node], jobs: list[Job], files: Dir | None = None, *,
        listing: int = 1, now: float = 0.0, reuse: bool = True) -> Tick:
    return advance(prev, jobs, listing=listing, now=now, reuse=reuse, files=files or Dir(),
                   rules=Rules(submit_tag="nonce", watch_workers=True, gone_ttl_s=TTL),
                   stray=lambda nonce: False)


G2 = [Group("7", 2, 0), Group("7", 2, 1)]


@dataclass
class Row:
    """One row of the table: records before, one listing -> node 7's (or 7.0's) phase after
    (None: gone), whether it is shown, and the events."""

    name: str
    prev: dict[str, Node]
    jobs: list[Job]
    after: Phase | None
    files: Dir = field(default_factory=Dir)
    listing: int = 1
    now: float = 0.0
    node: str = "7"
    crashed: list[str] = field(default_factory=list)
    orphans: list[str] = field(default_factory=list)


ROWS = [
    Row("CREATED, listed active -> LISTED",
        {"7": Node(stub("7"), {KIND: "worker"}, Phase.CREATED, born=0)}, [job("7")],
        Phase.LISTED),
    Row("CREATED, a listing started before sbatch returned -> CREATED",
        {"7": Node(stub("7"), {KIND: "worker"}, Phase.CREATED, born=1)}, [], Phase.CREATED),
    Row("CREATED, a later listing without it, worker -> GHOST",
        {"7": Node(stub("7"), {KIND: "worker"}, Phase.CREATED, born=0)}, [], Phase.GHOST),
    Row("CREATED, a later listing without it, head -> gone",
        {"7": Node(stub("7"), {KIND: "head"}, Phase.CREATED, born=0)}, [], None),
    Row("GHOST, the next listing -> gone, ended before Ray",
        {"7": Node(stub("7"), {KIND: "worker"}, Phase.GHOST)}, [], None, crashed=["7"]),
    Row("LISTED, the running worker's agent wrote ray.json -> RAY_UP",
        {"7": Node(job("7"), {KIND: "worker", "ray-node-status": "setting-up"})},
        [job("7")], Phase.RAY_UP, files=Dir(up={"7"})),
    Row("LISTED, the running head's agent wrote ray.json -> RAY_UP",
        {"7": Node(job("7", kind="head"), {KIND: "head"})}, [job("7", kind="head")],
        Phase.RAY_UP, files=Dir(up={"7"})),
    Row("no record, a listed job of ours -> LISTED", {}, [job("7", "PENDING")], Phase.LISTED),
    Row("LISTED, left the active list, Ray not up -> gone, crashed",
        {"7": Node(job("7"), {KIND: "worker"})}, [job("7", "COMPLETING")], None,
        crashed=["7"]),
    Row("RAY_UP, left the queue, ray.json still there -> gone, orphan",
        {"7": Node(job("7"), {KIND: "worker"}, Phase.RAY_UP)}, [], None,
        files=Dir(up={"7"}), orphans=["7"]),
    Row("RAY_UP, left the queue, its agent cleaned up -> gone, no event",
        {"7": Node(job("7"), {KIND: "worker"}, Phase.RAY_UP)}, [], None),
    Row("RELEASED, group not all released, job listed -> RELEASED",
        {"7.0": Node(job("7", size=2), {}, Phase.RELEASED, G2[0]),
         "7.1": Node(job("7", size=2), {KIND: "worker"}, Phase.LISTED, G2[1])},
        [job("7", size=2)], Phase.RELEASED, node="7.0"),
    Row("RELEASED, every member released, job listed (scancel failed) -> LISTED",
        {"7.0": Node(job("7", size=2), {}, Phase.RELEASED, G2[0]),
         "7.1": Node(job("7", size=2), {}, Phase.RELEASED, G2[1])},
        [job("7", size=2)], Phase.LISTED, node="7.0"),
    Row("RELEASED (by another process's marker), job listed -> RELEASED",
        {}, [job("7", size=2)], Phase.RELEASED, files=Dir(released_ids={"7.0"}), node="7.0"),
    Row("RELEASED, the job is no longer listed -> gone, no event",
        {"7.0": Node(job("7", size=2), {KIND: "worker"}, Phase.RELEASED, G2[0])}, [], None,
        node="7.0"),
    Row("CANCELLING, still listed within the TTL -> CANCELLING",
        {"7": Node(job("7"), {KIND: "worker"}, Phase.CANCELLING, since=0.0)}, [job("7")],
        Phase.CANCELLING, now=TTL - 1),
    Row("CANCELLING, the job is no longer listed -> gone, no event",
        {"7": Node(job("7"), {KIND: "worker"}, Phase.CANCELLING, since=0.0)}, [], None),
    Row("CANCELLING, still listed after the TTL -> LISTED",
        {"7": Node(job("7"), {KIND: "worker"}, Phase.CANCELLING, since=0.0)}, [job("7")],
        Phase.LISTED, now=TTL),
]


@pytest.mark.parametrize("row", ROWS, ids=[r.name for r in ROWS])
def test_each_listing_transition_of_the_table(row: Row) -> None:
    tick = run(row.prev, row.jobs, row.files, listing=row.listing, now=row.now)
    rec = tick.nodes.get(row.node)
    assert (rec.phase if rec else None) is row.after
    assert (row.node in tick.shown) == (row.after not in (None, Phase.RELEASED,
                                                          Phase.CANCELLING))
    assert [j for j, _ in tick.events.crashed] == row.crashed
    assert tick.events.orphans == row.orphans


def test_only_a_settled_listing_is_quiet() -> None:
    """The steady tick may follow only a tick with nothing pending."""
    assert run({}, [job("7", "PENDING")]).quiet  # running, it would be setting up
    assert not run({"7": Node(stub("7"), {KIND: "worker"}, Phase.CREATED, born=1)}, []).quiet
    assert not run({"7": Node(job("7"), {}, Phase.CANCELLING)}, [job("7")]).quiet
    setting_up = Node(job("7"), {KIND: "worker", "ray-node-status": "setting-up"})
    assert not run({"7": setting_up}, [job("7")]).quiet
    ghost = run({"7": Node(stub("7"), {KIND: "worker"}, Phase.CREATED)}, [])
    assert ghost.ghosts and not ghost.quiet


def test_a_heads_ray_is_looked_for_too_and_its_address_kept() -> None:
    """Issue 26.7: a head's ray.json moves it to RAY_UP as a worker's does (the provider then
    reads the address its Ray bound, once: test_provider.py); until then every listing looks
    again (no tick is quiet). A RAY_UP record rebuilt (a tags file changed) keeps the address
    read."""
    starting = run({}, [job("8", kind="head")])
    assert starting.nodes["8"].phase is Phase.LISTED and not starting.quiet
    up = run(starting.nodes, [job("8", kind="head")], Dir(up={"8"}), listing=2)
    assert up.nodes["8"].phase is Phase.RAY_UP and up.quiet
    up.nodes["8"].ip = "10.1.2.1"  # as the provider's internal_ip reads it
    again = run(up.nodes, [job("8", kind="head")], Dir(up={"8"}), listing=3, reuse=False)
    assert again.nodes["8"] is not up.nodes["8"] and again.nodes["8"].ip == "10.1.2.1"


def test_ray_up_and_came_up_follow_ray_json_whoever_starts_ray() -> None:
    """RAY_UP and a worker's `came_up` (it clears its type's crash hold-back: a crash is a
    worker gone before RAY_UP, told whatever the setting) follow ray.json, which the agent
    writes either way; only the worker's status tag waits for `watch_workers`."""
    tick = advance({}, [job("7")], listing=1, now=0.0, reuse=True, files=Dir(up={"7"}),
                   rules=Rules(submit_tag="nonce", watch_workers=False, gone_ttl_s=TTL),
                   stray=lambda nonce: False)
    assert tick.nodes["7"].phase is Phase.RAY_UP and tick.events.came_up == [""]
    assert "ray-node-status" not in tick.nodes["7"].tags


def test_a_gang_job_that_dies_before_ray_is_one_crash() -> None:
    prev = {f"7.{k}": Node(job("7", size=2), {KIND: "worker"}, Phase.LISTED, G2[k])
            for k in (0, 1)}
    assert [j for j, _ in run(prev, []).events.crashed] == ["7"]


# --- the provider's side of the table: create, release, cancel, a failed cancel ----------


def phases(p: SlurmNodeProvider) -> dict[str, Phase]:
    return {i: r.phase for i, r in p._nodes.items()}


def test_create_release_and_cancel_rows(tmp_path: Path) -> None:
    from tests.unit.test_gang_provider import GANG, TAGS, fake

    p, f = make(tmp_path, fake())
    p.create_node(GANG, TAGS, 2)  # - -> CREATED
    assert phases(p) == {"1000.0": Phase.CREATED, "1000.1": Phase.CREATED}
    p.non_terminated_nodes({})
    assert set(phases(p).values()) == {Phase.LISTED}
    p.terminate_node("1000.0")  # shown -> RELEASED: its group lives on
    assert phases(p)["1000.0"] is Phase.RELEASED and f.cancelled == []
    p.terminate_node("1000.1")  # the last member: the job is cancelled
    assert set(phases(p).values()) == {Phase.CANCELLING} and f.cancelled == [["1000"]]
    (w,) = p.create_node({}, WORKER_TAGS, 1)
    p.terminate_node(w)  # a one-node job: CANCELLING once its scancel returned
    assert phases(p)[w] is Phase.CANCELLING


def test_a_failed_scancel_restores_what_was_before(tmp_path: Path) -> None:
    from tests.unit.test_gang_provider import GANG, TAGS, fake

    p, f = make(tmp_path, fake())
    p.create_node(GANG, TAGS, 2)
    (w,) = p.create_node({}, WORKER_TAGS, 1)
    p.non_terminated_nodes({})
    p.terminate_node("1000.0")
    f.set_outage(True)
    p._sleep = lambda _s: None  # the cancel's own tries (teardown.cancel_jobs): no real waits
    with pytest.raises(SlurmError):
        p.terminate_nodes(["1000.1", w])
    assert phases(p) == {"1000.0": Phase.RELEASED, "1000.1": Phase.LISTED, w: Phase.LISTED}


def test_a_stray_job_this_process_never_listed_is_hidden_while_cancelled(
        tmp_path: Path) -> None:
    p, f = make(tmp_path)
    job_id = f.submit(JobSpec("ray-c1", ["true"]), comment="")  # reported failed to Ray
    p.terminate_nodes([job_id])
    assert phases(p) == {job_id: Phase.CANCELLING}


# --- no mixins -----------------------------------------------------------------------------


def test_the_provider_is_one_class_over_ray_s_node_provider() -> None:
    assert SlurmNodeProvider.__mro__ == (SlurmNodeProvider, NodeProvider, object)


def test_no_collaborator_holds_the_provider(tmp_path: Path) -> None:
    """The collaborators get narrow callables, never the provider itself."""
    p, _ = make(tmp_path)
    for part in (p.gangs, p.teardown, p.guard, p.head_time, p.strays):
        assert not any(v is p for v in vars(part).values()), type(part).__name__
        assert not isinstance(part, SlurmNodeProvider)


def test_every_public_hook_ray_calls_is_on_the_provider() -> None:
    for name in ("bootstrap_config", "fillout_available_node_types_resources",
                 "prepare_for_head_node", "nodes_for_teardown", "cleanup_cluster_resources",
                 "non_terminated_nodes", "create_node_with_resources_and_labels",
                 "terminate_nodes", "get_command_runner", "node_config", "describe_job"):
        assert name in vars(SlurmNodeProvider), name
