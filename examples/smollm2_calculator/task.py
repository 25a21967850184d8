"""Multi-digit arithmetic that a 135M model cannot do in its head, with a calculator tool: the questions, a seeded
split, the tool, and the reward.

A question is ``"What is A * B?"`` (A of three digits, B of two) or ``"What is A + B + C?"`` (three numbers of three
digits). A row is ``{"prompt": [system, *EXAMPLE, user], "answer": "9716"}``; ``answer`` reaches the reward as a
keyword.

The prompt shows one solved episode (:data:`EXAMPLE`: a question, the tool call, the tool's result, the answer) as
earlier chat turns, after a system prompt that spells out the call's format (:data:`SYSTEM`). Without the example
SmolLM2-135M never calls the tool, greedy or sampled, whatever the system prompt says (0 of 20 held-out questions
greedy, 0 of 32 sampled episodes). With the example and a one-line system prompt it calls the tool in 40% of its
greedy episodes but never with the right arguments (0 of 20 right greedy, 0 of 64 sampled episodes right): no signal
for GRPO. With the format spelled out too, 9 of 20 held-out questions are right greedy before any training, and 5 of
64 sampled episodes (seed 1): rare right answers that GRPO can learn from.

The environment (:func:`environment`) is ``ToolEnvironment([calculator], describe_tools=False)``: the tool is
described by the system prompt and the example, not by the Hermes preamble that ``ChatRenderer`` would put into the system message
for a template without tool support (SmolLM2's): that preamble is 200 tokens, most of every sequence on CPU.

The reward reads the final answer: 1.0 when the last number of the episode's final assistant turn (the one without a
tool call) equals the answer, else 0.0. Calling the tool is not rewarded by itself: only a right answer is.
"""

from __future__ import annotations

import random
import re
from typing import Any

from lightning_app_rlhf.agents import ToolEnvironment

SYSTEM = ('You are a helpful assistant with a calculator tool. For any arithmetic, reply first with only a tool call: '
          '<tool_call>{"name": "calculator", "arguments": {"expression": "<the expression>"}}</tool_call>. '
          'The tool replies with the result. Then answer: "The answer is <the result>."')
"""Spells out the call's format and the answer's: with the example alone, sampled episodes are rarely right."""
EXAMPLE = [
    {"role": "user", "content": "What is 123 * 45?"},
    {"role": "assistant", "content": '<tool_call>{"name": "calculator", "arguments": {"expression": "123 * 45"}}'
                                     "</tool_call>"},
    {"role": "tool", "content": "5535"},
    {"role": "assistant", "content": "The answer is 5535."},
]
"""One solved episode, shown before the question: the call format, by example."""
STOP_STRINGS = ["</tool_call>"]
"""A turn ends at its tool call's end (``GenerationConfig.stop_strings``): the call runs at once, nothing after it is
sampled."""
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression of integers with +, -, * and parentheses.

    Args:
        expression: The expression to evaluate, e.g. "347 * 28".
    """
    if not expression or not set(expression) <= set("0123456789+-*() ") or "**" in expression:
        # "**" is refused too: 9**9**9 would hold up the rollout for good.
        raise ValueError(f"the expression may only hold integers, +, -, * and parentheses, got {expression!r}")
    return str(eval(expression, {"__builtins__": {}}))  # noqa: S307 - characters checked above


def make_row(question: str, answer: int) -> dict[str, Any]:
    messages = [{"role": "system", "content": SYSTEM}, *EXAMPLE, {"role": "user", "content": question}]
    return {"prompt": messages, "answer": str(answer)}


def environment() -> ToolEnvironment:
    """The task's environment: ``ToolEnvironment([calculator], describe_tools=False)``. The prompt's :data:`EXAMPLE`
    shows the call instead of the 200-token Hermes description; the calls still run."""
    return ToolEnvironment([calculator], describe_tools=False)


def all_questions(count: int, seed: int) -> list[dict[str, Any]]:
    """``count`` distinct seeded questions, half products and half sums."""
    rng, rows, seen = random.Random(seed), [], set()
    while len(rows) < count:
        if len(rows) % 2 == 0:
            a, b = rng.randint(100, 999), rng.randint(10, 99)
            question, answer = f"What is {a} * {b}?", a * b
        else:
            a, b, c = (rng.randint(100, 999) for _ in range(3))
            question, answer = f"What is {a} + {b} + {c}?", a + b + c
        if question not in seen:
            seen.add(question)
            rows.append(make_row(question, answer))
    return rows


def train_test_split(train_size: int = 400, test_size: int = 50, seed: int = 0
                     ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The training rows and the held-out rows: no question is in both. Same seed, same split."""
    rows = all_questions(train_size + test_size, seed)
    return rows[test_size:], rows[:test_size]


def train_prompts() -> list[dict[str, Any]]:
    """The training rows of the default split: ``--data.prompts examples.smollm2_calculator.task:train_prompts``
    (``examples/configs/agent_calculator_cpu.yaml``)."""
    return train_test_split()[0]


def last_number(text: str) -> float | None:
    numbers = NUMBER.findall(text.replace(",", ""))
    return float(numbers[-1]) if numbers else None


def correct_answer(prompts: list[str], responses: list[str], answer: list[str]) -> list[float]:
    """1.0 where the final turn's last number is the row's ``answer``, else 0.0."""
    return [1.0 if last_number(r) == float(expected) else 0.0 for r, expected in zip(responses, answer)]
