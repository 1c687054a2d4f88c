"""The node agent: runs inside every Slurm job of a cluster and owns that job's Ray.

`python -m ray_slurm_provider.agent --spec '<json>'` is the last line of every job script.
Nothing here imports the provider (the head's autoscaler) or the command line.
"""
