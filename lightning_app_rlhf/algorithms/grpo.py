"""GRPO (Shao et al. 2024, DeepSeekMath): outcome rewards normalised by their prompt group's mean and std."""

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

GROUP_STD_EPS = 1e-6
"""Added to the group's standard deviation; a group of equal rewards gets advantage 0."""


@register_algorithm
class GRPO(Algorithm):
    """``A_i = (r_i - mean(r_group)) / (std(r_group) + eps)`` on every token of response i; each response's token
    losses averaged, then the responses (``seq_mean_token_mean``). The paper's KL is a loss term: set
    ``ppo.kl_loss_coef`` (beta, 0.04 in the paper) and ``ppo.kl_coef: 0``. ``ppo.scale_rewards`` picks the divisor:
    the group's std (``group``, the paper), the batch's (``batch``) or none (``none``)."""

    name = "grpo"
    min_group_size = 2
    default_loss_agg_mode = "seq_mean_token_mean"

    def advantages(self, rollout: ScoredRollout) -> tuple[torch.Tensor, torch.Tensor | None]:
        rewards = sequence_rewards(rollout)
        mean, std, _ = ppo.group_mean_std(rewards, rollout.valid, rollout.group_size)
        centred = rewards - mean
        if self.config.scale_rewards == "none":
            return per_token(centred, rollout.response_mask), None
        if self.config.scale_rewards == "batch":  # one std over every valid reward of the (gathered) rollout batch
            valid = rewards[rollout.valid].to(torch.float64)
            std = valid.std() if valid.numel() > 1 else torch.zeros((), dtype=torch.float64)
        return per_token(centred / (std + GROUP_STD_EPS), rollout.response_mask), None
