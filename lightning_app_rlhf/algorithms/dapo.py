"""DAPO (Yu et al. 2025, arXiv 2503.14476): GRPO's group advantages with the clip decoupled and raised, token-level
loss aggregation, and a soft penalty for overlong responses."""

from __future__ import annotations

from lightning_app_rlhf.algorithms.base import register_algorithm
from lightning_app_rlhf.algorithms.grpo import GRPO


@register_algorithm
class DAPO(GRPO):
    """``A_i = (r_i - mean(r_group)) / (std(r_group) + eps)``; PPO's clipped surrogate with the ratio clipped to
    ``[1 - 0.2, 1 + 0.28]`` ("clip-higher": low-probability tokens may grow further before the clip stops them);
    every token of the minibatch weighted alike (``token_mean``: long responses are not down-weighted); and the
    score of a response longer than ``max_new_tokens - overlong_buffer`` reduced linearly, by up to
    ``overlong_penalty_factor`` at ``max_new_tokens`` (the buffer defaults to a fifth of ``max_new_tokens``, the
    paper's 4096 of 20480). ``ppo.overlong_filter`` leaves truncated responses out of the loss instead. Dynamic
    sampling (``ppo.dynamic_sampling``): groups whose scores are all equal are dropped, and more prompts generated
    until the batch is full. No KL by default, as the paper (``ppo.kl_coef`` and ``ppo.kl_loss_coef`` 0)."""

    name = "dapo"
    default_kl = (0.0, 0.0)
    default_loss_agg_mode = "token_mean"
    default_clip_ratio = (0.2, 0.28)
    default_overlong_buffer_fraction = 0.2
    default_dynamic_sampling = True
