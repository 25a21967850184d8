"""Advantage estimators and losses of every registered algorithm, against numbers computed by hand."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from lightning_app_rlhf.algorithms import (
    ADVANTAGE_ESTIMATORS,
    ALGORITHMS,
    POLICY_LOSSES,
    VALUE_LOSSES,
    Algorithm,
    ScoredRollout,
    build_algorithm,
    functional,
    get_advantage_estimator,
    get_policy_loss,
    get_value_loss,
    register_advantage_estimator,
    register_algorithm,
    register_policy_loss,
    register_value_loss,
)
from lightning_app_rlhf.core.config import GenerationConfig, PPOConfig
from lightning_app_rlhf.generation import repeat_samples, sample_keys
from lightning_app_rlhf.models.calls import Experience

EPS = 1e-6  # GRPO's std epsilon


def scored(scores, mask, group_size, valid=None, kl=None, kl_coef=0.0, values=None) -> ScoredRollout:
    scores = torch.tensor(scores, dtype=torch.float32)
    mask = torch.tensor(mask, dtype=torch.long)
    return ScoredRollout(
        scores=scores,
        kl=torch.zeros(mask.shape) if kl is None else torch.tensor(kl, dtype=torch.float32) * mask,
        kl_coef=kl_coef,
        response_mask=mask,
        valid=torch.ones(len(scores), dtype=torch.bool) if valid is None else torch.tensor(valid),
        group_size=group_size,
        values=values,
    )


def algorithm(name: str, num_samples: int = 3, **config) -> Algorithm:
    """``name`` with ``config``; no KL loss term unless asked (the tests of a loss check its surrogate)."""
    config = {"kl_loss_coef": 0.0, **config}
    return build_algorithm(name, PPOConfig(**config), GenerationConfig(num_samples=num_samples, max_new_tokens=3))


MASK_6 = [[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 1, 1]]


def per_token(sequence_advantages, mask=MASK_6):
    return torch.tensor([[float(a * m) for m in row] for a, row in zip(sequence_advantages, mask)])


# ---------------------------------------------------------------------------------------------------------- GRPO


def test_grpo_normalises_by_group_mean_and_std():
    """Group 1 scores (1, 2, 3): mean 2, sample std 1 -> (-1, 0, 1) / (1 + eps). Group 2 all 5: std 0 -> 0."""
    advantages, returns = algorithm("grpo").advantages(scored([1, 2, 3, 5, 5, 5], MASK_6, 3))
    assert returns is None
    expected = per_token([-1 / (1 + EPS), 0.0, 1 / (1 + EPS), 0.0, 0.0, 0.0])
    assert_close(advantages, expected, rtol=0, atol=1e-7)


def test_grpo_folds_the_reward_kl_into_the_sequence_reward():
    """With kl_coef 0.5 and a per-token KL of 1, each reward drops by 0.5 x its length: (1 - 1, 2 - 0.5, 3 - 1.5) =
    (0, 1.5, 1.5): mean 1, sample std sqrt(0.75)."""
    rollout = scored([1, 2, 3], [[1, 1, 0], [1, 0, 0], [1, 1, 1]], 3, kl=[[1.0] * 3] * 3, kl_coef=0.5)
    advantages, _ = algorithm("grpo").advantages(rollout)
    std = math.sqrt(((0 - 1) ** 2 + 0.5**2 + 0.5**2) / 2)
    expected = torch.tensor([[-1 / (std + EPS)] * 2 + [0], [0.5 / (std + EPS), 0, 0], [0.5 / (std + EPS)] * 3])
    assert_close(advantages, expected, rtol=0, atol=1e-6)


def test_grpo_leaves_skipped_samples_out_of_the_group_statistics():
    """Sample 1 was skipped (non-finite score, zeroed): the group is (1, 3): mean 2, std sqrt(2)."""
    mask = [[1, 1, 0], [0, 0, 0], [1, 1, 1]]
    advantages, _ = algorithm("grpo").advantages(scored([1, 0, 3], mask, 3, valid=[True, False, True]))
    a = 1 / (math.sqrt(2) + EPS)
    assert_close(advantages, torch.tensor([[-a, -a, 0], [0, 0, 0], [a, a, a]]), rtol=0, atol=1e-6)


def test_grpo_loss_is_the_mean_over_sequences_of_token_means():
    """Ratio 1: per-token loss -A. Advantages (2, 0, 0, 0, 0, -1): sequence token means (-2, 0, 0, 0, 0, 1), whatever
    the lengths (2 and 3 tokens); their mean over 6 sequences is -1/6."""
    grpo = algorithm("grpo")
    mask = torch.tensor(MASK_6)
    batch = _experience(per_token([2, 0, 0, 0, 0, -1]), mask)
    scale = functional.LossScale(mask.sum().float(), 6, 3)
    loss, stats = grpo.policy_loss(batch.logprobs.clone(), torch.zeros(mask.shape), batch, scale)
    assert_close(loss, torch.tensor(-1 / 6), rtol=0, atol=1e-7)
    assert stats["policy/clipfrac"] == 0


def test_grpo_kl_loss_term_is_k3_and_differentiated():
    """k3 = exp(-d) + d - 1 with d = log p - log p_ref; its gradient in log p is 1 - exp(-d), token-meaned per
    sequence (GRPO's aggregation). Two sequences of 1 and 2 tokens, d = (0.5 | 0.2, -0.1)."""
    grpo = algorithm("grpo", kl_coef=0.0, kl_loss_coef=0.1)
    mask = torch.tensor([[1, 0], [1, 1]])
    d = torch.tensor([[0.5, 0.0], [0.2, -0.1]])
    batch = _experience(torch.zeros(2, 2), mask, ref_logprobs=-d)
    logprobs = torch.zeros(2, 2, requires_grad=True)
    loss, stats = grpo.policy_loss(logprobs, torch.zeros(2, 2), batch, functional.LossScale(3.0, 2, 2))
    k3 = lambda x: math.exp(-x) + x - 1
    expected_kl = (k3(0.5) + (k3(0.2) + k3(-0.1)) / 2) / 2
    assert stats["policy/kl_loss"].item() == pytest.approx(expected_kl, rel=1e-6)
    assert loss.item() == pytest.approx(0.1 * expected_kl, rel=1e-6)  # advantages 0: the surrogate is 0
    loss.backward()
    g = lambda x: 1 - math.exp(-x)
    expected_grad = torch.tensor([[0.1 * g(0.5) / 2, 0.0], [0.1 * g(0.2) / 4, 0.1 * g(-0.1) / 4]])
    assert_close(logprobs.grad, expected_grad, rtol=1e-5, atol=1e-8)


# ------------------------------------------------------------------------------------------------------ Dr. GRPO


def test_dr_grpo_subtracts_the_group_mean_without_std():
    """(1, 2, 3) -> (-1, 0, 1); (0, 0, 6) -> (-2, -2, 4): no division by the std; equal groups -> 0."""
    advantages, _ = algorithm("dr_grpo").advantages(scored([1, 2, 3, 0, 0, 6], MASK_6, 3))
    assert_close(advantages, per_token([-1, 0, 1, -2, -2, 4]), rtol=0, atol=1e-6)
    equal, _ = algorithm("dr_grpo").advantages(scored([7, 7, 7], MASK_6[:3], 3))
    assert_close(equal, torch.zeros(3, 3), rtol=0, atol=0)


def test_dr_grpo_divides_token_sums_by_a_constant():
    """Ratio 1, advantages (1 | 3) on 2 and 1 tokens: token sums -2 and -3, divided by 2 sequences x
    max_new_tokens 3: -5/6, whatever the responses' lengths."""
    dr_grpo = algorithm("dr_grpo")
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    batch = _experience(per_token([1, 3], mask.tolist()), mask)
    loss, _ = dr_grpo.policy_loss(batch.logprobs.clone(), torch.zeros(2, 3), batch, functional.LossScale(3.0, 2, 3))
    assert loss.item() == pytest.approx(-5 / 6)
    assert dr_grpo.loss_agg_mode == "seq_mean_token_sum_norm"


# ---------------------------------------------------------------------------------------------------------- RLOO


def test_rloo_uses_the_mean_of_the_other_samples():
    """(1, 2, 3): baselines (2.5, 2, 1.5) -> (-1.5, 0, 1.5); an equal group -> 0."""
    advantages, returns = algorithm("rloo").advantages(scored([1, 2, 3, 4, 4, 4], MASK_6, 3))
    assert returns is None
    assert_close(advantages, per_token([-1.5, 0, 1.5, 0, 0, 0]), rtol=0, atol=1e-6)


def test_rloo_baseline_skips_invalid_samples_and_lone_samples_learn_nothing():
    """Group (1, skipped, 3): baselines 3 and 1 -> (-2, 0, 2). Group (5, skipped, skipped): no baseline -> 0."""
    mask = [[1, 1, 0], [0, 0, 0], [1, 1, 1], [1, 0, 0], [0, 0, 0], [0, 0, 0]]
    valid = [True, False, True, True, False, False]
    advantages, _ = algorithm("rloo").advantages(scored([1, 0, 3, 5, 0, 0], mask, 3, valid=valid))
    assert_close(advantages, per_token([-2, 0, 2, 0, 0, 0], mask), rtol=0, atol=1e-6)


# -------------------------------------------------------------------------------------------------- REINFORCE++


def test_reinforce_pp_whitens_discounted_kl_shaped_returns_over_the_batch():
    """Masks (1, 1 | 1, 0), scores (1 | 0), KL 0.5 per token, coefficient 0.1, gamma 1.
    Rewards (-0.05, 0.95 | -0.05); returns (0.9, 0.95 | -0.05); mean 0.6, unbiased variance 0.635 / 2."""
    rollout = scored([1, 0], [[1, 1], [1, 0]], 1, kl=[[0.5, 0.5], [0.5, 0.5]], kl_coef=0.1)
    advantages, returns = algorithm("reinforce_pp", num_samples=1).advantages(rollout)
    assert returns is None
    std = math.sqrt(0.635 / 2 + 1e-8)
    assert_close(advantages, torch.tensor([[0.3 / std, 0.35 / std], [-0.65 / std, 0.0]]), rtol=1e-5, atol=1e-6)


def test_reinforce_pp_equal_returns_whiten_to_zero():
    """Scores (2 | 2) on one token each, no KL: every return is 2, the batch std is 0 -> advantages 0, not NaN."""
    advantages, _ = algorithm("reinforce_pp", num_samples=1).advantages(scored([2, 2], [[1, 0], [1, 0]], 1))
    assert_close(advantages, torch.zeros(2, 2), rtol=0, atol=0)


def test_reinforce_pp_discounts_returns():
    """gamma 0.5, no KL: the score 1 at the last of 3 tokens returns (0.25, 0.5, 1) before whitening."""
    mask = torch.tensor([[1, 1, 1]])
    rewards = functional.token_rewards(torch.tensor([1.0]), torch.zeros(1, 3), 0.0, mask)
    assert_close(functional.discounted_returns(rewards, mask, 0.5), torch.tensor([[0.25, 0.5, 1.0]]))


def test_reinforce_pp_baseline_centres_scores_per_group_then_whitens_globally():
    """One group (1, 0): centred (0.5, -0.5); masks (1, 1 | 1, 0), no KL: returns (0.5, 0.5 | -0.5); mean 1/6,
    unbiased variance (2/3) / 2 = 1/3."""
    rollout = scored([1, 0], [[1, 1], [1, 0]], 2)
    advantages, _ = algorithm("reinforce_pp_baseline", num_samples=2).advantages(rollout)
    std = math.sqrt(1 / 3 + 1e-8)
    expected = torch.tensor([[(1 / 3) / std, (1 / 3) / std], [(-2 / 3) / std, 0.0]])
    assert_close(advantages, expected, rtol=1e-5, atol=1e-6)


def test_reinforce_pp_baseline_equal_group_without_kl_gives_zero():
    advantages, _ = algorithm("reinforce_pp_baseline", num_samples=2).advantages(scored([3, 3], [[1, 1], [1, 0]], 2))
    assert_close(advantages, torch.zeros(2, 2), rtol=0, atol=0)


def test_grpo_scale_rewards_batch_divides_by_the_batch_std_and_none_by_nothing():
    """Scores (1, 2, 3 | 5, 5, 5): centred (-1, 0, 1 | 0, 0, 0). The batch's sample variance: squared deviations from
    3.5 sum to 6.25 + 2.25 + 0.25 + 3 x 2.25 = 15.5, / 5 = 3.1. ``none`` keeps the centred rewards."""
    rollout = scored([1, 2, 3, 5, 5, 5], MASK_6, 3)
    batch, _ = algorithm("grpo", scale_rewards="batch").advantages(rollout)
    scale = math.sqrt(3.1) + EPS
    assert_close(batch, per_token([-1 / scale, 0.0, 1 / scale, 0.0, 0.0, 0.0]), rtol=0, atol=1e-7)
    unscaled, _ = algorithm("grpo", scale_rewards="none").advantages(rollout)
    assert_close(unscaled, per_token([-1.0, 0.0, 1.0, 0.0, 0.0, 0.0]), rtol=0, atol=0)


def test_grpo_batch_scale_leaves_skipped_samples_out():
    """(1, skipped, 3 | 4, 4, 4): the batch std is that of (1, 3, 4, 4, 4): mean 3.2, squared deviations 4.84 +
    0.04 + 3 x 0.64 = 6.8, / 4 = 1.7; centred (-1, 0, 1 | 0, 0, 0)."""
    mask = [[1, 1, 0], [0, 0, 0], [1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 1, 1]]
    rollout = scored([1, 0, 3, 4, 4, 4], mask, 3, valid=[True, False, True, True, True, True])
    advantages, _ = algorithm("grpo", scale_rewards="batch").advantages(rollout)
    scale = math.sqrt(1.7) + EPS
    assert_close(advantages, per_token([-1 / scale, 0.0, 1 / scale, 0.0, 0.0, 0.0], mask), rtol=0, atol=1e-7)


# ------------------------------------------------------------------------------------------- equal-reward groups

# Group sizes and float32 scores whose sum is not exact in float32 (-0.7 x 8 rounds; 3.2006216 is what a reward
# model gives identical responses; 1/3 has no finite binary form). Before the float64 group statistics, G=8 at -0.7
# gave |A| = 0.056 under GRPO and 3.2006216 gave 0.316 (G=8) and 0.41 (G=12).
EQUAL_GROUP_SIZES = [3, *range(5, 17)]
EQUAL_SCORES = [-0.7, 3.2006216, 1 / 3]


def equal_groups_then_a_spread_one(value: float, group_size: int) -> ScoredRollout:
    """Two groups of ``group_size`` one-token responses: every score ``value``, then ``value + 0, 1, 2, ...``."""
    scores = [value] * group_size + [value + i for i in range(group_size)]
    return scored(scores, [[1]] * (2 * group_size), group_size)


@pytest.mark.parametrize("value", EQUAL_SCORES)
@pytest.mark.parametrize("group_size", EQUAL_GROUP_SIZES)
@pytest.mark.parametrize("name,config", [("grpo", {}), ("grpo", {"scale_rewards": "batch"}), ("dr_grpo", {}),
                                         ("rloo", {})])
def test_a_group_of_equal_rewards_gets_advantage_exactly_zero(name, config, group_size, value):
    """Exactly 0 for the equal group, whatever its size and value; the group beside it still learns."""
    rollout = equal_groups_then_a_spread_one(value, group_size)
    advantages, _ = algorithm(name, num_samples=group_size, **config).advantages(rollout)
    assert torch.equal(advantages[:group_size], torch.zeros(group_size, 1))
    assert advantages[group_size:].abs().max() > 0.1


@pytest.mark.parametrize("value", EQUAL_SCORES)
@pytest.mark.parametrize("group_size", EQUAL_GROUP_SIZES)
def test_reinforce_pp_baseline_equal_groups_get_advantage_exactly_zero(group_size, value):
    """Every group equal, no KL: each centred score is exactly 0, so the whitened batch is exactly 0 too. (In a
    batch with other groups, REINFORCE++'s global whitening shifts every return by the batch mean, as the paper does;
    the centred score before it is still exactly 0, checked through ``group_mean_std``.)"""
    rollout = scored([value] * (2 * group_size), [[1, 1]] * (2 * group_size), group_size)
    advantages, _ = algorithm("reinforce_pp_baseline", num_samples=group_size).advantages(rollout)
    assert torch.equal(advantages, torch.zeros(2 * group_size, 2))


@pytest.mark.parametrize("value", EQUAL_SCORES)
@pytest.mark.parametrize("group_size", EQUAL_GROUP_SIZES)
def test_group_mean_of_equal_float32_scores_is_the_score_and_the_std_is_zero(group_size, value):
    scores = torch.full((group_size,), value, dtype=torch.float32)
    mean, std, count = functional.group_mean_std(scores, torch.ones(group_size, dtype=torch.bool), group_size)
    assert torch.equal(scores - mean, torch.zeros(group_size, dtype=torch.float64))
    assert torch.equal(std, torch.zeros(group_size, dtype=torch.float64))
    assert torch.equal(count, torch.full((group_size,), float(group_size), dtype=torch.float64))


# ----------------------------------------------------------------------------------------------------------- PPO


def test_ppo_is_gae_then_whitening_bit_for_bit():
    """The ``ppo`` algorithm computes exactly the tested PPO math: token rewards, GAE, whitening."""
    gen = torch.Generator().manual_seed(0)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    values, kl = torch.randn(3, 4, generator=gen) * mask, torch.randn(3, 4, generator=gen) * mask
    scores = torch.tensor([0.3, -1.0, 2.0])
    rollout = ScoredRollout(scores, kl, 0.05, mask, torch.ones(3, dtype=torch.bool), 1, values)
    advantages, returns = algorithm("ppo", num_samples=1, gamma=0.99, lam=0.9).advantages(rollout)
    rewards = functional.token_rewards(scores, kl, 0.05, mask)
    expected_advantages, expected_returns = functional.gae_advantages(rewards, values, mask, 0.99, 0.9)
    assert torch.equal(returns, expected_returns)
    assert torch.equal(advantages, functional.masked_whiten(expected_advantages, mask))


def test_ppo_policy_loss_equals_the_clipped_surrogate_bit_for_bit():
    gen = torch.Generator().manual_seed(1)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    batch = _experience(torch.randn(2, 3, generator=gen), mask)
    logprobs = batch.logprobs + 0.3 * torch.randn(2, 3, generator=gen)
    loss, stats = algorithm("ppo", num_samples=1).policy_loss(logprobs, torch.zeros(2, 3), batch,
                                                                functional.LossScale(torch.tensor(8.0), 4, 3))
    expected, clipfrac, approx_kl = functional.policy_loss(logprobs, batch.logprobs, batch.advantages, mask, 0.2,
                                                    torch.tensor(8.0))
    assert torch.equal(loss, expected)
    assert torch.equal(stats["policy/clipfrac"], clipfrac)
    assert torch.equal(stats["policy/approx_kl"], approx_kl)


# ------------------------------------------------------------------------------------------------ aggregation


VALUES = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
AGG_MASK = torch.tensor([[1, 1, 0], [1, 0, 0]])


@pytest.mark.parametrize(("mode", "expected"), [
    ("token_mean", 7 / 3),             # (1 + 2 + 4) / 3 tokens
    ("seq_mean_token_sum", 3.5),       # (3 + 4) / 2 sequences
    ("seq_mean_token_mean", 2.75),     # (1.5 + 4) / 2
    ("seq_mean_token_sum_norm", 7 / 6),  # 7 / (2 sequences x 3 max tokens)
])
def test_loss_aggregation_by_hand(mode, expected):
    scale = functional.LossScale(AGG_MASK.sum().float(), 2, 3)
    assert functional.aggregate_loss(VALUES, AGG_MASK, mode, scale).item() == pytest.approx(expected)


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_sum", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_loss_aggregation_of_data_parallel_shards_adds_up(mode):
    """Each shard divides by the whole minibatch's sizes, so the shards' losses sum to the minibatch loss."""
    scale = functional.LossScale(AGG_MASK.sum().float(), 2, 3)
    whole = functional.aggregate_loss(VALUES, AGG_MASK, mode, scale)
    shards = sum(functional.aggregate_loss(VALUES[i : i + 1], AGG_MASK[i : i + 1], mode, scale) for i in range(2))
    assert_close(shards, whole)


def test_veRL_spellings_of_the_aggregation_are_accepted():
    assert PPOConfig(loss_agg_mode="seq-mean-token-sum-norm").loss_agg_mode == "seq_mean_token_sum_norm"
    with pytest.raises(ValueError, match="loss_agg_mode must be one of"):
        PPOConfig(loss_agg_mode="sum")


# -------------------------------------------------------------------------------------- registry and validation


def test_registry_has_every_algorithm_and_only_ppo_has_a_critic():
    assert sorted(ALGORITHMS) == ["cispo", "dapo", "dr_grpo", "grpo", "gspo", "gspo_token", "ppo", "reinforce_pp",
                                  "reinforce_pp_baseline", "rloo"]
    with_critic = [name for name, cls in ALGORITHMS.items() if "critic" in cls.roles]
    assert with_critic == ["ppo"]


def test_unknown_algorithm_lists_the_registered_ones():
    with pytest.raises(ValueError, match=r"Unknown algorithm 'gpro'.*'grpo'"):
        build_algorithm("gpro", PPOConfig(), GenerationConfig())


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"])
def test_group_algorithms_need_several_samples_per_prompt(name):
    with pytest.raises(ValueError, match=r"generation\.num_samples is 1.*--model\.generation\.num_samples 4"):
        build_algorithm(name, PPOConfig(), GenerationConfig(num_samples=1))


def test_a_new_algorithm_is_an_estimator_and_a_registered_class():
    """A user's algorithm: a registered estimator, and a registered class naming it; RLHFModule finds it by name."""

    @register_advantage_estimator("test_sign_of_reward")
    def sign_of_reward(scored: ScoredRollout, config: PPOConfig) -> tuple[torch.Tensor, None]:
        return torch.sign(scored.scores).unsqueeze(1) * scored.response_mask, None

    @register_algorithm
    class SignOfReward(Algorithm):
        name = "test_sign_of_reward"
        advantage_estimator = "test_sign_of_reward"

    try:
        built = build_algorithm("test_sign_of_reward", PPOConfig(), GenerationConfig())
        advantages, _ = built.advantages(scored([2.0, -0.5], [[1, 1], [1, 0]], 1))
        assert_close(advantages, torch.tensor([[1.0, 1.0], [-1.0, 0.0]]))
        assert built.stat_names("actor") == ("policy/loss", "policy/clipfrac", "policy/approx_kl", "policy/entropy")
    finally:
        del ALGORITHMS["test_sign_of_reward"], ADVANTAGE_ESTIMATORS["test_sign_of_reward"]


def test_the_registries_hold_the_shipped_estimators_and_losses():
    assert sorted(ADVANTAGE_ESTIMATORS) == ["dr_grpo", "gae", "grpo", "reinforce_pp", "reinforce_pp_baseline", "rloo"]
    assert sorted(POLICY_LOSSES) == ["cispo", "gspo", "gspo_token", "ppo_clip"]
    assert sorted(VALUE_LOSSES) == ["clipped_mse"]
    for cls in ALGORITHMS.values():
        assert get_advantage_estimator(cls.advantage_estimator) is not None
        assert get_policy_loss(cls.policy_loss_mode) is POLICY_LOSSES[cls.policy_loss_mode]
    assert get_value_loss(ALGORITHMS["ppo"].value_loss_mode) is VALUE_LOSSES["clipped_mse"]


@pytest.mark.parametrize(("get", "kind", "decorator", "known"), [
    (get_advantage_estimator, "advantage estimator", "register_advantage_estimator", "'gae'"),
    (get_policy_loss, "policy loss", "register_policy_loss", "'ppo_clip'"),
    (get_value_loss, "value loss", "register_value_loss", "'clipped_mse'"),
])
def test_an_unknown_name_lists_the_registered_ones_and_the_decorator(get, kind, decorator, known):
    with pytest.raises(ValueError, match=rf"Unknown {kind} 'nope'.*{known}.*@{decorator}"):
        get("nope")


@pytest.mark.parametrize("register", [register_advantage_estimator, register_policy_loss, register_value_loss])
def test_a_taken_name_is_refused(register):
    """A second function under a taken name is refused; the one registered stays."""
    registry = {register_advantage_estimator: ADVANTAGE_ESTIMATORS, register_policy_loss: POLICY_LOSSES,
                register_value_loss: VALUE_LOSSES}[register]
    name = sorted(registry)[0]
    kept = registry[name]
    with pytest.raises(ValueError, match=rf"named '{name}' is registered already.*under another name"):
        register(name)(lambda *args, **kwargs: None)
    assert registry[name] is kept
    assert register(name)(kept) is kept  # the same function again (a module imported twice) is fine


def test_a_taken_algorithm_name_is_refused():
    with pytest.raises(ValueError, match=r"algorithm named 'grpo' is registered already"):
        @register_algorithm
        class OtherGRPO(Algorithm):
            name = "grpo"
            advantage_estimator = "grpo"
    assert ALGORITHMS["grpo"].__name__ == "GRPO"


def test_an_algorithm_naming_unregistered_functions_or_no_critic_loss_is_refused():
    with pytest.raises(ValueError, match=r"Unknown advantage estimator 'nope'"):
        @register_algorithm
        class UnknownEstimator(Algorithm):
            name = "test_unknown_estimator"
            advantage_estimator = "nope"
    with pytest.raises(ValueError, match=r"names no advantage estimator.*@register_advantage_estimator"):
        @register_algorithm
        class NoEstimator(Algorithm):
            name = "test_no_estimator"
    with pytest.raises(ValueError, match=r"has a critic but no value loss: set value_loss_mode"):
        @register_algorithm
        class CriticWithoutLoss(Algorithm):
            name = "test_critic_without_loss"
            roles = ALGORITHMS["ppo"].roles
            advantage_estimator = "gae"
    assert not any(name.startswith("test_") for name in ALGORITHMS)


def test_ppo_value_loss_is_the_clipped_value_loss_times_its_coefficient_bit_for_bit():
    gen = torch.Generator().manual_seed(2)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    batch = _experience(torch.zeros(2, 3), mask)
    batch.values, batch.returns = torch.randn(2, 3, generator=gen), torch.randn(2, 3, generator=gen)
    values = batch.values + 0.3 * torch.randn(2, 3, generator=gen)
    ppo = algorithm("ppo", num_samples=1, value_loss_coef=0.5)
    loss, stats = ppo.value_loss(values, batch, functional.LossScale(torch.tensor(8.0), 4, 3))
    expected, clipfrac = functional.value_loss(values, batch.values, batch.returns, mask, 0.2, torch.tensor(8.0))
    assert torch.equal(loss, 0.5 * expected)
    assert torch.equal(stats["value/loss"], expected) and torch.equal(stats["value/clipfrac"], clipfrac)
    assert tuple(stats) == ppo.stat_names("critic")
    with pytest.raises(ValueError, match=r"'grpo' has no critic"):
        algorithm("grpo").value_loss(values, batch, functional.LossScale(8.0, 2, 3))


def test_k3_in_the_reward_warns_and_names_the_loss_term():
    with pytest.warns(UserWarning, match="kl_loss_coef"):
        algorithm("ppo", num_samples=1, kl_estimator="k3")  # ppo's default KL is in the reward


# ------------------------------------------------------------------------------------- samples and temperature


def test_samples_of_a_prompt_are_consecutive_and_keyed_by_their_sample_index():
    batch = {"input_ids": torch.tensor([[5, 6], [7, 8]]), "attention_mask": torch.ones(2, 2, dtype=torch.long),
             "index": torch.tensor([10, 11]), "fields": {"answer": ["a", "b"]}}
    out = repeat_samples(batch, 3)
    assert out["index"].tolist() == [10, 10, 10, 11, 11, 11]
    assert out["sample"].tolist() == [0, 1, 2, 0, 1, 2]
    assert out["input_ids"][:, 0].tolist() == [5, 5, 5, 7, 7, 7]
    assert out["fields"]["answer"] == ["a", "a", "a", "b", "b", "b"]
    keys = sample_keys(0, 4, out["index"], out["sample"])
    assert len(set(keys.tolist())) == 6
    # The first sample's key is the key of a run with one sample per prompt: PPO trajectories are unchanged.
    assert torch.equal(keys[[0, 3]], sample_keys(0, 4, torch.tensor([10, 11])))


def test_temperature_divides_after_the_float32_cast():
    """bf16 logits / T rounds again in bf16; the float32 division is what sampling does."""
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(2, 5, 50, generator=gen) * 4).bfloat16()
    tokens = torch.randint(0, 50, (2, 5), generator=gen)
    ours = functional.logprobs_from_logits(logits, tokens, 0.7)
    exact = torch.log_softmax(logits.float() / 0.7, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    early = torch.log_softmax((logits / 0.7).float(), -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    assert torch.equal(ours, exact)
    assert not torch.equal(ours, early)


def _experience(advantages: torch.Tensor, mask: torch.Tensor, ref_logprobs: torch.Tensor | None = None) -> Experience:
    batch, length = mask.shape
    return Experience(
        sequences=torch.zeros(batch, length + 1, dtype=torch.long), attention_mask=torch.ones(batch, length + 1),
        response_mask=mask, logprobs=torch.full((batch, length), -1.0), values=None, advantages=advantages,
        returns=None, prompt_length=1, iteration=0, ref_logprobs=ref_logprobs,
    )


# ------------------------------------------------------------------------------------ DAPO, GSPO, CISPO


def _policy_loss(name: str, logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, **config):
    """``name``'s actor loss and statistics on a batch whose behaviour log-probabilities are 0 (so each token's
    ratio is ``exp(logprobs)``), scaled by the batch itself."""
    built = algorithm(name, num_samples=2, **config)
    batch = _experience(advantages, mask)
    batch.logprobs = torch.zeros(mask.shape)
    scale = functional.LossScale(mask.sum().float(), mask.shape[0], mask.shape[1])
    return built.policy_loss(logprobs, None, batch, scale)


@pytest.mark.parametrize(("name", "kl"), [("ppo", (0.05, 0.0)), ("rloo", (0.05, 0.0)), ("grpo", (0.0, 0.04)),
                                          ("gspo", (0.0, 0.04)), ("cispo", (0.0, 0.04)), ("dapo", (0.0, 0.0))])
def test_each_algorithm_has_its_kl_default_and_keeps_the_users(name, kl):
    """GRPO's KL is the paper's: k3 in the loss (beta 0.04), none in the reward; DAPO has none; PPO keeps 0.05 in
    the reward. A coefficient the user sets is kept."""
    built = build_algorithm(name, PPOConfig(), GenerationConfig(num_samples=2))
    assert (built.config.kl_coef, built.config.kl_loss_coef) == kl
    assert built.keeps_ref_logprobs == (kl[1] > 0)
    assert ("reference" in built.roles) == (kl != (0.0, 0.0)) and "reference" in type(built).roles
    mine = build_algorithm(name, PPOConfig(kl_coef=0.01, kl_loss_coef=0.0), GenerationConfig(num_samples=2))
    assert (mine.config.kl_coef, mine.config.kl_loss_coef) == (0.01, 0.0)


def test_the_new_algorithms_take_their_papers_defaults_and_keep_what_the_user_set():
    dapo = build_algorithm("dapo", PPOConfig(), GenerationConfig(num_samples=4, max_new_tokens=24))
    assert dapo.config.clip_epsilons() == (0.2, 0.28) and dapo.config.overlong_buffer == 4  # a fifth of 24
    assert dapo.loss_agg_mode == "token_mean" and dapo.advantage_estimator == "grpo"
    assert algorithm("gspo", num_samples=2).config.clip_epsilons() == (3e-4, 4e-4)
    assert algorithm("gspo", num_samples=2).loss_agg_mode == "seq_mean_token_mean"
    assert algorithm("cispo", num_samples=2).config.clip_epsilons() == (1.0, 0.28)
    assert algorithm("grpo", num_samples=2, clip_range=0.1).config.clip_epsilons() == (0.1, 0.1)
    assert algorithm("grpo", num_samples=2).config.overlong_buffer == 0
    mine = build_algorithm("dapo", PPOConfig(clip_ratio_high=0.3, overlong_buffer=0), GenerationConfig(num_samples=2))
    assert mine.config.clip_epsilons() == (0.2, 0.3) and mine.config.overlong_buffer == 0
    assert algorithm("dapo", num_samples=2, scale_rewards="batch").config.scale_rewards == "batch"
    with pytest.raises(ValueError, match="overlong_buffer .24. must be below generation.max_new_tokens .24."):
        build_algorithm("dapo", PPOConfig(overlong_buffer=24), GenerationConfig(num_samples=2, max_new_tokens=24))
    with pytest.raises(ValueError, match="clip_ratio_low must be at most 1"):
        PPOConfig(clip_ratio_low=1.5)
    with pytest.raises(ValueError, match="scale_rewards='batch' is a setting of .*not of algorithm 'rloo'"):
        algorithm("rloo", num_samples=2, scale_rewards="batch")


def test_settings_of_some_algorithms_default_to_the_running_algorithms_own():
    """None is each algorithm's own: GRPO's family scales by the group's std, PPO whitens, the algorithms that
    compare a prompt's responses sample 4 of them and the others 1; a setting in ``ppo.per_algorithm`` applies only
    to the algorithm it names, over the top-level one."""
    for name in sorted(ALGORITHMS):
        built = build_algorithm(name, PPOConfig(), GenerationConfig())
        cls = ALGORITHMS[name]
        assert built.generation.num_samples == (4 if cls.min_group_size > 1 else 1), name
        assert built.config.scale_rewards == ("group" if cls.advantage_estimator == "grpo" else None), name
        assert built.config.whiten_advantages == (True if name == "ppo" else None), name
    scoped = {"grpo": {"scale_rewards": "batch", "clip_range": 0.1}, "ppo": {"whiten_advantages": False}}
    assert build_algorithm("grpo", PPOConfig(per_algorithm=scoped), GenerationConfig()).config.scale_rewards == "batch"
    assert build_algorithm("grpo", PPOConfig(per_algorithm=scoped), GenerationConfig()).config.clip_epsilons() == (
        0.1, 0.1)
    assert build_algorithm("dapo", PPOConfig(per_algorithm=scoped), GenerationConfig()).config.scale_rewards == "group"
    assert build_algorithm("ppo", PPOConfig(per_algorithm=scoped), GenerationConfig()).config.whiten_advantages is False
    rloo = build_algorithm("rloo", PPOConfig(per_algorithm=scoped), GenerationConfig())
    assert rloo.config.scale_rewards is None and rloo.config.clip_epsilons() == (0.2, 0.2)
    assert build_algorithm("ppo", PPOConfig(), GenerationConfig(num_samples=3)).generation.num_samples == 3


@pytest.mark.parametrize("name", ["dapo", "gspo", "gspo_token", "cispo"])
def test_the_new_algorithms_need_groups_and_learn_nothing_from_equal_rewards(name):
    with pytest.raises(ValueError, match="needs at least 2 per prompt"):
        algorithm(name, num_samples=1)
    advantages, returns = algorithm(name, num_samples=3).advantages(scored([0.7] * 6, MASK_6, 3))
    assert returns is None and torch.equal(advantages, torch.zeros(6, 3))
    loss, stats = _policy_loss(name, torch.randn(6, 3), advantages, torch.tensor(MASK_6))
    assert loss.item() == 0.0


def test_dapo_clips_the_ratio_to_its_decoupled_range():
    """Per token (A = +1 / -1, ratio r): the clipped term ``-A * clip(r, 0.8, 1.28)`` wins above 1.28 for A > 0
    and below 0.8 for A < 0; inside, the plain ``-A * r``. PPO's symmetric 0.2 clips r = 1.25 already."""
    ratios = torch.tensor([[1.25, 1.4, 0.7, 0.9]])
    advantages = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    mask = torch.ones(1, 4, dtype=torch.long)
    loss, stats = _policy_loss("dapo", ratios.log(), advantages, mask)
    assert loss.item() == pytest.approx((-1.25 - 1.28 + 0.8 + 0.9) / 4)
    assert stats["policy/clipfrac"].item() == pytest.approx(2 / 4)
    symmetric, _ = _policy_loss("grpo", ratios.log(), advantages, mask, loss_agg_mode="token_mean")
    assert symmetric.item() == pytest.approx((-1.2 - 1.2 + 0.8 + 0.9) / 4)


def test_gspo_takes_one_clipped_ratio_per_response_over_its_own_tokens():
    """Response 0 has 2 valid tokens with log-ratios 0.1 and 0.3 (the third is padding, log-ratio 5): s = e^0.2,
    clipped to 1.0004 for A = +1. Response 1: log-ratios 1e-4, -1e-4, 0, so s = 1, inside the range. The loss is
    the mean over the responses; the clip fraction counts response 0's two tokens of the five."""
    logprobs = torch.tensor([[0.1, 0.3, 5.0], [1e-4, -1e-4, 0.0]], requires_grad=True)
    advantages = torch.tensor([[1.0, 1.0, 0.0], [-2.0, -2.0, -2.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    loss, stats = _policy_loss("gspo", logprobs, advantages, mask)
    assert loss.item() == pytest.approx((-(1 + 4e-4) + 2.0 * 1.0) / 2, abs=1e-6)
    assert stats["policy/clipfrac"].item() == pytest.approx(2 / 5)
    loss.backward()
    # Response 0 is clipped: no gradient. Response 1: d/d logp_t of -A * s / 2 responses = 2 * s / 3 tokens / 2.
    assert_close(logprobs.grad, torch.tensor([[0.0, 0.0, 0.0], [1 / 3, 1 / 3, 1 / 3]]), atol=1e-6, rtol=1e-5)


def test_gspo_token_equals_gspo_in_value_and_gradient_with_one_advantage_per_response():
    gen = torch.Generator().manual_seed(3)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]])
    advantages = per_token([0.5, -1.5, 1.0], mask.tolist())
    base = 2e-4 * torch.randn(3, 4, generator=gen)  # inside and outside GSPO's tiny range
    results = []
    for name in ("gspo", "gspo_token"):
        logprobs = base.clone().requires_grad_(True)
        loss, stats = _policy_loss(name, logprobs, advantages, mask)
        loss.backward()
        results.append((loss.detach(), stats["policy/clipfrac"], logprobs.grad))
    for sequence, token in zip(*results):
        assert_close(token, sequence, atol=1e-7, rtol=1e-6)


def test_cispo_weights_every_tokens_gradient_by_its_clipped_detached_ratio():
    """Ratios 1.5 (A = +1) and 0.1 (A = -1), token mean: the loss is ``-sg(w) * A * log p`` with w = 1.28 (above
    1 + 0.28) and 0.1 (no lower bound), so the gradients are -1.28 / 2 and +0.1 / 2; PPO's clip would give both 0."""
    logprobs = torch.tensor([[1.5, 0.1]]).log().requires_grad_(True)
    advantages = torch.tensor([[1.0, -1.0]])
    mask = torch.ones(1, 2, dtype=torch.long)
    loss, stats = _policy_loss("cispo", logprobs, advantages, mask)
    assert loss.item() == pytest.approx((-1.28 * math.log(1.5) + 0.1 * math.log(0.1)) / 2)
    assert stats["policy/clipfrac"].item() == pytest.approx(1 / 2)  # only 1.5 left the range
    loss.backward()
    assert_close(logprobs.grad, torch.tensor([[-1.28 / 2, 0.1 / 2]]))


def test_overlong_penalty_falls_linearly_over_the_buffer():
    """max_new_tokens 24, buffer 4, factor 0.5: 0 up to 20 tokens, then -0.5 x (length - 20) / 4."""
    lengths = torch.tensor([10, 20, 21, 23, 24])
    penalty = functional.overlong_penalty(lengths, max_new_tokens=24, buffer=4, factor=0.5)
    assert_close(penalty, torch.tensor([0.0, 0.0, -0.125, -0.375, -0.5]))


# ------------------------------------------------------------------------------------ rollout-trainer mismatch


# Row 0: token ratios (trainer / behaviour) 1, 3, 0.5; row 1: 1.5, then padding (its log-ratio of 9 is ignored).
TRAINER = torch.tensor([[0.0, math.log(3.0), math.log(0.5)], [math.log(1.5), 9.0, 9.0]])
BEHAVIOUR = torch.zeros(2, 3)
MISMATCH_MASK = torch.tensor([[1, 1, 1], [1, 0, 0]])


def test_rollout_correction_statistics_by_hand():
    _, _, stats = functional.rollout_correction(TRAINER, BEHAVIOUR, MISMATCH_MASK, "none", "token", 2.0)
    diffs = [0.0, math.log(3.0), math.log(2.0), math.log(1.5)]
    k3 = [r - 1 - math.log(r) for r in (1.0, 3.0, 0.5, 1.5)]
    assert stats["rollout/logprob_abs_diff_mean"].item() == pytest.approx(sum(diffs) / 4)
    assert stats["rollout/logprob_abs_diff_max"].item() == pytest.approx(math.log(3.0))
    assert stats["rollout/kl_behaviour_trainer"].item() == pytest.approx(sum(k3) / 4)
    assert stats["rollout/is_weight_mean"].item() == 1.0 and stats["rollout/is_masked_frac"].item() == 0.0
    assert tuple(stats) == functional.MISMATCH_STATS


@pytest.mark.parametrize(("mode", "level", "weights", "kept"), [
    ("tis", "token", [[1.0, 2.0, 0.5], [1.5, 0.0, 0.0]], MISMATCH_MASK.tolist()),        # 3 capped at 2
    ("mis", "token", None, [[1, 0, 1], [1, 0, 0]]),                                       # 3 > 2 masked
    ("tis", "sequence", [[1.5, 1.5, 1.5], [1.5, 0.0, 0.0]], MISMATCH_MASK.tolist()),     # 1 x 3 x 0.5 = 1.5
    ("mis", "sequence", None, MISMATCH_MASK.tolist()),                                    # both 1.5 <= 2
])
def test_tis_and_mis_by_hand(mode, level, weights, kept):
    got_weights, got_kept, stats = functional.rollout_correction(TRAINER, BEHAVIOUR, MISMATCH_MASK, mode, level, 2.0)
    assert got_kept.tolist() == kept
    if weights is None:
        assert got_weights is None and stats["rollout/is_weight_mean"].item() == 1.0
    else:
        assert_close(got_weights, torch.tensor(weights))
        assert stats["rollout/is_weight_mean"].item() == pytest.approx(sum(map(sum, weights)) / 4)
    assert stats["rollout/is_masked_frac"].item() == pytest.approx(1 - sum(map(sum, kept)) / 4)


def test_sequence_level_mis_leaves_out_a_whole_sequence_whose_ratio_passes_the_threshold():
    trainer = TRAINER.clone()
    trainer[0] *= 2  # row 0's ratio: (1 x 3 x 0.5)^2 = 2.25 > 2; row 1's stays 1.5
    _, kept, stats = functional.rollout_correction(trainer, BEHAVIOUR, MISMATCH_MASK, "mis", "sequence", 2.0)
    assert kept.tolist() == [[0, 0, 0], [1, 0, 0]]
    assert stats["rollout/is_masked_frac"].item() == pytest.approx(3 / 4)


def test_tis_weights_multiply_each_tokens_surrogate():
    """The same minibatch with is_weights [[2, 0.5]] gives a PPO loss whose tokens count 2x and 0.5x."""
    mask = torch.ones(1, 2, dtype=torch.long)
    advantages = torch.tensor([[1.0, -1.0]])
    logprobs = torch.tensor([[0.1, -0.05]])
    plain, _ = _policy_loss("grpo", logprobs, advantages, mask, loss_agg_mode="token_mean")
    per_token, _, _ = functional.clipped_surrogate(logprobs, torch.zeros(1, 2), advantages, 0.2)
    built = algorithm("grpo", num_samples=2, loss_agg_mode="token_mean")
    batch = _experience(advantages, mask)
    batch.logprobs, batch.is_weights = torch.zeros(1, 2), torch.tensor([[2.0, 0.5]])
    weighted, _ = built.policy_loss(logprobs, None, batch, functional.LossScale(torch.tensor(2.0), 1, 2))
    assert plain.item() == pytest.approx(per_token.mean().item())
    assert weighted.item() == pytest.approx((2.0 * per_token[0, 0] + 0.5 * per_token[0, 1]).item() / 2)


def test_rollout_is_needs_the_trainers_logprobs_and_a_threshold_above_one():
    with pytest.raises(ValueError, match="set ppo.recompute_old_logprobs: true"):
        PPOConfig(rollout_is="tis", recompute_old_logprobs=False)
    with pytest.raises(ValueError, match="rollout_is_threshold must be > 1"):
        PPOConfig(recompute_old_logprobs=True, rollout_is="mis", rollout_is_threshold=1.0)
    assert algorithm("grpo", num_samples=2, recompute_old_logprobs=True).stat_names("actor")[-5:] == \
        functional.MISMATCH_STATS


def test_decoupled_ppo_for_stale_rollouts_by_hand():
    """AReaL's decoupled objective, as ``ppo.recompute_old_logprobs`` with ``ppo.rollout_is: tis`` computes it on a
    rollout that older weights generated (``max_staleness``): the clip is around the proximal policy (the trainer's
    weights before this update), and each token is weighted by proximal over behaviour, capped. Token 0: behaviour
    p = 0.5, proximal 0.6, now 0.66 (ratio 1.1, inside the clip): -A x 1.1 x 1.2. Token 1: behaviour 0.5, proximal
    0.4, now 0.2 (ratio 0.5, clipped at 0.8 with A = -1): 0.8 x 0.8. With proximal = behaviour (a fresh rollout)
    every weight is 1 and the loss is PPO's."""
    behaviour = torch.log(torch.tensor([[0.5, 0.5]]))
    proximal = torch.log(torch.tensor([[0.6, 0.4]]))
    now = torch.log(torch.tensor([[0.66, 0.2]]))
    advantages, mask = torch.tensor([[1.0, -1.0]]), torch.ones(1, 2, dtype=torch.long)
    weights, kept, _ = functional.rollout_correction(proximal, behaviour, mask, "tis", "token", 2.0)
    built = algorithm("ppo", recompute_old_logprobs=True, rollout_is="tis")
    batch = _experience(advantages, mask)
    batch.logprobs, batch.is_weights, batch.response_mask = proximal, weights, kept
    loss, _ = built.policy_loss(now, None, batch, functional.LossScale(torch.tensor(2.0), 1, 2))
    assert weights[0].tolist() == pytest.approx([1.2, 0.8])
    assert loss.item() == pytest.approx((-1.0 * 1.1 * 1.2 + 0.8 * 0.8) / 2)
    fresh, _, _ = functional.rollout_correction(behaviour, behaviour, mask, "tis", "token", 2.0)
    batch.logprobs, batch.is_weights = behaviour, fresh
    corrected, _ = built.policy_loss(now, None, batch, functional.LossScale(torch.tensor(2.0), 1, 2))
    batch.is_weights = None
    plain, _ = built.policy_loss(now, None, batch, functional.LossScale(torch.tensor(2.0), 1, 2))
    assert fresh.tolist() == [[1.0, 1.0]] and corrected.item() == plain.item()
