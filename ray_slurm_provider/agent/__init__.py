"""The node agent: runs inside every Slurm job of a cluster and owns that job's Ray.

`python -m ray_slurm_provider.agent --spec '<json>'` (__main__.py) is the last line of every
job script. agent.py is what both roles share, head.py the head's hand-off loop with `ray up`,
worker.py the worker. Nothing here imports the provider (the head's autoscaler) or the
command line.
"""
