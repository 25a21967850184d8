"""Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training"): GRPO without its two biases."""

from __future__ import annotations

from lightning_app_rlhf.algorithms.base import Algorithm, register_algorithm


@register_algorithm
class DrGRPO(Algorithm):
    """``A_i = r_i - mean(r_group)``: no division by the group's std (which up-weights too easy and too hard
    prompts), and token losses summed and divided by a constant, sequences x ``generation.max_new_tokens``
    (``seq_mean_token_sum_norm``), not by each response's length (which favours long wrong answers)."""

    name = "dr_grpo"
    advantage_estimator = "dr_grpo"
    min_group_size = 2
    default_loss_agg_mode = "seq_mean_token_sum_norm"
