"""Wrap a trainable role for data-parallel training on its own process group. Plain PyTorch, no Lightning."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

SHARDED_WRAPPERS = ("fsdp2", "zero3")
"""Wrappers after which no rank holds a role's full parameters."""


def wrap_for_training(
    module: nn.Module, wrapper: str, group: dist.ProcessGroup | None, group_size: int, device: torch.device
) -> nn.Module:
    """The module a role's train call runs: DDP or FSDP2 on the role's train group (the module itself on one rank).

    Args:
        module: The role's module. DDP keeps its parameters; FSDP2 shards them in place.
        wrapper: The plan's wrapper for the role.
        group: The process group of the role's train call.
        group_size: Ranks in that group.
        device: This rank's device.
    """
    if wrapper not in ("ddp", "fsdp2"):
        raise NotImplementedError(
            f"The {wrapper!r} wrapper (DeepSpeed) is not available yet in this release; use 'ddp' or 'fsdp2'."
        )
    if group_size == 1:
        return module
    if wrapper == "fsdp2":
        return shard_with_fsdp2(module, DeviceMesh.from_group(group, device_type=device.type))
    device_ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(module, process_group=group, device_ids=device_ids)


def shard_frozen(
    module: nn.Module, wrapper: str, group: dist.ProcessGroup | None, group_size: int, device: torch.device
) -> nn.Module:
    """Shard a frozen role (reference, reward model) with FSDP2 over its forward call's group, in place. Every rank
    of the group then runs each forward together (one forward per call, on its shard of the batch).

    Args:
        module: The frozen role's module.
        wrapper: The plan's wrapper for the role (``fsdp2``).
        group: The process group of the role's forward call.
        group_size: Ranks in that group.
        device: This rank's device.
    """
    if wrapper != "fsdp2":
        raise ValueError(f"A frozen role can only be sharded with 'fsdp2', got {wrapper!r}.")
    if group_size == 1:
        return module
    return shard_with_fsdp2(module, DeviceMesh.from_group(group, device_type=device.type))


def shard_with_fsdp2(module: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """``fully_shard`` each transformer block (the model's ``_no_split_modules`` classes), then the root."""
    block_names: set[str] = set()
    for sub in module.modules():
        block_names.update(getattr(sub, "_no_split_modules", None) or [])
    for sub in module.modules():
        if type(sub).__name__ in block_names:
            fully_shard(sub, mesh=mesh)
    fully_shard(module, mesh=mesh)
    return module
