"""Ray drivers for the hardening e2e tests (run with `ray job submit` on the head).

Each one waits on marker files the test creates, so the test decides when demand appears and
ends; results are printed as one `TAG json` line.
"""

OUTAGE = """
import json, os, time, ray
ray.init()

@ray.remote(num_cpus=1, max_retries=3)
def hold(i, stop):
    while not os.path.exists(stop):
        time.sleep(0.5)
    return i, os.environ.get("SLURM_JOB_ID")

first = hold.remote(0, {stop!r})
while not os.path.exists({more!r}):
    time.sleep(0.2)
second = hold.remote(1, {stop!r})  # new demand while slurmctld is down
print("OUTAGE_RESULT", json.dumps(sorted(ray.get([first, second]))), flush=True)
"""

# Tasks with retries and an actor with restarts keep two workers busy until `stop` exists.
LOST = """
import json, os, time, ray
ray.init()

@ray.remote(num_cpus=0.5, max_retries=5)
def work(i):
    time.sleep(2)
    return i

@ray.remote(num_cpus=0.5, max_restarts=5, max_task_retries=-1)
class Counter:
    def __init__(self):
        self.n = 0
    def add(self):
        self.n += 1
        time.sleep(1)
        return self.n

c = Counter.remote()
i, calls, restarts, last = 0, 0, 0, 0
while not os.path.exists({stop!r}):
    refs = [work.remote(i + k) for k in range(3)]
    n = ray.get(c.add.remote())
    restarts += n <= last
    last, calls = n, calls + 1
    assert sorted(ray.get(refs)) == [i, i + 1, i + 2]
    i += 3
    print("LOST_PROGRESS", i, calls, restarts, flush=True)
print("LOST_RESULT", json.dumps({{"tasks": i, "calls": calls, "restarts": restarts}}),
      flush=True)
"""

# Sequential 5-second steps on the short-lived node type, for `seconds` after the first.
WALLTIME = """
import json, os, time, ray
ray.init()

@ray.remote(num_cpus=0, resources={{"short": 1}}, max_retries=5)
def step(i):
    time.sleep(5)
    return i, os.environ.get("SLURM_JOB_ID")

out = [ray.get(step.remote(0))]  # the node may queue for a while on a busy cluster
t0 = time.time()
while time.time() - t0 < {seconds}:
    out.append(ray.get(step.remote(len(out))))
print("WALL_RESULT", json.dumps({{"ids": [i for i, _ in out],
                                 "jobs": sorted({{j for _, j in out}})}}), flush=True)
"""

# Demand for a node type whose jobs Slurm refuses: waits forever (stopped by the test).
BAD = """
import ray
ray.init()
ray.get(ray.remote(num_cpus=0, resources={"bad": 1})(lambda: 1).remote())
"""

# Two busy workers, for the head-gone test.
TWO = """
import time, ray
ray.init()
f = ray.remote(num_cpus=1)(lambda: time.sleep(3600))
ray.get([f.remote(), f.remote()])
"""
