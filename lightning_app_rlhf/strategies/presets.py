"""Named placements: a plan builder registered as a strategy name for the Trainer and for Fabric.

``register_preset("rlhf_mine", my_plan, "...")`` makes ``Trainer(strategy="rlhf_mine")`` a
:class:`~lightning_app_rlhf.strategies.PlacementStrategy` and ``Fabric(strategy="rlhf_mine")`` a
:class:`~lightning_app_rlhf.strategies.FabricPlacementStrategy`, both building their plan with ``my_plan``.
"""

from __future__ import annotations

from collections.abc import Callable

from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_STRATEGY_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry

from lightning_app_rlhf.parallel.plan import (
    PlacementPlan,
    flattening_plan,
    interleaving_plan,
    separation_plan,
)
from lightning_app_rlhf.strategies.fabric_placement_strategy import FabricPlacementStrategy
from lightning_app_rlhf.strategies.flattening import FlatteningStrategy
from lightning_app_rlhf.strategies.interleaving import InterleavingStrategy
from lightning_app_rlhf.strategies.placement_strategy import PlacementStrategy
from lightning_app_rlhf.strategies.separation import SeparationStrategy

PlanBuilder = Callable[..., PlacementPlan]
"""``(world_size, roles=...) -> PlacementPlan``: the plan for a world size and the algorithm's roles (or a function
of the world size alone, for a plan that names no critic-free variant)."""


def register_preset(
    name: str, build_plan: PlanBuilder, description: str, trainer_strategy: type[PlacementStrategy] | None = None
) -> None:
    """Register ``name`` for the Trainer and for Fabric. A name already taken is left as it is (re-importing a
    module that registers must not fail).

    Args:
        name: The strategy name, e.g. ``rlhf_mine``.
        build_plan: Builds the plan from the world size and the algorithm's roles.
        description: One line, shown by Lightning's registry.
        trainer_strategy: A :class:`PlacementStrategy` subclass whose own arguments (e.g. ``reference_ratio``) the
            Trainer's name then builds with their defaults; None: ``PlacementStrategy(plan=build_plan)``.
    """
    if not name.startswith("rlhf_"):
        raise ValueError(f"Preset names start with 'rlhf_' (they share Lightning's registry with its own "
                         f"strategies); got {name!r}. Name it 'rlhf_{name}'.")
    if name not in StrategyRegistry:
        if trainer_strategy is None:
            StrategyRegistry.register(name, PlacementStrategy, description=description, plan=build_plan)
        else:
            StrategyRegistry.register(name, trainer_strategy, description=description)
    if name not in FABRIC_STRATEGY_REGISTRY:
        FABRIC_STRATEGY_REGISTRY.register(name, FabricPlacementStrategy, description=description, plan=build_plan)


register_preset(FlatteningStrategy.strategy_name, flattening_plan,
                "RLHF: every model call on every rank (data parallel)", FlatteningStrategy)
register_preset(InterleavingStrategy.strategy_name, interleaving_plan,
                "RLHF: reference and reward on disjoint groups of ranks", InterleavingStrategy)
register_preset(SeparationStrategy.strategy_name, separation_plan,
                "RLHF: generation and training on separate ranks, weights reallocated after each update",
                SeparationStrategy)
