"""Bytes each rank holds per role: parameters, gradients, optimizer state. Plain PyTorch, no Lightning."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

OPTIMIZER_SLOTS = {torch.optim.Adam: 2, torch.optim.AdamW: 2, torch.optim.SGD: 1, torch.optim.RMSprop: 1}
"""State tensors per parameter element kept by common optimizers (SGD counts its momentum buffer)."""


@dataclass
class RoleMemory:
    """What one rank holds for one role."""

    role: str
    calls: str
    """The role's calls on this rank, e.g. ``generate+train``."""
    param_bytes: int
    grad_bytes: int
    """Gradients of the trainable parameters, on ranks that run the role's train call."""
    optimizer_bytes: int
    """Optimizer state: slots per element (Adam: 2) times the trainable parameter bytes."""
    shares: str | None = None
    """The role whose parameters this one runs on, counted there: a LoRA actor's reference is its base model with
    the adapters disabled, so it costs no bytes of its own."""


def role_memory(
    role: str, module: nn.Module, calls: list[str], optimizer: torch.optim.Optimizer | None
) -> RoleMemory:
    """Bytes of ``module`` on this rank; gradients and optimizer state only where the role trains here."""
    local = [_local(p) for p in module.parameters()]
    param_bytes = sum(p.numel() * p.element_size() for p in local)
    trainable = sum(_local(p).numel() * p.element_size() for p in module.parameters() if p.requires_grad)
    grads = trainable if optimizer is not None else 0
    slots = _optimizer_slots(optimizer) if optimizer is not None else 0
    return RoleMemory(role, "+".join(calls), param_bytes, grads, slots * trainable)


def _local(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if hasattr(param, "to_local") else param  # FSDP2 shard


def _optimizer_slots(optimizer: torch.optim.Optimizer) -> int:
    for cls, slots in OPTIMIZER_SLOTS.items():
        if type(optimizer) is cls:
            if cls is torch.optim.SGD and not optimizer.defaults.get("momentum"):
                return 0
            return slots
    return 2  # unknown optimizers: assume Adam-like
