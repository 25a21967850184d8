"""RLOO (Ahmadian et al. 2024, "Back to Basics"; Kool et al. 2019): REINFORCE with a leave-one-out baseline."""

from __future__ import annotations

import torch

from lightning_app_rlhf import ppo
from lightning_app_rlhf.algorithms.base import (
    Algorithm,
    ScoredRollout,
    per_token,
    register_algorithm,
    sequence_rewards,
)


@register_algorithm
class RLOO(Algorithm):
    """``A_i = r_i - mean_{j != i} r_j`` over the other responses of the same prompt, with the KL in the reward
    summed over the response (the whole response is one action), on every token of response i."""

    name = "rloo"
    min_group_size = 2

    def advantages(self, rollout: ScoredRollout) -> tuple[torch.Tensor, torch.Tensor | None]:
        rewards = sequence_rewards(rollout)
        mean, _, count = ppo.group_mean_std(rewards, rollout.valid, rollout.group_size)
        others = (count - 1).clamp(min=1.0)
        baseline = (mean * count - rewards) / others
        # A response with no valid sibling has no baseline: it teaches nothing.
        advantages = torch.where(count > 1, rewards - baseline, torch.zeros_like(rewards))
        return per_token(advantages, rollout.response_mask), None
