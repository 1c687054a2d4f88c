"""P2: demand -> task running on a new worker, minus the raw sbatch + `ray start` time.

One cluster (head only, no CPUs) stays up. Each round, alternating:

* provider: a driver (`ray job submit`, runs on the head) submits one `num_cpus=1` task; the
  autoscaler launches a worker job; the task returns `time.time()` when it runs. Measured:
  task start - task submit.
* raw: the driver submits a task that also needs `{"rawnode": 1}`, which no node type offers
  (the autoscaler launches nothing); the moment the driver has submitted it, this script
  `sbatch`es a plain batch script running the provider worker's own `ray start` line (taken
  from its job log; only the node address, the temp dir and `--resources` differ). Measured:
  task start - sbatch call.

Between rounds the worker's job is cancelled and every process of it is gone. P2 = median
(provider) - median(raw). The provider rounds are also split, from the slurmctld log and the
agent's log, into demand -> sbatch (autoscaler), sbatch -> allocated (Slurm), allocated ->
task (ray start + registration + scheduling).

    .venv/bin/python -m bench.p2_demand [--runs 5]
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import time
from typing import Any

from bench.common import (
    WORK,
    Cluster,
    bench_config,
    ctld_events,
    job_pss_kb,
    log,
    save,
    sbatch,
    scancel,
    squeue,
    summary,
    wait_for,
)
from bench.p1_ray_up import agent_start_line, agent_times, wait_gone
from tests.e2e.harness import RAY

DRIVER = r"""
import json, sys, time, ray
mode, marker = sys.argv[1], sys.argv[2]
ray.init()
res = {"rawnode": 1} if mode == "raw" else {}
@ray.remote(num_cpus=1, resources=res)
def where():
    return time.time(), ray.get_runtime_context().get_node_id()
t0 = time.time()
ref = where.remote()
open(marker, "w").write(repr(t0))
t1, node = ray.get(ref)
print("P2RESULT " + json.dumps({"t_demand": t0, "t_task": t1, "node": node}))
"""


def raw_worker_script(argv: list[str], c: Cluster) -> str:
    out = [shlex.quote(RAY)]
    for a in argv[1:]:
        if a.startswith("--node-ip-address="):
            out.append('--node-ip-address="$IP"')
        elif a.startswith("--temp-dir="):
            out.append('--temp-dir="/tmp/rsp-raw-$SLURM_JOB_ID"')
        elif a == "--block":
            continue
        else:
            out.append(shlex.quote(a))
    out += [shlex.quote('--resources={"rawnode": 1}'), "--block"]
    return "\n".join([
        "#!/bin/bash",
        "export RAY_AUTH_MODE=token",
        f"export RAY_AUTH_TOKEN_PATH={shlex.quote(str(c.token_path))}",
        "export RAY_USAGE_STATS_ENABLED=0 RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S=5",
        'K="${SLURMD_NODENAME#n}"; IP="127.0.0.$((K + 1))"',
        "exec " + " ".join(out),
        "",
    ])


def one_round(c: Cluster, mode: str, script: str | None, i: int) -> dict[str, Any]:
    marker = WORK / c.name / f"marker-{mode}-{i}"
    marker.unlink(missing_ok=True)
    before = {j["id"] for j in c.squeue()}
    args = [RAY, "job", "submit", "--address", c.dashboard, "--", "python", "-c", DRIVER,
            mode, str(marker)]
    p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env=c.env(), stdin=subprocess.DEVNULL)
    raw_job = None
    t_sbatch = None
    try:
        wait_for(lambda: marker.exists() or p.poll() is not None, 300,
                 "the driver to submit its task", every=0.05)
        if mode == "raw":
            assert script is not None
            t_sbatch = time.time()
            raw_job = sbatch(script, "--partition=cpu", "--cpus-per-task=1", "--mem=800M",
                             "--time=2:00:00", "--job-name=bench-raw-worker",
                             f"--output={WORK / c.name / 'raw-%j.out'}")
        out, _ = p.communicate(timeout=900)
    finally:
        if p.poll() is None:
            p.kill()
    m = re.search(r"P2RESULT (\{.*\})", out)
    if not m:
        raise RuntimeError(f"driver failed:\n{out[-3000:]}")
    r: dict[str, Any] = json.loads(m.group(1))
    if mode == "raw":
        assert t_sbatch is not None and raw_job is not None
        r.update(t_sbatch=t_sbatch, job_id=raw_job,
                 latency=round(r["t_task"] - t_sbatch, 3),
                 demand_to_sbatch=round(t_sbatch - r["t_demand"], 3))
        jobs = [raw_job]
    else:
        new = [j["id"] for j in c.squeue() if j["id"] not in before]
        r.update(job_id=",".join(new), latency=round(r["t_task"] - r["t_demand"], 3))
        jobs = new
        t0 = r["t_demand"]
        for jid in new:
            sub = ctld_events(rf"_slurm_rpc_submit_batch_job: JobId={jid} ", t0 - 5)
            alloc = ctld_events(rf"(?:sched: Allocate|_start_job: Started) JobId={jid} ",
                                t0 - 5)
            if sub:
                r["demand_to_sbatch"] = round(sub[0][0] - t0, 3)
            if sub and alloc:
                r["sbatch_to_alloc"] = round(alloc[0][0] - sub[0][0], 3)
            if alloc:
                r["alloc_to_task"] = round(r["t_task"] - alloc[0][0], 3)
            r.update(agent_times(c.cdir.log(jid), t0))
    r["pss_mb"] = {j: v["pss_kb"] // 1024 for j, v in job_pss_kb(jobs).items()}
    scancel(jobs)
    r["gone_s"] = round(wait_gone(None, jobs), 1)
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--settle", type=float, default=12.0,
                    help="seconds between rounds (the autoscaler forgets the last worker)")
    ap.add_argument("--name", default="p2")
    ap.add_argument("--keep", action="store_true", help="leave the cluster up")
    args = ap.parse_args()

    c = Cluster(bench_config("bench-p2", workers=2, idle_timeout_minutes=10))
    runs: dict[str, list[dict[str, Any]]] = {"provider": [], "raw": []}
    script = None
    try:
        log("ray up")
        c.up()
        for i in range(args.runs):
            log(f"round {i + 1}/{args.runs}: provider")
            r = one_round(c, "provider", None, i)
            runs["provider"].append(r)
            log(f"  {r}")
            if script is None:
                script = raw_worker_script(agent_start_line(c, r["job_id"].split(",")[0]), c)
                (WORK / c.name / "raw-worker.sbatch").write_text(script)
            time.sleep(args.settle)
            log(f"round {i + 1}/{args.runs}: raw")
            rr = one_round(c, "raw", script, i)
            runs["raw"].append(rr)
            log(f"  {rr}")
            time.sleep(args.settle)
    finally:
        if not args.keep:
            c.down()
            c.cleanup()
            wait_for(lambda: not squeue(c.job_name), 120, "the cluster's jobs to end")
    prov = summary([r["latency"] for r in runs["provider"]])
    raw = summary([r["latency"] for r in runs["raw"]])
    res: dict[str, Any] = {"runs": runs, "raw_script": script, "provider_s": prov, "raw_s": raw,
                           "overhead_s": round(prov["median"] - raw["median"], 3),
                           "target_s": 5.0}
    for k in ("demand_to_sbatch", "sbatch_to_alloc", "alloc_to_task"):
        vals = [r[k] for r in runs["provider"] if k in r]
        if vals:
            res[f"provider_{k}_s"] = summary(vals)
    res["meets_target"] = res["overhead_s"] <= 5.0
    save(args.name, res)


if __name__ == "__main__":
    main()
