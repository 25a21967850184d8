"""GSPO (Zheng et al. 2025, arXiv 2507.18071): the importance ratio, and its clip, taken per sequence."""

from __future__ import annotations

from lightning_app_rlhf.algorithms.base import register_algorithm
from lightning_app_rlhf.algorithms.grpo import GRPO


@register_algorithm
class GSPO(GRPO):
    """GRPO's group advantages; the ratio of a response is the geometric mean of its token ratios,
    ``s_i = exp(mean_t(log p_t - log p_old_t))``, and the loss ``-min(s_i A_i, clip(s_i, 1 - 3e-4, 1 + 4e-4) A_i)``
    is one number per response, averaged over the responses (``seq_mean_token_mean``). A whole response is clipped
    or not, so one off-policy token cannot dominate the update. The paper's clip range is tiny because ``s_i`` is a
    per-token geometric mean: its typical deviation from 1 is of the order of one token's log-ratio."""

    name = "gspo"
    policy_loss_mode = "gspo"
    default_clip_ratio = (3e-4, 4e-4)
