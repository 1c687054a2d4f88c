"""P7, the RPCs per second an 8-worker cluster sends a strict slurmctld in steady state.

On `sandbox up --slurm 25.11 --users 1 --strict --cpus-per-node 4` (issue 29): the sandbox's
user brings up a cluster whose `cpu_worker` type keeps 8 workers (min_workers 8); once all 8
run Ray and a settle time has passed, `sdiag --reset`, a window in which only the cluster
talks to slurmctld as that user, then `sdiag`: its per-user count is what the provider (in the
head's autoscaler) and all 9 node agents sent. The user's bucket is the small strict one, so
a rate over its refill would also show as throttling in slurmctld's log (counted too).

    .venv/bin/python -m bench.p7_strict_rpc [--state-dir /tmp/rsp-strict] [--window 120]

Prints `P7 {...}` and saves it under bench/results/. Brings the cluster down at the end.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import time
from pathlib import Path
from typing import Any

import yaml

from bench.common import save
from ray_slurm_provider.sandbox import Sandbox, strict
from tests.e2e.harness import ROOT, wait_for
from tests.e2e.users import UserCluster, user_venv

WORKERS = 8
#: sdiag's per-user line: "\trsp800-u1  (    1001) count:105    ave_time:74 ..."
USER_LINE = re.compile(r"^\s*(\S+)\s+\(\s*(\d+)\)\s+count:(\d+)")
TYPE_LINE = re.compile(r"^\s*(REQUEST_\S+|MESSAGE_\S+)\s+\(\s*\d+\)\s+count:(\d+)")


def config() -> dict[str, Any]:
    cfg = yaml.safe_load((ROOT / "cluster-configs" / "sandbox.yaml").read_text())
    t = cfg["available_node_types"]
    del t["gpu_worker"]
    t["cpu_worker"].update(min_workers=WORKERS, max_workers=WORKERS,
                           resources={"CPU": 1, "memory": 300_000_000})
    t["cpu_worker"]["node_config"]["mem"] = "700M"
    cfg["max_workers"] = WORKERS
    return cfg


def sdiag(env: dict[str, str], *args: str) -> str:
    return subprocess.run(["sdiag", *args], capture_output=True, text=True, timeout=60,
                          check=True, env=env).stdout


def counts(text: str) -> tuple[dict[str, int], dict[str, int]]:
    """(user -> RPCs, message type -> RPCs) from sdiag's output."""
    users: dict[str, int] = {}
    types: dict[str, int] = {}
    section = ""
    for line in text.splitlines():
        if "statistics by message type" in line:
            section = "type"
        elif "statistics by user" in line:
            section = "user"
        elif section == "user" and (m := USER_LINE.match(line)):
            users[m.group(1)] = int(m.group(3))
        elif section == "type" and (m := TYPE_LINE.match(line)):
            types[m.group(1)] = int(m.group(2))
    return users, types


def uptime() -> str:
    return Path("/proc/loadavg").read_text().strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--state-dir", default=None, help="the strict sandbox (default: "
                    "$RAY_SLURM_SANDBOX_DIR)")
    ap.add_argument("--window", type=float, default=120.0)
    ap.add_argument("--settle", type=float, default=30.0)
    args = ap.parse_args()
    sb = Sandbox.from_state_dir(args.state_dir)
    if not sb.spec.strict or not sb.users():
        raise SystemExit("needs `ray-slurm sandbox up --slurm 25.11 --users 1 --strict "
                         "--cpus-per-node 4`")
    env = {**sb.env(), "PATH": f"{sb.env().get('PATH', '')}:/usr/bin:/bin:/usr/sbin"}
    user = sb.users()[0]
    c = UserCluster(user, user_venv(sb), "bench-p7", config(), sb.env())
    res: dict[str, Any] = {"workers": WORKERS, "window s": args.window,
                           "bucket": strict.slurmctld_parameters(), "load before": uptime()}
    try:
        t0 = time.monotonic()
        c.up()

        def all_up() -> bool:
            jobs = [j for j, st in c.jobs() if st == "RUNNING"]
            return len(jobs) == WORKERS + 1 and all(c.cdir.ray_up(j) for j in jobs)

        wait_for(all_up, 600, f"{WORKERS} workers running Ray", every=5)
        res["up to 8 workers s"] = round(time.monotonic() - t0, 1)
        time.sleep(args.settle)
        log = Path(sb.layout.log_dir, "slurmctld.log")
        limited_before = log.read_text().count(f"by uid {user.uid} ")
        sdiag(env, "--reset")
        res["load at window start"] = uptime()
        time.sleep(args.window)
        users, types = counts(sdiag(env))
        res["load at window end"] = uptime()
        res["user RPCs"] = users.get(user.name, 0)
        res["RPCs per s"] = round(users.get(user.name, 0) / args.window, 3)
        res["by type (all users, sdiag's own included)"] = types
        res["rate-limit log lines in window"] = (log.read_text().count(f"by uid {user.uid} ")
                                                 - limited_before)
        res["jobs at end"] = len(c.jobs())
    finally:
        c.down()
        c.cleanup()
    print("P7", json.dumps(res, sort_keys=True))
    save("p7_strict_rpc", res)


if __name__ == "__main__":
    main()
