"""A real multi-node Slurm cluster on this one machine, for tests and local development.

    from ray_slurm_provider.sandbox import Sandbox
    env = Sandbox(nodes=3, gpus_per_node=2).up()   # as root; returns the variables to export
    ...
    Sandbox().down()

Or from a shell: ``ray-slurm sandbox up|status|down``.
"""

from ray_slurm_provider.sandbox.core import (
    DEFAULT_STATE_DIR,
    STATE_DIR_ENV,
    Sandbox,
    SandboxStatus,
    default_state_dir,
)
from ray_slurm_provider.sandbox.procs import SandboxError

__all__ = [
    "DEFAULT_STATE_DIR",
    "STATE_DIR_ENV",
    "Sandbox",
    "SandboxError",
    "SandboxStatus",
    "default_state_dir",
]
