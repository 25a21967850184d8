"""Placement strategies for Lightning's Trainer, registered as ``rlhf_flattening``, ``rlhf_interleaving``,
``rlhf_separation`` (and ``PlacementStrategy(plan=...)`` for a custom plan)."""

import functools

from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_STRATEGY_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry

from lightning_app_rlhf.parallel.plan import flattening_plan, interleaving_plan, separation_plan
from lightning_app_rlhf.strategies.fabric_placement_strategy import FabricPlacementStrategy
from lightning_app_rlhf.strategies.flattening import FlatteningStrategy
from lightning_app_rlhf.strategies.interleaving import InterleavingStrategy
from lightning_app_rlhf.strategies.placement_strategy import PlacementStrategy
from lightning_app_rlhf.strategies.separation import SeparationStrategy

_DESCRIPTIONS = {
    FlatteningStrategy: "RLHF: every model call on every rank (data parallel)",
    InterleavingStrategy: "RLHF: reference and reward on disjoint groups of ranks",
    SeparationStrategy: "RLHF: generation and training on separate ranks, weights reallocated after each update",
}
_FABRIC_PLANS = {
    FlatteningStrategy: flattening_plan,
    InterleavingStrategy: interleaving_plan,
    SeparationStrategy: separation_plan,
}
for _cls, _description in _DESCRIPTIONS.items():
    if _cls.strategy_name not in StrategyRegistry:
        StrategyRegistry.register(_cls.strategy_name, _cls, description=_description)
    if _cls.strategy_name not in FABRIC_STRATEGY_REGISTRY:  # Fabric: the same names, default arguments
        FABRIC_STRATEGY_REGISTRY.register(_cls.strategy_name, FabricPlacementStrategy, description=_description,
                                          plan=functools.partial(_FABRIC_PLANS[_cls]))

__all__ = ["FabricPlacementStrategy", "FlatteningStrategy", "InterleavingStrategy", "PlacementStrategy", "SeparationStrategy"]
