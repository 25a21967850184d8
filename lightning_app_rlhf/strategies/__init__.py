"""Placement strategies for Lightning's Trainer, registered as ``rlhf_flattening``, ``rlhf_interleaving``,
``rlhf_separation`` (and ``rlhf_placement`` for a custom plan)."""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_app_rlhf.strategies.flattening import FlatteningStrategy
from lightning_app_rlhf.strategies.interleaving import InterleavingStrategy
from lightning_app_rlhf.strategies.placement_strategy import PlacementStrategy
from lightning_app_rlhf.strategies.separation import SeparationStrategy

_DESCRIPTIONS = {
    FlatteningStrategy: "RLHF: every model call on every rank (data parallel)",
    InterleavingStrategy: "RLHF: reference and reward on disjoint groups of ranks",
    SeparationStrategy: "RLHF: generation and training on separate ranks, weights reallocated after each update",
}
for _cls, _description in _DESCRIPTIONS.items():
    if _cls.strategy_name not in StrategyRegistry:
        StrategyRegistry.register(_cls.strategy_name, _cls, description=_description)

__all__ = ["FlatteningStrategy", "InterleavingStrategy", "PlacementStrategy", "SeparationStrategy"]
