"""Bytes each rank holds per role: parameters, gradients, optimizer state. Plain PyTorch, no Lightning."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from lightning_app_rlhf.parallel.wrappers import RoleWrapper


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
    """Optimizer state (with DeepSpeed ZeRO: its fp32 master partition too), on ranks that run the train call."""
    shares: str | None = None
    """The role whose parameters this one runs on, counted there: a LoRA actor's reference is its base model with
    the adapters disabled, so it costs no bytes of its own."""
    tp_copy: int | None = None
    """Set on the row of a call's tensor-parallel copy of the role (its degree): the slice of the weights this rank
    keeps for that call, beside the role's own module."""


def role_memory(role: str, calls: list[str], module: nn.Module, wrapper: RoleWrapper | None) -> RoleMemory:
    """Bytes of ``role`` on this rank: its wrapper's accounting where the role is wrapped here, else the whole
    module's parameters (a shadow or an unwrapped frozen role)."""
    if wrapper is not None:
        return RoleMemory(role, "+".join(calls), *wrapper.memory_bytes())
    param_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
    return RoleMemory(role, "+".join(calls), param_bytes, 0, 0)
