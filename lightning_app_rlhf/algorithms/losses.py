"""Policy and value losses, registered by name as plain tensor functions (veRL's ``core_algos`` style). Plain PyTorch.

A loss sees tensors only: the engine runs the model's forward (``calls.policy_logprobs``, ``calls.critic_values``)
and hands the loss its outputs with the minibatch's rollout-time tensors. Each loss returns the scalar to
backpropagate and its statistics; the :class:`~lightning_app_rlhf.algorithms.Algorithm` that names the loss lists
those statistics' names (every rank must agree on them). A new loss is a function decorated with
:func:`register_policy_loss` or :func:`register_value_loss`.

Every loss is one data-parallel shard's share of its minibatch: it divides by the whole minibatch's sizes
(:class:`~lightning_app_rlhf.algorithms.functional.LossScale`), so the shards' losses add up to the minibatch's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from lightning_app_rlhf.algorithms import functional
from lightning_app_rlhf.algorithms.functional import LossScale
from lightning_app_rlhf.algorithms.registry import Registry
from lightning_app_rlhf.core.config import PPOConfig

Tensor = torch.Tensor
PerToken = tuple[Tensor, Tensor, Tensor]
"""A surrogate's ``(loss, clipped, approx_kl)``, each [B, T]."""
Surrogate = Callable[..., PerToken]
"""``(logprobs, old_logprobs, advantages, response_mask, config) -> (loss, clipped, approx_kl)``: a policy loss per
token, whether each token was clipped, and the k3 estimate of KL(old || new) per token (see
:class:`SurrogatePolicyLoss`)."""
PolicyLoss = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]
"""``(logprobs, old_logprobs, advantages, response_mask, scale, config, loss_agg_mode, ref_logprobs=None,
entropy=None, is_weights=None) -> (loss, stats)``: the actor's loss on one minibatch shard (see :class:`SurrogatePolicyLoss` for each
argument)."""
ValueLoss = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, LossScale, PPOConfig],
                     tuple[torch.Tensor, dict[str, torch.Tensor]]]
"""``(values, old_values, returns, response_mask, scale, config) -> (loss, stats)``: the critic's loss on one
minibatch shard (see :func:`clipped_mse` for each argument)."""

POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss", "@register_policy_loss(name)",
                                               "Algorithm.policy_loss_mode")
"""Name -> policy loss; filled by :func:`register_policy_loss`."""
VALUE_LOSSES: Registry[ValueLoss] = Registry("value loss", "@register_value_loss(name)", "Algorithm.value_loss_mode")
"""Name -> value loss; filled by :func:`register_value_loss`."""

register_policy_loss = POLICY_LOSSES.decorator_for
"""``@register_policy_loss(name)``: make the decorated function available as ``Algorithm.policy_loss_mode = name``;
a name taken by another function is refused."""
register_value_loss = VALUE_LOSSES.decorator_for
"""``@register_value_loss(name)``: make the decorated function available as ``Algorithm.value_loss_mode = name``;
a name taken by another function is refused."""
get_policy_loss = POLICY_LOSSES.lookup
"""``get_policy_loss(name)``: the policy loss registered as ``name``; the error lists the registered names."""
get_value_loss = VALUE_LOSSES.lookup
"""``get_value_loss(name)``: the value loss registered as ``name``; the error lists the registered names."""


class SurrogatePolicyLoss:
    """A policy loss made of a per-token surrogate: the surrogate aggregated by ``loss_agg_mode``, minus
    ``entropy_coef`` times the token-mean entropy, plus ``kl_loss_coef`` times the KL to the reference
    (``kl_loss_estimator``) aggregated like the surrogate. Statistics: ``policy/loss``, ``policy/clipfrac`` (the
    share of tokens the surrogate clipped), ``policy/approx_kl`` (k3 of KL(old || new)), ``policy/entropy`` (with
    ``entropy``) and ``policy/kl_loss`` (with the KL term). Made by :func:`register_surrogate`.

    Args:
        surrogate: ``(logprobs, old_logprobs, advantages, response_mask, config) -> (loss, clipped, approx_kl)``,
            each [B, T] per token.
    """

    def __init__(self, surrogate: Surrogate) -> None:
        self.surrogate = surrogate
        self.__qualname__ = f"SurrogatePolicyLoss({surrogate.__qualname__})"

    def __call__(
        self,
        logprobs: torch.Tensor,
        old_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        response_mask: torch.Tensor,
        scale: LossScale,
        config: PPOConfig,
        loss_agg_mode: str,
        ref_logprobs: torch.Tensor | None = None,
        entropy: torch.Tensor | None = None,
        is_weights: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The loss on one minibatch shard, and its statistics.

        Args:
            logprobs: [B, T] the actor's log-probabilities of the sampled tokens now, with gradients.
            old_logprobs: [B, T] the old log-probabilities of the ratio: the behaviour ones from sampling, or the
                trainer's own with ``ppo.recompute_old_logprobs``.
            advantages: [B, T] the estimator's advantages.
            response_mask: [B, T] 1 on the response tokens that count.
            scale: The whole minibatch's sizes, which every shard divides by.
            config: The update's hyper-parameters (``clip_ratio_low``, ``entropy_coef``, ``kl_loss_coef``...).
            loss_agg_mode: How per-token losses become one number
                (:func:`~lightning_app_rlhf.algorithms.functional.aggregate_loss`).
            ref_logprobs: [B, T] the reference's log-probabilities, when the loss has a KL term
                (``config.kl_loss_coef > 0``), else None.
            entropy: [B, T] the actor's entropies (with gradients when ``config.entropy_coef != 0``), or None.
            is_weights: [B, T] weights of each token's surrogate (``ppo.rollout_is: tis``), or None.
        """
        mask, mode = response_mask, loss_agg_mode
        per_token, clipped, approx_kl = self.surrogate(logprobs, old_logprobs, advantages, mask, config)
        per_token = per_token * is_weights if is_weights is not None else per_token
        loss = functional.aggregate_loss(per_token, mask, mode, scale)
        total = loss
        stats = {
            "policy/loss": loss.detach(),
            "policy/clipfrac": functional.aggregate_loss(clipped, mask, "token_mean", scale),
            "policy/approx_kl": functional.aggregate_loss(approx_kl, mask, "token_mean", scale),
        }
        if entropy is not None:
            entropy_mean = functional.aggregate_loss(entropy, mask, "token_mean", scale)
            total = total - config.entropy_coef * entropy_mean
            stats["policy/entropy"] = entropy_mean.detach()
        elif config.entropy_coef != 0:
            raise ValueError(f"ppo.entropy_coef is {config.entropy_coef} but the policy loss got no entropy: pass the "
                             "entropy from calls.policy_logprobs, or set ppo.entropy_coef: 0.")
        if config.kl_loss_coef > 0:
            if ref_logprobs is None:
                raise ValueError(f"ppo.kl_loss_coef is {config.kl_loss_coef} but the policy loss got no reference "
                                 "log-probabilities: keep them in the experience (Algorithm.keeps_ref_logprobs), or "
                                 "set ppo.kl_loss_coef: 0.")
            kl = functional.kl_penalty(logprobs, ref_logprobs, config.kl_loss_estimator)
            kl_loss = functional.aggregate_loss(kl, mask, mode, scale)
            total = total + config.kl_loss_coef * kl_loss
            stats["policy/kl_loss"] = kl_loss.detach()
        return total, stats


def register_surrogate(name: str) -> Callable[[Surrogate], Surrogate]:
    """``@register_surrogate(name)``: register the decorated per-token surrogate, wrapped in a
    :class:`SurrogatePolicyLoss`, as the policy loss ``name`` (``Algorithm.policy_loss_mode = name``); the function
    itself is returned unchanged."""

    def register(surrogate: Surrogate) -> Surrogate:
        POLICY_LOSSES.add(name, SurrogatePolicyLoss(surrogate))
        return surrogate

    return register


@register_surrogate("ppo_clip")
def ppo_clip(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, response_mask: Tensor, config: PPOConfig
) -> PerToken:
    """PPO's clipped surrogate, the ratio clipped to ``config.clip_epsilons()`` (DAPO's decoupled clip where
    ``clip_ratio_low`` and ``clip_ratio_high`` differ)."""
    return functional.clipped_surrogate(logprobs, old_logprobs, advantages, *config.clip_epsilons())


@register_surrogate("gspo")
def gspo(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, response_mask: Tensor, config: PPOConfig
) -> PerToken:
    """GSPO's: one ratio per response, the geometric mean of its token ratios, clipped as a whole."""
    return functional.sequence_clipped_surrogate(logprobs, old_logprobs, advantages, response_mask,
                                                 *config.clip_epsilons())


@register_surrogate("gspo_token")
def gspo_token(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, response_mask: Tensor, config: PPOConfig
) -> PerToken:
    """GSPO-token's: each token's ratio valued at its response's, differentiated through its own log-probability."""
    return functional.sequence_clipped_surrogate(logprobs, old_logprobs, advantages, response_mask,
                                                 *config.clip_epsilons(), token_level=True)


@register_surrogate("cispo")
def cispo(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, response_mask: Tensor, config: PPOConfig
) -> PerToken:
    """CISPO's: the importance weight clipped and detached, times the advantage and the log-probability."""
    return functional.clipped_weight_surrogate(logprobs, old_logprobs, advantages, *config.clip_epsilons())


@register_value_loss("clipped_mse")
def clipped_mse(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    scale: LossScale,
    config: PPOConfig,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped value loss (:func:`~lightning_app_rlhf.algorithms.functional.value_loss`, ``clip_range_value``),
    always a token mean over the minibatch, times ``value_loss_coef``. Statistics: ``value/loss`` (before the
    coefficient) and ``value/clipfrac``.

    Args:
        values: [B, T] the critic's values now, with gradients (unmasked).
        old_values: [B, T] the critic's values at rollout time.
        returns: [B, T] the estimator's returns, the critic's targets.
        response_mask: [B, T] 1 on the response tokens that count.
        scale: The whole minibatch's sizes, which every shard divides by.
        config: The update's hyper-parameters (``clip_range_value``, ``value_loss_coef``).
    """
    loss, clipfrac = functional.value_loss(values, old_values, returns, response_mask, config.clip_range_value,
                                           scale.tokens)
    return config.value_loss_coef * loss, {"value/loss": loss.detach(), "value/clipfrac": clipfrac}
