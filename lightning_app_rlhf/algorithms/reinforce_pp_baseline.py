"""REINFORCE++-baseline (Hu et al. 2025): REINFORCE++ with each prompt group's mean score subtracted first."""

from __future__ import annotations

import torch

from lightning_app_rlhf import ppo
from lightning_app_rlhf.algorithms.base import Algorithm, ScoredRollout, register_algorithm
from lightning_app_rlhf.algorithms.reinforce_pp import whitened_returns


@register_algorithm
class ReinforcePlusPlusBaseline(Algorithm):
    """``score_i - mean(score_group)`` replaces the score; then REINFORCE++: KL-shaped per-token rewards,
    discounted returns, whitened over the batch (the global std, not the group's, as the paper argues)."""

    name = "reinforce_pp_baseline"
    min_group_size = 2

    def advantages(self, rollout: ScoredRollout) -> tuple[torch.Tensor, torch.Tensor | None]:
        mean, _, _ = ppo.group_mean_std(rollout.scores, rollout.valid, rollout.group_size)
        # Centred in float64 (see group_mean_std: an equal group centres to exactly 0), then back to the scores' dtype.
        centred = torch.where(rollout.valid, rollout.scores - mean, torch.zeros_like(mean)).to(rollout.scores.dtype)
        return whitened_returns(centred, rollout, self.config.gamma), None
