"""Run a torch.distributed gang on Ray: attempts until one succeeds, placement group removed.

    from ray_slurm_provider.gang import GangSpec, run_gang
    result = run_gang(GangSpec(nodes=2, ranks_per_node=8), "my_recipe:train", payload)

`fn` ("module:function") runs in every rank as `fn(ctx, payload)` (see `context.py`); the
module is imported in the rank after its environment is set, from the job's working dir or any
installed package. The driver imports neither torch nor `fn`'s module.

Attempt `n` fails when any rank fails or stalls; the gang is torn down and attempt `n+1`
starts with new actors and a new rendezvous port on the same placement group. Resuming is the
training function's job: it loads the newest checkpoint in `ctx.checkpoint_dir` (every attempt
sees the same directory; `ctx.attempt` says which attempt this is). Errors that a restart
cannot fix (bad layout, `FatalRankError`) and a placement timeout stop at once.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ray_slurm_provider.gang import placement
from ray_slurm_provider.gang.attempt import Attempt, AttemptRecord
from ray_slurm_provider.gang.spec import GangSpec


class GangFailed(RuntimeError):
    """Every allowed attempt failed (or a failure was fatal); `.result` has the details."""

    def __init__(self, message: str, result: GangResult) -> None:
        super().__init__(message)
        self.result = result


@dataclass
class GangResult:
    ok: bool = False
    run_id: str = ""
    attempts: list[AttemptRecord] = field(default_factory=list)
    placement_wait_s: float = 0.0
    wall_s: float = 0.0

    @property
    def last(self) -> AttemptRecord | None:
        return self.attempts[-1] if self.attempts else None

    def reports(self) -> list[dict[str, Any]]:
        return [r for a in self.attempts for r in a.reports]

    def as_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "run_id": self.run_id, "wall_s": round(self.wall_s, 2),
                "placement_wait_s": round(self.placement_wait_s, 2),
                "attempts": [a.as_dict() for a in self.attempts]}


def run_gang(spec: GangSpec, fn: str, payload: Any = None, *,
             log: Callable[[str], None] | None = None) -> GangResult:
    """Run `fn` in a gang described by `spec`; raise `GangFailed` when it never succeeds."""
    spec.validate()
    say = log or (lambda m: print(m, flush=True))
    run_id = uuid.uuid4().hex[:8]
    result = GangResult(run_id=run_id)
    bundle = placement.node_bundle(spec.ranks_per_node, spec.rank_resources())
    used_ports: set[int] = set()
    t0 = time.monotonic()
    say(f"[launch] run {run_id}: {spec.nodes} node(s) x {spec.ranks_per_node} rank(s), "
        f"bundle {bundle} per node, device={spec.device} backend={spec.resolved_backend} "
        f"cvd_policy={spec.cvd_policy} max_attempts={spec.max_attempts} "
        f"placement={spec.placement}")
    pg = placement.create(spec.nodes, bundle, name=f"{spec.name}-{run_id}",
                          one_group=spec.placement == "group")
    try:
        for n in range(spec.max_attempts):
            try:
                waited = placement.wait_ready(pg, bundle, spec.nodes, spec.pg_timeout_s)
            except placement.PlacementTimeout as e:
                raise GangFailed(str(e), result) from e
            result.placement_wait_s += waited
            rec = Attempt(spec, pg, n, fn, payload, used_ports, run_id, say).run()
            result.attempts.append(rec)
            if rec.ok:
                result.ok = True
                say(f"[launch] attempt {n} succeeded in {rec.wall_s:.1f}s")
                return result
            if rec.fatal:
                raise GangFailed(f"attempt {n} failed and a restart cannot fix it: "
                                 f"{rec.failure}", result)
            if n + 1 < spec.max_attempts:
                say(f"[launch] restarting the gang (attempt {n + 1} of "
                    f"{spec.max_attempts - 1} restarts) from the last checkpoint")
        last = result.last
        raise GangFailed(f"all {spec.max_attempts} attempt(s) failed; last: "
                         f"{last.failure if last else '?'}", result)
    finally:
        placement.remove(pg)
        result.wall_s = time.monotonic() - t0
