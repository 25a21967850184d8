"""Multi-turn pieces that need no SmolLM2 tokenizer: docs/agents.md's worked environment runs as written, and an
environment is saved in a checkpoint's hyperparameters by its import path."""

from __future__ import annotations

import re

from helpers import ROOT

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
