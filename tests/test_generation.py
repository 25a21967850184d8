"""Tests for ``lightning_app_rlhf.generation``: keyed sampling, masks, early stop and behaviour log-probs.

Exact mask and token checks use :class:`ScriptedLM`, a stand-in for a Hugging Face causal LM whose logits
force a known token per row and step; the rest use a real tiny random-init GPT-2 built by the package.
"""

import math
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.testing import assert_close

from lightning_app_rlhf.algorithms import build_algorithm, functional
from lightning_app_rlhf.core.config import GenerationConfig, PPOConfig
from lightning_app_rlhf.data import collate_left_padded
from lightning_app_rlhf.engine.engine import RLHFEngine
from lightning_app_rlhf.engine.experience import RewardShaping, make_experience
from lightning_app_rlhf.generation import (
    Rollout,
    check_context_length,
    exponential_race,
    filter_log_probs,
    generate,
    hash32,
    keyed_seeds,
    keyed_uniforms,
    model_eos_token_ids,
    position_ids_from_mask,
    row_chunks,
    sample_keys,
)
from lightning_app_rlhf.generation.hf_cache import CACHE_ARGUMENT
from lightning_app_rlhf.generation.sampling import next_token, sum_tree_draw, tree_depth
from lightning_app_rlhf.models.calls import critic_forward, reference_forward, response_logits, reward_forward
from lightning_app_rlhf.models.roles import ModelSpec, build_causal_lm, build_critic, build_reward_model

PAD, EOS = 0, 2
VOCAB = 8
LOG4 = math.log(4.0)


@dataclass
class FakeCache:
    """Stands in for the KV cache (``CACHE_ARGUMENT``): only counts the decoding steps seen so far."""

    step: int


class ScriptedLM(nn.Module):
    """Mimics a HF causal LM. At step t, row b puts logit log(4) on ``script[b][t]`` and 0 on the other tokens.

    With ``top_k=1`` the scripted token is always sampled, and its log-probability at temperature tau is
    log(4**(1/tau) / (4**(1/tau) + VOCAB - 1)), a number we know in advance. Every call is recorded.
    """

    def __init__(self, script: list[list[int]], vocab: int = VOCAB) -> None:
        super().__init__()
        self.script = script
        self.vocab = vocab
        self.calls: list[dict[str, torch.Tensor]] = []

    def forward(self, input_ids, attention_mask, position_ids, use_cache=True, **kwargs):
        cache = kwargs.get(CACHE_ARGUMENT)  # the installed transformers' name for it
        step = 0 if cache is None else cache.step
        self.calls.append({
            "input_ids": input_ids.clone(),
            "attention_mask": attention_mask.clone(),
            "position_ids": position_ids.clone(),
            "use_cache": use_cache,
        })
        batch, length = input_ids.shape
        logits = torch.zeros(batch, length, self.vocab)
        for row in range(batch):
            logits[row, -1, self.script[row][step]] = LOG4
        return SimpleNamespace(logits=logits, **{CACHE_ARGUMENT: FakeCache(step + 1)})


class EOSBiased(nn.Module):
    """A real causal LM with ``bias`` added to the EOS logit, so that random-init responses do end."""

    def __init__(self, inner: nn.Module, bias: float) -> None:
        super().__init__()
        self.inner = inner
        self.bias = bias

    @property
    def config(self):
        return self.inner.config

    def forward(self, **kwargs):
        out = self.inner(**kwargs)
        logits = out.logits.clone()
        logits[..., EOS] += self.bias
        out.logits = logits
        return out


def scripted_logprob(temperature: float) -> float:
    boosted = 4.0 ** (1.0 / temperature)
    return math.log(boosted / (boosted + VOCAB - 1))


# Row 0 is left-padded by one token; row 1 is full.
PROMPT_IDS = torch.tensor([[PAD, 6, 7], [3, 4, 5]])
PROMPT_MASK = torch.tensor([[0, 1, 1], [1, 1, 1]])
KEYS = sample_keys(0, 0, torch.tensor([0, 1]))


@pytest.fixture
def gpt2(tiny_gpt2_config):
    """The tiny GPT-2 built by the package (init_seed 0, dropout off)."""
    return build_causal_lm(ModelSpec(config=tiny_gpt2_config, init_seed=0))


def encode_batch(tokenizer, prompts: list[str], indices: list[int]) -> dict[str, torch.Tensor]:
    items = [
        {"input_ids": tokenizer(p, add_special_tokens=False)["input_ids"], "index": i}
        for p, i in zip(prompts, indices)
    ]
    return collate_left_padded(items, pad_token_id=tokenizer.pad_token_id)


def run(model, batch, config, seed=0, iteration=0):
    keys = sample_keys(seed, iteration, batch["index"])
    return generate(model, batch["input_ids"], batch["attention_mask"], config, keys, EOS, PAD)


def run_with_tokenizer(model, batch, config, tokenizer, seed=1):
    keys = sample_keys(seed, 0, batch["index"])
    return generate(model, batch["input_ids"], batch["attention_mask"], config, keys, EOS, PAD, tokenizer=tokenizer)


# ---- exact masks with a scripted model ----


def test_scripted_masks_pad_after_eos_and_logprobs():
    """Row 0 emits EOS at step 2 and row 1 never: exact tokens, pad after EOS, masks and log-probs."""
    model = ScriptedLM([[5, 3, EOS, 6, 6, 6], [4, 4, 4, 4, 4, 4]])
    config = GenerationConfig(max_new_tokens=5, top_k=1)
    rollout = generate(model, PROMPT_IDS, PROMPT_MASK, config, KEYS, EOS, PAD)

    assert rollout.prompt_length == 3
    assert rollout.responses.tolist() == [[5, 3, EOS, PAD, PAD], [4, 4, 4, 4, 4]]
    assert rollout.sequences.tolist() == [[PAD, 6, 7, 5, 3, EOS, PAD, PAD], [3, 4, 5, 4, 4, 4, 4, 4]]
    assert rollout.response_mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]
    assert rollout.attention_mask.tolist() == [[0, 1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1]]
    assert torch.equal(rollout.attention_mask, torch.cat([PROMPT_MASK, rollout.response_mask], dim=1))
    assert rollout.response_mask.dtype == PROMPT_MASK.dtype
    lp = scripted_logprob(1.0)
    expected = torch.tensor([[lp, lp, lp, 0.0, 0.0], [lp] * 5])
    assert_close(rollout.logprobs, expected, rtol=0, atol=1e-6)
    assert torch.all(rollout.logprobs[rollout.response_mask == 0] == 0)


def test_scripted_early_stop_when_all_rows_done():
    """When every row has emitted EOS, generation stops: T is shorter than max_new_tokens."""
    model = ScriptedLM([[5, 3, EOS, 6, 6, 6, 6, 6], [4, 4, 4, EOS, 4, 4, 4, 4]])
    config = GenerationConfig(max_new_tokens=8, top_k=1)
    rollout = generate(model, PROMPT_IDS, PROMPT_MASK, config, KEYS, EOS, PAD)

    assert rollout.responses.shape == (2, 4)
    assert rollout.responses.tolist() == [[5, 3, EOS, PAD], [4, 4, 4, EOS]]
    assert rollout.response_mask.tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]
    assert rollout.attention_mask.shape == (2, 3 + 4)
    # One prompt forward plus one decode step per generated token except the last: no wasted steps.
    assert len(model.calls) == 4


def test_scripted_positions_and_cache_inputs():
    """The prompt forward gets padding-skipping positions; each decode step feeds one token at the next position."""
    model = ScriptedLM([[5, 3, EOS, 6], [4, 4, 4, EOS]])
    generate(model, PROMPT_IDS, PROMPT_MASK, GenerationConfig(max_new_tokens=4, top_k=1), KEYS, EOS, PAD)

    first = model.calls[0]
    assert torch.equal(first["input_ids"], PROMPT_IDS)
    assert first["position_ids"].tolist() == [[0, 0, 1], [0, 1, 2]]
    assert torch.equal(first["attention_mask"], PROMPT_MASK)
    assert first["use_cache"] is True
    # Decode step s (1-based) feeds the token sampled at step s-1, one position further, mask grown by one.
    fed = [[5, 4], [3, 4], [EOS, 4]]
    for s, call in enumerate(model.calls[1:], start=1):
        assert call["input_ids"].tolist() == [[t] for t in fed[s - 1]]
        assert call["position_ids"].tolist() == [[1 + s], [2 + s]]
        assert call["attention_mask"].shape == (2, 3 + s)
        assert torch.equal(call["attention_mask"][:, :3], PROMPT_MASK)
        assert torch.all(call["attention_mask"][:, 3:] == 1)


def test_scripted_logprobs_use_temperature_without_top_k():
    """Behaviour log-probs are at the sampling temperature over the full (unfiltered) distribution."""
    model = ScriptedLM([[5, EOS, 6], [4, 4, EOS]])
    rollout = generate(model, PROMPT_IDS, PROMPT_MASK, GenerationConfig(max_new_tokens=3, temperature=2.0, top_k=1),
                       KEYS, EOS, PAD)
    lp = scripted_logprob(2.0)  # log(2/9)
    assert lp == pytest.approx(math.log(2 / 9))
    assert_close(rollout.logprobs, torch.tensor([[lp, lp, 0.0], [lp, lp, lp]]), rtol=0, atol=1e-6)


def test_position_ids_from_mask_skips_left_padding():
    """Positions count only real tokens, so a left-padded prompt sees the positions of an unpadded one."""
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 1]])
    assert position_ids_from_mask(mask).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4], [0, 0, 0, 0, 0]]


# ---- a real tiny GPT-2 ----


def test_gpt2_masks_follow_first_eos(gpt2, tokenizer):
    """Real GPT-2: mask is 1 up to and including the first EOS, pad and zero log-prob after, 1s without EOS."""
    model = EOSBiased(gpt2, bias=4.0)
    prompts = ["list some fruit:", "red", "name a few animals: cat dog", "give me colors, like blue:"]
    batch = encode_batch(tokenizer, prompts, [0, 1, 2, 3])
    max_new = 8
    rollout = run(model, batch, GenerationConfig(max_new_tokens=max_new))
    responses, mask = rollout.responses, rollout.response_mask
    T = responses.shape[1]

    ended_early, never_ended = 0, 0
    for row in range(len(prompts)):
        eos_at = (responses[row] == EOS).nonzero().flatten().tolist()
        if eos_at:
            e = eos_at[0]
            ended_early += e + 1 < max_new
            assert mask[row, : e + 1].tolist() == [1] * (e + 1)
            assert mask[row, e + 1 :].tolist() == [0] * (T - e - 1)
            assert responses[row, e + 1 :].tolist() == [PAD] * (T - e - 1)
        else:
            never_ended += 1
            assert mask[row].tolist() == [1] * T
    # The scenario this test is about: both kinds of rows occur.
    assert ended_early >= 1 and never_ended >= 1
    assert T == max_new  # a row without EOS keeps generation going to the limit
    assert torch.equal(rollout.attention_mask, torch.cat([batch["attention_mask"], mask], dim=1))
    assert torch.equal(rollout.sequences[:, : rollout.prompt_length], batch["input_ids"])
    assert torch.all(rollout.logprobs[mask == 0] == 0)
    assert torch.all(rollout.logprobs[mask == 1] < 0)


def test_gpt2_early_stop_when_all_end(gpt2, tokenizer):
    """Real GPT-2 with EOS very likely: every row ends, and T is the latest EOS position + 1 < max_new_tokens."""
    model = EOSBiased(gpt2, bias=8.0)
    batch = encode_batch(tokenizer, ["list some fruit:", "red", "name a few animals:"], [0, 1, 2])
    rollout = run(model, batch, GenerationConfig(max_new_tokens=16))
    first_eos = [(row == EOS).nonzero().flatten()[0].item() for row in rollout.responses]
    assert rollout.responses.shape[1] == max(first_eos) + 1 < 16
    assert rollout.response_mask.sum(1).tolist() == [e + 1 for e in first_eos]


def _until_eos(tokens: torch.Tensor) -> list[int]:
    out = []
    for token in tokens.tolist():
        out.append(token)
        if token == EOS:
            break
    return out


def test_keyed_sampling_is_batch_invariant(gpt2, tokenizer):
    """A prompt alone and inside a left-padded batch with the same key gets the same response tokens."""
    model = EOSBiased(gpt2, bias=3.0)
    config = GenerationConfig(max_new_tokens=10, temperature=1.0)
    target = "red"
    alone = run(model, encode_batch(tokenizer, [target], [5]), config, seed=5, iteration=2)
    batch = encode_batch(tokenizer, ["list some fruit: apple banana", target, "name a few animals:"], [3, 5, 7])
    assert batch["attention_mask"][1].sum() < batch["attention_mask"].shape[1]  # the target row is padded
    together = run(model, batch, config, seed=5, iteration=2)

    expected = _until_eos(alone.responses[0])
    assert len(expected) >= 3 and expected[-1] == EOS  # the interesting case: a few tokens, then EOS
    assert together.responses[1, : len(expected)].tolist() == expected
    n = len(expected)
    assert_close(together.logprobs[1, :n], alone.logprobs[0, :n], rtol=0, atol=1e-5)


def test_same_keys_same_output_and_new_iteration_differs(gpt2, tokenizer):
    """Same (seed, iteration, index) reproduces the rollout exactly; another iteration gives other responses."""
    config = GenerationConfig(max_new_tokens=6)
    batch = encode_batch(tokenizer, ["list some fruit:", "red"], [0, 1])
    a = run(gpt2, batch, config, iteration=0)
    b = run(gpt2, batch, config, iteration=0)
    c = run(gpt2, batch, config, iteration=1)
    assert torch.equal(a.sequences, b.sequences)
    assert torch.equal(a.logprobs, b.logprobs)
    assert not torch.equal(a.responses[0], c.responses[0])
    assert not torch.equal(a.responses[1], c.responses[1])


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (5, 0.9)])
def test_behaviour_logprobs_match_full_forward(gpt2, tokenizer, top_k, top_p):
    """Behaviour log-probs equal log_softmax(logits / 0.7) of a no-cache forward over the rollout, within 1e-4."""
    temperature = 0.7
    model = EOSBiased(gpt2, bias=2.0)
    batch = encode_batch(tokenizer, ["list some fruit:", "red", "name a few animals: cat dog", "blue"], [0, 1, 2, 3])
    rollout = run(model, batch, GenerationConfig(max_new_tokens=8, temperature=temperature, top_k=top_k, top_p=top_p))
    assert rollout.response_mask.min() == 0  # some positions past EOS, to check they are excluded
    with torch.no_grad():
        logits = response_logits(model, rollout.sequences, rollout.attention_mask, rollout.prompt_length)[:, :-1]
    full = functional.logprobs_from_logits(logits / temperature, rollout.responses)
    valid = rollout.response_mask.bool()
    assert_close(rollout.logprobs[valid], full[valid], rtol=0, atol=1e-4)


# ---- sampling primitives ----


def test_sample_keys_depend_only_on_seed_iteration_index():
    """A sample's key is the same whatever batch it sits in, and changes with seed, iteration and index."""
    batch_keys = sample_keys(1, 4, torch.tensor([3, 5, 7]))
    alone = sample_keys(1, 4, torch.tensor([5]))
    assert batch_keys.dtype == torch.int64
    assert batch_keys[1] == alone[0]
    assert len(set(batch_keys.tolist())) == 3
    assert sample_keys(2, 4, torch.tensor([5]))[0] != alone[0]
    assert sample_keys(1, 5, torch.tensor([5]))[0] != alone[0]
    assert all(0 <= k < 2**63 for k in batch_keys.tolist())


def _fmix32(x: int) -> int:
    """murmur3's finalizer in Python integers: the reference for the tensor version."""
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & 0xFFFFFFFF
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & 0xFFFFFFFF
    return x ^ (x >> 16)


def test_hash32_is_murmur3_fmix32_without_int64_overflow():
    """hash32 equals murmur3's fmix32 (Python integers), also for inputs near 2**32 whose plain int64 products would
    overflow; known values: fmix32(0) = 0, fmix32(1) = 0x514E28B7."""
    inputs = [0, 1, 2, 12345, 0x7FFFFFFF, 0x80000000, 0xDEADBEEF, 0xFFFFFFFE, 0xFFFFFFFF]
    got = hash32(torch.tensor(inputs, dtype=torch.int64)).tolist()
    assert got == [_fmix32(x) for x in inputs]
    assert got[:2] == [0, 0x514E28B7]


def test_keyed_seeds_use_both_halves_of_a_key():
    """A key's seed is in [0, 2**32), the same alone or in a batch, and changes with either 32-bit half."""
    keys = torch.tensor([5, 5 + (1 << 32), 6, -1], dtype=torch.int64)
    seeds = keyed_seeds(keys)
    assert seeds.dtype == torch.int64 and bool(((seeds >= 0) & (seeds < 2**32)).all())
    assert len(set(seeds.tolist())) == 4
    assert keyed_seeds(keys[2:3]).item() == seeds[2].item()
    assert seeds[0].item() == _fmix32(_fmix32(5) ^ 0)


def test_keyed_uniforms_rows_depend_only_on_their_seed_and_column():
    """Row b of keyed_uniforms is a function of (seeds[b], columns[b]) only, float32 in (0, 1), and another column
    or seed gives other noise."""
    seeds = keyed_seeds(sample_keys(0, 0, torch.tensor([0, 1, 2])))
    u = keyed_uniforms(seeds, torch.tensor([0, 0, 3]), 50)
    assert u.shape == (3, 50) and u.dtype == torch.float32
    assert bool(((u > 0) & (u < 1)).all())
    assert torch.equal(u[2], keyed_uniforms(seeds[2:], torch.tensor([3]), 50)[0])
    assert torch.equal(u[:2], keyed_uniforms(seeds[:2], torch.tensor([0]), 50))  # a [1] column broadcasts
    assert not torch.equal(u[0], u[1])
    assert not torch.equal(u[2], keyed_uniforms(seeds[2:], torch.tensor([4]), 50)[0])


def test_exponential_race_hand_uniforms():
    """argmax p / E with E = -log u, by hand: p = (1/4, 1/4, 1/2) and u = (0.5, 0.9, 0.1) give E = (0.693, 0.105,
    2.303) and p / E = (0.361, 2.373, 0.217): token 1. A filtered (-inf) token never wins, even with u near 1."""
    log_p = torch.tensor([[0.25, 0.25, 0.5]]).log()
    assert exponential_race(log_p, torch.tensor([[0.5, 0.9, 0.1]])).tolist() == [1]
    assert exponential_race(log_p + 2.0, torch.tensor([[0.5, 0.9, 0.1]])).tolist() == [1]  # unnormalised works too
    filtered = torch.tensor([[0.5, 0.0, 0.1]]).log()
    assert exponential_race(filtered, torch.tensor([[0.5, 1 - 2**-23, 0.5]])).tolist() == [0]


def test_tree_depth_is_ceil_log2_of_the_vocabulary():
    """One uniform per level below the root: ceil(log2 V) levels (16 for SmolLM2's 49152 tokens and GPT-2's 50257)."""
    assert [tree_depth(v) for v in (1, 2, 3, 4, 5, 512, 513, 49152, 50257)] == [0, 1, 2, 2, 3, 9, 10, 16, 16]


def test_sum_tree_draw_hand_uniforms():
    """p = (1/4, 1/4, 1/2) gets a zero leaf (4 leaves); level 1 sums the halves: (p0 + p2, p1 + 0) = (3/4, 1/4). The
    root goes right (tokens 1 and the zero leaf) when u0 >= 3/4; node 0 goes right (token 2) when u1 * 3/4 >= 1/4,
    i.e. u1 >= 1/3; node 1 never enters its zero leaf, even with u1 near 1. Unnormalised works too, and a filtered
    (-inf) token is never reached: with p = (1/2, 0, 1/2) the root's right child is empty."""
    log_p = torch.tensor([0.25, 0.25, 0.5]).log().expand(5, 3)
    uniforms = torch.tensor([[0.5, 0.2], [0.5, 0.4], [0.74, 0.9], [0.76, 0.1], [0.9, 1 - 2**-23]])
    assert sum_tree_draw(log_p, uniforms).tolist() == [0, 2, 2, 1, 1]
    assert sum_tree_draw(log_p + 2.0, uniforms).tolist() == [0, 2, 2, 1, 1]
    filtered = torch.tensor([0.5, 0.0, 0.5]).log().expand(5, 3)
    assert sum_tree_draw(filtered, uniforms).tolist() == [0, 0, 2, 0, 2]  # token 2 when u1 >= 1/2
    assert sum_tree_draw(torch.zeros(2, 1), torch.zeros(2, 0)).tolist() == [0, 0]  # one token: no level


def test_keyed_draw_samples_each_token_with_its_probability():
    """Over 40,000 keyed draws (400 keys x 100 columns) of p = (0.5, 0.3, 0.15, 0.05), each token's frequency is its
    probability within 0.01 (4 standard errors at most), and the filtered token of a top-p=0.7 nucleus never comes."""
    keys = sample_keys(3, 0, torch.arange(400))
    seeds = keyed_seeds(keys).repeat_interleave(100)
    columns = torch.arange(100).repeat(400)
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    log_p = probs.log().expand(len(seeds), 4)
    tokens = sum_tree_draw(log_p, keyed_uniforms(seeds, columns, tree_depth(4)))
    frequencies = torch.bincount(tokens, minlength=4).float() / len(tokens)
    assert_close(frequencies, probs, rtol=0, atol=0.01)
    nucleus = sum_tree_draw(filter_log_probs(log_p, 0, 0.7), keyed_uniforms(seeds, columns, tree_depth(4)))
    assert set(nucleus.tolist()) == {0, 1}
    assert abs(float((nucleus == 0).float().mean()) - 0.5 / 0.8) < 0.01


@pytest.mark.parametrize("top_k", [0, 200])
def test_next_token_draws_the_softmax_of_a_large_vocabulary(top_k):
    """100,000 keyed draws through next_token from one row of 1000 logits (a long tail, a vocabulary whose tree has
    levels of odd length) match softmax(logits) (top-k: renormalised over the 200 most likely, no other token ever):
    Pearson's chi-square over the tokens expected at least 10 times, the rest pooled, stays under its degrees of
    freedom plus 6 standard deviations (fixed keys: the same statistic at every run)."""
    logits = 2.5 * torch.randn(1000, generator=torch.Generator().manual_seed(0))
    probs = torch.softmax(logits.double(), -1)
    if top_k:
        probs = torch.where(probs >= probs.topk(top_k).values[-1], probs, 0.0)
        probs /= probs.sum()
    seeds = keyed_seeds(sample_keys(11, 0, torch.arange(1000))).repeat_interleave(100)
    columns = torch.arange(100).repeat(1000)
    config = GenerationConfig(top_k=top_k)
    tokens = torch.cat([next_token(logits.expand(len(chunk), -1), config, seeds[chunk], columns[chunk],
                                   torch.zeros(len(chunk), dtype=torch.bool), PAD)[0]
                        for chunk in torch.arange(len(seeds)).split(25_000)])
    counts = torch.bincount(tokens, minlength=1000).double()
    assert counts[probs == 0].sum() == 0
    expected = probs * len(tokens)
    big = expected >= 10
    observed = torch.cat([counts[big], counts[~big].sum().view(1)])
    wanted = torch.cat([expected[big], expected[~big].sum().view(1)])
    observed, wanted = observed[wanted > 0], wanted[wanted > 0]  # top-k: nothing left to pool
    degrees = len(wanted) - 1
    assert degrees > 50
    chi_square = float(((observed - wanted) ** 2 / wanted).sum())
    assert chi_square < degrees + 6 * math.sqrt(2 * degrees), (chi_square, degrees)


@pytest.mark.parametrize("vocab", [49152, 50257])
def test_next_token_gives_each_row_its_own_token_in_any_batch(vocab):
    """At a real vocabulary size (SmolLM2's 49152; GPT-2's odd 50257), every row draws the same token alone, in the
    batch, and in the batch reversed: a row's draw reads its own logits and keys only, and every sum the tree makes is
    an elementwise addition of that row's numbers."""
    logits = 3.0 * torch.randn(6, vocab, generator=torch.Generator().manual_seed(vocab))
    seeds, done = keyed_seeds(sample_keys(2, 1, torch.arange(6))), torch.zeros(6, dtype=torch.bool)
    config = GenerationConfig(top_k=0)
    for column in range(3):
        columns = torch.full((6,), column)
        batch, logprobs = next_token(logits, config, seeds, columns, done, PAD)
        flipped = next_token(logits.flip(0), config, seeds.flip(0), columns, done, PAD)[0].flip(0)
        alone = [next_token(logits[r : r + 1], config, seeds[r : r + 1], columns[:1], done[:1], PAD)[0].item()
                 for r in range(6)]
        assert batch.tolist() == flipped.tolist() == alone
        assert_close(logprobs, torch.log_softmax(logits, -1).gather(-1, batch[:, None]).squeeze(-1))


def test_filter_log_probs_top_k_keeps_two_largest():
    """top_k=2 keeps exactly the two most likely tokens of each row, untouched."""
    probs = torch.tensor([[0.1, 0.4, 0.2, 0.3], [0.7, 0.05, 0.05, 0.2]])
    out = filter_log_probs(probs.log(), top_k=2, top_p=1.0).exp()
    assert_close(out, torch.tensor([[0.0, 0.4, 0.0, 0.3], [0.7, 0.0, 0.0, 0.2]]))


@pytest.mark.parametrize("top_p,expected", [
    (0.7, [0.5, 0.3, 0.0, 0.0]),
    (0.85, [0.5, 0.3, 0.15, 0.0]),
    (0.4, [0.5, 0.0, 0.0, 0.0]),
    (1.0, [0.5, 0.3, 0.15, 0.05]),
])
def test_filter_log_probs_top_p_keeps_smallest_nucleus(top_p, expected):
    """top_p keeps the smallest set of most likely tokens whose mass reaches top_p."""
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    assert_close(filter_log_probs(probs.log(), top_k=0, top_p=top_p).exp(), torch.tensor([expected]))


def test_filter_log_probs_top_p_unsorted_row_and_after_top_k():
    """The nucleus is found by probability, not by position in the vocabulary; after top-k, it is a share of the
    mass top-k left (0.8 of it: 0.5 and 0.3 reach 0.7 x 0.8 = 0.56 only together)."""
    probs = torch.tensor([[0.05, 0.3, 0.15, 0.5]])
    assert_close(filter_log_probs(probs.log(), top_k=0, top_p=0.7).exp(), torch.tensor([[0.0, 0.3, 0.0, 0.5]]))
    assert_close(filter_log_probs(probs.log(), top_k=2, top_p=0.7).exp(), torch.tensor([[0.0, 0.3, 0.0, 0.5]]))
    assert_close(filter_log_probs(probs.log(), top_k=2, top_p=0.6).exp(), torch.tensor([[0.0, 0.0, 0.0, 0.5]]))


def test_check_context_length_message_names_the_fixes():
    """Prompt + max_new_tokens beyond the context raises, naming generation.max_new_tokens and data.max_prompt_length."""
    model = SimpleNamespace(config=SimpleNamespace(n_positions=16))
    with pytest.raises(ValueError, match=r"generation\.max_new_tokens=12") as info:
        check_context_length(model, prompt_length=10, max_new_tokens=12)
    assert "data.max_prompt_length" in str(info.value)
    assert "(<= 4)" in str(info.value)
    check_context_length(model, prompt_length=4, max_new_tokens=12)  # exactly fits: no error
    check_context_length(SimpleNamespace(), prompt_length=10_000, max_new_tokens=12)  # no declared limit


def test_generate_checks_context_length(gpt2):
    """generate() refuses prompts that cannot fit max_new_tokens into the model's 64 positions."""
    ids = torch.full((1, 60), 5)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(gpt2, ids, torch.ones_like(ids), GenerationConfig(max_new_tokens=8),
                 sample_keys(0, 0, torch.tensor([0])), EOS, PAD)


# ---- generation.batch_size: chunked sampling and scoring ----

CHUNK_PROMPTS = ["list some fruit:", "red", "name a few animals: cat dog", "give me colors, like blue:", "hi",
                 "count to three:", "blue"]


class CountingLM(nn.Module):
    """Wraps a causal LM and records the batch size of every call, marking prefills (no cache) with a P."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.calls: list[str] = []

    @property
    def config(self):
        return self.inner.config

    def forward(self, **kwargs):
        prefill = kwargs.get(CACHE_ARGUMENT) is None
        self.calls.append(("P" if prefill else "") + str(kwargs["input_ids"].shape[0]))
        return self.inner(**kwargs)


class FakeLockstepGroup:
    """Stands in for the other ranks of a lockstep group, through a patched ``dist.all_reduce``: they hold
    ``peer_rows`` rows and stay running for the first ``peer_steps`` decode steps of every chunk."""

    def __init__(self, monkeypatch, model: CountingLM | None, peer_rows: int, peer_steps: int = 0) -> None:
        self.model, self.peer_rows, self.peer_steps = model, peer_rows, peer_steps
        self.row_counts = 0
        self.seen_prefills = 0
        self.steps = 0
        monkeypatch.setattr(torch.distributed, "all_reduce", self.all_reduce)

    def all_reduce(self, tensor, op=None, group=None):
        assert group is self and op == torch.distributed.ReduceOp.MAX
        if tensor.dtype == torch.int64:  # the row count of row_chunks
            self.row_counts += 1
            tensor.fill_(max(int(tensor.item()), self.peer_rows))
            return
        prefills = sum(call.startswith("P") for call in self.model.calls)
        if prefills != self.seen_prefills:  # a new chunk started
            self.seen_prefills, self.steps = prefills, 0
        self.steps += 1
        tensor.fill_(max(int(tensor.item()), int(self.steps <= self.peer_steps)))


def _pad_rollout_to(rollout, width: int):
    """The rollout's responses widened to ``width`` columns (pad token, mask 0, log-prob 0)."""
    extra = width - rollout.response_mask.shape[1]
    response_mask = torch.nn.functional.pad(rollout.response_mask, (0, extra))
    return SimpleNamespace(
        responses=torch.nn.functional.pad(rollout.responses, (0, extra), value=PAD),
        response_mask=response_mask,
        logprobs=torch.nn.functional.pad(rollout.logprobs, (0, extra)),
    )


@pytest.fixture
def chunk_batch(tokenizer):
    return encode_batch(tokenizer, CHUNK_PROMPTS, list(range(len(CHUNK_PROMPTS))))


@pytest.mark.parametrize("batch_size", [1, 3, 16])
def test_chunked_generation_equals_whole(gpt2, chunk_batch, batch_size):
    """Chunks of 1, 3 and more than the batch: the same tokens and masks, log-probs within 1e-5, with EOS and
    left padding (chunks whose responses are shorter than the longest are padded)."""
    model = EOSBiased(gpt2, bias=4.5)
    config = GenerationConfig(max_new_tokens=8)
    whole = run(model, chunk_batch, config, seed=1)
    chunked = run(model, chunk_batch, GenerationConfig(max_new_tokens=8, batch_size=batch_size), seed=1)

    lengths = whole.response_mask.sum(1)
    assert lengths.min() < lengths.max() == 8  # rows end at EOS at different steps, one never does
    assert (chunk_batch["attention_mask"] == 0).any()  # left padding
    assert chunked.prompt_length == whole.prompt_length
    assert torch.equal(chunked.sequences, whole.sequences)
    assert torch.equal(chunked.attention_mask, whole.attention_mask)
    assert torch.equal(chunked.response_mask, whole.response_mask)
    assert chunked.response_mask.dtype == whole.response_mask.dtype
    assert_close(chunked.logprobs, whole.logprobs, rtol=0, atol=1e-5)


def test_chunked_generation_runs_chunks_of_at_most_batch_size(gpt2, chunk_batch):
    """7 rows with batch_size 3: three prefills of 2, 2 and 3 rows (near-equal consecutive chunks)."""
    model = CountingLM(EOSBiased(gpt2, bias=4.5))
    run(model, chunk_batch, GenerationConfig(max_new_tokens=8, batch_size=3), seed=1)
    assert [call for call in model.calls if call.startswith("P")] == ["P2", "P2", "P3"]
    assert set(model.calls) == {"P3", "P2", "3", "2"}


def test_row_chunks_split():
    """Consecutive near-equal chunks of at most batch_size rows; None is one chunk; no rows, no chunks."""
    sizes = lambda chunks: [c.stop - c.start for c in chunks]
    assert sizes(row_chunks(7, 3)) == [2, 2, 3]
    assert row_chunks(7, 3)[0].start == 0 and row_chunks(7, 3)[-1].stop == 7
    assert sizes(row_chunks(7, 1)) == [1] * 7
    assert row_chunks(7, 16) == [slice(0, 7)]
    assert row_chunks(7, None) == [slice(0, 7)]
    assert row_chunks(0, 4) == [] and row_chunks(0, None) == []


def test_lockstep_chunks_follow_the_group(monkeypatch, gpt2, chunk_batch):
    """Under a lockstep group the chunk count comes from the group's largest shard (one all-reduce), a rank with
    fewer rows than chunks runs a stand-in chunk, and every chunk decodes as long as the group does; the tokens are
    still those of an unchunked call."""
    model = CountingLM(EOSBiased(gpt2, bias=8.0))
    rows = slice(0, 2)
    local = {k: v[rows] for k, v in chunk_batch.items() if torch.is_tensor(v)}
    whole = run(model.inner, local, GenerationConfig(max_new_tokens=8), seed=1)
    group = FakeLockstepGroup(monkeypatch, model, peer_rows=5, peer_steps=3)
    keys = sample_keys(1, 0, local["index"])
    config = GenerationConfig(max_new_tokens=8, batch_size=2)
    chunked = generate(model, local["input_ids"], local["attention_mask"], config, keys, EOS, PAD, lockstep_group=group)

    assert group.row_counts == 1
    # ceil(5 / 2) = 3 chunks of this rank's 2 rows: [], [0], [1]; the empty one runs on a stand-in row.
    assert [call for call in model.calls if call.startswith("P")] == ["P1", "P1", "P1"]
    assert whole.response_mask.sum(1).max() < 4  # every row ends before the peers do ...
    assert len(model.calls) == 3 * (1 + 3)  # ... so each chunk runs the peers' 3 decode steps
    expected = _pad_rollout_to(whole, chunked.response_mask.shape[1])
    assert torch.equal(chunked.responses, expected.responses)
    assert torch.equal(chunked.response_mask, expected.response_mask)
    assert_close(chunked.logprobs, expected.logprobs, rtol=0, atol=1e-5)


def test_lockstep_rank_without_rows_keeps_the_group_paired(monkeypatch, gpt2, chunk_batch):
    """A rank with no rows runs one stand-in chunk per group chunk and returns an empty rollout."""
    model = CountingLM(gpt2)
    group = FakeLockstepGroup(monkeypatch, model, peer_rows=3, peer_steps=2)
    empty = chunk_batch["input_ids"][:0]
    config = GenerationConfig(max_new_tokens=8, batch_size=2)
    keys = sample_keys(0, 0, torch.tensor([], dtype=torch.long))
    out = generate(model, empty, chunk_batch["attention_mask"][:0], config, keys, EOS, PAD, lockstep_group=group)
    assert model.calls == ["P1", "1", "1"] * 2
    assert out.sequences.shape == (0, empty.shape[1]) and out.response_mask.shape[0] == 0


@pytest.fixture
def scored(tiny_gpt2_config, gpt2, chunk_batch):
    """A rollout with EOS and left padding, and the three scoring models."""
    rollout = run(EOSBiased(gpt2, bias=4.5), chunk_batch, GenerationConfig(max_new_tokens=8), seed=1)
    critic = build_critic(ModelSpec(config=tiny_gpt2_config, init_seed=1))
    reward = build_reward_model(ModelSpec(config=tiny_gpt2_config, init_seed=2), pad_token_id=PAD)
    return rollout, gpt2, critic, reward


@pytest.mark.parametrize("batch_size", [1, 3, 16])
def test_chunked_forwards_equal_whole(scored, tokenizer, batch_size):
    """reference, critic and reward-model forwards in chunks equal one forward on all rows (within 1e-5)."""
    rollout, reference, critic, reward = scored
    assert rollout.response_mask.min() == 0
    for forward in (
        lambda **kw: reference_forward(reference, rollout, 0.7, **kw),
        lambda **kw: critic_forward(critic, rollout, **kw),
        lambda **kw: reward_forward(reward, rollout, tokenizer, **kw),
    ):
        whole, chunked = forward(), forward(batch_size=batch_size)
        assert chunked.shape == whole.shape and chunked.dtype == whole.dtype
        assert_close(chunked, whole, rtol=0, atol=1e-5)


def test_inference_mode_gives_the_same_numbers_as_tensors_a_loss_can_save(gpt2, chunk_batch, scored, tokenizer):
    """``inference_mode=True`` (the engine's choice for an unwrapped model): generate's rollout and the scoring
    forwards are bit for bit those of ``no_grad``, and come back as ordinary tensors, which a loss may save for
    backward (an inference tensor may not be)."""
    model, config = EOSBiased(gpt2, bias=4.5), GenerationConfig(max_new_tokens=8, batch_size=3)
    keys = sample_keys(1, 0, chunk_batch["index"])
    ids, mask = chunk_batch["input_ids"], chunk_batch["attention_mask"]
    plain = generate(model, ids, mask, config, keys, EOS, PAD)
    fast = generate(model, ids, mask, config, keys, EOS, PAD, inference_mode=True)
    for field in ("sequences", "attention_mask", "response_mask", "logprobs", "stopped"):
        got, expected = getattr(fast, field), getattr(plain, field)
        assert torch.equal(got, expected) and got.dtype == expected.dtype, field
        assert not got.is_inference(), field
    rollout, reference, critic, reward = scored
    for forward in (
        lambda **kw: reference_forward(reference, rollout, 0.7, batch_size=3, **kw),
        lambda **kw: critic_forward(critic, rollout, **kw),
        lambda **kw: reward_forward(reward, rollout, tokenizer, **kw),
    ):
        got = forward(inference_mode=True)
        assert torch.equal(got, forward()) and not got.is_inference()
    weight = torch.ones((), requires_grad=True)
    (weight * fast.logprobs).sum().backward()  # mul saves the log-probs for backward
    assert_close(weight.grad, fast.logprobs.sum())


def test_reward_function_called_once_whatever_batch_size(scored, tokenizer):
    """A reward function on decoded text sees the whole rollout in one call, with its row fields."""
    rollout, *_ = scored
    seen = []

    def reward_fn(prompts, responses, answer):
        seen.append(len(responses))
        return [float(len(r)) + a for r, a in zip(responses, answer)]

    answers = list(range(len(rollout.sequences)))
    scores = reward_forward(reward_fn, rollout, tokenizer, {"answer": answers}, batch_size=2)
    assert seen == [len(rollout.sequences)] and scores.shape == (len(rollout.sequences),)


def test_lockstep_forward_stand_in_chunks(monkeypatch, scored):
    """Under a lockstep group a scoring forward runs as many chunks as the group's largest shard needs, on a
    stand-in row where this rank has none, and still returns exactly its own rows' scores."""
    rollout, reference, *_ = scored
    model = CountingLM(reference)
    local = rollout.select(slice(0, 2))
    whole = reference_forward(reference, local, 1.0)
    group = FakeLockstepGroup(monkeypatch, model, peer_rows=5)
    chunked = reference_forward(model, local, 1.0, batch_size=2, lockstep_group=group)
    assert model.calls == ["P1", "P1", "P1"]  # chunks [], [0], [1]
    assert_close(chunked, whole, rtol=0, atol=1e-5)
    nothing = reference_forward(model, rollout.select(slice(0, 0)), 1.0, batch_size=2, lockstep_group=group)
    assert nothing.shape == (0, rollout.response_mask.shape[1]) and len(model.calls) == 6


@pytest.mark.parametrize("bad", [0, -2, 2.5, True])
def test_generation_batch_size_must_be_a_positive_integer(bad):
    """generation.batch_size below 1 (or not an integer) fails, naming the field and None."""
    with pytest.raises(ValueError, match=r"generation\.batch_size must be an integer >= 1.*or None"):
        GenerationConfig(batch_size=bad)
    assert GenerationConfig(batch_size=1).batch_size == 1
    assert GenerationConfig().batch_size is None


# ---- stop tokens, stop strings and greedy decoding ----


def _rollout(responses: list[list[int]], mask: list[list[int]], stopped: list[bool] | None = None) -> Rollout:
    """A hand-built rollout after a one-token prompt."""
    responses_t, mask_t = torch.tensor(responses), torch.tensor(mask)
    prompt = torch.full((len(responses), 1), 3)
    return Rollout(
        sequences=torch.cat([prompt, responses_t], 1),
        attention_mask=torch.cat([torch.ones_like(prompt), mask_t], 1),
        response_mask=mask_t,
        logprobs=torch.zeros(mask_t.shape),
        prompt_length=1,
        stopped=torch.tensor(stopped) if stopped is not None else None,
    )


def test_model_eos_token_ids_int_list_or_none(gpt2):
    """The actor's generation_config.eos_token_id as a list: an int, a list, None, or no generation config."""
    assert model_eos_token_ids(gpt2) == [EOS]  # built from a config with eos_token_id=2
    assert model_eos_token_ids(SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=[2, 6]))) == [2, 6]
    assert model_eos_token_ids(SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=None))) == []
    assert model_eos_token_ids(ScriptedLM([[1]])) == []


def test_scripted_stops_at_any_stop_id():
    """Several EOS ids plus generation.stop_token_ids: each row stops at its first stop id (kept, mask 1), pad
    after; a row without one runs to max_new_tokens and is not marked stopped."""
    prompts = torch.tensor([[PAD, 6, 7], [3, 4, 5], [3, 3, 3]])
    prompt_mask = torch.tensor([[0, 1, 1], [1, 1, 1], [1, 1, 1]])
    model = ScriptedLM([[5, 6, EOS, 3, 3], [4, 4, 7, 6, 3], [4, 3, 3, 3, 3]])
    config = GenerationConfig(max_new_tokens=5, top_k=1, stop_token_ids=[7])
    rollout = generate(model, prompts, prompt_mask, config, sample_keys(0, 0, torch.arange(3)), [EOS, 6], PAD)

    assert rollout.responses.tolist() == [[5, 6, PAD, PAD, PAD], [4, 4, 7, PAD, PAD], [4, 3, 3, 3, 3]]
    assert rollout.response_mask.tolist() == [[1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]
    assert rollout.stopped.tolist() == [True, True, False]
    lp = scripted_logprob(1.0)
    assert_close(rollout.logprobs, torch.tensor([[lp, lp, 0, 0, 0], [lp, lp, lp, 0, 0], [lp] * 5]), rtol=0, atol=1e-6)
    # Without the extra ids only EOS stops them: row 0 at step 2, row 1 never.
    plain = generate(model, prompts, prompt_mask, GenerationConfig(max_new_tokens=5, top_k=1),
                     sample_keys(0, 0, torch.arange(3)), EOS, PAD)
    assert plain.response_mask.sum(1).tolist() == [3, 5, 5]


def test_engine_generate_stops_at_generation_config_ids(tokenizer):
    """The engine's actor.generate stops at the tokenizer's EOS, every id of the actor's
    generation_config.eos_token_id and generation.stop_token_ids; all rows done before the limit ends the loop."""
    model = ScriptedLM([[5, 6, 3, 3, 3], [4, EOS, 3, 3, 3], [4, 3, 7, 3, 3]], vocab=16)
    model.generation_config = SimpleNamespace(eos_token_id=[EOS, 6])  # as Llama 3 / Qwen list several
    from lightning_app_rlhf.parallel.placed_roles import PlacedRoles

    generation = GenerationConfig(max_new_tokens=5, top_k=1, stop_token_ids=[7])
    engine = RLHFEngine(placed=PlacedRoles.single_process(torch.device("cpu"), ("actor", "reference", "reward")),
                        algorithm=None,
                        generation=generation, config=None, tokenizer=tokenizer, shaping=None,
                        modules=lambda role: model, reward_fn=None, seed=0)
    batch = {"input_ids": torch.tensor([[PAD, 6, 7], [3, 4, 5], [3, 3, 3]]),
             "attention_mask": torch.tensor([[0, 1, 1], [1, 1, 1], [1, 1, 1]]),
             "index": torch.arange(3), "sample": torch.zeros(3, dtype=torch.long)}
    rollout = engine.calls.generate_rows(batch, slice(0, 3), iteration=0, generation=generation,
                                            policy_version=0)
    assert rollout.responses.tolist() == [[5, 6, PAD], [4, EOS, PAD], [4, 3, 7]]
    assert rollout.response_mask.tolist() == [[1, 1, 0], [1, 1, 0], [1, 1, 1]]
    assert len(model.calls) == 3  # stopped after step 3 of 5


@pytest.fixture
def fruit_ids(tokenizer):
    """'list some fruit' in the demo tokenizer: li|st| some| fr|u|i|t."""
    ids = tokenizer("list some fruit", add_special_tokens=False)["input_ids"]
    assert tokenizer.convert_ids_to_tokens(ids) == ["li", "st", "Ġsome", "Ġfr", "u", "i", "t"]
    return ids


def test_stop_strings_stop_at_the_completing_token(tokenizer, fruit_ids):
    """A row stops at the token that completes a stop string, kept with mask 1: a string spanning two tokens
    ('me f' over ' some' and ' fr') and one spanning four ('fruit'); no match runs to the limit."""
    prompts = torch.tensor([[3, 4, 5]] * 3)
    prompt_mask = torch.ones_like(prompts)
    other = tokenizer("a b c d e f g", add_special_tokens=False)["input_ids"]
    model = ScriptedLM([fruit_ids, fruit_ids[3:] + [5, 5, 5], other], vocab=len(tokenizer))
    config = GenerationConfig(max_new_tokens=7, top_k=1, stop_strings=["me f", "fruit"])
    rollout = generate(model, prompts, prompt_mask, config, sample_keys(0, 0, torch.arange(3)), EOS, PAD,
                       tokenizer=tokenizer)

    assert rollout.response_mask.sum(1).tolist() == [4, 4, 7]
    assert rollout.responses[0].tolist() == fruit_ids[:4] + [PAD] * 3  # stops at ' fr', which completes 'me f'
    assert rollout.responses[1].tolist() == fruit_ids[3:] + [PAD] * 3  # stops at 't', which completes 'fruit'
    assert rollout.responses[2].tolist() == other[:7]
    assert rollout.stopped.tolist() == [True, True, False]
    for row, string in ((0, "me f"), (1, "fruit")):
        ids = rollout.responses[row, : rollout.response_mask[row].sum()].tolist()
        assert string in tokenizer.decode(ids) and string not in tokenizer.decode(ids[:-1])


def test_stop_strings_match_within_the_response_only(tokenizer, fruit_ids):
    """A stop string that starts in the prompt does not stop the row; one completed by the last allowed token
    marks the row stopped (no missing-EOS penalty)."""
    prompt = torch.tensor([fruit_ids[:3]] * 2)  # 'list some' ...
    model = ScriptedLM([fruit_ids[3:], [5] * 3 + fruit_ids[3:]], vocab=len(tokenizer))  # ... ' fruit'
    config = GenerationConfig(max_new_tokens=4, top_k=1, stop_strings=["me f", "fruit"])
    rollout = generate(model, prompt, torch.ones_like(prompt), config, sample_keys(0, 0, torch.arange(2)), EOS, PAD,
                       tokenizer=tokenizer)
    assert rollout.responses.tolist() == [fruit_ids[3:], [5, 5, 5, fruit_ids[3]]]
    assert rollout.response_mask.tolist() == [[1, 1, 1, 1]] * 2
    assert rollout.stopped.tolist() == [True, False]  # 'fruit' at the 4th token; 'me f' would need the prompt
    shaping = RewardShaping(PPOConfig(missing_eos_penalty=1.0, kl_coef=0.0), EOS)
    assert shaping.shape(torch.zeros(2), torch.ones(2, dtype=torch.bool), rollout, config).tolist() == [0.0, -1.0]


@pytest.mark.parametrize("batch_size", [1, 3])
def test_chunked_generation_with_stops_equals_whole(gpt2, chunk_batch, tokenizer, batch_size):
    """Stop strings and extra stop ids stop the same rows at the same tokens whether the rows run in chunks or not."""
    model = EOSBiased(gpt2, bias=1.5)
    stops = {"stop_strings": ["e"], "stop_token_ids": [5]}
    whole = run_with_tokenizer(model, chunk_batch, GenerationConfig(max_new_tokens=8, **stops), tokenizer)
    chunked = run_with_tokenizer(model, chunk_batch, GenerationConfig(max_new_tokens=8, batch_size=batch_size,
                                                                      **stops), tokenizer)
    plain = run(model, chunk_batch, GenerationConfig(max_new_tokens=8), seed=1)
    lengths = whole.response_mask.sum(1)
    assert (lengths < plain.response_mask.sum(1)).any()  # the stops cut some rows short ...
    assert lengths.min() < lengths.max() == 8  # ... at different steps, and one runs to the limit
    assert torch.equal(chunked.sequences, whole.sequences)
    assert torch.equal(chunked.response_mask, whole.response_mask)
    assert torch.equal(chunked.stopped, whole.stopped)
    for row, length in enumerate(lengths.tolist()):  # each row stops at its first stop, and only there
        ids = whole.responses[row, :length].tolist()
        ends = lambda ids: ids[-1] in (EOS, 5) or "e" in tokenizer.decode(ids)
        assert not any(ends(ids[:n]) for n in range(1, length))
        assert bool(whole.stopped[row]) == ends(ids) and (ends(ids) or length == 8)
    assert_close(chunked.logprobs, whole.logprobs, rtol=0, atol=1e-5)


def test_stop_strings_need_the_tokenizer(fruit_ids):
    """Stop strings without a tokenizer raise, naming the argument to pass."""
    prompt = torch.tensor([[3, 4, 5]])
    with pytest.raises(ValueError, match=r"generation\.stop_strings=\['fruit'\] needs the tokenizer.*tokenizer="):
        generate(ScriptedLM([fruit_ids]), prompt, torch.ones_like(prompt),
                 GenerationConfig(max_new_tokens=2, stop_strings=["fruit"]), sample_keys(0, 0, torch.arange(1)), EOS,
                 PAD)


def _greedy_reference(model, input_ids, attention_mask, max_new_tokens: int, temperature: float):
    """Row by row, without padding or KV cache: the argmax token of a full forward at every step, until EOS."""
    tokens, logprobs = [], []
    for ids, mask in zip(input_ids, attention_mask):
        sequence, row_tokens, row_logprobs = ids[mask.bool()].tolist(), [], []
        for _ in range(max_new_tokens):
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([sequence])).logits[0, -1].float()
            token = int(logits.argmax())
            row_tokens.append(token)
            row_logprobs.append(float(torch.log_softmax(logits / temperature, -1)[token]))
            sequence.append(token)
            if token == EOS:
                break
        tokens.append(row_tokens)
        logprobs.append(row_logprobs)
    return tokens, logprobs


def test_greedy_equals_step_by_step_argmax(gpt2, chunk_batch):
    """do_sample=False: each token is the argmax of a no-cache forward (top-k/top-p and keys play no part), and the
    behaviour log-probs are log_softmax(logits / temperature) of it."""
    model = EOSBiased(gpt2, bias=0.5)
    temperature, max_new = 0.7, 8
    expected_tokens, expected_logprobs = _greedy_reference(
        model, chunk_batch["input_ids"], chunk_batch["attention_mask"], max_new, temperature)
    lengths = [len(row) for row in expected_tokens]
    assert min(lengths) < max_new  # the interesting case: some rows end at EOS ...
    assert len({tuple(row) for row in expected_tokens}) > 1  # ... and the rows differ
    for config, seed in ((GenerationConfig(max_new_tokens=max_new, temperature=temperature, do_sample=False), 0),
                         (GenerationConfig(max_new_tokens=max_new, temperature=temperature, do_sample=False, top_k=2,
                                           top_p=0.3, batch_size=3), 5)):
        rollout = run(model, chunk_batch, config, seed=seed)
        assert rollout.response_mask.sum(1).tolist() == lengths
        for row, (tokens, logprobs) in enumerate(zip(expected_tokens, expected_logprobs)):
            assert rollout.responses[row, : len(tokens)].tolist() == tokens
            assert_close(rollout.logprobs[row, : len(tokens)], torch.tensor(logprobs), rtol=0, atol=1e-4)


def test_missing_eos_penalty_any_stop_hand_computed():
    """missing_eos_penalty: only a response cut at max_new_tokens without a stop pays it. A shorter response ended
    at a stop (any id, or a stop string); a full-length one ends properly when its last token is EOS or a
    generation.stop_token_ids id; rollout.stopped, when generation recorded it, decides exactly."""
    rollout = _rollout(
        [[5, 6, PAD, PAD], [5, 3, 3, 3], [4, 4, 4, 7], [4, 4, 4, EOS], [5, 6, 3, 3]],
        [[1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 1]],
    )
    shaping = RewardShaping(PPOConfig(missing_eos_penalty=2.0, kl_coef=0.0), EOS)
    generation = GenerationConfig(max_new_tokens=4, stop_token_ids=[7])
    scores, finite = torch.tensor([1.0, 1.0, 0.5, 0.25, 0.0]), torch.ones(5, dtype=torch.bool)
    assert shaping.shape(scores, finite, rollout, generation).tolist() == [1.0, -1.0, 0.5, 0.25, -2.0]
    # Without the generation settings only the last token counts (EOS alone, as before stop ids existed).
    assert shaping.shape(scores, finite, rollout).tolist() == [-1.0, -1.0, -1.5, 0.25, -2.0]
    # Several EOS ids given to RewardShaping count too.
    several = RewardShaping(PPOConfig(missing_eos_penalty=2.0, kl_coef=0.0), [EOS, 7])
    assert several.shape(scores, finite, rollout).tolist() == [-1.0, -1.0, 0.5, 0.25, -2.0]
    # rollout.stopped from generate() is exact: row 4 ended at a stop string completed by its last token.
    stopped = _rollout(rollout.responses.tolist(), rollout.response_mask.tolist(), [True, False, True, True, True])
    assert shaping.shape(scores, finite, stopped, generation).tolist() == [1.0, -1.0, 0.5, 0.25, 0.0]
    assert stopped.select(slice(1, 3)).stopped.tolist() == [False, True]


def test_make_experience_penalises_only_cut_responses():
    """Through make_experience (RLOO, groups of 2, no KL): a response ended by an extra stop id or before the limit
    is not penalised; RLOO's advantages are of the penalised scores [1, -1] and [0.5, 0.25]."""
    generation = GenerationConfig(max_new_tokens=4, num_samples=2, stop_token_ids=[7])
    config = PPOConfig(missing_eos_penalty=2.0, kl_coef=0.0)
    algorithm = build_algorithm("rloo", config, generation)
    rollout = _rollout([[5, 6, PAD, PAD], [5, 3, 3, 3], [4, 4, 4, 7], [4, 4, 4, EOS]],
                       [[1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 1]])
    experience, _ = make_experience(rollout, torch.zeros(4, 4), torch.tensor([1.0, 1.0, 0.5, 0.25]), None,
                                    algorithm, RewardShaping(config, EOS), iteration=0)
    expected = torch.tensor([2.0, -2.0, 0.25, -0.25]).unsqueeze(1) * rollout.response_mask
    assert_close(experience.advantages, expected)



def test_dapo_overlong_shaping_and_filtering_through_make_experience():
    """DAPO, max_new_tokens 4, overlong_buffer 2: lengths 2, 4, 4, 3 lose 0, 1, 1, 0.5 of their scores [1, 1, 0.5,
    0.25], so the groups see [1, 0] and [-0.5, -0.25] (advantages -+1/sqrt(2) and +-1/sqrt(2)). With the filter,
    the one response cut without a stop (row 1) keeps its group statistics but leaves the loss."""
    generation = GenerationConfig(max_new_tokens=4, num_samples=2, stop_token_ids=[7])
    config = PPOConfig(kl_coef=0.0, overlong_buffer=2, overlong_filter=True)
    algorithm = build_algorithm("dapo", config, generation)
    rollout = _rollout([[5, 6, PAD, PAD], [5, 3, 3, 3], [4, 4, 4, 7], [4, 4, EOS, PAD]],
                       [[1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 0]])
    experience, stats = make_experience(rollout, torch.zeros(4, 4), torch.tensor([1.0, 1.0, 0.5, 0.25]), None,
                                        algorithm, RewardShaping(config, EOS), iteration=0)
    half = 2 ** -0.5
    expected = torch.tensor([half, -half, -half, half]).unsqueeze(1) * rollout.response_mask
    assert_close(experience.advantages, expected, atol=1e-5, rtol=1e-5)
    assert experience.response_mask.sum(1).tolist() == [2, 0, 4, 3]
    assert stats["reward/overlong_penalty_mean"].item() == pytest.approx(-2.5 / 4)
    assert stats["response/overlong_filtered"].item() == 1.0
    assert stats["reward/mean"].item() == pytest.approx(2.75 / 4)  # the raw scores, before any shaping

@pytest.mark.parametrize("kwargs,match", [
    ({"stop_strings": ["ok", ""]}, r"generation\.stop_strings must hold non-empty strings, got ''"),
    ({"stop_strings": [3]}, r"generation\.stop_strings must hold non-empty strings, got 3"),
    ({"stop_strings": "</s>"}, r"generation\.stop_strings must be a list.*stop_strings=\['</s>'\]"),
    ({"stop_token_ids": [5, -1]}, r"generation\.stop_token_ids must hold token ids \(integers >= 0\), got -1"),
    ({"stop_token_ids": [True]}, r"generation\.stop_token_ids must hold token ids"),
    ({"stop_token_ids": 7}, r"generation\.stop_token_ids must be a list.*stop_token_ids=\[7\]"),
    ({"do_sample": "no"}, r"generation\.do_sample must be True \(sampling\) or False \(greedy\)"),
])
def test_stop_settings_validation_names_the_fix(kwargs, match):
    """Bad stop strings, stop ids or do_sample fail on construction, saying what to write instead."""
    with pytest.raises(ValueError, match=match):
        GenerationConfig(**kwargs)
    config = GenerationConfig(stop_strings=["\n\n"], stop_token_ids=[0, 7], do_sample=False)
    assert (config.stop_strings, config.stop_token_ids, config.do_sample) == (["\n\n"], [0, 7], False)
    assert (GenerationConfig().stop_strings, GenerationConfig().stop_token_ids, GenerationConfig().do_sample) == (
        None, None, True)
