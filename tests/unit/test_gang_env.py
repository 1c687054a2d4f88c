"""Rank environment, profiles, rendezvous port, watchdog and context of the gang launcher."""

from __future__ import annotations

import socket
from itertools import count

import pytest

from ray_slurm_provider.gang import profiles
from ray_slurm_provider.gang.context import (
    CRASH_EXIT_CODE,
    FaultSpec,
    Progress,
    RankContext,
    RankInfo,
)
from ray_slurm_provider.gang.devices import DeviceBinding
from ray_slurm_provider.gang.rankenv import OWNED, EnvInputs, apply_env, build_rank_env
from ray_slurm_provider.gang.rendezvous import (
    RendezvousError,
    fresh_port,
    master_of,
    probe_free_port,
)
from ray_slurm_provider.gang.topology import Assignment, Member
from ray_slurm_provider.gang.watchdog import Watchdog

A = Assignment(Member(5, 1, "10.0.0.7", "n1", ("3",)), rank=5, node_rank=1, local_index=1,
               world_size=8, local_world_size=4, num_nodes=2)
G = EnvInputs("10.0.0.2", 41234, "nccl", "gpu", "node", attempt=2, omp_threads=4,
              run_id="abc", checkpoint_dir="/ckpt")


def test_every_torchrun_variable_is_set_explicitly() -> None:
    env = build_rank_env(A, DeviceBinding("0,1,2,3", 1, 1), G)
    assert {k: env[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                                "NODE_RANK", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
                                "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS")} == {
        "RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4",
        "NODE_RANK": "1", "GROUP_RANK": "1", "MASTER_ADDR": "10.0.0.2", "MASTER_PORT": "41234",
        "CUDA_VISIBLE_DEVICES": "0,1,2,3", "OMP_NUM_THREADS": "4"}
    assert env["RSP_ATTEMPT"] == "2" and env["RSP_DEVICE_INDEX"] == "1"
    assert set(OWNED) <= set(env)


def test_launcher_variables_win_over_profiles_and_none_removes() -> None:
    base = {"RANK": "99", "NCCL_DEBUG": "INFO", "OMP_NUM_THREADS": "16"}
    env = build_rank_env(A, DeviceBinding(None, 3, 3), G, base)
    assert env["RANK"] == "5" and env["NCCL_DEBUG"] == "INFO"
    assert env["OMP_NUM_THREADS"] == "16"  # an explicit --env wins over the default
    assert env["CUDA_VISIBLE_DEVICES"] is None and env["LOCAL_RANK"] == "3"


def test_apply_env_scrubs_slurm_and_mpi_but_keeps_ray() -> None:
    environ = {"SLURM_JOB_ID": "7", "SLURM_LOCALID": "3", "SLURMD_NODENAME": "n1",
               "PMI_RANK": "1", "OMPI_COMM_WORLD_RANK": "1", "TORCHELASTIC_RUN_ID": "x",
               "GROUP_WORLD_SIZE": "2", "RAY_ADDRESS": "a", "CUDA_VISIBLE_DEVICES": "3",
               "PATH": "/bin"}
    removed = apply_env(environ, {"RANK": "0", "CUDA_VISIBLE_DEVICES": None})
    assert environ == {"RAY_ADDRESS": "a", "PATH": "/bin", "RANK": "0"}
    assert "SLURM_LOCALID" in removed and "CUDA_VISIBLE_DEVICES" in removed


def test_profiles_are_opt_in_and_ordered() -> None:
    assert profiles.resolve([]) == {}
    env = profiles.resolve(["efa", "nccl-debug", "megatron"], {"NCCL_DEBUG": "TRACE"})
    assert env["FI_PROVIDER"] == "efa" and env["NCCL_P2P_NET_CHUNKSIZE"] == "524288"
    assert env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1" and env["NCCL_DEBUG"] == "TRACE"


def test_socket_profile_keeps_nccl_syntax_away_from_gloo() -> None:
    assert profiles.profile_env("socket=^docker,lo,veth") == {
        "NCCL_SOCKET_IFNAME": "^docker,lo,veth"}
    assert profiles.profile_env("socket=eth0,lo") == {"NCCL_SOCKET_IFNAME": "eth0,lo",
                                                      "GLOO_SOCKET_IFNAME": "eth0,lo"}
    with pytest.raises(profiles.ProfileError, match="plain interface names"):
        profiles.profile_env("gloo-socket=^docker")
    with pytest.raises(profiles.ProfileError, match="plain interface names"):
        profiles.resolve([], {"GLOO_SOCKET_IFNAME": "=eth0"})


@pytest.mark.parametrize("spec", ["nope", "socket", "socket=", "efa=1"])
def test_bad_profiles(spec: str) -> None:
    with pytest.raises(profiles.ProfileError):
        profiles.profile_env(spec)


def test_env_assignments() -> None:
    assert profiles.parse_env_assignments(["A=1", "B_2=x=y", "C="]) == {
        "A": "1", "B_2": "x=y", "C": ""}
    for bad in ("A", "=1", "1A=2", "A-B=1"):
        with pytest.raises(profiles.ProfileError):
            profiles.parse_env_assignments([bad])


def test_fresh_port_skips_used_and_well_known_ports() -> None:
    ports = iter([29500, 40000, 40001, 40002])
    assert fresh_port(lambda: next(ports), used={40000}) == 40001
    with pytest.raises(RendezvousError, match="no fresh port"):
        fresh_port(lambda: 40000, used={40000}, tries=3)


def test_probed_port_can_be_bound() -> None:
    port = probe_free_port("")
    with socket.socket() as s:
        s.bind(("", port))


def test_master_is_rank_zeros_node() -> None:
    a0 = Assignment(Member(0, 0, "10.0.0.1", "n"), 0, 0, 0, 1, 1, 1)
    assert master_of([A, a0]) == "10.0.0.1"
    with pytest.raises(RendezvousError):
        master_of([A])


def P(beats: int, step: int | None, age: float | None, running: float) -> Progress:
    return Progress(beats, step, age, running, [])


def test_watchdog_start_stall_and_silence() -> None:
    wd = Watchdog(start_timeout_s=100, stall_timeout_s=10, answer_timeout_s=30, ranks=[0, 1, 2],
                  started_at=0.0)
    for r in (0, 1, 2):
        wd.observe(r, P(0, None, None, 50), now=50)
    assert wd.check(50) == []
    wd.observe(0, P(0, None, None, 101), now=101)  # never beat, past the start timeout
    wd.observe(1, P(5, 4, 11.0, 101), now=101)  # stalled at step 4
    wd.observe(2, P(5, 5, 1.0, 101), now=101)
    stuck = wd.check(101)
    assert [s.rank for s in stuck] == [0, 1]
    assert "within 100s of starting" in stuck[0].reason and "last step 4" in stuck[1].reason
    wd.done(0)
    wd.done(1)
    assert [s.rank for s in wd.check(131.5)] == [2]  # no answer for 30.5 s
    assert "not answered a poll" in wd.check(131.5)[0].reason


def test_watchdog_blames_the_rank_with_least_progress() -> None:
    wd = Watchdog(10, 10, 60, ranks=[0, 1, 2, 3], started_at=0)
    for r in (0, 1, 2):
        wd.observe(r, P(9, 5, 20.0, 99), now=99)
    wd.observe(3, P(8, 4, 21.0, 99), now=99)  # the one the others wait for
    assert [s.rank for s in wd.check(99)] == [3, 0, 1, 2]


def test_fault_spec_parsing() -> None:
    assert FaultSpec.parse("crash:3:5") == FaultSpec("crash", 3, 5, 0)
    assert FaultSpec.parse("stall:0:2:1") == FaultSpec("stall", 0, 2, 1)
    for bad in ("crash:3", "boom:1:2", "crash:a:2"):
        with pytest.raises(ValueError):
            FaultSpec.parse(bad)


def test_context_beats_reports_and_polls_once() -> None:
    t = count()
    ctx = RankContext(RankInfo(1, 1, 2, 2, 0, 1), clock=lambda: float(next(t)))
    assert ctx.poll().beats == 0
    ctx.heartbeat(0)
    ctx.report(0, loss=4.5, note="x")
    p = ctx.poll()
    assert (p.beats, p.last_step) == (2, 0)
    assert p.reports == [{"step": 0, "rank": 1, "attempt": 0, "loss": 4.5, "note": "x"}]
    assert ctx.poll().reports == [] and len(ctx.reports()) == 1


def test_injected_faults_fire_only_where_asked() -> None:
    exits: list[int] = []
    info = RankInfo(3, 1, 4, 2, 1, 2, attempt=0)
    ctx = RankContext(info, fault=FaultSpec("crash", 3, 5), exit_fn=exits.append)
    ctx.heartbeat(4)
    assert exits == []
    ctx.heartbeat(5)
    assert exits == [CRASH_EXIT_CODE]
    later = RankContext(RankInfo(3, 1, 4, 2, 1, 2, attempt=1), fault=FaultSpec("crash", 3, 5),
                        exit_fn=exits.append)
    later.heartbeat(5)  # attempt 1: the fault is spent
    assert exits == [CRASH_EXIT_CODE]
    with pytest.raises(RuntimeError, match="injected failure"):
        RankContext(info, fault=FaultSpec("raise", 3, 1)).heartbeat(1)


def test_rank_info_from_torchrun_environment() -> None:
    info = RankInfo.from_env({"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4",
                              "LOCAL_WORLD_SIZE": "2", "NODE_RANK": "1", "RSP_DEVICE": "gpu",
                              "RSP_DEVICE_INDEX": "1", "MASTER_ADDR": "h", "MASTER_PORT": "5"})
    assert (info.rank, info.num_nodes, info.backend, info.device_index) == (3, 2, "nccl", 1)
    assert RankInfo.from_env({}).backend == "gloo"


def test_watchdog_ages_heartbeats_to_the_same_moment() -> None:
    # Rank 0 answered at t=100 (beat 2.5 s old), rank 1 at t=102 (beat 3.5 s old): as of
    # t=102, rank 0's beat is the older one (4.5 s), whatever the order of the answers.
    wd = Watchdog(10, 4, 60, ranks=[0, 1], started_at=0)
    wd.observe(0, P(9, 5, 2.5, 100), now=100)
    wd.observe(1, P(9, 5, 3.5, 102), now=102)
    stuck = wd.check(102)
    # Rank 1 (silent for 3.5 s, more than half the timeout) is a suspect, after rank 0.
    assert [s.rank for s in stuck] == [0, 1] and "for 4s" in stuck[0].reason


def test_watchdog_blames_the_laggard_even_when_a_peer_crossed_the_timeout_first() -> None:
    wd = Watchdog(10, 10, 60, ranks=[0, 3], started_at=0)
    wd.observe(0, P(9, 4, 10.5, 99), now=99)  # beat at step 4, then waits at the collective
    wd.observe(3, P(8, 3, 9.0, 99), now=99)  # hung before step 4, beat a little later
    assert [s.rank for s in wd.check(99)] == [3, 0]
    wd.observe(0, P(9, 4, 4.0, 99), now=99)
    assert wd.check(99) == []  # nobody past the timeout: no suspects yet
