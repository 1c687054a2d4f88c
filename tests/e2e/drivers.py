"""Ray drivers for the hardening e2e tests (run with `ray job submit` on the head).

Each one waits on marker files the test creates, so the test decides when demand appears and
ends; results are printed as one `TAG json` line.
"""

# The Slurm job a task ran in, as squeue and the provider name it (pasted into the drivers
# that report it; no braces, because the drivers are str.format() templates).
JOB_ID_FN = """
def job_id():
    e = os.environ
    if e.get("SLURM_ARRAY_TASK_ID"):
        return e["SLURM_ARRAY_JOB_ID"] + "_" + e["SLURM_ARRAY_TASK_ID"]
    return e.get("SLURM_JOB_ID")
"""

OUTAGE = """
import json, os, time, ray
ray.init(log_to_driver=False)
""" + JOB_ID_FN + """

@ray.remote(num_cpus=1, max_retries=3)
def hold(i, stop):
    while not os.path.exists(stop):
        time.sleep(0.5)
    return i, job_id()

first = hold.remote(0, {stop!r})
while not os.path.exists({more!r}):
    time.sleep(0.2)
second = hold.remote(1, {stop!r})  # new demand while slurmctld is down
print("OUTAGE_RESULT", json.dumps(sorted(ray.get([first, second]))), flush=True)
"""

# Tasks with retries and an actor with restarts, with a backlog larger than the two workers
# (`max_workers: 2`) can take, so demand always remains, until `stop` exists.
LOST = """
import json, os, time, ray
ray.init(log_to_driver=False)

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
        time.sleep(0.5)
        return self.n

c = Counter.remote()
call = c.add.remote()
pending, done, started = {{}}, set(), 0
calls, restarts, last = 0, 0, 0
while not os.path.exists({stop!r}) or pending:
    while len(pending) < 8 and not os.path.exists({stop!r}):
        pending[work.remote(started)] = started
        started += 1
    ready, _ = ray.wait([call, *pending], num_returns=1, timeout=1.0)
    for ref in ready:
        if ref == call:
            n = ray.get(ref)
            restarts += n <= last
            last, calls = n, calls + 1
            call = c.add.remote()
        else:
            done.add(ray.get(ref))
            del pending[ref]
assert done == set(range(started)), sorted(set(range(started)) - done)
print("LOST_RESULT", json.dumps({{"tasks": started, "calls": calls, "restarts": restarts}}),
      flush=True)
"""

# Sequential 5-second steps on the short-lived node type until three steps in a row ran on a
# job other than the first (the first node left, a replacement took over), or for `seconds`.
WALLTIME = """
import json, os, time, ray
ray.init(log_to_driver=False)
""" + JOB_ID_FN + """

@ray.remote(num_cpus=0, resources={{"short": 1}}, max_retries=5)
def step(i):
    time.sleep(5)
    return i, job_id()

out = [ray.get(step.remote(0))]  # the node may queue for a while on a busy cluster
t0 = time.time()
while time.time() - t0 < {seconds}:
    out.append(ray.get(step.remote(len(out))))
    last = [j for _, j in out[-3:]]
    if len(last) == 3 and len(set(last)) == 1 and last[0] != out[0][1]:
        break
print("WALL_RESULT", json.dumps({{"ids": [i for i, _ in out],
                                 "jobs": sorted({{j for _, j in out}})}}), flush=True)
"""

# Demand for a node type whose jobs Slurm refuses: waits forever (stopped by the test).
BAD = """
import ray
ray.init(log_to_driver=False)
ray.get(ray.remote(num_cpus=0, resources={"bad": 1})(lambda: 1).remote())
"""

# Demand for a type whose jobs die in their prologue (issue 14.1), and for one whose setup
# command runs long (issue 14.3).
CRASH = BAD.replace('"bad"', '"crash"')
SLOW = BAD.replace('"bad"', '"slow"')

# Two busy workers, for the head-gone test.
TWO = """
import time, ray
ray.init(log_to_driver=False)
f = ray.remote(num_cpus=1)(lambda: time.sleep(3600))
ray.get([f.remote(), f.remote()])
"""
