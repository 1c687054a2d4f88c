"""Issue 16: gang node types in the provider, on the fake Slurm (no sandbox, no sleeping).

A gang type (`nodes: N`) launches whole groups: one Slurm job of N nodes per group, listed as
N nodes `<job>.<k>`; a member the autoscaler terminates is released (its Ray stops, its task
ends with exit 0) and the job is cancelled once every member is released; a job that ends
takes all its members with it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from ray.autoscaler.tags import TAG_RAY_NODE_KIND, TAG_RAY_USER_NODE_TYPE

from ray_slurm_provider.jobs import GROUP_TAG
from ray_slurm_provider.nodespec import member_ids, split
from ray_slurm_provider.provider import gangs
from ray_slurm_provider.slurm.client import Node, SlurmError, TransientSlurmError
from tests.fakes import FakeSlurm
from tests.unit.test_provider import make

GANG = {"partition": "cpu", "cpus": 2, "nodes": 2}
TAGS = {TAG_RAY_NODE_KIND: "worker", TAG_RAY_USER_NODE_TYPE: "gang"}


def fake() -> FakeSlurm:
    nodes = [Node(f"n{i}", f"127.0.0.{i + 1}", "IDLE", 2, 4000, "") for i in (1, 2, 3)]
    return FakeSlurm(nodes=nodes, partitions={"cpu": {"default": True,
                                                      "nodes": ["n1", "n2", "n3"]}})


def test_ids_and_counts() -> None:
    assert member_ids("12", 3) == ["12.0", "12.1", "12.2"]
    assert split("12.1") == ("12", 1) and split("12_3.0") == ("12_3", 0)
    assert split("12") == ("12", None) and split("12_3") == ("12_3", None)
    assert [gangs.groups(k, 2) for k in (1, 2, 3, 4)] == [1, 1, 2, 2]


def test_a_demand_of_k_nodes_launches_whole_groups_of_one_job_each(tmp_path: Path) -> None:
    p, f = make(tmp_path, fake())
    created = p.create_node(GANG, TAGS, 3)  # 3 nodes: 2 groups of 2
    # One sbatch: an array of 2 gang jobs (each task a whole group), never one of members.
    assert sorted(created) == ["1000_0.0", "1000_0.1", "1000_1.0", "1000_1.1"]
    assert len(f.submitted) == 1
    spec = f.submitted[0]
    assert (spec.nodes, spec.ntasks, spec.cpus_per_task) == (2, 2, 2)
    assert spec.command[0] == "srun" and "--kill-on-bad-exit=1" in spec.command
    assert sorted(p.non_terminated_nodes({})) == sorted(created)
    assert p.node_tags("1000_1.1")[TAG_RAY_USER_NODE_TYPE] == "gang"
    assert GROUP_TAG not in p.node_tags("1000_1.1")


def test_members_are_pending_until_the_whole_job_runs_and_each_has_its_own_address(
        tmp_path: Path) -> None:
    p, f = make(tmp_path, fake())
    p.create_node(GANG, TAGS, 2)
    p.non_terminated_nodes({})
    assert not p.is_running("1000.0") and not p.is_running("1000.1")
    f.start("1000", "n[2-3]")
    p.non_terminated_nodes({})
    assert p.is_running("1000.0") and p.is_running("1000.1")
    assert (p.internal_ip("1000.0"), p.internal_ip("1000.1")) == ("127.0.0.3", "127.0.0.4")


def test_a_members_address_is_the_one_its_own_ray_bound(tmp_path: Path) -> None:
    """Issue 26.7: each member's agent writes its own ray.json (nodes/<job>.<k>/); from then on
    that is the member's address, the other member keeps its host's until its Ray is up."""
    from ray_slurm_provider.state import RayUp

    p, f = make(tmp_path, fake())
    p.create_node(GANG, TAGS, 2)
    f.start("1000", "n[2-3]")
    p.cluster_dir.node("1000.1").write_ray_up(RayUp(ip="10.1.2.4", job_id="1000"))
    p.non_terminated_nodes({})
    assert (p.internal_ip("1000.0"), p.internal_ip("1000.1")) == ("127.0.0.3", "10.1.2.4")
    assert p.external_ip("1000.1") == "10.1.2.4"


def test_a_released_member_leaves_and_the_job_ends_with_its_last_member(
        tmp_path: Path) -> None:
    p, f = make(tmp_path, fake())
    p.create_node(GANG, TAGS, 2)
    f.start("1000", "n[1-2]")
    p.non_terminated_nodes({})
    p.terminate_node("1000.0")  # idle: released, its Ray stops; the group's job stays
    assert f.cancelled == []
    assert p.cluster_dir.node("1000.0").released()
    assert p.non_terminated_nodes({}) == ["1000.1"]
    p.terminate_nodes(["1000.1"])  # the last member: the whole job goes
    assert f.cancelled == [["1000"]]
    assert p.non_terminated_nodes({}) == []


def test_terminating_a_whole_group_at_once_cancels_its_job_once(tmp_path: Path) -> None:
    p, f = make(tmp_path, fake())
    p.create_node(GANG, TAGS, 4)
    p.non_terminated_nodes({})
    p.terminate_nodes(["1000_0.1", "1000_0.0", "1000_1.0"])
    assert f.cancelled == [["1000_0"]]
    assert sorted(p.non_terminated_nodes({})) == ["1000_1.1"]


def test_a_lost_member_takes_its_group_with_it(tmp_path: Path) -> None:
    """A member whose Ray dies ends its agent with an error, srun (--kill-on-bad-exit) ends
    the others, and the job ends: every member leaves the same listing."""
    p, f = make(tmp_path, fake())
    p.create_node(GANG, TAGS, 4)
    f.start("1000_0", "n[1-2]")
    f.start("1000_1", "n[2-3]")
    p.non_terminated_nodes({})
    f.finish("1000_0", "FAILED")
    assert sorted(p.non_terminated_nodes({})) == ["1000_1.0", "1000_1.1"]


def test_a_released_member_stays_released_for_a_new_provider(tmp_path: Path) -> None:
    """The head's autoscaler restarts: what was released is in the cluster directory."""
    p, f = make(tmp_path, fake())
    p.create_node(GANG, TAGS, 2)
    p.non_terminated_nodes({})
    p.terminate_node("1000.1")
    q, _ = make(tmp_path, f)
    assert q.non_terminated_nodes({}) == ["1000.0"]
    q.terminate_node("1000.0")
    assert f.cancelled == [["1000"]]


def test_legacy_stop_files_both_ways(tmp_path: Path) -> None:
    """For one release (state.py): a release also writes the `stop` an agent of the previous
    release reads, and a member the previous release's provider released (`stop` alone)
    stays released for this one."""
    p, f = make(tmp_path, fake())
    p.create_node(GANG, TAGS, 4)
    p.non_terminated_nodes({})
    p.terminate_node("1000_0.0")
    assert (p.cluster_dir.node("1000_0.0").path / "stop").exists()
    old = p.cluster_dir.node("1000_1.1").path
    old.mkdir(parents=True)
    (old / "stop").touch()  # the previous release's provider released it
    q, _ = make(tmp_path, f)
    assert sorted(q.non_terminated_nodes({})) == ["1000_0.1", "1000_1.0"]
    q.terminate_node("1000_1.0")
    assert f.cancelled == [["1000_1"]]


def test_autoscaler_v2_adopts_the_members_it_did_not_ask_for(tmp_path: Path) -> None:
    """Ray 2.60's own reconciler steps over the provider: v2 asked for one node of the gang
    type; the group's other member is listed too and becomes an instance of the type."""
    from ray.autoscaler.tags import TAG_RAY_LAUNCH_REQUEST
    from ray.autoscaler.v2.instance_manager.instance_manager import InstanceManager
    from ray.autoscaler.v2.instance_manager.instance_storage import InstanceStorage
    from ray.autoscaler.v2.instance_manager.node_provider import NodeProviderAdapter
    from ray.autoscaler.v2.instance_manager.reconciler import Reconciler
    from ray.autoscaler.v2.instance_manager.storage import InMemoryStorage
    from ray.core.generated.instance_manager_pb2 import Instance

    p, _ = make(tmp_path, fake())
    storage = InstanceStorage("c1", InMemoryStorage())
    storage.batch_upsert_instances([Instance(instance_id="i1", instance_type="gang",
                                             status=Instance.REQUESTED,
                                             launch_request_id="r1")])
    im = InstanceManager(storage, None)
    p.create_node(GANG, {**TAGS, TAG_RAY_LAUNCH_REQUEST: "r1"}, 1)  # what v2's launch does
    cloud = NodeProviderAdapter(p, None).get_non_terminated()  # type: ignore[arg-type]
    assert sorted(cloud) == ["1000.0", "1000.1"]
    assert {c.node_type for c in cloud.values()} == {"gang"}
    Reconciler._handle_cloud_instance_allocation(im, cloud, [])
    Reconciler._handle_extra_cloud_instances(im, cloud, [])
    instances, _ = Reconciler._get_im_instances(im)
    assert sorted((i.cloud_instance_id, i.status) for i in instances) == [
        ("1000.0", Instance.ALLOCATED), ("1000.1", Instance.ALLOCATED)]
    assert {i.instance_type for i in instances} == {"gang"}


def test_autoscaler_v1_sees_every_member_as_a_worker_of_the_type(tmp_path: Path) -> None:
    """v1 counts workers per type from the listing with its own filter and tags: a group's
    members are all workers of the type (its max_workers counts them), launched with the
    launch config v1 tagged the create call with."""
    from ray.autoscaler.tags import TAG_RAY_LAUNCH_CONFIG, TAG_RAY_NODE_STATUS

    p, f = make(tmp_path, fake())
    p.create_node(GANG, {**TAGS, TAG_RAY_LAUNCH_CONFIG: "h1"}, 1)  # v1 asked for one node
    workers = p.non_terminated_nodes({TAG_RAY_NODE_KIND: "worker"})
    assert sorted(workers) == ["1000.0", "1000.1"]
    assert {p.node_tags(w)[TAG_RAY_LAUNCH_CONFIG] for w in workers} == {"h1"}
    assert {p.node_tags(w)[TAG_RAY_USER_NODE_TYPE] for w in workers} == {"gang"}
    f.start("1000", "n[1-2]")
    from ray_slurm_provider.state import RayUp

    p.cluster_dir.node("1000.1").write_ray_up(RayUp(ip="127.0.0.3", job_id="1000"))
    p.non_terminated_nodes({})
    assert p.node_tags("1000.1")[TAG_RAY_NODE_STATUS] == "up-to-date"
    assert p.node_tags("1000.0")[TAG_RAY_NODE_STATUS] == "setting-up"  # each its own Ray


def test_a_gang_job_that_dies_before_ray_counts_once_against_its_type(tmp_path: Path) -> None:
    """Its N members leave together: one crash of the type, not N (the back-off counts jobs)."""
    import json

    p, f = make(tmp_path, fake())
    p.create_node(GANG, TAGS, 2)
    f.start("1000", "n[1-2]")
    p.non_terminated_nodes({})
    f.finish("1000", "FAILED")
    p.non_terminated_nodes({})
    entry = json.loads((p.cluster_dir.root / "errors.json").read_text())["gang"]
    assert entry["failures"] == 1 and "Slurm job 1000 " in entry["message"]


def test_a_member_terminated_before_any_listing_leaves_its_group_be(tmp_path: Path) -> None:
    """Review finding: the records of a job just created had no N, so releasing one member
    cancelled the whole (live) group."""
    p, f = make(tmp_path, fake())
    p.create_node(GANG, TAGS, 2)
    p.terminate_node("1000.1")
    assert f.cancelled == []
    assert p.non_terminated_nodes({}) == ["1000.0"]


def test_a_listing_in_flight_while_a_member_is_released_does_not_bring_it_back(
        tmp_path: Path) -> None:
    """v2 terminates from its own thread: a listing that read Slurm before the release must
    not restore the member, neither then nor on the steady ticks after. (The records move on
    under the provider's lock, so "meanwhile" is while Slurm's answer is in flight.)"""
    p, f = make(tmp_path, fake())
    p.create_node(GANG, TAGS, 2)
    p.non_terminated_nodes({})
    f.start("1000", "n[1-2]")
    real = f.list_jobs

    def list_then_release(name: str) -> list[Any]:
        jobs = real(name)  # the listing: job 1000, so 1000.1 among its nodes
        p.terminate_node("1000.1")  # "meanwhile", on the executor's thread
        return jobs

    f.list_jobs = list_then_release  # type: ignore[method-assign]
    try:
        assert p.non_terminated_nodes({}) == ["1000.0"]
    finally:
        f.list_jobs = real  # type: ignore[method-assign]
    assert p.non_terminated_nodes({}) == ["1000.0"] == p.non_terminated_nodes({})


def test_a_group_we_cancelled_is_no_crash_and_a_reused_job_id_starts_fresh(
        tmp_path: Path) -> None:
    p, f = make(tmp_path, fake())
    p.create_node(GANG, TAGS, 2)
    p.non_terminated_nodes({})
    p.terminate_nodes(["1000.0", "1000.1"])
    assert f.cancelled == [["1000"]]
    p.non_terminated_nodes({})
    assert not (p.cluster_dir.root / "errors.json").exists()  # not held against the type
    # Slurm's ids start again (a new controller state): old member dirs must not count.
    stale = p.cluster_dir.node("1001.1")
    stale.path.mkdir(parents=True)
    stale.release()
    q, _ = make(tmp_path, FakeSlurm(nodes=fake().nodes.values(), first_id=1001,
                                    partitions=fake().partitions))
    assert sorted(q.create_node(GANG, TAGS, 2)) == ["1001.0", "1001.1"]
    for _ in range(2):  # the first listing after a create keeps what it created anyway
        assert sorted(q.non_terminated_nodes({})) == ["1001.0", "1001.1"]


def test_a_group_created_while_a_listing_is_in_flight_keeps_its_size(tmp_path: Path) -> None:
    """The listing that started before the create does not list the job yet; releasing one
    member afterwards must still leave the group be (its N is not forgotten)."""
    p, f = make(tmp_path, fake())
    real = f.list_jobs

    def create_meanwhile(name: str) -> list[Any]:
        jobs = real(name)
        p.create_node(GANG, TAGS, 2)  # on another thread, while this listing is in flight
        return jobs

    f.list_jobs = create_meanwhile  # type: ignore[method-assign]
    try:
        assert sorted(p.non_terminated_nodes({})) == ["1000.0", "1000.1"]
    finally:
        f.list_jobs = real  # type: ignore[method-assign]
    p.terminate_node("1000.0")
    assert f.cancelled == []


def _cancel_failed(tmp_path: Path, running: bool) -> tuple[Any, FakeSlurm]:
    """A group of 2 terminated whole in one call whose scancel fails: listed whole again."""
    p, f = make(tmp_path, fake())
    p.create_node(GANG, TAGS, 2)
    if running:
        f.start("1000", "n[1-2]")
    p.non_terminated_nodes({})
    f.set_outage(True)
    p._sleep = lambda _s: None  # the cancel's own tries (teardown.cancel_jobs): no real waits
    with pytest.raises(SlurmError):
        p.terminate_nodes(["1000.0", "1000.1"])
    f.set_outage(False)
    assert sorted(p.non_terminated_nodes({})) == ["1000.0", "1000.1"]
    return p, f


def test_a_group_whose_cancel_failed_shows_up_again_and_is_cancelled_next_time(
        tmp_path: Path) -> None:
    """A transient Slurm error in the scancel of a fully released group: the job (PENDING,
    so no agent sees its stop file yet) must not hide behind its released members, or it
    would outlive its cluster. Like a one-node job, it shows up again until cancelled."""
    p, f = _cancel_failed(tmp_path, running=False)
    p.terminate_nodes(["1000.0", "1000.1"])
    assert f.cancelled == [["1000"]]
    assert p.non_terminated_nodes({}) == []


def test_ray_down_cancels_a_fully_released_group_the_head_could_not_cancel(
        tmp_path: Path) -> None:
    """The head's autoscaler released every member but its scancel failed; `ray down` (a
    new process, nothing in memory but the stop files) still lists and cancels the job."""
    p, f = make(tmp_path, fake())
    p.create_node(GANG, TAGS, 2)
    p.non_terminated_nodes({})
    p.terminate_node("1000.0")
    f.set_outage(True)
    p._sleep = lambda _s: None  # the cancel's own tries (teardown.cancel_jobs): no real waits
    with pytest.raises(SlurmError):
        p.terminate_node("1000.1")
    f.set_outage(False)
    q, _ = make(tmp_path, f)
    assert sorted(q.non_terminated_nodes({})) == ["1000.0", "1000.1"]
    q.terminate_nodes(sorted(q.non_terminated_nodes({})))
    assert f.cancelled == [["1000"]]


def test_a_listing_during_the_groups_scancel_brings_back_no_member(tmp_path: Path) -> None:
    """v2 terminates from its own thread pool: a listing while the last member's scancel is
    in flight must not show the member released earlier (v2 would adopt it as new)."""
    p, f = make(tmp_path, fake())
    p.create_node(GANG, TAGS, 2)
    f.start("1000", "n[1-2]")
    p.non_terminated_nodes({})
    p.terminate_node("1000.0")
    real = f.cancel
    seen: list[list[str]] = []

    def cancel_while_listing(ids: Any) -> None:
        seen.append(p.non_terminated_nodes({}))  # the reconciler's tick, meanwhile
        real(ids)

    f.cancel = cancel_while_listing  # type: ignore[method-assign]
    p.terminate_node("1000.1")
    assert seen == [[]] and f.cancelled == [["1000"]]


def test_a_group_whose_cancel_failed_is_listed_whole_on_a_steady_tick(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Members released in two calls, the second scancel fails: the next tick (the same
    listing, so a steady one) shows the whole group again."""
    p, f = make(tmp_path, fake())
    listed: list[list[Any]] = []
    real = f.list_jobs

    def stable(name: str) -> list[Any]:
        """As the CLI client's cache does: an unchanged listing is the same list again."""
        new = real(name)
        if listed and [(j.job_id, j.state) for j in listed[-1]] == [
                (j.job_id, j.state) for j in new]:
            return listed[-1]
        listed.append(new)
        return new

    monkeypatch.setattr(f, "list_jobs", stable)
    p.create_node(GANG, TAGS, 2)
    p.non_terminated_nodes({})
    p.terminate_node("1000.0")
    assert p.non_terminated_nodes({}) == ["1000.1"]
    def down(jobs: Any) -> None:  # every try of the cancel (teardown.cancel_jobs) fails
        raise TransientSlurmError("scancel: error: Unable to contact slurm controller "
                                  "(connect failure)")

    monkeypatch.setattr(f, "cancel", down)
    p._sleep = lambda _s: None
    with pytest.raises(SlurmError):
        p.terminate_node("1000.1")
    assert sorted(p.non_terminated_nodes({})) == ["1000.0", "1000.1"]


def test_a_group_listed_again_that_ends_on_its_own_is_no_crash(tmp_path: Path) -> None:
    """After a failed scancel the released members show again; their agents obey the stop
    files and the job completes: not a type whose jobs die before Ray."""
    p, f = _cancel_failed(tmp_path, running=True)
    f.finish("1000", "COMPLETED")
    assert p.non_terminated_nodes({}) == []
    assert not (p.cluster_dir.root / "errors.json").exists()
