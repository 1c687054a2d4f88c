"""Rank order and device policies of the gang launcher: pure logic, no Ray, no torch."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ray_slurm_provider.gang.devices import DevicePolicyError, bind_all, bind_devices
from ray_slurm_provider.gang.topology import (
    Member,
    TopologyError,
    assign_ranks,
    describe_layout,
    gpu_key,
    group_by_node,
    ip_key,
)


def members(spec: list[tuple[str, str, list[str]]]) -> list[Member]:
    """[(ip, node_id, [gpu ids of each rank])] per bundle, slots in bundle-major order."""
    out, slot = [], 0
    for b, (ip, node, gpus) in enumerate(spec):
        for g in gpus:
            out.append(Member(slot, b, ip, node, (g,) if g else ()))
            slot += 1
    return out


def test_ips_sort_numerically_not_as_text() -> None:
    ips = ["10.0.0.10", "10.0.0.9", "10.0.1.1", "9.255.255.255"]
    assert sorted(ips, key=ip_key) == ["9.255.255.255", "10.0.0.9", "10.0.0.10", "10.0.1.1"]
    assert ip_key("10.0.0.1") < ip_key("::1") < ip_key("not-an-ip")


def test_gpu_ids_sort_numerically_then_as_text() -> None:
    ids = ["10", "2", "GPU-b", "MIG-a", "0"]
    assert sorted(ids, key=gpu_key) == ["0", "2", "10", "GPU-b", "MIG-a"]


def test_the_seed_bug_string_ip_order_is_fixed() -> None:
    # The seed sorted "10.0.0.10" before "10.0.0.9": rank 0 landed on the wrong node.
    ms = members([("10.0.0.10", "b", ["0", "1"]), ("10.0.0.9", "a", ["0", "1"])])
    out = assign_ranks(ms, nodes=2, ranks_per_node=2)
    assert [a.member.node_ip for a in out] == ["10.0.0.9"] * 2 + ["10.0.0.10"] * 2
    assert [a.rank for a in out] == [0, 1, 2, 3]
    assert [a.node_rank for a in out] == [0, 0, 1, 1]


def test_same_ip_falls_back_on_node_id_and_ranks_follow_gpu_ids() -> None:
    # Two Slurm jobs on one host: same IP, different Ray nodes. Ray gave bundle 0 GPUs 3 and 1.
    ms = members([("10.0.0.5", "ffff", ["3", "1"]), ("10.0.0.5", "0000", ["10", "2"])])
    out = assign_ranks(ms, nodes=2, ranks_per_node=2)
    assert [(a.member.node_id, a.member.gpu_ids[0], a.local_index) for a in out] == [
        ("0000", "2", 0), ("0000", "10", 1), ("ffff", "1", 0), ("ffff", "3", 1)]


@given(st.permutations(list(range(8))), st.lists(st.integers(0, 255), min_size=4,
                                                   max_size=4, unique=True))
@settings(max_examples=50, deadline=None)
def test_order_does_not_depend_on_reporting_order(perm: list[int], last_octets: list[int]) -> None:
    ms = members([(f"10.0.{o}.{o}", f"n{i}", ["1", "0"]) for i, o in enumerate(last_octets)])
    shuffled = [ms[i % len(ms)] for i in perm]
    a = assign_ranks(ms, nodes=4, ranks_per_node=2)
    b = assign_ranks(shuffled, nodes=4, ranks_per_node=2)
    assert [(x.rank, x.member) for x in a] == [(x.rank, x.member) for x in b]
    assert [x.member.node_ip for x in a] == sorted((x.member.node_ip for x in a), key=ip_key)


@pytest.mark.parametrize("spec, nodes, rpn, msg", [
    ([("1.1.1.1", "a", ["0", "1"])], 2, 2, "expected 2 x 2 ranks"),
    ([("1.1.1.1", "a", ["0", "1"]), ("1.1.1.2", "a", ["0", "1"])], 2, 2, "share Ray node"),
    ([("1.1.1.1", "a", ["0", "0"]), ("1.1.1.2", "b", ["0", "1"])], 2, 2, "GPU is shared"),
])
def test_broken_placements_are_refused(spec: list[tuple[str, str, list[str]]], nodes: int,
                                       rpn: int, msg: str) -> None:
    with pytest.raises(TopologyError, match=msg):
        assign_ranks(members(spec), nodes=nodes, ranks_per_node=rpn)


def test_a_bundle_spanning_two_nodes_is_refused() -> None:
    ms = [Member(0, 0, "1.1.1.1", "a"), Member(1, 0, "1.1.1.2", "b")]
    with pytest.raises(TopologyError, match="spans several Ray nodes"):
        assign_ranks(ms, nodes=1, ranks_per_node=2)


def test_layout_description_names_nodes_ranks_and_gpus() -> None:
    ms = members([("10.0.0.2", "bbbbbbbbbb", ["0", "1"]), ("10.0.0.1", "aaaaaaaaaa", ["1", "0"])])
    text = describe_layout(assign_ranks(ms, nodes=2, ranks_per_node=2))
    assert text.splitlines() == ["node 0 10.0.0.1 (?, Ray node aaaaaaaa): ranks 0-1 gpus 0,1",
                                 "node 1 10.0.0.2 (?, Ray node bbbbbbbb): ranks 2-3 gpus 0,1"]


# --- CUDA_VISIBLE_DEVICES policies -------------------------------------------------------

NODE = [Member(0, 0, "1.1.1.1", "a", ("2",)), Member(1, 0, "1.1.1.1", "a", ("5",))]


def test_node_policy_one_list_per_node() -> None:
    b = [bind_devices("node", NODE, i) for i in range(2)]
    assert [(x.cuda_visible_devices, x.local_rank, x.device_index) for x in b] == [
        ("2,5", 0, 0), ("2,5", 1, 1)]


def test_ray_policy_keeps_the_per_gpu_mask() -> None:
    b = [bind_devices("ray", NODE, i) for i in range(2)]
    assert [(x.cuda_visible_devices, x.local_rank, x.device_index) for x in b] == [
        ("2", 0, 0), ("5", 1, 0)]


def test_pop_policy_is_the_seeds() -> None:
    b = [bind_devices("pop", NODE, i) for i in range(2)]
    assert [(x.cuda_visible_devices, x.local_rank, x.device_index) for x in b] == [
        (None, 2, 2), (None, 5, 5)]


def test_uuid_ids_work_with_node_policy_and_are_refused_by_pop() -> None:
    node = [Member(0, 0, "1.1.1.1", "a", ("GPU-aa",)), Member(1, 0, "1.1.1.1", "a", ("GPU-bb",))]
    assert bind_devices("node", node, 1).cuda_visible_devices == "GPU-aa,GPU-bb"
    with pytest.raises(DevicePolicyError, match="integer GPU ids"):
        bind_devices("pop", node, 0)


def test_cpu_ranks_hide_gpus() -> None:
    node = [Member(0, 0, "1.1.1.1", "a"), Member(1, 0, "1.1.1.1", "a")]
    b = bind_devices("node", node, 1)
    assert (b.cuda_visible_devices, b.local_rank, b.device_index) == ("", 1, None)


@pytest.mark.parametrize("node, policy, msg", [
    ([Member(0, 0, "i", "a", ("0", "1"))], "node", "exactly one GPU"),
    ([Member(0, 0, "i", "a", ("0",)), Member(1, 0, "i", "a")], "node", "exactly one GPU"),
    ([Member(0, 0, "i", "a", ("0",))], "per-gpu", "unknown"),
])
def test_bad_device_layouts(node: list[Member], policy: str, msg: str) -> None:
    with pytest.raises(DevicePolicyError, match=msg):
        bind_devices(policy, node, 0)


def test_bind_all_follows_group_order() -> None:
    ms = members([("1.1.1.2", "b", ["1", "0"]), ("1.1.1.1", "a", ["3", "2"])])
    random.Random(0).shuffle(ms)
    groups = group_by_node(ms, nodes=2, ranks_per_node=2)
    out = bind_all("node", groups)
    assert [[b.cuda_visible_devices for b in node] for node in out] == [["2,3"] * 2, ["0,1"] * 2]
