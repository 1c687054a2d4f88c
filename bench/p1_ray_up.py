"""P1: `ray up` until the head answers, divided by the raw path, alternating in one run.

Provider path: `ray up -y` of a sandbox cluster (head only). Raw path: `sbatch` of a plain
batch script that runs `ray start --head --block` with the same flags the provider's head ran
(taken from the head job's log: the agent logs its exact `ray start` line; only the temp dir,
the node address (`--node-ip-address`, `--dashboard-host`) and `--autoscaling-config` differ,
so the raw head's monitor runs read-only), the same Slurm resources and the same Ray
environment (token auth on, usage stats off).

Both paths are polled the same way, every `--poll` s from the moment the command starts:
squeue for the job's node, then a TCP connect to the GCS port and `GET /api/version` on the
dashboard with the token. "The head answers" = the first 200 from the dashboard (what
`ray job submit` needs); the GCS time and the exit time of `ray up` are recorded too. Between
runs every job of the path ends and its processes are gone.

    .venv/bin/python -m bench.p1_ray_up [--runs 5]
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import time
from pathlib import Path
from typing import Any

from bench.common import (
    WORK,
    Cluster,
    bench_config,
    gcs_ok,
    http_ok,
    job_processes_left,
    log,
    node_ip,
    save,
    sbatch,
    scancel,
    squeue,
    summary,
    wait_for,
)
from ray_slurm_provider.ports import port_block
from tests.e2e.harness import RAY


class Probe:
    """Poll one head job (found by job id or name) until its dashboard answers."""

    def __init__(self, t0: float, gcs_port: int, dash_port: int, token: str | None) -> None:
        self.t0, self.gcs_port, self.dash_port, self.token = t0, gcs_port, dash_port, token
        self.times: dict[str, float] = {"load1": round(os.getloadavg()[0], 1)}
        self.ip: str | None = None

    def mark(self, what: str) -> None:
        self.times.setdefault(what, round(time.time() - self.t0, 3))

    def poll(self, jobs: list[dict[str, str]]) -> bool:
        if jobs and "job_seen" not in self.times:
            self.mark("job_seen")
        running = [j for j in jobs if j["state"] == "RUNNING" and j["node"]]
        if running:
            self.mark("job_running")
            self.ip = node_ip(running[0]["node"])
        if self.ip is None:
            return False
        if "gcs" not in self.times and gcs_ok(self.ip, self.gcs_port):
            self.mark("gcs")
        if "gcs" in self.times and http_ok(
                f"http://{self.ip}:{self.dash_port}/api/version", self.token):
            self.mark("answer")
            return True
        return False


def wait_gone(name: str | None, ids: list[str], timeout: float = 180) -> float:
    t0 = time.time()
    wait_for(lambda: not squeue(name) if name else not squeue(job_ids=ids), timeout,
             "the jobs to leave squeue")
    wait_for(lambda: job_processes_left(ids) == 0, timeout, "the job processes to exit")
    return time.time() - t0


def provider_run(c: Cluster, poll: float, timeout: float) -> dict[str, Any]:
    ports = port_block(c.name)
    t0 = time.time()
    p = subprocess.Popen([RAY, *c.up_args()], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, env=c.env(), stdin=subprocess.DEVNULL)
    probe = Probe(t0, ports.gcs, ports.dashboard, None)
    out = ""
    try:
        while time.time() - t0 < timeout:
            tick = time.time()
            if probe.token is None:
                probe.token = c.token()
            info = c.cdir.read_head()
            if info:  # the head takes the next free block when one of its ports is taken
                probe.gcs_port, probe.dash_port = info.gcs_port, info.dashboard_port
            answered = probe.poll(c.squeue())
            if p.poll() is not None:
                probe.mark("ray_up_exit")
            if answered and "ray_up_exit" in probe.times:
                break
            if p.poll() not in (None, 0):
                break
            time.sleep(max(0.0, poll - (time.time() - tick)))
        if p.poll() is None:
            p.wait(timeout=max(1.0, timeout - (time.time() - t0)))
            probe.mark("ray_up_exit")
        out = p.stdout.read() if p.stdout else ""
    finally:
        if p.poll() is None:
            p.kill()
    with c.log.open("a") as f:
        f.write(f"$ ray up (P1)\n{out[-6000:]}\nexit {p.returncode}\n")
    if p.returncode != 0 or "answer" not in probe.times:
        raise RuntimeError(f"ray up failed or the head never answered: {probe.times}\n"
                           f"{out[-3000:]}")
    head = c.head()
    res: dict[str, Any] = {**probe.times, "job_id": head["job_id"]}
    res.update(agent_times(c.cdir.log(str(head["job_id"])), t0))
    started = ray_started_at(c.cdir.log(str(head["job_id"])), t0)
    if started is not None:
        res["ray_started"] = started
    return res


def agent_times(log_path: Path, t0: float) -> dict[str, float]:
    """Seconds after t0 at which the head agent logged `starting:` and `Ray is up`."""
    out: dict[str, float] = {}
    day = time.strftime("%Y-%m-%d", time.localtime(t0))
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except OSError:
        return out
    for line in lines:
        m = re.match(r"^\[ray-slurm (\d\d:\d\d:\d\d)\] (starting:|Ray is up)", line)
        if m:
            t = time.mktime(time.strptime(f"{day} {m.group(1)}", "%Y-%m-%d %H:%M:%S"))
            out.setdefault("agent_" + ("start" if m.group(2) == "starting:" else "up"),
                           round(t - t0, 1))
    return out


def ray_started_at(log_path: Path, t0: float, wait_s: float = 0.0) -> float | None:
    """Seconds after t0 at which `ray start` logged "Ray runtime started." (Ray's own line,
    with milliseconds: the raylet has registered, which is when `ray start` returns)."""
    deadline = time.time() + wait_s
    while True:
        try:
            text = log_path.read_text(errors="replace")
        except OSError:
            text = ""
        m = re.search(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3})\s.*Ray runtime started",
                      text, re.M)
        if m:
            t = time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S"))
            return round(t + int(m.group(2)) / 1000 - t0, 3)
        if time.time() >= deadline:
            return None
        time.sleep(0.2)


def agent_start_line(c: Cluster, job_id: str) -> list[str]:
    """The `ray start` argv the agent of `job_id` logged (`starting: ...`)."""
    for line in c.cdir.log(job_id).read_text().splitlines():
        m = re.match(r"^\[ray-slurm [\d:]+\] starting: (.*)$", line)
        if m:
            return m.group(1).split()
    raise RuntimeError(f"no `starting:` line in {c.cdir.log(job_id)}")


def raw_script(argv: list[str], c: Cluster) -> str:
    """A plain batch script with the provider head's `ray start` line."""
    ports = port_block(c.name)
    out = []
    for a in argv:
        if a.startswith("--autoscaling-config="):
            continue
        if a.startswith(("--node-ip-address=", "--dashboard-host=")):
            out.append(a.split("=", 1)[0] + '="$IP"')
        elif a.startswith("--temp-dir="):
            out.append('--temp-dir="/tmp/rsp-raw-$SLURM_JOB_ID"')
        else:
            out.append(shlex.quote(a))
    out[0] = shlex.quote(RAY)
    return "\n".join([
        "#!/bin/bash",
        "export RAY_AUTH_MODE=token",
        f"export RAY_AUTH_TOKEN_PATH={shlex.quote(str(c.token_path))}",
        "export RAY_USAGE_STATS_ENABLED=0 RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S=5",
        f"export AUTOSCALER_METRIC_PORT={ports.autoscaler_metrics}"
        f" DASHBOARD_METRIC_PORT={ports.dashboard_metrics}",
        'K="${SLURMD_NODENAME#n}"; IP="127.0.0.$((K + 1))"',  # the sandbox's NodeAddr
        "exec " + " ".join(out),
        "",
    ])


def raw_run(c: Cluster, script: str, poll: float, timeout: float) -> dict[str, Any]:
    # The raw head binds the ports of the provider's `ray start` line it copies.
    gcs, dash = (int(re.search(rf"--{k}=(\d+)", script).group(1))  # type: ignore[union-attr]
                 for k in ("port", "dashboard-port"))
    probe = Probe(time.time(), gcs, dash, c.token())
    job = sbatch(script, "--partition=cpu", "--cpus-per-task=1", "--mem=1500M",
                 "--time=8:00:00", "--job-name=bench-raw-head",
                 f"--output={WORK / c.name / 'raw-%j.out'}")
    probe.mark("sbatch_returned")
    try:
        while time.time() - probe.t0 < timeout:
            tick = time.time()
            if probe.poll(squeue(job_ids=[job])):
                break
            time.sleep(max(0.0, poll - (time.time() - tick)))
        # `ray start` returns once the raylet registers, after the dashboard answers.
        started = ray_started_at(WORK / c.name / f"raw-{job}.out", probe.t0, wait_s=30)
        if started is not None:
            probe.times["ray_started"] = started
    finally:
        scancel([job])
        gone = wait_gone(None, [job])
    if "answer" not in probe.times:
        raise RuntimeError(f"the raw head (job {job}) never answered: {probe.times}")
    probe.times["job_id"] = job  # type: ignore[assignment]
    probe.times["gone_s"] = round(gone, 1)
    return dict(probe.times)



def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5, help="runs of each path (alternating)")
    ap.add_argument("--poll", type=float, default=1.0)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--name", default="p1", help="result name (bench/results/NAME.json)")
    args = ap.parse_args()

    cname = "bench-p1"
    c = Cluster(bench_config(cname, workers=0))
    runs: dict[str, list[dict[str, Any]]] = {"provider": [], "raw": []}
    failed: dict[str, list[str]] = {"provider": [], "raw": []}
    script = None
    attempts = 0
    try:
        while min(len(runs["provider"]), len(runs["raw"])) < args.runs \
                and attempts < 2 * args.runs + 2:
            attempts += 1
            i = len(runs["provider"]) + 1
            if len(runs["provider"]) < args.runs or script is None:
                log(f"provider run {i}: ray up")
                try:
                    r = provider_run(c, args.poll, args.timeout)
                except RuntimeError as e:
                    # Under load `ray start` itself can time out (Ray's fixed 30 s wait for
                    # the raylet to register): a failed run is recorded, not timed.
                    failed["provider"].append(str(e)[-600:])
                    log(f"  provider run failed: {str(e)[-300:]}")
                    c.down()
                    c.cleanup()
                    wait_gone(c.job_name, [j["id"] for j in c.squeue()])
                    continue
                job = str(r["job_id"])
                t = time.time()  # the bound: Ray's CLI start-up, which `ray up` pays first
                subprocess.run([RAY, "--version"], capture_output=True, check=True)
                r["ray_cli_s"] = round(time.time() - t, 3)
                if script is None:
                    script = raw_script(agent_start_line(c, job), c)
                    (WORK / cname / "raw-head.sbatch").write_text(script)
                t = time.time()
                c.down()
                r["ray_down_s"] = round(time.time() - t, 1)
                r["gone_s"] = round(wait_gone(c.job_name, [job]), 1)
                runs["provider"].append(r)
                log(f"  provider: {r}")
            if len(runs["raw"]) < args.runs:
                log(f"raw run {len(runs['raw']) + 1}: sbatch + ray start --head --block")
                try:
                    rr = raw_run(c, script, args.poll, args.timeout)
                except RuntimeError as e:
                    failed["raw"].append(str(e)[-600:])
                    log(f"  raw run failed: {str(e)[-300:]}")
                    continue
                runs["raw"].append(rr)
                log(f"  raw: {rr}")
    finally:
        c.down()
        c.cleanup()
    prov = summary([r["answer"] for r in runs["provider"]])
    raw = summary([r["answer"] for r in runs["raw"]])
    res = {
        "runs": runs, "failed": failed, "raw_script": script,
        "provider_answer_s": prov, "raw_answer_s": raw,
        "provider_ray_up_exit_s": summary([r["ray_up_exit"] for r in runs["provider"]]),
        "provider_gcs_s": summary([r["gcs"] for r in runs["provider"]]),
        "raw_gcs_s": summary([r["gcs"] for r in runs["raw"]]),
        "ratio_answer": round(prov["median"] / raw["median"], 3),
        # P1b: `ray up` exit / raw answer; and the same against raw `ray start` returning.
        "ratio_exit_answer": round(summary([r["ray_up_exit"] for r in runs["provider"]])[
            "median"] / raw["median"], 3),
        "ray_cli_s": summary([r["ray_cli_s"] for r in runs["provider"]]),
        "raw_ray_started_s": summary([r["ray_started"] for r in runs["raw"]
                                      if "ray_started" in r]),
        "provider_ray_started_s": summary([r["ray_started"] for r in runs["provider"]
                                           if "ray_started" in r]),
        "ratio_gcs": round(summary([r["gcs"] for r in runs["provider"]])["median"]
                           / summary([r["gcs"] for r in runs["raw"]])["median"], 3),
        "target_ratio": 1.10,
    }
    res["meets_target"] = res["ratio_answer"] <= 1.10
    save(args.name, res)


if __name__ == "__main__":
    main()
