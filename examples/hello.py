"""A first Ray job: which Ray nodes (Slurm jobs) ran the tasks."""

import ray

ray.init()


@ray.remote(num_cpus=1)
def hello(i: int) -> tuple[int, str]:
    ctx = ray.get_runtime_context()
    return i, ctx.get_node_id()[:8]


print("cluster resources before scaling:", ray.cluster_resources())
for i, node in ray.get([hello.remote(i) for i in range(4)]):
    print(f"task {i} ran on Ray node {node}")
