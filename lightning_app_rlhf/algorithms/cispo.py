"""CISPO (MiniMax 2025, arXiv 2506.13585): clip the importance weight, not the update."""

from __future__ import annotations

from lightning_app_rlhf.algorithms.base import register_algorithm
from lightning_app_rlhf.algorithms.grpo import GRPO


@register_algorithm
class CISPO(GRPO):
    """GRPO's group advantages; the loss ``-sg(clip(r_t, 1 - eps_low, 1 + eps_high)) * A * log p_t``: the
    importance weight is clipped and detached, and every token keeps its policy gradient (PPO's clip zeroes the
    gradient of a token whose ratio left the range, which drops the rare "reflective" tokens the paper cares
    about). Token-level aggregation, as the paper's ``1 / sum_i |o_i|``. The paper sets no lower bound
    (``clip_ratio_low`` 1.0: the weight floor is 0) and tunes the upper one; 0.28 is veRL's default."""

    name = "cispo"
    policy_loss_mode = "cispo"
    default_loss_agg_mode = "token_mean"
    default_clip_ratio = (1.0, 0.28)
