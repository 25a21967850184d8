"""Named placements for the Trainer and Fabric: each placement preset as a strategy name.

A placement preset (:mod:`lightning_app_rlhf.parallel.placement_presets`, no Lightning) is a plan builder the
planner prices. ``register_preset("rlhf_mine", my_plan, "...")`` registers the preset ``mine`` there (so
``plan_placement`` and ``PlacementTuner`` consider it) and makes ``Trainer(strategy="rlhf_mine")`` a
:class:`~lightning_app_rlhf.strategies.PlacementStrategy` and ``Fabric(strategy="rlhf_mine")`` a
:class:`~lightning_app_rlhf.strategies.FabricPlacementStrategy`, both building their plan with ``my_plan``. The
built-in presets get their typed strategy classes, whose arguments the command line sets
(``--trainer.strategy.reference_ratio``).
"""

from __future__ import annotations

from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_STRATEGY_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry

from lightning_app_rlhf.parallel.placement_presets import (
    CandidatePlans,
    PlanBuilder,
    placement_preset,
    register_placement_preset,
)
from lightning_app_rlhf.strategies.fabric_placement_strategy import FabricPlacementStrategy
from lightning_app_rlhf.strategies.flattening import FlatteningStrategy
from lightning_app_rlhf.strategies.interleaving import InterleavingStrategy
from lightning_app_rlhf.strategies.placement_strategy import PlacementStrategy
from lightning_app_rlhf.strategies.separation import SeparationStrategy

STRATEGY_PREFIX = "rlhf_"
"""What a placement preset's strategy name adds to its name (the names share Lightning's registry with its own)."""


def register_preset(
    name: str,
    build_plan: PlanBuilder,
    description: str,
    trainer_strategy: type[PlacementStrategy] | None = None,
    *,
    candidates: CandidatePlans | None = None,
    min_world_size: int = 1,
) -> None:
    """Register the placement preset ``name`` without its ``rlhf_`` prefix for the planner, and ``name`` for the
    Trainer and for Fabric. A strategy name already taken is left as it is (re-importing a module that registers
    must not fail).

    Args:
        name: The strategy name, e.g. ``rlhf_mine`` (the planner reports it as ``mine``).
        build_plan: Builds the plan from the world size and the algorithm's roles.
        description: One line, shown by Lightning's registry.
        trainer_strategy: A :class:`PlacementStrategy` subclass whose own arguments (e.g. ``reference_ratio``) the
            Trainer's name then builds with their defaults; None: ``PlacementStrategy(plan=build_plan)``.
        candidates: The variants the planner prices, ``(world_size, wrappers, roles) -> plans``; None: the plan of
            ``build_plan`` per searched wrapper
            (:attr:`~lightning_app_rlhf.parallel.placement_presets.PlacementPreset.candidates`).
        min_world_size: Fewest ranks the preset places; the planner leaves it out on fewer.
    """
    if not name.startswith(STRATEGY_PREFIX):
        raise ValueError(f"Preset names start with 'rlhf_' (they share Lightning's registry with its own "
                         f"strategies); got {name!r}. Name it 'rlhf_{name}'.")
    register_placement_preset(name.removeprefix(STRATEGY_PREFIX), build_plan, description, candidates=candidates,
                              min_world_size=min_world_size)
    _register_strategy_name(name, build_plan, description, trainer_strategy)


def _register_strategy_name(
    name: str, build_plan: PlanBuilder, description: str, trainer_strategy: type[PlacementStrategy] | None
) -> None:
    """``name`` for the Trainer (``trainer_strategy``, else a :class:`PlacementStrategy` building with
    ``build_plan``) and for Fabric, unless taken."""
    if name not in StrategyRegistry:
        if trainer_strategy is None:
            StrategyRegistry.register(name, PlacementStrategy, description=description, plan=build_plan)
        else:
            StrategyRegistry.register(name, trainer_strategy, description=description)
    if name not in FABRIC_STRATEGY_REGISTRY:
        FABRIC_STRATEGY_REGISTRY.register(name, FabricPlacementStrategy, description=description, plan=build_plan)


for _strategy in (FlatteningStrategy, InterleavingStrategy, SeparationStrategy):
    _preset = placement_preset(_strategy.strategy_name.removeprefix(STRATEGY_PREFIX))
    _register_strategy_name(_strategy.strategy_name, _preset.build_plan, _preset.description, _strategy)
