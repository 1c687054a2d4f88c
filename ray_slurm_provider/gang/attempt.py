"""One attempt of a gang: fresh actors, rank order, a fresh port, run, watch, tear down.

Any failure of any rank (an exception, a dead process, a missed heartbeat, an unanswered poll)
ends the attempt, and `finally` kills every actor of it: survivors of a broken process group
would otherwise block in their next collective (gloo fails some of them, NCCL can wait until
its timeout). The placement group stays; the next attempt reuses its bundles.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from ray_slurm_provider.gang.context import FatalRankError, Progress, RankInfo
from ray_slurm_provider.gang.devices import DevicePolicyError, bind_all
from ray_slurm_provider.gang.rankenv import EnvInputs, build_rank_env
from ray_slurm_provider.gang.rendezvous import RendezvousError, fresh_port, master_of
from ray_slurm_provider.gang.spec import GangSpec
from ray_slurm_provider.gang.topology import (
    Assignment,
    Member,
    TopologyError,
    assign_ranks,
    describe_layout,
    group_by_node,
)
from ray_slurm_provider.gang.watchdog import Watchdog

Log = Callable[[str], None]


@dataclass
class AttemptRecord:
    attempt: int
    ok: bool = False
    fatal: bool = False
    failure: str | None = None
    failed_rank: int | None = None
    master: str = ""
    layout: list[dict[str, Any]] = field(default_factory=list)
    results: dict[int, Any] = field(default_factory=dict)
    reports: list[dict[str, Any]] = field(default_factory=list)
    wall_s: float = 0.0
    ready_s: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _error_text(e: BaseException) -> str:
    """One short line: Ray's actor-death messages run to a paragraph of advice."""
    text = " ".join(str(e).split())
    m = re.search(r"Worker exit type: (\w+)", text)
    if "ActorDiedError" in type(e).__name__ and m:
        return f"{type(e).__name__}: the rank's process died (exit type {m.group(1)})"
    lines = [x for x in str(e).strip().splitlines() if x.strip()]
    return f"{type(e).__name__}: {lines[-1].strip() if lines else ''}"[:300]


class Attempt:
    def __init__(self, spec: GangSpec, pg: Any, number: int, fn: str, payload: Any,
                 used_ports: set[int], run_id: str, log: Log) -> None:
        self.spec, self.pg, self.fn, self.payload = spec, pg, fn, payload
        self.used_ports, self.run_id, self.log = used_ports, run_id, log
        self.rec = AttemptRecord(number)
        self.actors: dict[int, Any] = {}  # slot, then rank -> actor handle

    def run(self) -> AttemptRecord:
        import ray

        t0 = time.monotonic()
        try:
            self._run()
        except (TopologyError, DevicePolicyError, FatalRankError) as e:
            self._fail(None, _error_text(e), fatal=True)
        except (ray.exceptions.RayError, TimeoutError, RendezvousError) as e:
            self._fail(None, _error_text(e))
        finally:
            for actor in self.actors.values():
                try:
                    ray.kill(actor, no_restart=True)
                except Exception:  # already dead
                    pass
            self.rec.wall_s = time.monotonic() - t0
        return self.rec

    def _fail(self, rank: int | None, text: str, fatal: bool = False) -> None:
        if self.rec.failure is None:
            self.rec.failure, self.rec.failed_rank, self.rec.fatal = text, rank, fatal

    def _create(self) -> list[Member]:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from ray_slurm_provider.gang.actor import RankWorker

        s = self.spec
        res = s.rank_resources()
        other = {k: v for k, v in res.items() if k not in ("CPU", "GPU")}
        cls = ray.remote(RankWorker)
        for b in range(s.nodes):
            for j in range(s.ranks_per_node):
                slot = b * s.ranks_per_node + j
                self.actors[slot] = cls.options(
                    num_cpus=res.get("CPU", 0), num_gpus=res.get("GPU", 0),
                    resources=other or None, max_concurrency=2, max_restarts=0,
                    max_task_retries=0, scheduling_strategy=PlacementGroupSchedulingStrategy(
                        self.pg, placement_group_bundle_index=b),
                ).remote(slot, b)
        slots = sorted(self.actors)
        infos = ray.get([self.actors[k].describe.remote() for k in slots],
                        timeout=s.start_timeout_s)
        return [Member(slot=i["slot"], bundle=i["bundle"], node_ip=i["node_ip"],
                       node_id=i["node_id"], gpu_ids=tuple(i["gpu_ids"]),
                       hostname=i["hostname"], pid=i["pid"],
                       slurm_job_id=i["slurm_job_id"]) for i in infos]

    def _run(self) -> None:
        import ray

        s, t0 = self.spec, time.monotonic()
        members = self._create()
        assignments = assign_ranks(members, nodes=s.nodes, ranks_per_node=s.ranks_per_node)
        groups = group_by_node(members, nodes=s.nodes, ranks_per_node=s.ranks_per_node)
        bindings = bind_all(s.cvd_policy, groups)
        self.actors = {a.rank: self.actors[a.member.slot] for a in assignments}
        rank0 = self.actors[0]
        port = fresh_port(lambda: int(ray.get(rank0.probe_port.remote(), timeout=60)),
                          self.used_ports)
        self.used_ports.add(port)
        master = master_of(assignments)
        self.rec.master = f"{master}:{port}"
        self.rec.ready_s = time.monotonic() - t0
        self.log(f"[launch] attempt {self.rec.attempt}: {s.world_size} ranks ready in "
                 f"{self.rec.ready_s:.1f}s, rendezvous {master}:{port}\n"
                 + describe_layout(assignments))
        g = EnvInputs(master, port, s.resolved_backend, s.device, s.cvd_policy,
                      self.rec.attempt, s.threads, self.run_id, s.checkpoint_dir)
        base = s.profile_env()
        leaders = self._leaders(assignments)
        if s.s3_uri and s.checkpoint_dir:
            pulls = [self.actors[r].stage_in.remote(s.s3_uri, s.s3_endpoint, s.checkpoint_dir)
                     for r in leaders]
            got = ray.get(pulls, timeout=s.start_timeout_s)
            self.log(f"[launch] staged in {sum(len(x) for x in got)} file(s) from {s.s3_uri}")
        refs = {}
        for a in assignments:
            d = bindings[a.node_rank][a.local_index]
            info = RankInfo(a.rank, d.local_rank, a.world_size, a.local_world_size,
                            a.node_rank, a.num_nodes, self.rec.attempt, s.resolved_backend,
                            s.device, d.device_index, s.cvd_policy, s.checkpoint_dir,
                            master, port)
            env = build_rank_env(a, d, g, base)
            stage = ({"uri": s.s3_uri, "endpoint": s.s3_endpoint}
                     if s.s3_uri and a.rank in leaders else None)
            fault = asdict(s.fault) if s.fault else None
            self.rec.layout.append({**asdict(a.member), "rank": a.rank,
                                    "node_rank": a.node_rank, "local_rank": d.local_rank,
                                    "device_index": d.device_index,
                                    "cuda_visible_devices": d.cuda_visible_devices})
            refs[self.actors[a.rank].run.remote(self.fn, self.payload, asdict(info), env,
                                                fault, stage)] = a.rank
        self._watch(refs)

    def _leaders(self, assignments: list[Assignment]) -> list[int]:
        if self.spec.checkpoint_shared:
            return [0]
        return [a.rank for a in assignments if a.local_index == 0]

    def _watch(self, refs: dict[Any, int]) -> None:
        import ray

        s = self.spec
        wd = Watchdog(s.start_timeout_s, s.stall_timeout_s, s.answer_timeout_s,
                      ranks=list(refs.values()), started_at=time.monotonic())
        polls: dict[int, Any] = {}
        while refs and self.rec.failure is None:
            done, _ = ray.wait(list(refs), num_returns=1, timeout=s.poll_interval_s)
            for ref in done:
                rank = refs.pop(ref)
                wd.done(rank)
                try:
                    out = ray.get(ref)
                    # A poll issued before the rank finished holds earlier reports than
                    # its result: read it first so reports stay in step order.
                    self._poll(polls, set(), wd, wait_s=5.0, only=rank)
                    self._take(out.pop("reports", []))
                    self.rec.results[rank] = out
                except (FatalRankError, ray.exceptions.RayError) as e:
                    fatal = isinstance(e, FatalRankError) or isinstance(
                        getattr(e, "cause", None), FatalRankError)
                    self._fail(rank, f"rank {rank} failed: {_error_text(e)}", fatal)
            self._poll(polls, set(refs.values()), wd)
            stuck = wd.check(time.monotonic())
            if stuck:
                more = f" ({len(stuck)} ranks stuck in all)" if len(stuck) > 1 else ""
                self._fail(stuck[0].rank, stuck[0].reason + more)
        if self.rec.failure is not None:
            self.log(f"[launch] attempt {self.rec.attempt} failed: {self.rec.failure}; "
                     "tearing the whole gang down")
            # Collect what the survivors reported before they were stopped: the answers in
            # flight, then one fresh poll each.
            self._poll(polls, set(), wd, wait_s=5.0)
            self._poll(polls, set(refs.values()), wd, wait_s=5.0)
        else:
            self.rec.ok = True

    def _poll(self, polls: dict[int, Any], running: set[int], wd: Watchdog,
              wait_s: float = 0.0, only: int | None = None) -> None:
        """Issue a poll to every running rank without one in flight; read those answered
        (waiting up to `wait_s` for all of them, or only for rank `only`'s)."""
        import ray

        for rank in running - set(polls):
            polls[rank] = self.actors[rank].poll.remote()
        wanted = [ref for r, ref in polls.items() if only is None or r == only]
        if not wanted:
            return
        ready, _ = ray.wait(wanted, num_returns=len(wanted), timeout=wait_s)
        by_ref = {ref: rank for rank, ref in polls.items()}
        for ref in ready:
            rank = by_ref[ref]
            del polls[rank]
            try:
                p = Progress(**ray.get(ref))
            except ray.exceptions.RayError:
                continue  # the run() result reports the death
            wd.observe(rank, p, time.monotonic())
            self._take(p.reports)

    def _take(self, rows: list[dict[str, Any]]) -> None:
        self.rec.reports.extend(rows)
        for row in rows:
            if row.get("rank") == 0:
                self.log(f"[attempt {self.rec.attempt}] " + " ".join(
                    f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}"
                    for k, v in row.items() if k not in ("rank", "attempt")))
