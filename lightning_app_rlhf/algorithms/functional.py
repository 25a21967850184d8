"""Policy-gradient math on padded [batch, time] tensors with a 0/1 response mask: stateless functions. Plain PyTorch,
no Lightning.

The pieces (masked statistics, KL estimators, token rewards, GAE, discounted returns, float64 group statistics, the
clipped surrogate, the value loss, loss aggregation) that the registered advantage estimators (``advantages.py``) and
losses (``losses.py``) are built from. Stateful reward shaping (KL controllers, running moments) is in ``shaping.py``.

Conventions: ``mask[b, t] = 1`` for response tokens up to and including EOS, 0 after. Means over tokens are
token-level over the whole batch (every valid token weighs the same), as in TRL and OpenRLHF.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F


def masked_mean(
    values: torch.Tensor, mask: torch.Tensor, dim: int | None = None, count: torch.Tensor | float | None = None
) -> torch.Tensor:
    """Mean of ``values`` over positions where ``mask`` is 1 (over all positions, or along ``dim``).

    ``count`` replaces the local number of valid positions: a data-parallel shard of a minibatch divides by
    the whole minibatch's count, so the shards' results add up to the minibatch mean.
    """
    mask = mask.to(values.dtype)
    if dim is None:
        denominator = mask.sum().clamp(min=1.0) if count is None else count
        return (values * mask).sum() / denominator
    return (values * mask).sum(dim) / mask.sum(dim).clamp(min=1.0)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of the masked entries; ``unbiased`` applies Bessel's correction n / (n - 1)."""
    mask = mask.to(values.dtype)
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        n = mask.sum()
        if n < 2:
            raise ValueError(f"Whitening needs at least 2 valid tokens, got {int(n.item())}.")
        var = var * n / (n - 1)
    return var


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """Normalise the masked entries to unit variance (and zero mean if ``shift_mean``); masked-out entries -> 0."""
    mean, var = masked_mean(values, mask), masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return whitened * mask.to(values.dtype)


def tempered_float(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``logits`` in float32, divided by ``temperature``. The division comes after the cast, as in sampling:
    dividing bf16 logits first would round them again and widen the gap between behaviour and training
    log-probabilities. At temperature 1 there is no division: a pass over [B, T, V] that changes no number."""
    logits = logits.float()
    return logits if temperature == 1.0 else logits / temperature


def logprobs_from_logits(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Log-probability of ``tokens`` [B, T] under ``logits`` [B, T, V] / ``temperature``."""
    logp = F.log_softmax(tempered_float(logits, temperature), dim=-1)
    return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


class _TokenLogprobsAndEntropy(torch.autograd.Function):
    """:func:`token_logprobs_and_entropy`'s forward and its hand-written backward.

    Autograd's backward of ``log_softmax(x).gather(...)`` fills a zero tensor of the logits' size and scatters
    into it (gather's backward), runs log-softmax's backward over it, and, when the caller sliced the logits,
    fills and copies another logits-sized tensor (the slice's backward). The gradient has a closed form instead:
    d log p(t) / dx = onehot(t) - p, and d H / dx = -p (log p + H). One pass writes it, into the logits' own
    shape, so no slice, zero fill or scatter of the vocabulary is needed. Float32 throughout. Saved for backward:
    ``p``, as log-softmax's output would be (and log p as well when the entropy takes a gradient)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        logits: torch.Tensor,
        tokens: torch.Tensor,
        temperature: float,
        entropy_grad: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        steps = tokens.shape[1]
        logp = F.log_softmax(tempered_float(logits[:, :steps], temperature), dim=-1)
        logprobs = logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        probs = logp.exp()
        entropy = -(probs * logp).sum(-1)
        ctx.temperature, ctx.entropy_grad = temperature, entropy_grad
        ctx.logits_shape, ctx.logits_dtype = logits.shape, logits.dtype
        if entropy_grad:
            ctx.save_for_backward(tokens, probs, logp, entropy)
        else:
            ctx.save_for_backward(tokens, probs)
            ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, grad_logprobs: torch.Tensor, grad_entropy: torch.Tensor | None
    ) -> tuple[torch.Tensor, None, None, None]:
        tokens, probs = ctx.saved_tensors[:2]
        steps = tokens.shape[1]
        grad = probs * -grad_logprobs.unsqueeze(-1)
        if ctx.entropy_grad and grad_entropy is not None:
            logp, entropy = ctx.saved_tensors[2:]
            grad -= (grad_entropy.unsqueeze(-1) * probs) * (logp + entropy.unsqueeze(-1))
        grad.scatter_add_(-1, tokens.unsqueeze(-1), grad_logprobs.unsqueeze(-1))
        if ctx.temperature != 1.0:
            grad /= ctx.temperature
        if ctx.logits_shape[1] == steps and ctx.logits_dtype == grad.dtype:
            return grad, None, None, None
        full = grad.new_empty(ctx.logits_shape, dtype=ctx.logits_dtype)
        full[:, :steps] = grad
        full[:, steps:] = 0  # positions past the response (e.g. the last one, which predicts no response token)
        return full, None, None, None


def token_logprobs_and_entropy(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0, entropy_grad: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probabilities [B, T] of ``tokens`` and entropies [B, T] under ``logits`` / ``temperature``, with one
    float32 log-softmax over the vocabulary and a closed-form backward (no logits-sized zero fill or scatter).

    The numbers are :func:`logprobs_from_logits`'s and :func:`entropy_from_logits`'s, and so are the gradients,
    within float rounding.

    Args:
        logits: [B, T', V] with T' >= T: position t predicts ``tokens[:, t]``; positions from T on get zero
            gradient (an LM head run with ``logits_to_keep=T + 1`` returns one position past the response).
        tokens: [B, T] int64.
        temperature: The sampling temperature the log-probabilities are taken at.
        entropy_grad: False: the entropy is a statistic (no entropy term in the loss), returned without a graph.
    """
    if logits.shape[1] < tokens.shape[1]:
        raise ValueError(f"logits cover {logits.shape[1]} positions, fewer than the {tokens.shape[1]} tokens.")
    if not (torch.is_grad_enabled() and logits.requires_grad):
        logp = F.log_softmax(tempered_float(logits[:, : tokens.shape[1]], temperature), dim=-1)
        return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)
    return _TokenLogprobsAndEntropy.apply(logits, tokens, temperature, entropy_grad)


def entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy [B, T] of the categorical distributions given by ``logits`` [B, T, V] / ``temperature``."""
    logp = F.log_softmax(tempered_float(logits, temperature), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def kl_penalty(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: Literal["k1", "k3"] = "k1"
) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from log-probabilities of the sampled tokens.

    k1 = log p - log q is unbiased but can be negative; k3 = (r - 1) - log r with r = q / p is unbiased and
    never negative (Schulman, "Approximating KL divergence"). Differentiable: as a loss term (GRPO's k3) its
    gradient flows through ``logprobs``.
    """
    log_ratio = logprobs - ref_logprobs
    if estimator == "k1":
        return log_ratio
    if estimator == "k3":
        return torch.expm1(-log_ratio) + log_ratio
    raise ValueError(f"Unknown KL estimator {estimator!r}: use 'k1' or 'k3'.")


def last_token_index(mask: torch.Tensor) -> torch.Tensor:
    """Index [B] of the last valid token of each row (0 for an all-zero row)."""
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    return (positions * mask.long()).amax(dim=1)


def token_rewards(
    scores: torch.Tensor, kl: torch.Tensor, kl_coef: float, mask: torch.Tensor, turn_rewards: torch.Tensor | None = None
) -> torch.Tensor:
    """Per-token rewards: ``-kl_coef * kl`` on every response token, plus the score on the last one.

    A multi-turn episode's ``turn_rewards`` [B, T] (each turn's environment reward on its last sampled token, their
    sum part of ``scores``) stay where they are; the last token gets the rest of the score."""
    rewards = -kl_coef * kl * mask.to(kl.dtype)
    last = last_token_index(mask)
    has_tokens = mask.sum(dim=1) > 0
    if turn_rewards is not None:
        turn_rewards = turn_rewards.to(rewards.dtype) * mask.to(rewards.dtype)
        rewards = rewards + turn_rewards
        scores = scores.to(rewards.dtype) - turn_rewards.sum(1)
    rewards[torch.arange(len(scores), device=scores.device), last] += scores.to(rewards.dtype) * has_tokens
    return rewards


def gae_advantages(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised Advantage Estimation over the response tokens.

    Positions where ``mask`` is 0 are skipped: the recursion runs over the valid tokens only, so a multi-turn
    episode's observation tokens (0 between two turns) neither bootstrap nor discount, and after the last valid
    token the bootstrap value is 0 (terminal).

    Returns:
        ``(advantages, returns)`` with ``returns = advantages + values``; both zero where ``mask`` is 0.
    """
    mask_f = mask.to(values.dtype)
    valid = mask.bool()
    values = values * mask_f
    rewards = rewards * mask_f
    advantages = torch.zeros_like(values)
    last_gae = torch.zeros_like(values[:, 0])
    next_value = torch.zeros_like(last_gae)
    for t in reversed(range(values.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        gae = delta + gamma * lam * last_gae
        last_gae = torch.where(valid[:, t], gae, last_gae)
        next_value = torch.where(valid[:, t], values[:, t], next_value)
        advantages[:, t] = last_gae
    advantages = advantages * mask_f
    return advantages, (advantages + values) * mask_f


def discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """``G_t = sum_{k >= t} gamma^(k - t) r_k`` over the response tokens (REINFORCE), ``k`` counting valid tokens
    only (a multi-turn episode's observation tokens are skipped); zero where ``mask`` is 0."""
    mask_f = mask.to(rewards.dtype)
    valid = mask.bool()
    rewards = rewards * mask_f
    returns = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        running = torch.where(valid[:, t], rewards[:, t] + gamma * running, running)
        returns[:, t] = running
    return returns * mask_f


def group_view(values: torch.Tensor, group_size: int) -> torch.Tensor:
    """[B] -> [B / G, G]: the samples of one prompt are consecutive rows of the rollout batch."""
    if values.shape[0] % group_size:
        raise ValueError(f"A batch of {values.shape[0]} samples does not split into groups of {group_size}.")
    return values.reshape(-1, group_size)


def group_mean_std(
    scores: torch.Tensor, valid: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample mean, sample standard deviation (Bessel) and count of the valid scores of its group, in float64.

    Skipped samples (``valid`` False) count in no statistic. A group with one valid sample has std 0.

    float64 because a group of equal scores must get a spread of exactly 0. Summed in float32, ``G`` copies of a
    score are rounded (``-0.7`` eight times), the mean is off by an ulp, and every member gets the same tiny
    non-zero difference, which GRPO's division by ``std + eps`` blows up to an advantage of order 0.1-1. In float64
    the sum of up to 2**29 float32 copies is exact, so the mean equals the score bit for bit and every centred score,
    and the std, is exactly 0. Callers subtract the mean in float64 too and cast the result back.
    """
    scores_g = group_view(scores.to(torch.float64), group_size)
    valid_g = group_view(valid.to(torch.float64), group_size)
    count = valid_g.sum(1, keepdim=True)
    mean = (scores_g * valid_g).sum(1, keepdim=True) / count.clamp(min=1.0)
    var = ((scores_g - mean) ** 2 * valid_g).sum(1, keepdim=True) / (count - 1).clamp(min=1.0)
    expand = lambda x: x.expand_as(scores_g).reshape(-1)
    return expand(mean), expand(var.sqrt()), expand(count)


def clipped_surrogate(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, clip_low: float,
    clip_high: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token PPO-clip loss ``max(-A * r, -A * clip(r, 1 - clip_low, 1 + clip_high))`` (``clip_high`` None: the
    same as ``clip_low``), whether the clipped term won, and the per-token k3 estimate of KL(old || new). The token-mean
    of these is :func:`policy_loss`."""
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    high = clip_low if clip_high is None else clip_high
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + high)
    return torch.maximum(unclipped, clipped), (clipped > unclipped).float(), ((ratio - 1.0) - log_ratio).detach()


def sequence_clipped_surrogate(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
    clip_low: float, clip_high: float, token_level: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GSPO's surrogate: each response's ratio ``s = exp(mean over its valid tokens of (log p - log p_old))``,
    ``max(-A * s, -A * clip(s, 1 - clip_low, 1 + clip_high))`` on each of its tokens, and which tokens were clipped;
    with ``token_level`` (GSPO-token) each token's ratio is ``sg(s) * p_t / sg(p_t)``: the same value, the token's
    own gradient. The third output is the per-token k3 estimate of KL(old || new), as :func:`clipped_surrogate`'s."""
    weights = mask.to(logprobs.dtype)
    log_ratio = logprobs - old_logprobs
    sequence = (log_ratio * weights).sum(1, keepdim=True) / weights.sum(1, keepdim=True).clamp(min=1.0)
    log_s = sequence.detach() + logprobs - logprobs.detach() if token_level else sequence.expand_as(logprobs)
    ratio = torch.exp(log_s)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    approx_kl = (torch.exp(log_ratio) - 1.0 - log_ratio).detach()
    return torch.maximum(unclipped, clipped), (clipped > unclipped).float(), approx_kl


def clipped_weight_surrogate(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, clip_low: float, clip_high: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """CISPO's surrogate: ``-sg(clip(r, 1 - clip_low, 1 + clip_high)) * A * log p`` per token (its gradient is the
    REINFORCE gradient weighted by the clipped ratio, for every token), whether the weight was clipped, and the
    per-token k3 estimate of KL(old || new)."""
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    weight = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high).detach()
    clipped = ((ratio < 1.0 - clip_low) | (ratio > 1.0 + clip_high)).float()
    return -weight * advantages * logprobs, clipped, ((ratio - 1.0) - log_ratio).detach()


MISMATCH_STATS = ("rollout/logprob_abs_diff_mean", "rollout/logprob_abs_diff_max", "rollout/kl_behaviour_trainer",
                  "rollout/is_weight_mean", "rollout/is_masked_frac")
"""The rollout-trainer mismatch statistics of :func:`rollout_correction`, in order."""


def rollout_correction(
    trainer_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, mask: torch.Tensor, mode: str, level: str,
    threshold: float,
) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, torch.Tensor]]:
    """Correct for the rollout engine's log-probabilities differing from the trainer's (another numeric path: bf16
    shadows, the static decoder, a tensor-parallel copy): the importance weight ``w = p_trainer / p_behaviour`` per
    token, or per sequence (``level="sequence"``: the product over its valid tokens), and by ``mode``:

    - ``tis`` (truncated importance sampling): the loss of each token is multiplied by ``min(w, threshold)``;
    - ``mis`` (masked importance sampling): tokens (or whole sequences) with ``w > threshold`` leave the loss;
    - ``decoupled`` (the decoupled PPO objective of AReaL's ``use_decoupled_loss``, after Hilton et al. 2022,
      "Batch size-invariance for policy optimization"): the trainer's log-probabilities are the proximal policy's;
      the loss of each token is multiplied by ``w``, and tokens with ``w > threshold`` leave it (AReaL's
      ``behav_imp_weight_cap``);
    - ``none``: nothing changes; the statistics are still measured.

    Args:
        trainer_logprobs: [B, T] the trainer's log-probabilities of the sampled tokens, before the update.
        behaviour_logprobs: [B, T] the log-probabilities the rollout engine sampled them with.
        mask: [B, T] 1 on the valid response tokens.
        mode: ``none``, ``tis``, ``mis`` or ``decoupled``.
        level: ``token`` or ``sequence``.
        threshold: The cap (``tis``) or the rejection bound (``mis``, ``decoupled``) of the weight.

    Returns:
        ``(weights, mask, stats)``: the per-token loss weights for ``tis`` and ``decoupled`` (else None), the loss
        mask after ``mis`` and ``decoupled``,
        and the :data:`MISMATCH_STATS` over the valid tokens: the mean and largest ``|log p_trainer - log
        p_behaviour|``, the k3 estimate of KL(behaviour || trainer), the mean weight the loss uses (1 without
        ``tis``) and the share of valid tokens ``mis`` masked.
    """
    valid = mask.to(trainer_logprobs.dtype)
    tokens = valid.sum().clamp(min=1.0)
    token_log_w = (trainer_logprobs - behaviour_logprobs) * valid
    log_w = token_log_w.sum(1, keepdim=True).expand_as(token_log_w) * valid if level == "sequence" else token_log_w
    weight = torch.exp(log_w)
    kept = valid * (weight <= threshold) if mode in ("mis", "decoupled") else valid
    weights = torch.clamp(weight, max=threshold) * valid if mode == "tis" else (
        weight * kept if mode == "decoupled" else None)
    diff = token_log_w.abs()
    stats = {
        "rollout/logprob_abs_diff_mean": diff.sum() / tokens,
        "rollout/logprob_abs_diff_max": diff.max() if diff.numel() else diff.new_zeros(()),
        "rollout/kl_behaviour_trainer": ((torch.exp(token_log_w) - 1.0 - token_log_w) * valid).sum() / tokens,
        "rollout/is_weight_mean": (weights.sum() / tokens) if weights is not None else valid.new_ones(()),
        "rollout/is_masked_frac": (valid - kept).sum() / tokens,
    }
    return weights, kept.to(mask.dtype), stats


def overlong_penalty(lengths: torch.Tensor, max_new_tokens: int, buffer: int, factor: float) -> torch.Tensor:
    """DAPO's soft overlong punishment per response: 0 up to ``max_new_tokens - buffer`` tokens, then falling
    linearly to ``-factor`` at ``max_new_tokens``."""
    over = (lengths.float() - (max_new_tokens - buffer)).clamp(min=0.0)
    return -factor * over / buffer


@dataclass
class LossScale:
    """The whole minibatch's sizes, for a data-parallel shard of it: every rank divides by these, so the shards'
    losses add up to the minibatch loss."""

    tokens: torch.Tensor | float
    """Valid response tokens in the minibatch."""
    sequences: int
    """Sequences in the minibatch."""
    max_new_tokens: int
    """The generation budget: Dr. GRPO's constant normaliser per sequence."""


def aggregate_loss(values: torch.Tensor, mask: torch.Tensor, mode: str, scale: LossScale) -> torch.Tensor:
    """Per-token ``values`` [B, T] -> one number, by ``mode`` (veRL's ``loss_agg_mode`` names).

    ``token_mean``: sum over valid tokens / minibatch tokens. ``seq_mean_token_sum``: sum over valid tokens /
    minibatch sequences. ``seq_mean_token_mean``: each sequence's token mean, summed / minibatch sequences.
    ``seq_mean_token_sum_norm``: sum over valid tokens / (minibatch sequences x max_new_tokens), Dr. GRPO's constant.
    """
    mask = mask.to(values.dtype)
    if mode == "token_mean":
        return (values * mask).sum() / scale.tokens
    if mode == "seq_mean_token_sum":
        return (values * mask).sum() / scale.sequences
    if mode == "seq_mean_token_mean":
        return ((values * mask).sum(1) / mask.sum(1).clamp(min=1.0)).sum() / scale.sequences
    if mode == "seq_mean_token_sum_norm":
        return (values * mask).sum() / (scale.sequences * scale.max_new_tokens)
    raise ValueError(f"Unknown loss aggregation {mode!r}.")


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_range: float,
    token_count: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Clipped surrogate objective of PPO, as a loss to minimise. ``token_count``: see :func:`masked_mean`.

    Returns:
        ``(loss, clipfrac, approx_kl)``: the token-mean of ``max(-A * r, -A * clip(r, 1 - eps, 1 + eps))``,
        the fraction of tokens where the clipped term is the larger one, and the k3 estimate of
        KL(old || new), ``mean((r - 1) - log r)``.
    """
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    loss = masked_mean(torch.maximum(unclipped, clipped), mask, count=token_count)
    with torch.no_grad():
        clipfrac = masked_mean((clipped > unclipped).float(), mask, count=token_count)
        approx_kl = masked_mean((ratio - 1.0) - log_ratio, mask, count=token_count)
    return loss, clipfrac, approx_kl


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip_range: float,
    token_count: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss (``token_count``: see :func:`masked_mean`): ``0.5 * mean(max((v - R)^2, (v_clip - R)^2))`` with
    ``v_clip = old + clip(v - old, -eps, eps)``.

    Returns:
        ``(loss, clipfrac)``, the fraction of tokens where the clipped error is the larger one.
    """
    # clamp(v, old - eps, old + eps) rather than old + clamp(v - old, ...): inside the range it returns v
    # exactly, so rounding never shows up as clipping in clipfrac.
    clipped_values = torch.clamp(values, old_values - clip_range, old_values + clip_range)
    error = (values - returns) ** 2
    clipped_error = (clipped_values - returns) ** 2
    loss = 0.5 * masked_mean(torch.maximum(error, clipped_error), mask, count=token_count)
    with torch.no_grad():
        clipfrac = masked_mean((clipped_error > error).float(), mask, count=token_count)
    return loss, clipfrac


def superseded_token_mask(mask: torch.Tensor, versions: torch.Tensor) -> torch.Tensor:
    """Partial rollouts, slime's ``--mask-offpolicy-in-partial-rollout``: ``mask`` without the tokens sampled by a
    policy version older than the newest that sampled any token of the same row (the weights were superseded while
    the sample was in flight).

    Args:
        mask: [B, T] the loss mask.
        versions: [B, T] the policy version that sampled each token (:attr:`Rollout.versions`).
    """
    valid = mask.bool()
    newest = torch.where(valid, versions, torch.iinfo(versions.dtype).min).amax(1, keepdim=True)
    return (valid & (versions == newest)).to(mask.dtype)
