"""Parallel wrappers: how a role runs on its process group. One registry, read by the strategies, the memory summary,
the planner's cost model and its search space; the plan validates against its names
(:mod:`lightning_app_rlhf.core.wrapper_names`, whose rows give each class its traits). Plain PyTorch, no Lightning."""

from __future__ import annotations

from lightning_app_rlhf.core.wrapper_names import (
    FROZEN_WRAPPERS,
    SHARDED_WRAPPERS,
    check_wrapper,
    is_available,
)
from lightning_app_rlhf.parallel.wrappers.base import RoleWrapper, optimizer_slots
from lightning_app_rlhf.parallel.wrappers.ddp import DDPWrapper
from lightning_app_rlhf.parallel.wrappers.deepspeed_zero import Zero1Wrapper, Zero2Wrapper, Zero3Wrapper
from lightning_app_rlhf.parallel.wrappers.fsdp2 import FSDP2Wrapper

WRAPPERS: dict[str, type[RoleWrapper]] = {
    cls.name: cls for cls in (DDPWrapper, FSDP2Wrapper, Zero1Wrapper, Zero2Wrapper, Zero3Wrapper)
}
"""Name -> wrapper class, in the order the planner tries them (that of
:data:`~lightning_app_rlhf.core.wrapper_names.WRAPPER_NAMES`)."""


def wrapper_class(name: str, role: str | None = None) -> type[RoleWrapper]:
    """The wrapper called ``name``; a ``ValueError`` naming the choices, or the install command for a wrapper whose
    package is missing."""
    check_wrapper(name, role, available=is_available)
    return WRAPPERS[name]


def available_wrappers() -> tuple[str, ...]:
    """The wrappers this machine can run, in registry order: the planner searches only these."""
    return tuple(name for name in WRAPPERS if is_available(name))


__all__ = [
    "FROZEN_WRAPPERS",
    "SHARDED_WRAPPERS",
    "WRAPPERS",
    "DDPWrapper",
    "FSDP2Wrapper",
    "RoleWrapper",
    "Zero1Wrapper",
    "Zero2Wrapper",
    "Zero3Wrapper",
    "available_wrappers",
    "is_available",
    "optimizer_slots",
    "wrapper_class",
]
