"""A Ray cluster on Slurm from a notebook (or a script), on the login node or a laptop.

Cells in the `# %%` format (VS Code, Jupyter with jupytext, or `python examples/notebook.py`).
The config is any cluster YAML that `ray up` takes; the sandbox's works after
`ray-slurm sandbox up` and `source /tmp/rsp-sandbox/env.sh`. On a laptop, use a config with
`provider.ssh` and `provider.python` (the sandbox's: cluster-configs/sandbox-login.yaml after
`ray-slurm sandbox up --users 1 --login`): the same cells then reach the cluster through the
login node and its tunnels.
"""

# %%
import ray

from ray_slurm_provider import ClusterError, SlurmCluster

CONFIG = "cluster-configs/sandbox.yaml"

# %% Bring the cluster up: `ray up`'s output shows under the cell as it comes.
cluster = SlurmCluster(CONFIG, reuse=True)  # reuse: a cluster already up is used, left up
cluster.up()
print(cluster.dashboard_url)

# %% Ask for workers ahead of the work (Ray's request_resources); they come as Slurm jobs.
cluster.request_resources(num_cpus=2)
print(cluster.status_table())

# %% Connect this process (Ray Client) and run tasks; the autoscaler adds what they need.
ray.init(cluster.address)


@ray.remote(num_cpus=1)
def where(i: int) -> tuple[int, str]:
    return i, ray.get_runtime_context().get_node_id()[:8]


for i, node in ray.get([where.remote(i) for i in range(4)]):
    print(f"task {i} ran on Ray node {node}")

# %% What the head printed (a worker's: its Slurm job id, from status()).
print(cluster.logs("head", lines=20))

# %% Done: disconnect, then cancel every job of the cluster (only if this notebook started it).
ray.shutdown()
try:
    cluster.close()
except ClusterError as e:
    print(f"could not take the cluster down: {e}")
