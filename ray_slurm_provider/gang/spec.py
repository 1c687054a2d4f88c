"""What a gang run is: `GangSpec`, checked up front, and the command-line options for it.

The job scripts (cluster-configs/megatron/launch.py) build a spec from `add_arguments` /
`from_args`; everything is validated in the driver before a placement group exists, so a typo
costs no cluster time.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Literal

from ray_slurm_provider.gang import profiles
from ray_slurm_provider.gang.context import FaultSpec
from ray_slurm_provider.gang.devices import CVD_POLICIES
from ray_slurm_provider.gang.rankenv import OWNED

Device = Literal["gpu", "cpu"]


#: Where the gang's nodes may be: any distinct Ray nodes, or the nodes of one gang group.
PLACEMENTS = ("spread", "group")


class SpecError(ValueError):
    pass


@dataclass(frozen=True)
class GangSpec:
    nodes: int = 1
    ranks_per_node: int = 1
    device: Device = "gpu"
    cpus_per_rank: float = 1.0
    resources_per_rank: dict[str, float] = field(default_factory=dict)
    backend: str | None = None
    cvd_policy: str = "node"
    profiles: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    max_attempts: int = 3
    pg_timeout_s: float = 600.0
    start_timeout_s: float = 900.0
    stall_timeout_s: float = 900.0
    answer_timeout_s: float = 120.0
    poll_interval_s: float = 2.0
    checkpoint_dir: str | None = None
    checkpoint_shared: bool = True
    s3_uri: str | None = None
    s3_endpoint: str | None = None
    fault: FaultSpec | None = None
    name: str = "gang"
    omp_threads: int | None = None
    placement: str = "spread"  # "group": all nodes in one gang node group (placement.py)

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def resolved_backend(self) -> str:
        return self.backend or ("nccl" if self.device == "gpu" else "gloo")

    @property
    def threads(self) -> int:
        return self.omp_threads or max(1, int(self.cpus_per_rank))

    def rank_resources(self) -> dict[str, float]:
        """One rank's share of its node's bundle."""
        res: dict[str, float] = {"CPU": float(self.cpus_per_rank)}
        if self.device == "gpu":
            res["GPU"] = 1.0
        res.update({k: float(v) for k, v in self.resources_per_rank.items()})
        return {k: v for k, v in res.items() if v}

    def profile_env(self) -> dict[str, str]:
        return profiles.resolve(self.profiles, self.env)

    def validate(self) -> GangSpec:
        if self.nodes < 1 or self.ranks_per_node < 1:
            raise SpecError("--nodes and --ranks-per-node must be at least 1")
        if self.device not in ("gpu", "cpu"):
            raise SpecError(f"--device must be gpu or cpu, got {self.device!r}")
        if self.cvd_policy not in CVD_POLICIES:
            raise SpecError(f"--cvd-policy must be one of {', '.join(CVD_POLICIES)}")
        if self.max_attempts < 1:
            raise SpecError("--max-attempts must be at least 1")
        if self.placement not in PLACEMENTS:
            raise SpecError(f"--placement must be one of {', '.join(PLACEMENTS)}, "
                            f"got {self.placement!r}")
        if self.cpus_per_rank < 0:
            raise SpecError("--cpus-per-rank must be >= 0")
        for name, v in (("pg", self.pg_timeout_s), ("start", self.start_timeout_s),
                        ("stall", self.stall_timeout_s), ("answer", self.answer_timeout_s),
                        ("poll", self.poll_interval_s)):
            if v <= 0:
                raise SpecError(f"the {name} timeout/interval must be positive")
        owned = sorted(set(self.env) & set(OWNED))
        if owned:
            raise SpecError(f"--env cannot set {', '.join(owned)}: the launcher owns them")
        if self.s3_uri and not self.s3_uri.startswith("s3://"):
            raise SpecError(f"--checkpoint-s3 must be s3://bucket/prefix, got {self.s3_uri!r}")
        if self.s3_uri and not self.checkpoint_dir:
            raise SpecError("--checkpoint-s3 needs --checkpoint-dir (where ranks read/write)")
        if self.fault and not 0 <= self.fault.rank < self.world_size:
            raise SpecError(f"--inject-fault rank {self.fault.rank} is not in the gang")
        try:
            self.profile_env()
        except profiles.ProfileError as e:
            raise SpecError(str(e)) from e
        return self


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("gang (ray_slurm_provider.gang)")
    g.add_argument("--nodes", type=int, default=1, help="Ray nodes (Slurm jobs) in the gang")
    g.add_argument("--ranks-per-node", type=int, default=1,
                   help="ranks per node; on GPUs one GPU each")
    g.add_argument("--device", choices=["gpu", "cpu"], default="gpu")
    g.add_argument("--cpus-per-rank", type=float, default=1.0)
    g.add_argument("--backend", default=None, help="default: nccl on gpu, gloo on cpu")
    g.add_argument("--cvd-policy", choices=list(CVD_POLICIES), default="node",
                   help="CUDA_VISIBLE_DEVICES/LOCAL_RANK policy (see launch/devices.py)")
    g.add_argument("--profile", action="append", default=[], metavar="NAME[=VALUE]",
                   help="environment preset: " + ", ".join(profiles.known()))
    g.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="extra rank environment variable (wins over profiles)")
    g.add_argument("--placement", choices=PLACEMENTS, default="spread",
                   help="spread: the nodes are any distinct Ray nodes; group: all of them in "
                   "ONE gang node group (a node type with node_config.nodes: N, one Slurm "
                   "job of N nodes; its nodes carry the label ray-slurm.io/group)")
    g.add_argument("--max-attempts", type=int, default=3,
                   help="gang attempts in all (1 = no restart)")
    g.add_argument("--pg-timeout", type=float, default=600.0,
                   help="seconds to wait for the placement group")
    g.add_argument("--start-timeout", type=float, default=900.0,
                   help="seconds a rank may take to its first heartbeat")
    g.add_argument("--stall-timeout", type=float, default=900.0,
                   help="seconds between heartbeats before the gang is restarted")
    g.add_argument("--checkpoint-dir", default=None,
                   help="checkpoint directory the ranks save to and resume from")
    g.add_argument("--node-local-checkpoints", action="store_true",
                   help="--checkpoint-dir is not shared between nodes (stage per node)")
    g.add_argument("--checkpoint-s3", default=None, metavar="s3://BUCKET/PREFIX",
                   help="mirror --checkpoint-dir to S3: pulled before each attempt, pushed "
                        "after each checkpoint")
    g.add_argument("--s3-endpoint", default=None, help="S3 endpoint URL (non-AWS stores)")
    g.add_argument("--inject-fault", default=None, metavar="crash|stall|raise:RANK:STEP[:ATT]",
                   help="fault drill: fail one rank at one step")
    g.add_argument("--name", default="gang", help="placement group name prefix")


def from_args(a: argparse.Namespace) -> GangSpec:
    try:
        env = profiles.parse_env_assignments(a.env)
        fault = FaultSpec.parse(a.inject_fault) if a.inject_fault else None
    except ValueError as e:
        raise SpecError(str(e)) from e
    return GangSpec(
        nodes=a.nodes, ranks_per_node=a.ranks_per_node, device=a.device,
        cpus_per_rank=a.cpus_per_rank, backend=a.backend, cvd_policy=a.cvd_policy,
        profiles=tuple(a.profile), env=env, max_attempts=a.max_attempts,
        pg_timeout_s=a.pg_timeout, start_timeout_s=a.start_timeout,
        stall_timeout_s=a.stall_timeout, checkpoint_dir=a.checkpoint_dir,
        checkpoint_shared=not a.node_local_checkpoints, s3_uri=a.checkpoint_s3,
        s3_endpoint=a.s3_endpoint, fault=fault, name=a.name, placement=a.placement,
    ).validate()
