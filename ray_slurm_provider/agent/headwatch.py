"""A worker ends when its head is gone, or when Slurm no longer counts its job, so no
allocation is left burning and no Ray node outlives its allocation.

Ray's own raylet gives up on a vanished GCS only after `gcs_rpc_server_reconnect_timeout_s`
(60 s), and then `ray start --block` still has to notice. The worker agent therefore watches
the head itself, cheaply and without asking Slurm:

* `head.json` in the cluster directory is removed by the head agent when the head's Ray
  stops (the head job ended, was cancelled, or `ray up` restarts Ray), and rewritten with
  another job id when a new head takes over: either means this worker's GCS is gone;
* if the head dies without cleaning up (SIGKILL, an OOM kill), its host refuses connections
  to the GCS port: after `grace_s` (Ray's own 60 s) of refusals, the head counts as gone.
  A connect that times out or finds no route is no evidence (a network blip, a switch
  reboot): it neither counts nor resets the count. A head whose node dies is seen by Slurm,
  which ends the head job, and head.json then goes;
* the provider writes the node's `orphan` marker (state.py) when a worker's job has left
  Slurm's active list while its Ray still runs: a node set DOWN by an administrator leaves
  the job's processes running (orphans) although Slurm has ended the job and may give its
  CPUs to others; and its `released` marker when the autoscaler let a gang member go.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable

from ray_slurm_provider.state import ClusterDir, HeadInfo, NodeDir

PERIOD_S = 2.0  # the files: a stat each on the shared filesystem
CONNECT_EVERY_S = 5.0  # the GCS port: one TCP connect
GRACE_S = 60.0  # Ray's gcs_rpc_server_reconnect_timeout_s


def probe_gcs(ip: str, port: int, timeout: float = 2.0) -> str:
    """"open", "refused" (the host answered: nothing listens there) or "timeout" (no answer:
    a timeout, no route, a network that is down)."""
    try:
        with socket.create_connection((ip, port), timeout=timeout):
            return "open"
    except ConnectionRefusedError:
        return "refused"
    except OSError:
        return "timeout"


class HeadWatch:
    """One worker's view of its head; `clock` and `connect` are injectable for tests."""

    def __init__(self, cdir: ClusterDir, head: HeadInfo, *, node: NodeDir | None = None,
                 grace_s: float = GRACE_S, clock: Callable[[], float] = time.monotonic,
                 connect: Callable[[str, int], str] = probe_gcs) -> None:
        self.cdir = cdir
        self.node = node  # whose `orphan` and `released` markers to watch
        self.job_id = head.job_id
        self.ip = head.ip
        self.port = head.gcs_port
        self.grace_s = grace_s
        self._clock = clock
        self._connect = connect
        self._unreachable_since: float | None = None
        self._next_connect = 0.0

    def check(self) -> str | None:
        """One look; the reason to stop, or None while the head is (or may be) there."""
        if self.node is not None and self.node.orphaned():
            return "Slurm no longer counts this job as running (the provider asked it to stop)"
        if self.node is not None and self.node.released():
            return "the autoscaler released this gang member"
        if self.node is not None and self.node.ray_stop_requested():
            return "`ray stop` was asked for this node"
        try:
            info = self.cdir.read_head()
        except (OSError, ValueError):
            return None  # a shared-filesystem hiccup is no evidence either way
        if info is None:
            return f"the head's Ray stopped ({self.cdir.head_file} was removed)"
        if info.job_id != self.job_id:
            return f"another head (job {info.job_id}) replaced head job {self.job_id}"
        now = self._clock()
        if now < self._next_connect:
            return None
        self._next_connect = now + CONNECT_EVERY_S
        answer = self._connect(self.ip, self.port)
        if answer == "open":
            self._unreachable_since = None
            return None
        if answer != "refused":
            return None  # no answer is no evidence either way
        if self._unreachable_since is None:
            self._unreachable_since = now
        if now - self._unreachable_since >= self.grace_s:
            return (f"the head's GCS {self.ip}:{self.port} (job {self.job_id}) has refused "
                    f"connections for {now - self._unreachable_since:.0f}s")
        return None

    def run(self, alive: Callable[[], bool], on_gone: Callable[[str], None],
            period_s: float = PERIOD_S, sleep: Callable[[float], None] = time.sleep) -> None:
        """Check every `period_s` while `alive()`; call `on_gone(reason)` once, then stop."""
        while alive():
            reason = self.check()
            if reason is not None:
                on_gone(reason)
                return
            sleep(period_s)


def start(cdir: ClusterDir, head: HeadInfo, alive: Callable[[], bool],
          on_gone: Callable[[str], None], node: NodeDir | None = None, *,
          period_s: float = PERIOD_S,
          connect: Callable[[str, int], str] = probe_gcs) -> threading.Thread:
    """Watch in a daemon thread (it ends with the agent)."""
    watch = HeadWatch(cdir, head, node=node, connect=connect)
    t = threading.Thread(target=watch.run, args=(alive, on_gone, period_s), daemon=True,
                         name="head-watch")
    t.start()
    return t
