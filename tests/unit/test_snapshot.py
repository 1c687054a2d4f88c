"""The per-tick listing fast paths (bench P4) keep the slow paths' results; the benchmark's
own parsers read real tool output. No timings are asserted here."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from ray.autoscaler.tags import TAG_RAY_NODE_KIND as KIND

from bench.common import TICK_MARK, is_query, monitor_ticks
from bench.p4_listing_cpu import FakeRun, scontrol_nodes, squeue_output
from ray_slurm_provider import proc
from ray_slurm_provider.jobs import decode_tags, encode_tags
from ray_slurm_provider.slurm import parse
from ray_slurm_provider.slurm.cli import CliSlurmClient
from ray_slurm_provider.state import ClusterDir, RayUp


def test_parse_squeue_fills_addresses_from_the_table() -> None:
    out = squeue_output(30)
    plain = parse.parse_squeue(out)
    addrs = {f"n{k}": f"10.0.0.{k}" for k in range(1, 1001)}
    filled = parse.parse_squeue(out, addrs)
    assert [j.node_addr for j in plain] == [""] * 30
    for a, b in zip(plain, filled, strict=True):
        assert b.node_addr == (addrs[a.batch_host] if a.batch_host else "")
        assert replace(b, node_addr="") == a


def test_list_jobs_uses_the_cached_table_and_fetches_it_for_new_hosts() -> None:
    fake = FakeRun(squeue_output(40), scontrol_nodes(1000))
    with mock.patch.object(proc, "run", fake):
        client = CliSlurmClient(env={"PATH": "/usr/bin"})
        first = client.list_jobs("ray-p4")
        second = client.list_jobs("ray-p4")
    # The federation is asked after each of the first two listings (CliSlurmClient._learn_local).
    assert fake.calls == {"squeue": 2, "scontrol": 1, "federation": 2}
    assert first == second
    assert {j.batch_host: j.node_addr for j in first if j.batch_host}["n3"] == "10.0.0.3"
    # The first listing with a running job fetches the table before it parses (no job is
    # rebuilt). A host the table does not know is looked up again when a job line with it
    # first appears, not on every listing of the same lines.
    t40, t42 = squeue_output(40), squeue_output(42)
    fake = FakeRun([t42, t40, t40], scontrol_nodes(20))  # served in turn: t40, t40, t42
    with mock.patch.object(proc, "run", fake):
        client = CliSlurmClient(env={"PATH": "/usr/bin"})
        jobs = [client.list_jobs("ray-p4") for _ in range(2)][-1]
        assert fake.calls == {"squeue": 2, "scontrol": 1, "federation": 2}
        by_host = {j.batch_host: j.node_addr for j in jobs if j.batch_host}
        assert all(bool(addr) == (int(host[1:]) <= 20) for host, addr in by_host.items())
        client.list_jobs("ray-p4")  # job 41, running on n42, is new: the table is asked again
    assert fake.calls == {"squeue": 3, "scontrol": 2, "federation": 2}


def test_decode_tags_returns_a_fresh_dict_each_time() -> None:
    comment = encode_tags({"a": "1", "b": "2"})
    first = decode_tags(comment)
    assert first == {"a": "1", "b": "2"}
    first.pop("a")  # the provider pops its submission nonce
    assert decode_tags(comment) == {"a": "1", "b": "2"}
    assert decode_tags("not ours") is None
    assert decode_tags("ray-slurm:{broken") is None


def test_cluster_dir_fast_paths(tmp_path: Path) -> None:
    cdir = ClusterDir(str(tmp_path), "c")
    assert cdir.tags("7") == {} and not cdir.ray_up("7")
    cdir.set_tags("7", {"k": "v"})
    cdir.node("7").write_ray_up(RayUp(ip="x", job_id="7"))
    assert cdir.tags("7") == {"k": "v"} and cdir.ray_up("7")


def test_sdiag_query_rpcs_and_monitor_ticks(tmp_path: Path) -> None:
    assert is_query("REQUEST_JOB_INFO") and is_query("REQUEST_PARTITION_INFO")
    assert is_query("REQUEST_JOB_INFO_SINGLE") and is_query("REQUEST_NODE_INFO")
    assert not is_query("REQUEST_STATS_INFO") and not is_query("REQUEST_SUBMIT_BATCH_JOB")
    log = tmp_path / "monitor.log"
    log.write_text(f"2026-11-30 01:20:25,271\tWARNING util.py:279 -- {TICK_MARK}. x\n"
                   "2026-11-30 01:20:25,271\tWARNING util.py:279 -- Dropping worker_nodes\n"
                   f"2026-11-30 01:20:30,355\tWARNING util.py:279 -- {TICK_MARK}. x\n")
    ticks = monitor_ticks(log)
    assert len(ticks) == 2 and round(ticks[1] - ticks[0], 3) == 5.084


# --- incremental listing (P4, second round) ------------------------------------------------


def test_squeue_cache_matches_the_full_parser_across_listings() -> None:
    from bench.p4_listing_cpu import squeue_output as listing

    cache = parse.SqueueCache()
    addrs = {f"n{k}": f"10.0.0.{k}" for k in range(1, 1001)}
    first = cache.parse(listing(50, 0), addrs)
    assert first == parse.parse_squeue(listing(50, 0), addrs) and len(cache.fresh) == 50
    # The same listing again (no field changes by itself): the very same list, nothing parsed.
    second = cache.parse(listing(50, 1), addrs)
    assert second is first and cache.fresh == []
    # A job that changed state is parsed anew; a job that left is forgotten; the others are
    # the same objects.
    lines = listing(50, 1).splitlines()
    lines[3] = lines[3].replace("RUNNING", "COMPLETING")
    third = cache.parse("\n".join(lines[:-1]) + "\n", addrs)
    assert [j.job_id for j in cache.fresh] == [third[3].job_id] and not third[3].active
    assert len(third) == 49 and third[0] is first[0]
    assert third == parse.parse_squeue("\n".join(lines[:-1]) + "\n", addrs)
    # A new node table: addresses may have changed, so everything is parsed again.
    cache.parse(listing(50, 1), dict(addrs))
    assert len(cache.fresh) == 50


def _provider(tmp_path: Path) -> tuple[Any, Any]:
    from tests.fakes import FakeSlurm
    from tests.unit.test_provider import WORKER_TAGS, make

    p, f = make(tmp_path)
    ids = list(p.create_node({}, WORKER_TAGS, 3))
    for i in ids:
        f.start(i)
    assert isinstance(f, FakeSlurm)
    return p, f


def test_kept_records_still_see_tags_written_elsewhere(tmp_path: Path) -> None:
    p, _ = _provider(tmp_path)
    ids = p.non_terminated_nodes({})
    p.non_terminated_nodes({})
    # Another process (`ray up`, the head) writes a node's tags: seen on the next tick.
    ClusterDir(p.pcfg.state_dir, "c1").set_tags(ids[0], {"extra": "1"})
    p.non_terminated_nodes({})
    assert p.node_tags(ids[0])["extra"] == "1"


def test_kept_records_still_see_ray_come_up_and_state_change(tmp_path: Path) -> None:
    p, f = _provider(tmp_path)
    ids = p.non_terminated_nodes({})
    assert {p.node_tags(i)["ray-node-status"] for i in ids} == {"setting-up"}
    p.cluster_dir.node(ids[1]).write_ray_up(RayUp(ip="x", job_id=ids[1]))
    p.non_terminated_nodes({})
    assert p.node_tags(ids[1])["ray-node-status"] == "up-to-date"
    f.finish(ids[2])
    assert ids[2] not in p.non_terminated_nodes({})


def test_kept_records_still_cancel_a_late_stray(tmp_path: Path) -> None:
    p, f = _provider(tmp_path)
    ids = p.non_terminated_nodes({})
    nonce = decode_tags(f.job(ids[0]).comment)["ray-slurm-submit"]  # type: ignore[index]
    p.strays.add(nonce)  # its submission was reported failed after it was listed
    assert p.non_terminated_nodes({}) == []  # the whole array shares the nonce
    assert f.cancelled == [sorted(ids)]


def _job(job_id: str, state: str = "RUNNING", **tags: str) -> Any:
    from ray_slurm_provider.slurm.client import Job

    comment = encode_tags({KIND: "worker", **tags})
    return Job(job_id=job_id, name="ray-c", state=state, comment=comment)


class Dir:
    """A cluster directory's answers, from memory."""

    def __init__(self, tags: dict[str, dict[str, str]] | None = None,
                 up: set[str] | None = None, released: set[str] | None = None) -> None:
        self._tags = tags or {}
        self.up = up or set()
        self._released = released or set()
        self.reads: list[str] = []

    def tags(self, job_id: str) -> dict[str, str]:
        self.reads.append(job_id)
        return dict(self._tags.get(job_id, {}))

    def ray_up(self, job_id: str) -> bool:
        return job_id in self.up

    def released(self, node_id: str) -> bool:
        return node_id in self._released


def _advance(prev: dict[str, Any], jobs: list[Any], files: Dir | None = None,
             stray: Any = lambda n: False, reuse: bool = True, listing: int = 1) -> Any:
    from ray_slurm_provider.provider.nodes import Rules, advance

    return advance(prev, jobs, listing=listing, now=0.0, reuse=reuse, files=files or Dir(),
                   rules=Rules(submit_tag="nonce", watch_workers=True, gone_ttl_s=120.0),
                   stray=stray)


def test_advance_keeps_ours_drops_cancelled_inactive_and_foreign_and_finds_strays() -> None:
    from ray_slurm_provider.jobs import encode_tags as enc
    from ray_slurm_provider.provider.nodes import Node, Phase
    from ray_slurm_provider.slurm.client import Job

    jobs = [_job("1"), _job("2", "COMPLETING"), _job("3"), _job("4", nonce="bad"),
            Job(job_id="5", name="ray-c", state="RUNNING", comment="someone else's"),
            Job(job_id="6", name="ray-c", state="PENDING", comment=enc({"nonce": "ok"}))]
    cancelled = {"3": Node(_job("3"), {}, Phase.CANCELLING, since=0.0)}
    tick = _advance(cancelled, jobs, Dir(tags={"6": {"seen": "6"}}), stray=lambda n: n == "bad")
    assert tick.shown == ["1", "6"] and tick.events.strays == ["4"]
    assert tick.nodes["6"].tags == {"seen": "6"}  # the submit tag is not a node tag
    assert tick.nodes["3"].phase is Phase.CANCELLING  # hidden while Slurm lists it


def test_advance_reuses_an_unchanged_record_with_the_fresh_job() -> None:
    from ray_slurm_provider.provider.nodes import Node, Phase

    old = Node(_job("1"), {"kept": "yes"}, Phase.RAY_UP)  # running: once its Ray is up
    fresh = replace(_job("1"), time_left_s=5)
    files = Dir(tags={"1": {"rebuilt": "yes"}})
    tick = _advance({"1": old}, [fresh], files)
    assert tick.nodes["1"] is old and old.tags == {"kept": "yes"} and old.job is fresh
    assert files.reads == []
    assert _advance({"1": old}, [fresh], files, reuse=False).nodes["1"].tags["rebuilt"] == "yes"


def test_ended_workers_are_shown_workers_that_left_unless_cancelled_by_us() -> None:
    from ray_slurm_provider.provider.nodes import Node, Phase

    prev = {"1": Node(_job("1"), {KIND: "worker"}),
            "2": Node(_job("2", "PENDING"), {KIND: "worker"}),
            "3": Node(_job("3"), {KIND: "head"}),
            "4": Node(_job("4"), {KIND: "worker"}, Phase.CANCELLING),
            "5": Node(_job("5"), {KIND: "worker"}),
            "6": Node(_job("6", "COMPLETING"), {KIND: "worker"}),  # already ending
            "7": Node(_job("7"), {KIND: "worker"}, Phase.RAY_UP)}
    tick = _advance(prev, [_job("5")], Dir(up={"7"}))
    assert [j for j, _ in tick.events.crashed] == ["1", "2"]
    assert tick.events.orphans == ["7"]


def test_a_steady_tick_reuses_every_record_and_still_moves_the_heads_time_left(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 18 (P4): an unchanged listing (same Job objects: the CLI client's cache) with no
    tags written, nothing cancelled or created and no worker still setting up is last tick's
    view; only the head's time left moves."""
    from ray_slurm_provider.provider import provider as provider_module
    from ray_slurm_provider.provider.nodes import advance
    from tests.unit.test_provider import HEAD_TAGS, WORKER_TAGS, make

    p, f = make(tmp_path)
    listed: list[list[Any]] = [[]]
    real = f.list_jobs

    def stable(name: str) -> list[Any]:
        """As the CLI client's cache does: an unchanged job is the same Job object."""
        old = {j.job_id: j for j in listed[-1]}
        out = [old[j.job_id] if j.job_id in old and old[j.job_id].state == j.state else j
               for j in real(name)]
        listed.append(out)
        return out

    monkeypatch.setattr(f, "list_jobs", stable)
    (head,) = p.create_node({}, HEAD_TAGS, 1)
    workers = list(p.create_node({}, WORKER_TAGS, 2))
    for i in [head, *workers]:
        f.start(i)
        p.cluster_dir.node(i).write_ray_up(RayUp(ip="x", job_id=i))
    first = sorted(p.non_terminated_nodes({}))
    tags = {i: p.node_tags(i) for i in first}
    calls: list[int] = []
    monkeypatch.setattr(provider_module, "advance",
                        lambda *a, **k: calls.append(1) or advance(*a, **k))
    seen: list[str] = []
    monkeypatch.setattr(p.head_time, "observe", lambda job: seen.append(job.job_id) or False)
    assert sorted(p.non_terminated_nodes({})) == first
    assert calls == [] and seen == [head]
    assert {i: p.node_tags(i) for i in first} == tags
    # Anything that may change a record takes the full path again: a creation, ...
    (new,) = p.create_node({}, WORKER_TAGS, 1)
    assert new in p.non_terminated_nodes({}) and calls == [1]
    p.non_terminated_nodes({})  # settled: steady again
    assert calls == [1]
    # ... a job whose state changed, ...
    f.finish(workers[0])
    assert workers[0] not in p.non_terminated_nodes({}) and calls == [1, 1]
    # ... and a cancellation.
    p.terminate_node(workers[1])
    assert workers[1] not in p.non_terminated_nodes({}) and calls == [1, 1, 1]
