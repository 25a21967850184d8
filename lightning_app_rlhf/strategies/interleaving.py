"""``InterleavingStrategy`` (``rlhf_interleaving``): reference and reward on disjoint groups of ranks."""

from __future__ import annotations

from typing import Any

from typing_extensions import override

from lightning_app_rlhf.core.role_table import REFERENCE, ROLE_NAMES
from lightning_app_rlhf.parallel.placement_presets import placement_preset
from lightning_app_rlhf.parallel.plan import PlacementPlan
from lightning_app_rlhf.strategies.option_checks import check_interleaving_options, check_wrapper_option
from lightning_app_rlhf.strategies.placement_strategy import PlacementStrategy


class InterleavingStrategy(PlacementStrategy):
    """The trainable roles on every rank; the reference on the first ``reference_ratio`` of the ranks and the reward
    on the next ``reward_ratio`` (APP's Model Placement Ratio). The two forwards run at the same time.

    Args:
        reference_ratio: Fraction of ranks holding the reference (a multiple of 1 / world size).
        reward_ratio: Fraction of ranks holding the reward model.
        wrapper: Data-parallel wrapper of the trainable roles.
        **kwargs: See :class:`PlacementStrategy`.
    """

    strategy_name = "rlhf_interleaving"

    def __init__(self, reference_ratio: float = 0.5, reward_ratio: float = 0.5, wrapper: str = "ddp", **kwargs: Any):
        super().__init__(**kwargs)
        self.reference_ratio = reference_ratio
        self.reward_ratio = reward_ratio
        check_wrapper_option(self.strategy_name, wrapper)
        self.wrapper = wrapper

    @override
    def build_plan(self, world_size: int, roles: tuple[str, ...] = ROLE_NAMES) -> PlacementPlan:
        reference_ratio = self.reference_ratio if REFERENCE.name in roles else None
        check_interleaving_options(world_size, reference_ratio, self.reward_ratio)
        return placement_preset("interleaving").build_plan(world_size, self.reference_ratio, self.reward_ratio,
                                                           self.wrapper, roles=roles)
