"""Container runtimes for Ray nodes: docker, podman, apptainer, enroot, pyxis, or none."""

from __future__ import annotations

from ray_slurm_provider.runtimes.base import RunContext, Runtime, container_name
from ray_slurm_provider.runtimes.docker import Docker, Podman
from ray_slurm_provider.runtimes.hpc import Apptainer, Enroot, Pyxis

RUNTIMES: dict[str, type[Runtime]] = {
    "none": Runtime, "docker": Docker, "podman": Podman, "apptainer": Apptainer,
    "enroot": Enroot, "pyxis": Pyxis,
}


def get_runtime(name: str) -> Runtime:
    return RUNTIMES[name]()


__all__ = ["RUNTIMES", "RunContext", "Runtime", "container_name", "get_runtime"]
