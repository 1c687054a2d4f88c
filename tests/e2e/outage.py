"""The controller-outage scenario, for either transport: stop a Slurm daemon (60 s unless
told otherwise) while the autoscaler is scaling up, then check that nothing was duplicated
or terminated and that scaling resumed within two autoscaler ticks of the restart."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

from ray_slurm_provider.sandbox import Sandbox
from tests.e2e import drivers
from tests.e2e.faults import (
    SUBMITTED,
    Driver,
    alive,
    log_lines,
    monitor_log,
    raylet_pid,
    submit_logged_at,
    ticks,
    workers,
)
from tests.e2e.harness import RayCluster, wait_for

OUTAGE_S = 60.0


def outage(cluster: RayCluster, sandbox: Sandbox, daemon: str, tmp_path: Path,
           failure: str, ntype: str = "cpu_worker", down_s: float = OUTAGE_S) -> dict[str, Any]:
    """Run the scenario with `daemon` down for `down_s`; `failure` matches the failed ticks'
    log lines."""
    stop_f, more = tmp_path / "stop", tmp_path / "more"
    d = Driver(cluster, drivers.OUTAGE.format(stop=str(stop_f), more=str(more)))
    (w1,) = wait_for(lambda: workers(cluster, ntype, ray_up=True), 300, "a worker")
    w1_raylet = raylet_pid(w1.numeric_id)
    t_stop = time.time()
    sandbox.stop_daemon(daemon)
    try:
        more.touch()  # the driver asks for a second worker while Slurm cannot be reached
        while time.time() < t_stop + down_s:
            assert alive(w1_raylet), f"a Ray node died while {daemon} was down"
            time.sleep(1)
    finally:
        t_start = time.time()
        sandbox.start_daemon(daemon)
    t_ready = time.time()
    w2 = wait_for(lambda: [j for j in workers(cluster, ntype) if j.job_id != w1.job_id],
                  120, "scaling to resume", every=0.5)[0]
    # From the moment the daemon was started again (slurmctld answers before every slurmd has
    # re-registered, which is when start_daemon returns). Submit times have 1 s steps.
    log = monitor_log(cluster)
    t_new = submit_logged_at(log, w2.job_id)
    recovery = max(0.0, t_new - t_start)
    wait_for(lambda: w2.job_id in [j.job_id for j in workers(cluster, ntype, ray_up=True)],
             300, "the second worker's Ray")
    stop_f.touch()
    t_release = time.time()
    wait_for(d.done, 300, "the outage driver to finish")
    assert d.status() == "SUCCEEDED", d.why()
    result = json.loads(d.result("OUTAGE_RESULT"))
    # This type's submissions only: another type of the cluster (the hardening suite's
    # crash_worker) may be launched meanwhile, once its back-off allows.
    submitted = log_lines(log, t_stop, SUBMITTED + r"[\d_, ]+ for (a |\d+ )?worker.* node "
                          rf"type {re.escape(ntype)}\b")
    failed_ticks = [t for t, _ in log_lines(log, t_stop, failure) if t <= t_start + 1]
    cancelled = [ln for t, ln in log_lines(log, t_stop, r"Cancelled Slurm jobs") if t < t_release]
    figures = {"down s": round(t_start - t_stop, 1),
               "restart -> ready s": round(t_ready - t_start, 1),
               "failed autoscaler ticks": len(failed_ticks),
               "worker submissions": len(submitted), "cancelled": len(cancelled),
               "restart -> next submission s": round(recovery, 1),
               "restart -> next submission ticks": ticks(log, t_start, t_new)}
    assert failed_ticks, f"the autoscaler never noticed {daemon} was down"
    assert len(submitted) == 1 and w2.job_id in submitted[0][1], submitted  # 0 duplicates
    assert figures["restart -> next submission ticks"] <= 2, figures
    assert cancelled == []  # 0 nodes terminated
    assert alive(w1_raylet) and [r[1] for r in result] == [w1.job_id, w2.job_id]
    return figures
