"""GRPO (Shao et al. 2024, DeepSeekMath): outcome rewards normalised by their prompt group's mean and std."""

from __future__ import annotations

from lightning_app_rlhf.algorithms.base import Algorithm, register_algorithm


@register_algorithm
class GRPO(Algorithm):
    """``A_i = (r_i - mean(r_group)) / (std(r_group) + eps)`` on every token of response i; each response's token
    losses averaged, then the responses (``seq_mean_token_mean``). The paper's KL is a loss term: set
    ``ppo.kl_loss_coef`` (beta, 0.04 in the paper) and ``ppo.kl_coef: 0``. ``ppo.scale_rewards`` picks the divisor:
    the group's std (``group``, the paper), the batch's (``batch``) or none (``none``)."""

    name = "grpo"
    advantage_estimator = "grpo"
    min_group_size = 2
    default_loss_agg_mode = "seq_mean_token_mean"
