"""RLOO (Ahmadian et al. 2024, "Back to Basics"; Kool et al. 2019): REINFORCE with a leave-one-out baseline."""

from __future__ import annotations

from lightning_app_rlhf.algorithms.base import Algorithm, register_algorithm


@register_algorithm
class RLOO(Algorithm):
    """``A_i = r_i - mean_{j != i} r_j`` over the other responses of the same prompt, with the KL in the reward
    summed over the response (the whole response is one action), on every token of response i."""

    name = "rloo"
    advantage_estimator = "rloo"
    min_group_size = 2
