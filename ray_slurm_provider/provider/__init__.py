"""The head's autoscaler side (and `ray up`'s hooks on the login node): Ray's NodeProvider
contract on Slurm. `ray_slurm_provider.provider.SlurmNodeProvider` is the class the cluster
YAML names; it is imported lazily so that the pure modules here stay cheap to import."""

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "SlurmNodeProvider":
        from ray_slurm_provider.provider.provider import SlurmNodeProvider

        return SlurmNodeProvider
    raise AttributeError(name)
