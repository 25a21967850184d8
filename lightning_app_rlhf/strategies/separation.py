"""``SeparationStrategy`` (``rlhf_separation``): generation and training on separate ranks."""

from __future__ import annotations

from typing import Any

from typing_extensions import override

from lightning_app_rlhf.core.role_table import ROLE_NAMES
from lightning_app_rlhf.parallel.plan import PlacementPlan, separation_plan
from lightning_app_rlhf.strategies.placement_strategy import PlacementStrategy


class SeparationStrategy(PlacementStrategy):
    """A generation group runs ``actor.generate`` and the forward calls on shadow copies; a training group runs
    the train calls. After every update the trained weights are reallocated to the shadows (on-policy).

    Args:
        generation_ranks: Explicit generation group. Default: the first ``generation_ratio`` of the ranks.
        training_ranks: Explicit training group. Default: the other ranks.
        generation_ratio: Fraction of ranks that generate.
        wrapper: Data-parallel wrapper of the trainable roles on the training group.
        max_staleness: Bounded staleness on a fixed schedule: the training group updates on the rollout of
            ``max_staleness`` iterations earlier while the generation group samples the next, so every update (after
            the first ``max_staleness`` iterations, which train nothing) uses data that many weight versions old
            (logged as ``rollout/staleness_mean`` and ``rollout/staleness_max``). 0 (default): on-policy.
        overlap: ``True`` is ``max_staleness=1`` (one-step off-policy).
        **kwargs: See :class:`PlacementStrategy`.
    """

    strategy_name = "rlhf_separation"

    def __init__(
        self,
        generation_ranks: list[int] | None = None,
        training_ranks: list[int] | None = None,
        generation_ratio: float = 0.5,
        wrapper: str = "ddp",
        max_staleness: int | None = None,
        overlap: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.generation_ranks = generation_ranks
        self.training_ranks = training_ranks
        self.generation_ratio = generation_ratio
        self.wrapper = wrapper
        if overlap and max_staleness == 0:
            raise ValueError("overlap=True trains one step off-policy, max_staleness=0 on-policy: pass one of them "
                             "(overlap=True is max_staleness=1).")
        self.max_staleness = max_staleness if max_staleness is not None else int(overlap)

    @override
    def build_plan(self, world_size: int, roles: tuple[str, ...] = ROLE_NAMES) -> PlacementPlan:
        return separation_plan(world_size, self.generation_ranks, self.training_ranks, self.generation_ratio,
                               self.wrapper, self.max_staleness, roles=roles)
