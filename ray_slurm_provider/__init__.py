"""Ray on Slurm: a Ray cluster-launcher NodeProvider where every Ray node is a Slurm job."""

from typing import Any

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # The Python API (cli/api.py) is imported when first asked for: `import
    # ray_slurm_provider` (every job's agent does) loads nothing above the ground.
    if name in ("SlurmCluster", "ClusterError"):
        from ray_slurm_provider.cli import api

        return getattr(api, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
