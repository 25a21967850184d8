"""A small multi-turn task for the tests: the demo tokenizer with a chat template, and an environment that answers
every turn and scores its characters, so a random tiny model's episodes have several turns. Importable by name on
the command line (``--model.environment '{class_path: agent_task.LetterCount}'``) in the tests' subprocesses."""

from __future__ import annotations

from typing import Any

from lightning_app_rlhf.agents import Environment, StepResult
from lightning_app_rlhf.demo import build_tokenizer

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<eos>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
"""ChatML's shape with the demo tokenizer's own end token."""


def tokenizer() -> Any:
    """The demo tokenizer with :data:`CHAT_TEMPLATE`."""
    tok = build_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    return tok


class LetterCount(Environment):
    """Each turn scores the share of the letter ``e`` in the assistant's text (a per-turn reward) and answers with
    the count; the episode ends after ``turns`` turns.

    Args:
        turns: Turns per episode.
    """

    def __init__(self, turns: int = 3) -> None:
        self.turns = turns
        self.taken = 0

    def reset(self, row: dict[str, Any]) -> list[dict[str, str]]:
        prompt = row["prompt"]
        return [{"role": "user", "content": prompt if isinstance(prompt, str) else prompt[-1]["content"]}]

    def step(self, assistant_text: str) -> StepResult:
        self.taken += 1
        count = assistant_text.count("e")
        reward = count / max(len(assistant_text), 1)
        if self.taken >= self.turns:
            return StepResult(reward=reward, done=True)
        return StepResult([{"role": "user", "content": f"{count} e. Again."}], reward, False)
