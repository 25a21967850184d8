"""Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training"): GRPO without its two biases."""

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
class DrGRPO(Algorithm):
    """``A_i = r_i - mean(r_group)``: no division by the group's std (which up-weights too easy and too hard
    prompts), and token losses summed and divided by a constant, sequences x ``generation.max_new_tokens``
    (``seq_mean_token_sum_norm``), not by each response's length (which favours long wrong answers)."""

    name = "dr_grpo"
    min_group_size = 2
    default_loss_agg_mode = "seq_mean_token_sum_norm"

    def advantages(self, rollout: ScoredRollout) -> tuple[torch.Tensor, torch.Tensor | None]:
        rewards = sequence_rewards(rollout)
        mean, _, _ = ppo.group_mean_std(rewards, rollout.valid, rollout.group_size)
        return per_token(rewards - mean, rollout.response_mask), None
