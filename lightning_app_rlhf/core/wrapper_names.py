"""The parallel wrappers by name, and what a plan must know of each, without importing one. Plain Python, no torch.

One table: :class:`~lightning_app_rlhf.parallel.plan.PlacementPlan` and :class:`~lightning_app_rlhf.parallel.placement.Placement`
read it, and every wrapper class of :mod:`lightning_app_rlhf.parallel.wrappers` takes its traits from its row (see
:attr:`~lightning_app_rlhf.parallel.wrappers.base.RoleWrapper.name`), so the plan, the planner and the wrappers agree.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class WrapperTraits:
    """What a plan, a placement and the planner's search space need to know of a wrapper."""

    name: str
    """The plan's name for the wrapper (``PlacementPlan.wrappers`` values)."""
    shards_params: bool = False
    """No rank holds the full parameters: a forward gathers them, collectively over the group."""
    wraps_frozen: bool = False
    """Can shard a frozen role over its forward group."""
    package: str | None = None
    """The package it needs beyond torch; absent, the planner does not search it and a plan asking for it fails."""
    extra: str | None = None
    """This project's pip extra that installs :attr:`package`."""


WRAPPER_TRAITS: dict[str, WrapperTraits] = {traits.name: traits for traits in (
    WrapperTraits("ddp"),
    WrapperTraits("fsdp2", shards_params=True, wraps_frozen=True),
    WrapperTraits("zero1", package="deepspeed", extra="deepspeed"),
    WrapperTraits("zero2", package="deepspeed", extra="deepspeed"),
    WrapperTraits("zero3", shards_params=True, wraps_frozen=True, package="deepspeed", extra="deepspeed"),
)}
"""Name -> traits, in the order the planner tries the wrappers."""
WRAPPER_NAMES: tuple[str, ...] = tuple(WRAPPER_TRAITS)
SHARDED_WRAPPERS: tuple[str, ...] = tuple(name for name, traits in WRAPPER_TRAITS.items() if traits.shards_params)
"""Wrappers after which no rank holds a role's full parameters."""
FROZEN_WRAPPERS: tuple[str, ...] = tuple(name for name, traits in WRAPPER_TRAITS.items() if traits.wraps_frozen)
"""Wrappers that can shard a frozen role over its forward group."""


def is_available(name: str) -> bool:
    """Whether this machine can run the wrapper (its package is installed)."""
    package = WRAPPER_TRAITS[name].package
    return package is None or importlib.util.find_spec(package) is not None


def check_wrapper(name: str, role: str | None = None, available: Callable[[str], bool] = is_available) -> None:
    """Raise a ``ValueError`` naming the choices for an unknown wrapper, or the install command for a wrapper whose
    package is missing.

    Args:
        name: The wrapper's name.
        role: The role that asks for it, for the message.
        available: Tells whether a wrapper's package is installed (default :func:`is_available`; the registry's
            :func:`~lightning_app_rlhf.parallel.wrappers.wrapper_class` passes the one it exports, which tests replace).
    """
    if name not in WRAPPER_TRAITS:
        whose = f"Role {role!r} has wrapper {name!r}" if role else f"Unknown wrapper {name!r}"
        raise ValueError(f"{whose}; choose one of {list(WRAPPER_NAMES)}.")
    if not available(name):
        traits = WRAPPER_TRAITS[name]
        whose = f"Role {role!r} asks for" if role else "Wrapper"
        raise ValueError(f"{whose} {name!r}, which needs {traits.package}, and {traits.package} is not installed. "
                         f"Install it with `pip install 'lightning-app-rlhf[{traits.extra}]'`, or use "
                         f"{[n for n, t in WRAPPER_TRAITS.items() if t.package is None]}.")
