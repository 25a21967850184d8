"""GRPO (Shao et al. 2024, DeepSeekMath): outcome rewards normalised by their prompt group's mean and std."""

from __future__ import annotations

from typing import Any, ClassVar

from lightning_app_rlhf.algorithms.base import Algorithm, register_algorithm


@register_algorithm
class GRPO(Algorithm):
    """``A_i = (r_i - mean(r_group)) / (std(r_group) + eps)`` on every token of response i; each response's token
    losses averaged, then the responses (``seq_mean_token_mean``). The KL is the paper's by default: a k3 term in the
    loss with beta 0.04 (``ppo.kl_loss_coef``), none in the reward (``ppo.kl_coef`` 0). A KL in the reward is not
    the default because the group's std divides it too: in a group of equal scores the responses' small KL
    differences become advantages of order 1. ``ppo.scale_rewards`` picks the divisor: the group's std (``group``,
    the paper), the batch's (``batch``) or none (``none``)."""

    name = "grpo"
    advantage_estimator = "grpo"
    min_group_size = 2
    own_settings: ClassVar[dict[str, Any]] = {"scale_rewards": "group"}
    default_kl = (0.0, 0.04)
    default_loss_agg_mode = "seq_mean_token_mean"
