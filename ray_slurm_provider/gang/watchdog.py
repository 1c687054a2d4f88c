"""Deciding that a running gang is stuck, from heartbeats, without sleeping.

The driver polls every rank actor every few seconds. A rank is declared stuck when

* it has never sent a heartbeat `start_timeout_s` after it started (imports, rendezvous and
  checkpoint loading all happen before the first step, so this one is generous);
* its last heartbeat is older than `stall_timeout_s` (a hang in a collective, a dead peer
  that NCCL waits on, one slow node);
* its actor has not answered a poll for `answer_timeout_s` (the process is wedged or its
  node is gone; the actor runs its poll in a second thread, so a busy rank still answers).

One stuck rank is enough: torch.distributed cannot lose a member, so the whole gang is torn
down and restarted. The clock is injected: tests drive it by hand.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from ray_slurm_provider.gang.context import Progress


@dataclass(frozen=True)
class Stuck:
    rank: int
    reason: str


@dataclass
class _RankState:
    last_answer: float
    progress: Progress | None = None


@dataclass
class Watchdog:
    start_timeout_s: float
    stall_timeout_s: float
    answer_timeout_s: float
    ranks: Iterable[int] = ()
    started_at: float = 0.0
    _state: dict[int, _RankState] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        for r in self.ranks:
            self._state[r] = _RankState(self.started_at)

    def observe(self, rank: int, progress: Progress, now: float) -> None:
        """A poll of `rank` answered at `now`."""
        st = self._state.setdefault(rank, _RankState(now))
        st.last_answer = now
        st.progress = progress

    def done(self, rank: int) -> None:
        """`rank` returned: it is no longer watched."""
        self._state.pop(rank, None)

    def check(self, now: float) -> list[Stuck]:
        """Every rank that is stuck at `now`, the likeliest culprit first.

        In a hang every rank stops beating (the others wait on it in a collective), so the
        order is: unanswered polls, then least progress (last step), then oldest heartbeat.
        The rank that hung may have beaten last (it stalled just after its peers entered the
        collective), so once one rank is past the stall timeout, every rank silent for half
        of it is a suspect too.
        """
        out: list[tuple[tuple[int, int, float], Stuck]] = []
        silent_ranks: list[tuple[tuple[int, int, float], Stuck]] = []
        stalled = False
        for rank, st in sorted(self._state.items()):
            silent = now - st.last_answer
            if silent > self.answer_timeout_s:
                out.append(((0, 0, -silent), Stuck(rank, f"rank {rank} has not answered a "
                            f"poll for {silent:.0f}s (process wedged or node lost)")))
                continue
            p = st.progress
            if p is None:
                continue
            # Ages as of `now`: polls are answered at different moments, and a rank whose
            # answer came late must not look staler than one whose answer came early.
            running = p.running_s + silent
            if p.beats == 0 and running > self.start_timeout_s:
                out.append(((1, -1, -running), Stuck(
                    rank, f"rank {rank} sent no heartbeat within "
                          f"{self.start_timeout_s:.0f}s of starting")))
            elif p.beats > 0 and p.beat_age_s is not None:
                age = p.beat_age_s + silent
                if age <= self.stall_timeout_s / 2:
                    continue
                stalled = stalled or age > self.stall_timeout_s
                step = -1 if p.last_step is None else p.last_step
                where = "" if p.last_step is None else f" (last step {p.last_step})"
                silent_ranks.append(((1, step, -age), Stuck(
                    rank, f"rank {rank} sent no heartbeat for {age:.0f}s{where}")))
        if stalled:
            out += silent_ranks
        return [s for _, s in sorted(out, key=lambda x: (x[0], x[1].rank))]
