"""``FlatteningStrategy`` (``rlhf_flattening``): every call on every rank, data parallel."""

from __future__ import annotations

from typing import Any

from typing_extensions import override

from lightning_app_rlhf.core.role_table import ROLE_NAMES
from lightning_app_rlhf.parallel.placement_presets import placement_preset
from lightning_app_rlhf.parallel.plan import PlacementPlan
from lightning_app_rlhf.strategies.option_checks import check_wrapper_option
from lightning_app_rlhf.strategies.placement_strategy import PlacementStrategy


class FlatteningStrategy(PlacementStrategy):
    """All four roles on every rank (DeepSpeed-Chat / TRL style); each call shards the global batch over all ranks.

    Args:
        wrapper: Data-parallel wrapper of the trainable roles.
        **kwargs: See :class:`PlacementStrategy` (timeout, start_method, ...).
    """

    strategy_name = "rlhf_flattening"

    def __init__(self, wrapper: str = "ddp", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        check_wrapper_option(self.strategy_name, wrapper)
        self.wrapper = wrapper

    @override
    def build_plan(self, world_size: int, roles: tuple[str, ...] = ROLE_NAMES) -> PlacementPlan:
        return placement_preset("flattening").build_plan(world_size, self.wrapper, roles=roles)
