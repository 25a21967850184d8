"""REINFORCE++ (Hu et al. 2025): token-level KL in the reward, discounted returns, advantages whitened over the
whole batch: no critic and no per-prompt baseline."""

from __future__ import annotations

from lightning_app_rlhf.algorithms.base import Algorithm, register_algorithm


@register_algorithm
class ReinforcePlusPlus(Algorithm):
    """``A_t = whiten(G_t)`` over the batch's tokens, with ``G_t`` the discounted return of the KL-shaped
    per-token rewards (``ppo.gamma``)."""

    name = "reinforce_pp"
    advantage_estimator = "reinforce_pp"
