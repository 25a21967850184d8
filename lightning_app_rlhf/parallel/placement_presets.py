"""Placement presets by name: a plan builder and the variants the planner prices. No Lightning.

A preset is one plan builder (``(world_size, ..., wrapper=..., roles=...) -> PlacementPlan``) plus one call of
:func:`register_placement_preset`. The planner (:func:`~lightning_app_rlhf.planner.search.plan_placement`) evaluates
every registered preset, each with its best wrapper and batch sizes, so a new preset needs no planner edit; the
strategies build their plans through the preset of their name (``rlhf_flattening`` -> ``flattening``), and
:func:`~lightning_app_rlhf.strategies.register_preset` registers one here and as a Trainer and Fabric strategy name.

The three APP placements register here, on import, in the order the planner reports them: ``flattening``,
``interleaving``, ``separation``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from lightning_app_rlhf.core.registry import Registry
from lightning_app_rlhf.parallel.plan import (
    PlacementPlan,
    flattening_plan,
    interleaving_plan,
    separation_plan,
)

PlanBuilder = Callable[..., PlacementPlan]
"""``(world_size, ..., roles=...) -> PlacementPlan``: the plan for a world size and the algorithm's roles (or a function
of the world size alone, for a plan that names no critic-free variant)."""
CandidatePlans = Callable[[int, Sequence[str], tuple[str, ...]], list[PlacementPlan]]
"""``(world_size, wrappers, roles) -> plans``: the variants of a preset the planner prices for a world size, the
wrappers it searches and the workload's roles; empty where the preset does not apply."""


@dataclass(frozen=True)
class PlacementPreset:
    """A named placement: how to build its plan, and which of its variants the planner prices."""

    name: str
    """The preset's name, e.g. ``flattening``: the key of the planner's ``presets``, and without ``rlhf_`` the
    strategy name (``rlhf_flattening``)."""
    build_plan: PlanBuilder
    """Builds the plan: ``(world_size, ..., roles=...)``, with the preset's own options (a wrapper, ratios) as
    keywords with defaults."""
    description: str = ""
    """One line, for summaries and Lightning's strategy registry."""
    candidates: CandidatePlans | None = None
    """The variants the planner prices (``(world_size, wrappers, roles) -> plans``). None: :attr:`build_plan` once
    per searched wrapper when it takes a ``wrapper`` keyword, else once, with its other options at their
    defaults."""
    min_world_size: int = 1
    """Fewest ranks the preset places (2 for a placement that needs disjoint groups): below it the planner leaves
    the preset out."""

    def candidate_plans(self, world_size: int, wrappers: Sequence[str], roles: tuple[str, ...]) -> list[PlacementPlan]:
        """The plans the planner prices for this preset.

        Args:
            world_size: Ranks of the cluster.
            wrappers: The trainable roles' wrappers the planner searches, in its order.
            roles: The workload's roles (a critic-free algorithm has no critic calls).

        Returns:
            The variants (the planner adds the frozen roles' wrapper options to each); empty below
            :attr:`min_world_size`.
        """
        if world_size < self.min_world_size:
            return []
        if self.candidates is not None:
            return self.candidates(world_size, wrappers, roles)
        parameters = inspect.signature(self.build_plan).parameters
        given_roles = {"roles": roles} if "roles" in parameters else {}
        if "wrapper" not in parameters:
            return [self.build_plan(world_size, **given_roles)]
        return [self.build_plan(world_size, wrapper=wrapper, **given_roles) for wrapper in wrappers]


PLACEMENT_PRESETS: Registry[PlacementPreset] = Registry(
    "A placement preset",
    "Use one of them, or register yours first: `register_placement_preset(name, build_plan, description)` from "
    "lightning_app_rlhf.parallel.placement_presets (or `register_preset('rlhf_<name>', ...)` from "
    "lightning_app_rlhf.strategies, which also names it for the Trainer and Fabric).",
)
"""Name -> :class:`PlacementPreset`, in registration order: the order the planner evaluates and reports them."""


def register_placement_preset(
    name: str,
    build_plan: PlanBuilder,
    description: str = "",
    *,
    candidates: CandidatePlans | None = None,
    min_world_size: int = 1,
) -> PlacementPreset:
    """Register a placement preset, replacing any of that name: from then on the planner prices it beside the
    built-in ones.

    Args:
        name: The preset's name, e.g. ``reference_apart`` (without the strategies' ``rlhf_`` prefix).
        build_plan: Builds its plan from the world size (and ``roles=``, the algorithm's roles, when it takes them:
            build the calls from :func:`~lightning_app_rlhf.core.role_table.calls_of` so a critic-free algorithm
            gets no critic calls).
        description: One line, for summaries and Lightning's strategy registry.
        candidates: The variants the planner prices, ``(world_size, wrappers, roles) -> plans``; None: the plan of
            ``build_plan`` per searched wrapper (see :attr:`PlacementPreset.candidates`).
        min_world_size: Fewest ranks the preset places; the planner leaves it out on fewer.

    Returns:
        The registered preset.
    """
    if name.startswith("rlhf_"):
        raise ValueError(f"A placement preset's name has no 'rlhf_' prefix (the strategies add it), got {name!r}: "
                         f"register it as {name.removeprefix('rlhf_')!r}.")
    if not callable(build_plan):
        raise TypeError(f"build_plan of placement preset {name!r} must be a function (world_size, ..., roles=...) -> "
                        f"PlacementPlan, got {build_plan!r}.")
    preset = PlacementPreset(name, build_plan, description, candidates, min_world_size)
    return PLACEMENT_PRESETS.register(name, preset)


def placement_preset(name: str) -> PlacementPreset:
    """The preset registered as ``name``; an unknown name's error lists the registered ones."""
    return PLACEMENT_PRESETS.get(name)


def _interleaving_candidates(world_size: int, wrappers: Sequence[str], roles: tuple[str, ...]) -> list[PlacementPlan]:
    """Reference and reward on half of the ranks each (on an odd count, the smaller half holds the reference)."""
    n = world_size
    reference_ratio, reward_ratio = (0.5, 0.5) if n % 2 == 0 else ((n // 2) / n, (n - n // 2) / n)
    return [interleaving_plan(n, reference_ratio, reward_ratio, wrapper, roles=roles) for wrapper in wrappers]


def _separation_candidates(world_size: int, wrappers: Sequence[str], roles: tuple[str, ...]) -> list[PlacementPlan]:
    """Generation on the first half of the ranks (the smaller half on an odd count), training on the rest;
    on-policy (the planner adds the staleness variants itself)."""
    ratio = (world_size // 2) / world_size
    return [separation_plan(world_size, generation_ratio=ratio, wrapper=wrapper, roles=roles) for wrapper in wrappers]


register_placement_preset("flattening", flattening_plan, "RLHF: every model call on every rank (data parallel)")
register_placement_preset("interleaving", interleaving_plan, "RLHF: reference and reward on disjoint groups of ranks",
                          candidates=_interleaving_candidates, min_world_size=2)
register_placement_preset("separation", separation_plan,
                          "RLHF: generation and training on separate ranks, weights reallocated after each update",
                          candidates=_separation_candidates, min_world_size=2)
