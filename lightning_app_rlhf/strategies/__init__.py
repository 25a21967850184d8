"""Placement strategies for Lightning's Trainer and Fabric, registered as ``rlhf_flattening``, ``rlhf_interleaving``,
``rlhf_separation`` (and ``PlacementStrategy(plan=...)`` for a custom plan, or :func:`register_preset` to name
one: a strategy name, and a placement preset the planner prices)."""

from lightning_app_rlhf.strategies.fabric_placement_strategy import FabricPlacementStrategy
from lightning_app_rlhf.strategies.flattening import FlatteningStrategy
from lightning_app_rlhf.strategies.interleaving import InterleavingStrategy
from lightning_app_rlhf.strategies.placement_strategy import PlacementStrategy
from lightning_app_rlhf.strategies.presets import register_preset
from lightning_app_rlhf.strategies.separation import SeparationStrategy

__all__ = [
    "FabricPlacementStrategy",
    "FlatteningStrategy",
    "InterleavingStrategy",
    "PlacementStrategy",
    "SeparationStrategy",
    "register_preset",
]
