"""REINFORCE++-baseline (Hu et al. 2025): REINFORCE++ with each prompt group's mean score subtracted first."""

from __future__ import annotations

from lightning_app_rlhf.algorithms.base import Algorithm, register_algorithm


@register_algorithm
class ReinforcePlusPlusBaseline(Algorithm):
    """``score_i - mean(score_group)`` replaces the score; then REINFORCE++: KL-shaped per-token rewards,
    discounted returns, whitened over the batch (the global std, not the group's, as the paper argues)."""

    name = "reinforce_pp_baseline"
    advantage_estimator = "reinforce_pp_baseline"
    min_group_size = 2
