"""CUDA_VISIBLE_DEVICES and LOCAL_RANK for each rank: three policies.

Ray gives every GPU actor its own mask (`CUDA_VISIBLE_DEVICES=<its GPU>`). Megatron and NCCL
have their own expectations, so the launcher rewrites the mask before torch is imported:

* `node` (default): every rank of a node sees the **same list**, the gang's GPUs on that node
  in GPU-id order; LOCAL_RANK is the rank's index in that list and the device to select. For a
  whole-node job this is what torchrun does. It works with UUID/MIG ids and on partial nodes,
  and avoids the per-process masks that are reported to trip NCCL on NVSwitch systems.
* `ray`: keep Ray's per-GPU mask. Each rank sees one GPU (device 0); LOCAL_RANK stays the
  node-local index. Megatron-Bridge needs `dist.external_gpu_device_mapping=True` with it.
* `pop`: the seed's behaviour. CUDA_VISIBLE_DEVICES is removed (every GPU of the node is
  visible) and LOCAL_RANK is the physical GPU id. Only for integer ids and a runtime that
  numbers GPUs like the host (the container sees all of the node's GPUs).

CPU ranks (no GPU ids) get `CUDA_VISIBLE_DEVICES=""` so a GPU host still takes the CPU path.
Pure logic: no Ray, no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, get_args

from ray_slurm_provider.gang.topology import Member

CvdPolicy = Literal["node", "ray", "pop"]
CVD_POLICIES: tuple[str, ...] = get_args(CvdPolicy)


class DevicePolicyError(ValueError):
    """A policy cannot be applied to the GPUs Ray handed out."""


@dataclass(frozen=True)
class DeviceBinding:
    """What one rank's environment says about devices.

    `cuda_visible_devices` None means "remove the variable"; `device_index` is the CUDA
    ordinal the rank selects (`torch.cuda.set_device`), None on CPU.
    """

    cuda_visible_devices: str | None
    local_rank: int
    device_index: int | None


def bind_devices(policy: str, node: Sequence[Member], index: int) -> DeviceBinding:
    """Binding of `node[index]`; `node` is the node's members in local order."""
    if policy not in CVD_POLICIES:
        raise DevicePolicyError(f"unknown CUDA_VISIBLE_DEVICES policy {policy!r}; "
                                f"choose one of {', '.join(CVD_POLICIES)}")
    me = node[index]
    counts = {len(m.gpu_ids) for m in node}
    if counts == {0}:
        return DeviceBinding("", index, None)
    if counts != {1}:
        raise DevicePolicyError(
            "each rank must hold exactly one GPU; got "
            + ", ".join(f"slot {m.slot}: {list(m.gpu_ids)}" for m in node))
    gpu = me.gpu_ids[0]
    if policy == "node":
        return DeviceBinding(",".join(m.gpu_ids[0] for m in node), index, index)
    if policy == "ray":
        return DeviceBinding(gpu, index, 0)
    if not gpu.strip().isdigit():
        raise DevicePolicyError(
            f"policy 'pop' needs integer GPU ids (LOCAL_RANK = physical id), got {gpu!r}; "
            "use --cvd-policy node")
    return DeviceBinding(None, int(gpu), int(gpu))


def bind_all(policy: str, nodes: Sequence[Sequence[Member]]) -> list[list[DeviceBinding]]:
    """Bindings for every node (outer) and local rank (inner)."""
    return [[bind_devices(policy, node, i) for i in range(len(node))] for node in nodes]
