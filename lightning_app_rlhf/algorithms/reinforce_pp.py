"""REINFORCE++ (Hu et al. 2025): token-level KL in the reward, discounted returns, advantages whitened over the
whole batch: no critic and no per-prompt baseline."""

from __future__ import annotations

import torch

from lightning_app_rlhf import ppo
from lightning_app_rlhf.algorithms.base import Algorithm, ScoredRollout, register_algorithm


def whitened_returns(scores: torch.Tensor, rollout: ScoredRollout, gamma: float) -> torch.Tensor:
    """``r_t = score * [t = last] - beta * KL_t``; ``G_t = sum_{k >= t} gamma^(k-t) r_k``; whitened over every
    valid token of the batch."""
    mask = rollout.response_mask
    rewards = ppo.token_rewards(scores, rollout.kl, rollout.kl_coef, mask)
    returns = ppo.discounted_returns(rewards, mask, gamma)
    return ppo.masked_whiten(returns, mask) if mask.sum() > 1 else returns


@register_algorithm
class ReinforcePlusPlus(Algorithm):
    """``A_t = whiten(G_t)`` over the batch's tokens, with ``G_t`` the discounted return of the KL-shaped
    per-token rewards (``ppo.gamma``)."""

    name = "reinforce_pp"

    def advantages(self, rollout: ScoredRollout) -> tuple[torch.Tensor, torch.Tensor | None]:
        return whitened_returns(rollout.scores, rollout, self.config.gamma), None
