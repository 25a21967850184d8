"""Wrap a trainable role for data-parallel training on its own process group. Plain PyTorch, no Lightning."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def wrap_for_training(
    module: nn.Module, wrapper: str, group: dist.ProcessGroup | None, group_size: int, device: torch.device
) -> nn.Module:
    """The module a role's train call runs: DDP on the role's train group (the module itself on one rank).

    Args:
        module: The role's module; it keeps its parameters (DDP does not copy them).
        wrapper: The plan's wrapper for the role.
        group: The process group of the role's train call.
        group_size: Ranks in that group.
        device: This rank's device.
    """
    if wrapper != "ddp":
        raise NotImplementedError(
            f"The {wrapper!r} wrapper is not available yet in this release; use wrapper='ddp' for now."
        )
    if group_size == 1:
        return module
    device_ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(module, process_group=group, device_ids=device_ids)
