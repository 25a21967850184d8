"""Hand-checked unit tests for the PPO math in ``lightning_app_rlhf.algorithms.functional`` (and the reward shaping
state in ``algorithms.shaping``).

Every expected number is worked out on paper in the comment next to it; nothing is recomputed with the
formula under test. Tensors are float64 where the function keeps the dtype, so tolerances can be tight.
"""

import math

import pytest
import torch
from torch.testing import assert_close

from lightning_app_rlhf.algorithms.functional import (
    entropy_from_logits,
    discounted_returns,
    gae_advantages,
    kl_penalty,
    last_token_index,
    logprobs_from_logits,
    masked_mean,
    masked_var,
    masked_whiten,
    policy_loss,
    token_logprobs_and_entropy,
    token_rewards,
    value_loss,
)
from lightning_app_rlhf.algorithms.shaping import AdaptiveKLController, FixedKLController, RunningMoments

F64 = torch.float64
TOL = {"rtol": 1e-9, "atol": 1e-9}
LN2 = 0.6931471805599453
LN3 = 1.0986122886681098
LN4 = 1.3862943611198906
LN1_5 = 0.4054651081081644  # ln(3/2)


def t64(data):
    return torch.tensor(data, dtype=F64)


# --------------------------------------------------------------------------------------------- masked stats


def test_masked_mean_all_and_per_row():
    """masked_mean averages only valid entries, over everything or along a dim; an empty row gives 0."""
    values = t64([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])
    # (1 + 2 + 4) / 3 = 7/3
    assert_close(masked_mean(values, mask), t64(7.0 / 3.0), **TOL)
    # row 0: (1 + 2) / 2 = 1.5; row 1: 4 / 1 = 4; row 2: 0 / clamp(0, min=1) = 0
    assert_close(masked_mean(values, mask, dim=1), t64([1.5, 4.0, 0.0]), **TOL)


def test_masked_var_bessel_correction():
    """masked_var uses only valid entries; unbiased=True multiplies by n/(n-1), unbiased=False does not."""
    values = t64([[1.0, 2.0, 3.0], [4.0, 100.0, -50.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    # valid = 1, 2, 3, 4; mean = 2.5; squared deviations 2.25 + 0.25 + 0.25 + 2.25 = 5
    # biased = 5 / 4 = 1.25 ; unbiased = 5 / 3
    assert_close(masked_var(values, mask, unbiased=False), t64(1.25), **TOL)
    assert_close(masked_var(values, mask, unbiased=True), t64(5.0 / 3.0), **TOL)


def test_masked_var_needs_two_tokens():
    """Bessel's correction is undefined for a single valid token: masked_var raises."""
    with pytest.raises(ValueError):
        masked_var(t64([[1.0, 2.0]]), torch.tensor([[1, 0]]))


def test_masked_whiten_zero_mean_unit_var():
    """masked_whiten: valid entries get mean 0 and unbiased var 1; masked entries become exactly 0."""
    values = t64([[1.0, 2.0, 3.0], [4.0, 100.0, -50.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    out = masked_whiten(values, mask)
    # mean 2.5, unbiased var 5/3 -> 1/std = sqrt(3/5) = 0.7745966692414834
    s = 0.7745966692414834
    # (1-2.5)*s = -1.5*s = -1.161895, -0.5*s = -0.387298, 0.5*s = 0.387298, 1.5*s = 1.161895; masked -> 0
    expected = t64([[-1.5 * s, -0.5 * s, 0.5 * s], [1.5 * s, 0.0, 0.0]])
    assert_close(out, expected, rtol=1e-7, atol=1e-8)  # 1e-8 epsilon under the rsqrt
    assert_close(masked_mean(out, mask), t64(0.0), rtol=0, atol=1e-12)
    assert_close(masked_var(out, mask), t64(1.0), rtol=1e-7, atol=1e-8)


def test_masked_whiten_without_shift_keeps_mean():
    """shift_mean=False scales deviations to unit var but adds the original mean (2.5) back."""
    values = t64([[1.0, 2.0, 3.0], [4.0, 100.0, -50.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    out = masked_whiten(values, mask, shift_mean=False)
    s = 0.7745966692414834  # sqrt(3/5)
    # 2.5 - 1.5*s = 1.338105, 2.5 - 0.5*s = 2.112702, 2.5 + 0.5*s = 2.887298, 2.5 + 1.5*s = 3.661895
    expected = t64([[2.5 - 1.5 * s, 2.5 - 0.5 * s, 2.5 + 0.5 * s], [2.5 + 1.5 * s, 0.0, 0.0]])
    assert_close(out, expected, rtol=1e-7, atol=1e-8)
    assert_close(masked_mean(out, mask), t64(2.5), rtol=1e-12, atol=1e-12)
    assert_close(masked_var(out, mask), t64(1.0), rtol=1e-7, atol=1e-8)


def test_masked_whiten_ignores_masked_values():
    """Changing values where mask == 0 leaves the whitened output unchanged."""
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    a = masked_whiten(t64([[1.0, 2.0, 3.0], [4.0, 100.0, -50.0]]), mask)
    b = masked_whiten(t64([[1.0, 2.0, 3.0], [4.0, -7.0, 1e6]]), mask)
    assert_close(a, b, rtol=0, atol=0)


# ------------------------------------------------------------------------------------- logits -> logp / H


def test_logprobs_and_entropy_uniform():
    """Uniform logits over 4 tokens: every log-prob is -ln 4 and the entropy is ln 4."""
    logits = torch.zeros(2, 3, 4)
    tokens = torch.tensor([[0, 1, 2], [3, 0, 1]])
    assert_close(logprobs_from_logits(logits, tokens), torch.full((2, 3), -LN4), rtol=1e-6, atol=1e-6)
    assert_close(entropy_from_logits(logits), torch.full((2, 3), LN4), rtol=1e-6, atol=1e-6)


def test_logprobs_and_entropy_two_tokens():
    """logits [0, ln 3] -> probs 1/4, 3/4; a constant shift of the logits changes nothing."""
    # row 0: logits [0, ln3]; row 1: same shifted by +5 -> softmax identical
    logits = torch.tensor([[[0.0, LN3], [0.0, LN3]], [[5.0, 5.0 + LN3], [5.0, 5.0 + LN3]]])
    tokens = torch.tensor([[0, 1], [1, 0]])
    # e^0 = 1, e^ln3 = 3 -> p = 1/4, 3/4 ; ln(1/4) = -1.386294, ln(3/4) = -0.287682
    lp0, lp1 = -LN4, -0.2876820724517809
    expected_lp = torch.tensor([[lp0, lp1], [lp1, lp0]])
    assert_close(logprobs_from_logits(logits, tokens), expected_lp, rtol=1e-6, atol=1e-6)
    # H = -(1/4 ln 1/4 + 3/4 ln 3/4) = 0.25*1.386294 + 0.75*0.287682 = 0.346574 + 0.215762 = 0.562335
    assert_close(entropy_from_logits(logits), torch.full((2, 2), 0.5623351446188083), rtol=1e-6, atol=1e-6)



def test_token_logprobs_and_entropy_hand_values_and_gradient():
    """logits [0, ln 3] (p = 1/4, 3/4), token 1: log p = ln 3/4; d log p / dx = onehot - p = [-1/4, 1/4]. H = 0.562335,
    dH/dx = -p (log p + H) = [-1/4 (-1.386294 + 0.562335), -3/4 (-0.287682 + 0.562335)] = [0.205990, -0.205990].
    An extra last position (what ``logits_to_keep=T + 1`` returns) gets zero gradient."""
    logits = torch.tensor([[[0.0, LN3], [7.0, -7.0]]], requires_grad=True)
    logprobs, entropy = token_logprobs_and_entropy(logits, torch.tensor([[1]]), entropy_grad=True)
    assert_close(logprobs, torch.tensor([[-0.2876820724517809]]))
    assert_close(entropy, torch.tensor([[0.5623351446188083]]))
    (grad,) = torch.autograd.grad(logprobs.sum(), logits, retain_graph=True)
    assert_close(grad, torch.tensor([[[-0.25, 0.25], [0.0, 0.0]]]))
    (grad,) = torch.autograd.grad(entropy.sum(), logits)
    assert_close(grad, torch.tensor([[[0.2059896, -0.2059896], [0.0, 0.0]]]), atol=1e-6, rtol=0)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("entropy_grad", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_logprobs_and_entropy_match_autograd(temperature: float, entropy_grad: bool, dtype: torch.dtype):
    """The closed-form backward gives autograd's gradients of log_softmax + gather (+ entropy) on the sliced
    logits, for any temperature, with and without the entropy's graph, and for bf16 logits (autocast's LM head:
    compared with autograd on the same logits in float32, since autograd's own bf16 path sums the two terms'
    gradients in bf16)."""
    generator = torch.Generator().manual_seed(0)
    full = (torch.randn(3, 5, 11, generator=generator) * 3).to(dtype)
    tokens = torch.randint(0, 11, (3, 4), generator=generator)
    weights = torch.randn(3, 4, generator=generator)
    ours_in = full.clone().requires_grad_()
    ours_lp, ours_h = token_logprobs_and_entropy(ours_in, tokens, temperature, entropy_grad)
    ref_in = full.float().requires_grad_()
    ref_lp = logprobs_from_logits(ref_in[:, :4], tokens, temperature)
    ref_h = entropy_from_logits(ref_in[:, :4] if entropy_grad else ref_in[:, :4].detach(), temperature)
    assert_close(ours_lp, ref_lp, rtol=1e-6, atol=1e-6)
    assert_close(ours_h, ref_h, rtol=1e-6, atol=1e-6)
    assert ours_h.requires_grad is entropy_grad
    loss = lambda lp, h: (lp * weights).sum() + ((h * weights.flip(0)).sum() if entropy_grad else 0)  # noqa: E731
    (ours_grad,) = torch.autograd.grad(loss(ours_lp, ours_h), ours_in)
    (ref_grad,) = torch.autograd.grad(loss(ref_lp, ref_h), ref_in)
    assert ours_grad.dtype == dtype
    if dtype == torch.float32:
        assert_close(ours_grad, ref_grad, rtol=1e-5, atol=1e-6)
    else:  # one bf16 rounding of the float32 gradient (within one bf16 step)
        assert_close(ours_grad.float(), ref_grad.to(dtype).float(), rtol=2**-8, atol=1e-6)
    assert not ours_grad[:, 4:].any()


# ------------------------------------------------------------------------------------------ KL estimators


def test_kl_k1_and_k3_specific_values():
    """k1 = log p - log q; k3 = (r - 1) - log r with r = q/p, for p=1/2, q=1/4 and for p=1/4, q=1/2."""
    logp = t64([math.log(0.5), math.log(0.25)])
    ref = t64([math.log(0.25), math.log(0.5)])
    # k1: ln(0.5/0.25) = ln2 = 0.693147 ; ln(0.25/0.5) = -ln2
    assert_close(kl_penalty(logp, ref, "k1"), t64([LN2, -LN2]), **TOL)
    # k3, r = q/p: r = 0.5 -> -0.5 - ln0.5 = -0.5 + 0.693147 = 0.193147
    #              r = 2   ->  1.0 - ln2   = 1 - 0.693147   = 0.306853
    assert_close(kl_penalty(logp, ref, "k3"), t64([LN2 - 0.5, 1.0 - LN2]), **TOL)
    # default estimator is k1
    assert_close(kl_penalty(logp, ref), t64([LN2, -LN2]), **TOL)


def test_kl_k3_nonnegative_and_zero_when_equal():
    """k3 is never negative (even where k1 is) and is exactly 0 when the log-probs agree."""
    gen = torch.Generator().manual_seed(0)
    logp = -torch.rand(4, 5, generator=gen, dtype=F64) * 5
    ref = -torch.rand(4, 5, generator=gen, dtype=F64) * 5
    assert (kl_penalty(logp, ref, "k1") < 0).any()
    assert (kl_penalty(logp, ref, "k3") >= 0).all()
    assert_close(kl_penalty(logp, logp, "k3"), torch.zeros(4, 5, dtype=F64), rtol=0, atol=0)


def test_kl_unknown_estimator_raises():
    """An estimator name other than k1/k3 is rejected."""
    with pytest.raises(ValueError):
        kl_penalty(t64([0.0]), t64([0.0]), "k2")


# ------------------------------------------------------------------------------------- KL coefficients


def test_adaptive_kl_controller_updates_by_hand():
    """value *= 1 + clip(kl/target - 1, -0.2, 0.2) * n / horizon, checked over three updates."""
    ctl = AdaptiveKLController(init_kl_coef=0.2, target=6.0, horizon=10000)
    ctl.update(current_kl=9.0, n_samples=1000)
    # error = 9/6 - 1 = 0.5 -> clipped to +0.2; 0.2 * (1 + 0.2 * 1000/10000) = 0.2 * 1.02 = 0.204
    assert ctl.value == pytest.approx(0.204, rel=1e-12)
    ctl.update(current_kl=5.4, n_samples=2000)
    # error = 5.4/6 - 1 = -0.1 (no clip); 0.204 * (1 - 0.1 * 0.2) = 0.204 * 0.98 = 0.19992
    assert ctl.value == pytest.approx(0.19992, rel=1e-12)
    ctl.update(current_kl=0.0, n_samples=5000)
    # error = 0/6 - 1 = -1 -> clipped to -0.2; 0.19992 * (1 - 0.2 * 0.5) = 0.19992 * 0.9 = 0.179928
    assert ctl.value == pytest.approx(0.179928, rel=1e-12)


def test_adaptive_kl_controller_state_dict_round_trip():
    """A controller restored from state_dict has the same value and evolves identically afterwards."""
    ctl = AdaptiveKLController(init_kl_coef=0.2, target=6.0, horizon=10000)
    ctl.update(current_kl=9.0, n_samples=1000)  # -> 0.204
    restored = AdaptiveKLController(init_kl_coef=1.0, target=6.0, horizon=10000)
    restored.load_state_dict(ctl.state_dict())
    assert restored.value == pytest.approx(0.204, rel=1e-12)
    ctl.update(current_kl=5.4, n_samples=2000)
    restored.update(current_kl=5.4, n_samples=2000)
    # both: 0.204 * 0.98 = 0.19992
    assert restored.value == pytest.approx(0.19992, rel=1e-12)
    assert restored.value == ctl.value


def test_fixed_kl_controller_ignores_update_and_round_trips():
    """FixedKLController keeps its value whatever KL it is told; state_dict restores it."""
    ctl = FixedKLController(0.1)
    ctl.update(current_kl=100.0, n_samples=1000)
    ctl.update(current_kl=0.0, n_samples=1000)
    assert ctl.value == 0.1
    restored = FixedKLController(0.5)
    restored.load_state_dict(ctl.state_dict())
    assert restored.value == 0.1


# ------------------------------------------------------------------------------------------ RunningMoments


def test_running_moments_two_batches_match_concatenation():
    """After [1,2,3] then [4,10], mean/var equal the mean/population var of [1,2,3,4,10]."""
    rm = RunningMoments()
    assert (rm.mean, rm.std, rm.count) == (0.0, 1.0, 0)
    rm.update(torch.tensor([1.0, 2.0, 3.0]))
    # mean 2; population var (1 + 0 + 1) / 3 = 2/3
    assert rm.mean == pytest.approx(2.0, rel=1e-12)
    assert rm.var == pytest.approx(2.0 / 3.0, rel=1e-12)
    assert rm.count == 3
    rm.update(torch.tensor([4.0, 10.0]))
    # all = 1,2,3,4,10: mean 20/5 = 4; deviations -3,-2,-1,0,6 -> 9+4+1+0+36 = 50; pop var 50/5 = 10
    assert rm.mean == pytest.approx(4.0, rel=1e-12)
    assert rm.var == pytest.approx(10.0, rel=1e-12)
    assert rm.std == pytest.approx(math.sqrt(10.0), rel=1e-12)  # 3.162278
    assert rm.count == 5


def test_running_moments_single_value_and_state_dict():
    """With one value seen the std falls back to 1; state_dict round trip restores mean/var/count."""
    rm = RunningMoments()
    rm.update(torch.tensor([3.0]))
    # mean 0 + (3 - 0) * 1/1 = 3, count 1 -> std defaults to 1.0
    assert rm.mean == pytest.approx(3.0)
    assert rm.std == 1.0
    rm.update(torch.tensor([]))  # empty batch is a no-op
    assert rm.count == 1
    rm.update(torch.tensor([5.0]))
    # all = 3, 5: mean 4, pop var (1 + 1) / 2 = 1
    restored = RunningMoments()
    restored.load_state_dict(rm.state_dict())
    assert (restored.mean, restored.var, restored.count) == pytest.approx((4.0, 1.0, 2))
    assert restored.std == pytest.approx(1.0)


# ------------------------------------------------------------------------------------------ rewards / GAE


def test_last_token_index():
    """Index of the last 1 in each row; 0 for an all-zero row."""
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0], [1, 0, 0]])
    assert last_token_index(mask).tolist() == [1, 2, 0, 0]


def test_token_rewards_kl_penalty_plus_final_score():
    """-kl_coef*kl on every valid token, score added on the last valid one; nothing on padding."""
    kl = t64([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6], [0.7, 0.8, 0.9]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [0, 0, 0]])
    scores = t64([1.0, -2.0, 5.0])
    rewards = token_rewards(scores, kl, 0.5, mask)
    expected = t64(
        [
            # -0.5*0.1 = -0.05, -0.5*0.2 = -0.1, -0.5*0.3 + 1 = 0.85
            [-0.05, -0.1, 0.85],
            # -0.5*0.4 = -0.2, -0.5*0.5 - 2 = -2.25, padding -> 0
            [-0.2, -2.25, 0.0],
            # empty row: no penalty and no score
            [0.0, 0.0, 0.0],
        ]
    )
    assert_close(rewards, expected, **TOL)


def test_token_rewards_ignore_masked_kl():
    """KL values at masked positions do not leak into the rewards."""
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    scores = t64([1.0, -2.0])
    a = token_rewards(scores, t64([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6]]), 0.5, mask)
    b = token_rewards(scores, t64([[0.1, 0.2, 0.3], [0.4, 0.5, 1e3]]), 0.5, mask)
    assert_close(a, b, rtol=0, atol=0)


def _gae_inputs():
    # row 0: full length 3; row 1: ends after 2 tokens (the 9.0 / 7.0 at t=2 are padding garbage)
    rewards = t64([[1.0, 0.0, 2.0], [0.5, 1.0, 9.0]])
    values = t64([[0.5, 1.0, 1.0], [1.0, 2.0, 7.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    return rewards, values, mask


def test_gae_advantages_and_returns_by_hand():
    """GAE with gamma=0.9, lam=0.5 (gamma*lam=0.45) on a full row and a row that ends early."""
    rewards, values, mask = _gae_inputs()
    adv, ret = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.5)
    # row 0 (bootstrap after t=2 is 0):
    #   delta_2 = 2 + 0.9*0 - 1   = 1      A_2 = 1
    #   delta_1 = 0 + 0.9*1 - 1   = -0.1   A_1 = -0.1 + 0.45*1    = 0.35
    #   delta_0 = 1 + 0.9*1 - 0.5 = 1.4    A_0 = 1.4 + 0.45*0.35  = 1.5575
    # row 1 (ends at t=1, so V after it is 0 and t=2 is ignored):
    #   delta_1 = 1 + 0.9*0 - 2   = -1     A_1 = -1
    #   delta_0 = 0.5 + 0.9*2 - 1 = 1.3    A_0 = 1.3 + 0.45*(-1)  = 0.85
    #   A_2 = 0 (padding)
    expected_adv = t64([[1.5575, 0.35, 1.0], [0.85, -1.0, 0.0]])
    # returns = A + V: 1.5575+0.5 = 2.0575, 0.35+1 = 1.35, 1+1 = 2 ; 0.85+1 = 1.85, -1+2 = 1, padding 0
    expected_ret = t64([[2.0575, 1.35, 2.0], [1.85, 1.0, 0.0]])
    assert_close(adv, expected_adv, **TOL)
    assert_close(ret, expected_ret, **TOL)


def test_gae_ignores_values_and_rewards_after_end():
    """Changing rewards/values where mask == 0 leaves advantages and returns unchanged."""
    rewards, values, mask = _gae_inputs()
    adv_a, ret_a = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.5)
    rewards_b, values_b = rewards.clone(), values.clone()
    rewards_b[1, 2], values_b[1, 2] = -123.0, 456.0
    adv_b, ret_b = gae_advantages(rewards_b, values_b, mask, gamma=0.9, lam=0.5)
    assert_close(adv_a, adv_b, rtol=0, atol=0)
    assert_close(ret_a, ret_b, rtol=0, atol=0)


def test_gae_skips_a_multi_turn_episodes_observation_tokens_by_hand():
    """Mask 1 0 0 1 (turn, observation, observation, turn): the recursion runs over the two sampled tokens as if
    adjacent; the observations' rewards and values (garbage here) count nowhere. gamma=0.9, lam=0.5."""
    rewards = t64([[1.0, 50.0, 60.0, 2.0]])
    values = t64([[0.5, 70.0, 80.0, 1.0]])
    mask = torch.tensor([[1, 0, 0, 1]])
    adv, ret = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.5)
    #   t=3: delta = 2 + 0 - 1 = 1                   A_3 = 1
    #   t=0: delta = 1 + 0.9*1 - 0.5 = 1.4 (V next = V_3)   A_0 = 1.4 + 0.45*1 = 1.85
    assert_close(adv, t64([[1.85, 0.0, 0.0, 1.0]]), **TOL)
    assert_close(ret, t64([[2.35, 0.0, 0.0, 2.0]]), **TOL)


def test_discounted_returns_skip_observation_tokens_by_hand():
    """G_t over the sampled tokens only: rewards 1 | (obs) | 2 with gamma 0.5 -> G_3 = 2, G_0 = 1 + 0.5*2 = 2."""
    returns = discounted_returns(t64([[1.0, 9.0, 9.0, 2.0]]), torch.tensor([[1, 0, 0, 1]]), 0.5)
    assert_close(returns, t64([[2.0, 0.0, 0.0, 2.0]]), **TOL)


def test_token_rewards_keep_turn_rewards_on_their_turns():
    """Turn rewards 0.5 (turn 1, t=1) and 0.25 (turn 2, t=4) are part of the score 2.0: they stay on their tokens,
    and the last token gets the rest, 2.0 - 0.75 = 1.25; the KL penalty -0.5*kl on every sampled token."""
    mask = torch.tensor([[1, 1, 0, 1, 1]])
    kl = t64([[0.2, 0.2, 9.0, 0.2, 0.2]])
    turns = t64([[0.0, 0.5, 0.0, 0.0, 0.25]])
    rewards = token_rewards(t64([2.0]), kl, 0.5, mask, turns)
    assert_close(rewards, t64([[-0.1, 0.4, 0.0, -0.1, -0.1 + 0.25 + 1.25]]), **TOL)


# -------------------------------------------------------------------------------------------------- losses


def _policy_inputs():
    # ratio r = exp(logp - old); old = -1 everywhere, logp = -1 + ln r
    # tokens: (r=1.5, A=+1) (r=0.5, A=-1) (r=1, A=2) | (r=0.5, A=+1) (r=1.5, A=-1) (masked)
    old = torch.full((2, 3), -1.0, dtype=F64)
    logp = t64([[-1.0 + LN1_5, -1.0 - LN2, -1.0], [-1.0 - LN2, -1.0 + LN1_5, 3.0]])
    adv = t64([[1.0, -1.0, 2.0], [1.0, -1.0, 50.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    return logp, old, adv, mask


def test_policy_loss_clipping_clipfrac_and_approx_kl():
    """Clipped surrogate with eps=0.2: clipping active for A>0, r>1.2 and for A<0, r<0.8 only."""
    logp, old, adv, mask = _policy_inputs()
    logp = logp.clone().requires_grad_(True)
    loss, clipfrac, approx_kl = policy_loss(logp, old, adv, mask, clip_range=0.2)
    # per token max(-A*r, -A*clip(r, 0.8, 1.2)):
    #   r=1.5, A=+1: max(-1.5, -1.2) = -1.2  (clipped term larger -> counts)
    #   r=0.5, A=-1: max( 0.5,  0.8) =  0.8  (clipped term larger -> counts)
    #   r=1,   A=2 : max(-2,   -2  ) = -2    (equal -> does not count)
    #   r=0.5, A=+1: max(-0.5, -0.8) = -0.5  (unclipped)
    #   r=1.5, A=-1: max( 1.5,  1.2) =  1.5  (unclipped)
    # loss = (-1.2 + 0.8 - 2 - 0.5 + 1.5) / 5 = -1.4 / 5 = -0.28
    assert_close(loss, t64(-0.28), **TOL)
    # clipfrac = 2 / 5 = 0.4
    assert clipfrac.item() == pytest.approx(0.4, abs=1e-7)  # float32 from a 0/1 mean
    # approx_kl = mean((r - 1) - ln r): r=1.5 -> 0.5 - 0.405465 = 0.094535 ; r=0.5 -> -0.5 + 0.693147 = 0.193147
    #   (2*0.094535 + 2*0.193147 + 0) / 5 = 0.575364 / 5 = 0.115073
    assert_close(approx_kl, t64((2 * (0.5 - LN1_5) + 2 * (LN2 - 0.5)) / 5), **TOL)
    assert approx_kl.item() == pytest.approx(0.1150728, abs=1e-7)
    # gradient d loss / d logp = -A*r/5 where the unclipped term is used, 0 where clipped or masked:
    #   clipped -> 0, 0 ; r=1,A=2 -> -2/5 = -0.4 ; r=0.5,A=1 -> -0.5/5 = -0.1 ; r=1.5,A=-1 -> 1.5/5 = 0.3 ; masked 0
    loss.backward()
    assert_close(logp.grad, t64([[0.0, 0.0, -0.4], [-0.1, 0.3, 0.0]]), **TOL)


def test_policy_loss_ignores_masked_positions():
    """Garbage logprobs / old logprobs / advantages at mask == 0 leave loss, clipfrac, approx_kl unchanged."""
    logp, old, adv, mask = _policy_inputs()
    a = policy_loss(logp, old, adv, mask, clip_range=0.2)
    logp_b, old_b, adv_b = logp.clone(), old.clone(), adv.clone()
    logp_b[1, 2], old_b[1, 2], adv_b[1, 2] = -40.0, 10.0, -1e4
    b = policy_loss(logp_b, old_b, adv_b, mask, clip_range=0.2)
    for x, y in zip(a, b):
        assert_close(x, y, rtol=0, atol=0)


def _value_inputs():
    # tokens (old, v, R): (1, 1.5, 1) (1, 1.5, 2) (0, 0.1, 1) | (0, -1, 0.5) (0, -1, -2) (masked)
    old = t64([[1.0, 1.0, 0.0], [0.0, 0.0, 5.0]])
    values = t64([[1.5, 1.5, 0.1], [-1.0, -1.0, -8.0]])
    returns = t64([[1.0, 2.0, 1.0], [0.5, -2.0, 30.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    return values, old, returns, mask


def test_value_loss_clipped_case():
    """Clipped value loss with eps=0.2: max of squared errors, the 0.5 factor, and the clipfrac."""
    values, old, returns, mask = _value_inputs()
    loss, clipfrac = value_loss(values, old, returns, mask, clip_range=0.2)
    # v_clip = old + clip(v - old, -0.2, 0.2); per token (v-R)^2 vs (v_clip-R)^2:
    #   old=1, v=1.5, R=1 : v_clip=1.2 ; 0.25 vs 0.04 -> 0.25
    #   old=1, v=1.5, R=2 : v_clip=1.2 ; 0.25 vs 0.64 -> 0.64 (clipped larger, counts)
    #   old=0, v=0.1, R=1 : v_clip=0.1 ; 0.81 vs 0.81 -> 0.81 (equal, does not count)
    #   old=0, v=-1,  R=0.5: v_clip=-0.2; 2.25 vs 0.49 -> 2.25
    #   old=0, v=-1,  R=-2: v_clip=-0.2; 1.00 vs 3.24 -> 3.24 (clipped larger, counts)
    # loss = 0.5 * (0.25 + 0.64 + 0.81 + 2.25 + 3.24) / 5 = 0.5 * 7.19 / 5 = 0.5 * 1.438 = 0.719
    assert_close(loss, t64(0.719), rtol=1e-12, atol=1e-12)
    # clipfrac = 2 / 5 = 0.4
    assert clipfrac.item() == pytest.approx(0.4, abs=1e-7)  # float32 from a 0/1 mean


def test_value_loss_unclipped_case():
    """With a huge clip range no clipping happens: loss = 0.5 * mean squared error, clipfrac 0."""
    values, old, returns, mask = _value_inputs()
    loss, clipfrac = value_loss(values, old, returns, mask, clip_range=100.0)
    # 0.5 * (0.25 + 0.25 + 0.81 + 2.25 + 1.0) / 5 = 0.5 * 4.56 / 5 = 0.5 * 0.912 = 0.456
    assert_close(loss, t64(0.456), rtol=1e-12, atol=1e-12)
    assert clipfrac.item() == 0.0


def test_value_loss_half_factor_single_token():
    """One token, v = old = 3, R = 1: loss = 0.5 * (3 - 1)^2 = 2 (not 4)."""
    loss, clipfrac = value_loss(t64([[3.0]]), t64([[3.0]]), t64([[1.0]]), torch.tensor([[1]]), clip_range=0.2)
    assert_close(loss, t64(2.0), **TOL)
    assert clipfrac.item() == 0.0


def test_value_loss_ignores_masked_positions():
    """Garbage values / old values / returns at mask == 0 leave the value loss and clipfrac unchanged."""
    values, old, returns, mask = _value_inputs()
    a = value_loss(values, old, returns, mask, clip_range=0.2)
    values_b, old_b, returns_b = values.clone(), old.clone(), returns.clone()
    values_b[1, 2], old_b[1, 2], returns_b[1, 2] = 1e3, -1e3, 0.0
    b = value_loss(values_b, old_b, returns_b, mask, clip_range=0.2)
    for x, y in zip(a, b):
        assert_close(x, y, rtol=0, atol=0)

