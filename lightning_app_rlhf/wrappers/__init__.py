"""Parallel wrappers: how a role runs on its process group. One registry, read by the plan's validation, the
strategies, the memory summary, the planner's cost model and its search space. Plain PyTorch, no Lightning."""

from __future__ import annotations

import importlib.util

from lightning_app_rlhf.wrappers.base import RoleWrapper, optimizer_slots
from lightning_app_rlhf.wrappers.ddp import DDPWrapper
from lightning_app_rlhf.wrappers.deepspeed_zero import Zero1Wrapper, Zero2Wrapper, Zero3Wrapper
from lightning_app_rlhf.wrappers.fsdp2 import FSDP2Wrapper

WRAPPERS: dict[str, type[RoleWrapper]] = {
    cls.name: cls for cls in (DDPWrapper, FSDP2Wrapper, Zero1Wrapper, Zero2Wrapper, Zero3Wrapper)
}
"""Name -> wrapper class, in the order the planner tries them."""


def wrapper_class(name: str, role: str | None = None) -> type[RoleWrapper]:
    """The wrapper called ``name``; a ``ValueError`` naming the choices, or the install command for a wrapper whose
    package is missing."""
    if name not in WRAPPERS:
        whose = f"Role {role!r} has wrapper {name!r}" if role else f"Unknown wrapper {name!r}"
        raise ValueError(f"{whose}; choose one of {list(WRAPPERS)}.")
    cls = WRAPPERS[name]
    if not is_available(name):
        whose = f"Role {role!r} asks for" if role else "Wrapper"
        raise ValueError(f"{whose} {name!r}, which needs {cls.package}, and {cls.package} is not installed. Install "
                         f"it with `pip install 'lightning-app-rlhf[{cls.extra}]'`, or use "
                         f"{[n for n in WRAPPERS if WRAPPERS[n].package is None]}.")
    return cls


def is_available(name: str) -> bool:
    """Whether this machine can run the wrapper (its package is installed)."""
    package = WRAPPERS[name].package
    return package is None or importlib.util.find_spec(package) is not None


def available_wrappers() -> tuple[str, ...]:
    """The wrappers this machine can run, in registry order: the planner searches only these."""
    return tuple(name for name in WRAPPERS if is_available(name))


SHARDED_WRAPPERS = tuple(name for name, cls in WRAPPERS.items() if cls.shards_params)
"""Wrappers after which no rank holds a role's full parameters."""
FROZEN_WRAPPERS = tuple(name for name, cls in WRAPPERS.items() if cls.wraps_frozen)
"""Wrappers that can shard a frozen role over its forward group."""

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
