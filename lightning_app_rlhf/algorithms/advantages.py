"""Advantage estimators, registered by name as plain tensor functions (veRL's ``core_algos`` style). Plain PyTorch.

An estimator turns the scored rollout of the whole gathered batch into per-token advantages [B, T] and, for an
algorithm with a critic, the critic's returns [B, T] (else None), both 0 outside the response mask. It runs on every
rank on the same data, so it must be deterministic. An :class:`~lightning_app_rlhf.algorithms.Algorithm` names one in
``advantage_estimator``; a new one is a function decorated with :func:`register_advantage_estimator`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from lightning_app_rlhf.algorithms import functional
from lightning_app_rlhf.algorithms.registry import Registry
from lightning_app_rlhf.core.config import PPOConfig

GROUP_STD_EPS = 1e-6
"""Added to GRPO's standard deviation; a group of equal rewards gets advantage 0."""


@dataclass
class ScoredRollout:
    """What every advantage estimator reads, for the whole (gathered) rollout batch of ``B = prompts x G`` samples;
    the ``G`` samples of a prompt are consecutive rows."""

    scores: torch.Tensor
    """[B] sequence scores after shaping (normalisation, clipping, EOS penalty); 0 for skipped samples."""
    kl: torch.Tensor
    """[B, T] per-token KL(policy || reference) in ``ppo.kl_estimator``, 0 outside the response."""
    kl_coef: float
    """The current coefficient of the KL in the reward (0: none)."""
    response_mask: torch.Tensor
    """[B, T] 1 on response tokens up to EOS; all 0 for skipped samples."""
    valid: torch.Tensor
    """[B] False for samples whose score was skipped (non-finite): they count in no statistic."""
    group_size: int
    """Samples per prompt (``generation.num_samples``)."""
    values: torch.Tensor | None = None
    """[B, T] critic values, for algorithms with a critic."""
    turn_rewards: torch.Tensor | None = None
    """[B, T] a multi-turn episode's per-turn environment rewards, on each turn's last sampled token (``scores``
    already holds their sum): a token-level estimator puts them there, the rest of the score on the last token."""


AdvantageEstimator = Callable[[ScoredRollout, PPOConfig], tuple[torch.Tensor, torch.Tensor | None]]
"""``(scored, config) -> (advantages, returns | None)``: per-token advantages [B, T] and the critic's returns [B, T]
(None without a critic), 0 outside the mask, from the whole gathered batch's shaped scores, KL, masks and (with a
critic) values, and the update's hyper-parameters (``gamma``, ``lam``, ``scale_rewards``...)."""

ADVANTAGE_ESTIMATORS: Registry[AdvantageEstimator] = Registry(
    "advantage estimator", "@register_advantage_estimator(name)", "Algorithm.advantage_estimator"
)
"""Name -> advantage estimator; filled by :func:`register_advantage_estimator`."""

register_advantage_estimator = ADVANTAGE_ESTIMATORS.decorator_for
"""``@register_advantage_estimator(name)``: make the decorated function available as
``Algorithm.advantage_estimator = name``; a name taken by another function is refused."""
get_advantage_estimator = ADVANTAGE_ESTIMATORS.lookup
"""``get_advantage_estimator(name)``: the estimator registered as ``name``; the error lists the registered names."""


# ---- shared pieces ----


def sequence_rewards(scored: ScoredRollout) -> torch.Tensor:
    """[B] score minus ``kl_coef`` times the response's summed KL: the one reward of a sequence-level estimator."""
    return scored.scores - scored.kl_coef * (scored.kl * scored.response_mask).sum(1)


def per_token(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B] sequence advantages -> [B, T], the same on every response token (outcome supervision)."""
    return advantages.unsqueeze(1).to(torch.float32) * mask.to(torch.float32)


def whitened_returns(scores: torch.Tensor, scored: ScoredRollout, gamma: float) -> torch.Tensor:
    """``r_t = score * [t = last] - beta * KL_t``; ``G_t = sum_{k >= t} gamma^(k-t) r_k``; whitened over every
    valid token of the batch."""
    mask = scored.response_mask
    rewards = functional.token_rewards(scores, scored.kl, scored.kl_coef, mask, scored.turn_rewards)
    returns = functional.discounted_returns(rewards, mask, gamma)
    return functional.masked_whiten(returns, mask) if mask.sum() > 1 else returns


def group_centred_rewards(scored: ScoredRollout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[B] sequence rewards, the same minus their group's mean in float64 (see
    :func:`~lightning_app_rlhf.algorithms.functional.group_mean_std`: an equal group centres to exactly 0), and their
    group's std."""
    rewards = sequence_rewards(scored)
    mean, std, _ = functional.group_mean_std(rewards, scored.valid, scored.group_size)
    return rewards, rewards - mean, std


# ---- the estimators ----


@register_advantage_estimator("gae")
def gae(scored: ScoredRollout, config: PPOConfig) -> tuple[torch.Tensor, torch.Tensor | None]:
    """PPO's: ``r_t = -beta * KL_t`` on every response token plus the score on the last one; GAE(gamma, lambda) with
    the critic's values; advantages whitened over the batch (``ppo.whiten_advantages``); returns for the critic."""
    if scored.values is None:
        raise ValueError("The 'gae' advantage estimator needs the critic's values: give the algorithm the 'critic' "
                         "role, or name a critic-free estimator (e.g. 'grpo').")
    mask = scored.response_mask
    rewards = functional.token_rewards(scored.scores, scored.kl, scored.kl_coef, mask, scored.turn_rewards)
    advantages, returns = functional.gae_advantages(rewards, scored.values, mask, config.gamma, config.lam)
    whiten = config.whiten_advantages is not False  # None (a config no algorithm resolved): PPO's own, whitened
    if whiten and mask.sum() > 1:  # every score skipped: nothing to whiten or learn
        advantages = functional.masked_whiten(advantages, mask)
    return advantages, returns


@register_advantage_estimator("grpo")
def grpo(scored: ScoredRollout, config: PPOConfig) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``A_i = (r_i - mean(r_group)) / (std + eps)`` on every token of response i, ``r_i`` the score minus the KL in
    the reward. ``ppo.scale_rewards`` picks the std: the group's (``group``), the batch's (``batch``) or none."""
    rewards, centred, std = group_centred_rewards(scored)
    if config.scale_rewards == "none":
        return per_token(centred, scored.response_mask), None
    if config.scale_rewards == "batch":  # one std over every valid reward of the (gathered) rollout batch
        valid = rewards[scored.valid].to(torch.float64)
        std = valid.std() if valid.numel() > 1 else torch.zeros((), dtype=torch.float64)
    return per_token(centred / (std + GROUP_STD_EPS), scored.response_mask), None


@register_advantage_estimator("dr_grpo")
def dr_grpo(scored: ScoredRollout, config: PPOConfig) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``A_i = r_i - mean(r_group)``: GRPO without the division by the group's std (which up-weights too easy and
    too hard prompts)."""
    _, centred, _ = group_centred_rewards(scored)
    return per_token(centred, scored.response_mask), None


@register_advantage_estimator("rloo")
def rloo(scored: ScoredRollout, config: PPOConfig) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``A_i = r_i - mean_{j != i} r_j`` over the other valid responses of the same prompt, with the KL in the
    reward summed over the response (the whole response is one action)."""
    rewards = sequence_rewards(scored)
    mean, _, count = functional.group_mean_std(rewards, scored.valid, scored.group_size)
    others = (count - 1).clamp(min=1.0)
    baseline = (mean * count - rewards) / others
    # A response with no valid sibling has no baseline: it teaches nothing.
    advantages = torch.where(count > 1, rewards - baseline, torch.zeros_like(rewards))
    return per_token(advantages, scored.response_mask), None


@register_advantage_estimator("reinforce_pp")
def reinforce_pp(scored: ScoredRollout, config: PPOConfig) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``A_t = whiten(G_t)`` over the batch's tokens, ``G_t`` the discounted return (``ppo.gamma``) of the KL-shaped
    per-token rewards: no critic and no per-prompt baseline."""
    return whitened_returns(scored.scores, scored, config.gamma), None


@register_advantage_estimator("reinforce_pp_baseline")
def reinforce_pp_baseline(scored: ScoredRollout, config: PPOConfig) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``score_i - mean(score_group)`` replaces the score, then :func:`reinforce_pp`: whitened over the batch (the
    global std, not the group's, as the paper argues)."""
    mean, _, _ = functional.group_mean_std(scored.scores, scored.valid, scored.group_size)
    # Centred in float64 (an equal group centres to exactly 0), then back to the scores' dtype.
    centred = torch.where(scored.valid, scored.scores - mean, torch.zeros_like(mean)).to(scored.scores.dtype)
    return whitened_returns(centred, scored, config.gamma), None
