"""The complete environment of one rank, set explicitly and applied before torch is imported.

Every variable torch.distributed, Megatron and Megatron-Bridge read is set for every rank:
RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, NODE_RANK/GROUP_RANK, MASTER_ADDR,
MASTER_PORT, CUDA_VISIBLE_DEVICES, OMP_NUM_THREADS. Nothing is left to fall back on.

The Ray workers on a Slurm cluster inherit the job's SLURM_* variables (the raylet runs under
the batch step). Megatron-Bridge and other libraries fall back to SLURM_LOCALID,
SLURM_NODELIST, SLURM_JOB_ID and friends when a torchrun variable is missing, and MPI-style
PMI_*/OMPI_* variables confuse other launchers, so those are scrubbed from the rank.

Launcher-owned variables are applied last: a profile or `--env` cannot override them (`--env`
naming one is refused in `GangSpec`). Pure logic.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

from ray_slurm_provider.gang.devices import DeviceBinding
from ray_slurm_provider.gang.topology import Assignment

SCRUB_PREFIXES: tuple[str, ...] = (
    "SLURM_", "SLURMD_", "SBATCH_", "SRUN_", "SALLOC_",
    "PMI_", "PMIX_", "OMPI_", "MPI_LOCAL", "TORCHELASTIC_",
)
#: torchrun leftovers that would contradict the launcher's layout.
SCRUB_NAMES: tuple[str, ...] = ("ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE",
                                "GROUP_WORLD_SIZE", "LOCAL_RANK_OFFSET")
OWNED: tuple[str, ...] = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK",
    "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES", "RSP_DEVICE", "RSP_DEVICE_INDEX",
    "RSP_BACKEND", "RSP_ATTEMPT", "RSP_NUM_NODES", "RSP_CVD_POLICY", "RSP_CHECKPOINT_DIR",
    "RSP_RUN_ID",
)


@dataclass(frozen=True)
class EnvInputs:
    """Gang-wide settings that go into every rank's environment."""

    master_addr: str
    master_port: int
    backend: str
    device: str
    cvd_policy: str
    attempt: int
    omp_threads: int
    run_id: str
    checkpoint_dir: str | None = None


def build_rank_env(a: Assignment, d: DeviceBinding, g: EnvInputs,
                   base: Mapping[str, str] | None = None) -> dict[str, str | None]:
    """The variables to set (value) or remove (None) in one rank.

    `base` (profiles, then `--env`) comes first; launcher-owned keys are written over it.
    """
    env: dict[str, str | None] = dict(base or {})
    env.setdefault("OMP_NUM_THREADS", str(g.omp_threads))
    env.setdefault("PYTHONUNBUFFERED", "1")
    owned: dict[str, str | None] = {
        "RANK": str(a.rank),
        "LOCAL_RANK": str(d.local_rank),
        "WORLD_SIZE": str(a.world_size),
        "LOCAL_WORLD_SIZE": str(a.local_world_size),
        "NODE_RANK": str(a.node_rank),
        "GROUP_RANK": str(a.node_rank),
        "MASTER_ADDR": g.master_addr,
        "MASTER_PORT": str(g.master_port),
        "CUDA_VISIBLE_DEVICES": d.cuda_visible_devices,
        "RSP_DEVICE": g.device,
        "RSP_DEVICE_INDEX": None if d.device_index is None else str(d.device_index),
        "RSP_BACKEND": g.backend,
        "RSP_ATTEMPT": str(g.attempt),
        "RSP_NUM_NODES": str(a.num_nodes),
        "RSP_CVD_POLICY": g.cvd_policy,
        "RSP_CHECKPOINT_DIR": g.checkpoint_dir,
        "RSP_RUN_ID": g.run_id,
    }
    assert set(owned) == set(OWNED)
    env.update(owned)
    return env


def scrubbed(name: str) -> bool:
    return name.startswith(SCRUB_PREFIXES) or name in SCRUB_NAMES


def apply_env(environ: MutableMapping[str, str], env: Mapping[str, str | None]) -> list[str]:
    """Scrub inherited launcher variables, then set/remove `env`; return the names removed."""
    removed = sorted(k for k in environ if scrubbed(k) and k not in env)
    for k in removed:
        del environ[k]
    for k, v in env.items():
        if v is None:
            if environ.pop(k, None) is not None:
                removed.append(k)
        else:
            environ[k] = v
    return removed
