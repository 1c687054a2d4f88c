"""A torch.distributed gang on Ray placement groups, without torchrun.

`run_gang(spec, "module:function", payload)` starts `nodes x ranks_per_node` rank actors in one
STRICT_SPREAD placement group (one bundle per node), orders them by numeric node IP, node id
and GPU id, gives each the full torchrun-style environment (CUDA_VISIBLE_DEVICES per the
chosen policy, SLURM_* scrubbed, opt-in NCCL/EFA profiles, a fresh rendezvous port per
attempt), calls the function in every rank, and restarts the whole gang when one rank fails
or stalls, up to `max_attempts`. The placement group is always removed.

Modules: `topology` (rank order), `devices` (CVD policies), `rankenv` (environment),
`profiles` (presets), `rendezvous` (port), `watchdog` (stall detection), `overrides`
(Hydra-style key=value), `spec` (options), `placement`, `actor`, `attempt`, `gang` (Ray),
`context` (what the training function sees), `s3stage` (optional S3 checkpoint staging).
Importing this package imports neither Ray nor torch.
"""

from __future__ import annotations

from ray_slurm_provider.gang.context import FatalRankError, FaultSpec, RankContext, RankInfo
from ray_slurm_provider.gang.gang import GangFailed, GangResult, run_gang
from ray_slurm_provider.gang.overrides import OverrideError, apply_overrides
from ray_slurm_provider.gang.spec import GangSpec, SpecError

__all__ = [
    "FatalRankError", "FaultSpec", "GangFailed", "GangResult", "GangSpec", "OverrideError",
    "RankContext", "RankInfo", "SpecError", "apply_overrides", "run_gang",
]

