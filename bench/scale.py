"""P3, P5, P6 (and the raw burst P5 is compared with) on one cluster, phase by phase.

Phases (`--phases`, comma-separated, run in order):

* `up`        `ray up` of cluster `bench-scale` (head without CPUs; worker type `cpu_worker`:
              1 Ray CPU, 500 MB, 75 MB object store, one 1-CPU sandbox node each).
* `grow:N`    bring the cluster to N workers (`request_resources`, through a driver on the
              head that waits until exactly N are alive in Ray), `--step` workers at a time.
* `p3:N`      `grow:N`, let it settle, then
              `sdiag --reset`, wait `--window` s without any other Slurm query, `sdiag`:
              query RPCs / autoscaler ticks counted in the head's monitor.log.
* `p5:N`      burst: request N workers at once (from whatever runs; normally 0) and time
              until all N are registered in Ray; sbatch calls per autoscaler tick from
              slurmctld's `_slurm_rpc_submit_batch_job` lines bucketed by the monitor's ticks;
              Slurm's own part (submit -> `sched: Allocate`) from the same log.
* `raw:N`     the raw path of a burst: N plain batch jobs (one `sbatch --array`) running the
              provider worker's `ray start` line with `--resources={"rawnode": 1}`; time from
              the sbatch call until all N are registered. Cancelled afterwards.
* `mem`       PSS and CPU seconds of every job of the cluster, slurmd and slurmctld.
* `reset`     back to 0 workers at once (request cleared, worker jobs cancelled).
* `p6`        `ray down`: time until no job of the cluster is left in squeue (any state) and
              no process of those jobs is left (and, with --container, no container).

    .venv/bin/python -m bench.scale --phases up,p3:0,p5:32,mem,p3:32,p6 [--name scale-1]
    .venv/bin/python -m bench.scale --phases up,p3:8,raw:32,p6 --name scale-8

The Ray side of the burst is opened up so the provider sees the whole burst at once
(`upscaling_speed: 32`, `AUTOSCALER_MAX_CONCURRENT_LAUNCHES=32` and
`AUTOSCALER_MAX_LAUNCH_BATCH=32` in the head's environment); without that Ray's v2 autoscaler
itself releases at most ceil(upscaling_speed * running) and 10 launches per tick, in
`create_node` calls of at most 5 nodes.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter
from typing import Any

from bench.common import (
    SANDBOX_DIR,
    WORK,
    Cluster,
    bench_config,
    ctld_events,
    daemon_pss_kb,
    is_query,
    job_pss_kb,
    log,
    mem_available_mb,
    monitor_ticks,
    run,
    save,
    sbatch,
    scancel,
    sdiag_counts,
    sdiag_reset,
    squeue,
    summary,
    wait_for,
)
from bench.p1_ray_up import agent_start_line
from bench.p2_demand import raw_worker_script
from tests.e2e.harness import RAY

DRIVER = r"""
import json, sys, time, ray
from ray.autoscaler.sdk import request_resources
want, kind, marker, timeout = int(sys.argv[1]), sys.argv[2], sys.argv[3], float(sys.argv[4])
ray.init()
def alive():
    out = {}
    for x in ray.nodes():
        r = x["Resources"]
        ours = ("rawnode" in r) if kind == "raw" else (r.get("CPU", 0) >= 1
                                                      and "rawnode" not in r)
        if x["Alive"] and ours:
            out[x["NodeID"]] = x["NodeManagerAddress"]
    return out
base = alive()
t0 = time.time()
if kind == "provider":
    request_resources(bundles=[{"CPU": 1}] * want)
open(marker, "w").write(repr(t0))
seen, cur = {}, base
while time.time() - t0 < timeout:
    now = time.time()
    cur = alive()
    for nid, ip in cur.items():
        if nid not in base:
            seen.setdefault(nid, [ip, now])
    if len(cur) == want:
        break
    time.sleep(0.5)
print("SCALERESULT " + json.dumps({"t0": t0, "t_end": time.time(), "base": len(base),
                                   "alive": len(cur), "seen": seen}))
"""


#: slurmctld's log line when a job gets its nodes (main scheduler or backfill).
ALLOC = r"(?:sched: Allocate|_start_job: Started) JobId="


class Scale:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        cfg = bench_config(args.cluster, workers=args.max_workers,
                           upscaling_speed=args.upscaling_speed,
                           idle_timeout_minutes=args.idle_minutes, container=args.container,
                           rest=args.rest)
        cfg["provider"]["environment"] = {
            "AUTOSCALER_MAX_CONCURRENT_LAUNCHES": str(args.max_concurrent_launches),
            # Ray v2 cuts a launch into create_node calls of at most this many (default 5).
            "AUTOSCALER_MAX_LAUNCH_BATCH": str(args.max_launch_batch)}
        self.c = Cluster(cfg)
        self.res: dict[str, Any] = {"config": {
            "upscaling_speed": args.upscaling_speed, "max_workers": args.max_workers,
            "AUTOSCALER_MAX_CONCURRENT_LAUNCHES": args.max_concurrent_launches,
            "AUTOSCALER_MAX_LAUNCH_BATCH": args.max_launch_batch,
            "container": args.container, "slurm_api": "rest" if args.rest else "cli"}}
        self.raw_script: str | None = None

    # --- drivers -------------------------------------------------------------------------
    def driver(self, want: int, kind: str, timeout: float,
               on_ready: Any = None) -> dict[str, Any]:
        c = self.c
        marker = WORK / c.name / f"marker-{kind}-{time.time():.0f}"
        args = [RAY, "job", "submit", "--address", c.dashboard, "--", "python", "-c", DRIVER,
                str(want), kind, str(marker), str(timeout)]
        p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, env=c.env(), stdin=subprocess.DEVNULL)
        extra: dict[str, Any] = {}
        try:
            wait_for(lambda: marker.exists() or p.poll() is not None, 300,
                     "the driver to start", every=0.05)
            if on_ready is not None:
                extra = on_ready()
            out, _ = p.communicate(timeout=timeout + 300)
        finally:
            if p.poll() is None:
                p.kill()
        m = re.search(r"SCALERESULT (\{.*\})", out)
        if not m:
            raise RuntimeError(f"driver failed:\n{out[-3000:]}")
        r: dict[str, Any] = json.loads(m.group(1))
        r.update(extra)
        if r["alive"] != want:
            log(f"  wanted {want} {kind} workers, {r['alive']} alive after {timeout:.0f}s")
        return r

    def workers(self) -> list[str]:
        head = str(self.c.head()["job_id"])
        return [j["id"] for j in self.c.squeue() if j["id"] != head]

    # --- phases --------------------------------------------------------------------------
    def up(self) -> None:
        log("ray up")
        self.res["ray_up_s"] = round(self.c.up(), 1)

    def grow(self, n: int) -> None:
        """Scale to n workers in steps of --step (a burst of concurrent `ray start`s larger
        than this machine can absorb times out; see BENCHMARKS.md)."""
        alive = self.driver(len(self.workers()), "provider", 60)["alive"]
        steps = [*range(alive + self.args.step, n, self.args.step), n] if n > alive else [n]
        for k in steps:
            r = self.driver(k, "provider", self.args.timeout)
            log(f"  {r['alive']}/{k} workers alive after {r['t_end'] - r['t0']:.1f}s")
            if r["alive"] != k:
                if not self.args.best_effort:
                    raise RuntimeError(f"wanted {k} workers; {r['alive']} came up")
                self.res.setdefault("grow_stopped", []).append(
                    {"wanted": k, "alive": r["alive"], "after_s": round(r["t_end"] - r["t0"], 1),
                     "load1": round(os.getloadavg()[0], 1)})
                log(f"  stopping at {r['alive']} workers (--best-effort)")
                return

    def p3(self, n: int) -> None:
        log(f"P3 at {n} workers: scaling")
        self.grow(n)
        n = self.driver(len(self.workers()), "provider", 120)["alive"]
        log(f"  {n} alive; settling {self.args.settle}s")
        wait_for(lambda: all(j["state"] == "RUNNING" for j in self.c.squeue())
                 and len(self.workers()) == n, 300, f"{n} running worker jobs")
        time.sleep(self.args.settle)
        mon = self.c.monitor_log()
        sdiag_reset()
        t0 = time.time()
        time.sleep(self.args.window)  # nothing of ours asks slurmctld meanwhile
        counts = sdiag_counts()
        t1 = time.time()
        ticks = monitor_ticks(mon, t0, t1)
        queries = {k: v for k, v in counts.items() if is_query(k)}
        nq = sum(queries.values())
        res = {"workers": n, "load1": round(os.getloadavg()[0], 1),
               "window_s": round(t1 - t0, 1), "ticks": len(ticks),
               "rpcs": counts, "query_rpcs": nq,
               "query_rpcs_per_tick": round(nq / len(ticks), 3) if ticks else None,
               "tick_period_s": round(statistics.median(
                   b - a for a, b in itertools.pairwise(ticks)), 2)
               if len(ticks) > 2 else None}
        self.res.setdefault("p3", []).append(res)
        log(f"  P3 {res}")

    def p5(self, n: int) -> None:
        log(f"P5 burst to {n} workers (free MB: {mem_available_mb()})")
        mon = self.c.monitor_log()
        load_before = round(os.getloadavg()[0], 1)
        r = self.driver(n, "provider", self.args.timeout)
        t0, t_end = r["t0"], r["t_end"]
        reg = sorted(v[1] - t0 for v in r["seen"].values())
        subs = ctld_events(r"_slurm_rpc_submit_batch_job: JobId=", t0 - 1)
        subs = [(t, ln) for t, ln in subs if t <= t_end]
        # An array task is allocated as `JobId=<array>_<task>(<id>)`: each counts against
        # the one submit of its array.
        allocs = [(re.search(r"JobId=(\d+)", ln).group(1), t)  # type: ignore[union-attr]
                  for t, ln in ctld_events(ALLOC, t0 - 1)]
        sub_at = {re.search(r"JobId=(\d+)", ln).group(1): t  # type: ignore[union-attr]
                  for t, ln in subs}
        allocs = [(j, t) for j, t in allocs if j in sub_at]
        ticks = monitor_ticks(mon, t0 - 10, t_end + 1)
        per_tick: Counter[int] = Counter()
        for t, _ in subs:
            k = sum(1 for x in ticks if x <= t)  # the tick the submit belongs to
            per_tick[k] += 1
        sched = [t - sub_at[j] for j, t in allocs]
        res = {
            "workers": n, "base": r["base"], "registered": len(reg),
            "load1_before": load_before, "load1_after": round(os.getloadavg()[0], 1),
            "all_registered_s": round(reg[-1], 2) if len(reg) >= n - r["base"] else None,
            "first_registered_s": round(reg[0], 2) if reg else None,
            "registered_s": [round(x, 2) for x in reg],
            "start_failures": self._start_failures(),
            "sbatch_calls": len(subs),
            "sbatch_calls_per_tick": sorted(per_tick.values(), reverse=True),
            "ticks_with_submits": len(per_tick),
            "first_sbatch_s": round(subs[0][0] - t0, 2) if subs else None,
            "last_sbatch_s": round(subs[-1][0] - t0, 2) if subs else None,
            "allocated": len(allocs),
            "last_alloc_s": round(max(t for _, t in allocs) - t0, 2) if allocs else None,
            "slurm_submit_to_alloc_s": summary(sched) if sched else None,
            "tick_period_s": round(statistics.median(
                b - a for a, b in itertools.pairwise(ticks)), 2)
            if len(ticks) > 2 else None,
            "free_mb_after": mem_available_mb(),
        }
        self.res.setdefault("p5", []).append(res)
        log(f"  P5 {res}")

    def reset(self) -> None:
        """Back to 0 workers at once: clear the request and cancel the worker jobs."""
        log("reset to 0 workers")
        ids = self.workers()
        self.driver(0, "provider", self.args.timeout, on_ready=lambda: _cancelled(ids))
        wait_for(lambda: not squeue(job_ids=ids), 300, "the cancelled workers to end")
        time.sleep(self.args.settle)

    def _start_failures(self) -> int:
        """`ray start` attempts that failed in the cluster's worker jobs so far."""
        n = 0
        for p in self.c.cdir.logs.glob("*.out"):
            n += p.read_text(errors="replace").count("ray start failed (attempt")
        return n

    def raw(self, n: int) -> None:
        c = self.c
        if self.raw_script is None:
            # A current worker's line: it joins this head (older logs may name another).
            logs = [c.cdir.log(j) for j in self.workers() if c.cdir.log(j).exists()
                    and "starting: " in c.cdir.log(j).read_text()]
            if not logs:
                raise RuntimeError(f"raw:{n} needs a provider worker's log first")
            self.raw_script = raw_worker_script(agent_start_line(c, logs[-1].stem), c)
        jobs: list[str] = []

        def submit() -> dict[str, Any]:
            t = time.time()
            jobs.append(sbatch(self.raw_script or "", f"--array=1-{n}", "--partition=cpu",
                               "--cpus-per-task=1", "--mem=800M", "--time=2:00:00",
                               "--job-name=bench-raw-burst",
                               f"--output={WORK / c.name / 'raw-%A_%a.out'}"))
            return {"t_sbatch": t}

        log(f"raw burst of {n}")
        try:
            r = self.driver(n, "raw", self.args.timeout, on_ready=submit)
        finally:
            scancel(jobs)
        reg = sorted(v[1] - r["t_sbatch"] for v in r["seen"].values())
        res = {"workers": n, "registered": len(reg),
               "all_registered_s": round(reg[-1], 2) if len(reg) == n else None,
               "first_registered_s": round(reg[0], 2) if reg else None,
               "registered_s": [round(x, 2) for x in reg], "sbatch_calls": 1}
        wait_for(lambda: not squeue("bench-raw-burst"), 300, "the raw burst to end")
        self.res.setdefault("raw", []).append(res)
        log(f"  raw {res}")

    def mem(self) -> None:
        head = str(self.c.head()["job_id"])
        pss = job_pss_kb([j["num"] for j in self.c.squeue()])
        workers = [v["pss_kb"] / 1024 for j, v in pss.items() if j != head]
        slurmd = [v / 1024 for v in daemon_pss_kb("slurmd -D -N n",
                                                   f"{SANDBOX_DIR}/etc/slurm.conf")]
        res = {"head_pss_mb": round(pss.get(head, {}).get("pss_kb", 0) / 1024, 1),
               "worker_pss_mb": summary(workers) if workers else None,
               # M1: the node agent alone (the provider's process in every job)
               "agent_rss_mb": summary([v.get("agent_rss_kb", 0) / 1024 for v in pss.values()]),
               "agent_pss_mb": summary([v.get("agent_pss_kb", 0) / 1024 for v in pss.values()]),
               "worker_procs": summary([v["procs"] for j, v in pss.items() if j != head]),
               "worker_cpu_s": summary([v["cpu_s"] for j, v in pss.items() if j != head]),
               "head_cpu_s": round(pss.get(head, {}).get("cpu_s", 0.0), 1),
               "slurmd_pss_mb": summary(slurmd) if slurmd else None,
               "slurmctld_pss_mb": round(sum(daemon_pss_kb(
                   "slurmctld -D", f"{SANDBOX_DIR}/etc/slurm.conf")) / 1024, 1),
               "mem_available_mb": mem_available_mb()}
        self.res.setdefault("mem", []).append(res)
        log(f"  mem {json.dumps(res)[:400]}")

    def p6(self) -> None:
        c = self.c
        ids = [j["num"] for j in c.squeue()]  # numeric: how their processes are found
        log(f"P6 ray down with {len(ids)} jobs")
        load1 = round(os.getloadavg()[0], 1)
        t0 = time.time()
        p = subprocess.Popen([RAY, "down", "-y", str(c.path)], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, env=c.env(),
                             stdin=subprocess.DEVNULL)
        times: dict[str, float] = {}
        from bench.common import job_processes_left

        while time.time() - t0 < 600:
            now = time.time()
            if p.poll() is not None:
                times.setdefault("ray_down_exit_s", round(now - t0, 2))
            if "no_job_s" not in times and not squeue(c.job_name):
                times["no_job_s"] = round(time.time() - t0, 2)
            if "no_process_s" not in times and job_processes_left(ids) == 0:
                times["no_process_s"] = round(time.time() - t0, 2)
            if self.args.container and "no_container_s" not in times \
                    and not _containers(c.name):
                times["no_container_s"] = round(time.time() - t0, 2)
            done = ["ray_down_exit_s", "no_job_s", "no_process_s"]
            if self.args.container:
                done.append("no_container_s")
            if all(k in times for k in done):
                break
            time.sleep(max(0.0, 0.5 - (time.time() - now)))
        out = p.stdout.read() if p.stdout else ""
        with c.log.open("a") as f:
            f.write(f"$ ray down (P6)\n{out[-4000:]}\n")
        keys = ["no_job_s", "no_process_s"] + (["no_container_s"] if self.args.container else [])
        res = {"jobs": len(ids), "load1": load1, **times,
               "all_gone_s": max(times.get(k, float("inf")) for k in keys)}
        self.res.setdefault("p6", []).append(res)
        log(f"  P6 {res}")


def _cancelled(ids: list[str]) -> dict[str, Any]:
    scancel(ids)
    return {}


def _containers(cluster: str) -> list[str]:
    from ray_slurm_provider.runtimes.docker import CLUSTER_LABEL

    cp = run(["docker", "ps", "-aq", "--filter", f"label={CLUSTER_LABEL}={cluster}"],
             timeout=30, check=False)
    return cp.stdout.split()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--phases", default="up,p3:0,p5:32,mem,p3:32,p6")
    ap.add_argument("--cluster", default="bench-scale")
    ap.add_argument("--name", default="scale")
    ap.add_argument("--max-workers", type=int, default=32)
    ap.add_argument("--upscaling-speed", type=float, default=32.0)
    ap.add_argument("--max-concurrent-launches", type=int, default=32)
    ap.add_argument("--max-launch-batch", type=int, default=32)
    ap.add_argument("--idle-minutes", type=float, default=1.0)
    ap.add_argument("--window", type=float, default=60.0, help="P3 sdiag window, seconds")
    ap.add_argument("--settle", type=float, default=15.0)
    ap.add_argument("--step", type=int, default=4, help="workers added at a time by grow/p3")
    ap.add_argument("--best-effort", action="store_true",
                    help="when a grow step does not come up in --timeout, carry on with the "
                    "workers that are alive")
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--container", action="store_true")
    ap.add_argument("--rest", action="store_true", help="provider.slurm_api: rest")
    ap.add_argument("--keep", action="store_true", help="do not `ray down` at the end")
    args = ap.parse_args()
    s = Scale(args)
    # SIGTERM (timeout, Ctrl-C from a wrapper) still tears the cluster down and saves.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        for phase in args.phases.split(","):
            name, _, arg = phase.partition(":")
            getattr(s, name)(*([int(arg)] if arg else []))
    finally:
        if not args.keep:
            s.c.down()
            s.c.cleanup()
        save(args.name, s.res)


if __name__ == "__main__":
    main()
