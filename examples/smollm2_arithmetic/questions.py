"""Single-digit arithmetic with a verifiable answer: the questions, a seeded split, the exact-match reward.

Every question is ``"What is A + B? Answer with the number only."`` or ``"What is A - B? ..."`` with
single-digit operands (subtractions only where the result is not negative): 100 additions and 55
subtractions, 155 distinct questions. A seeded shuffle splits them into a training set and a held-out test
set that share no question.

A row is ``{"prompt": [system message, user message], "answer": "12"}``: the prompt is a chat message list
(``PromptDataModule`` renders it with the tokenizer's chat template) and ``answer`` reaches the reward
function as a keyword argument, one entry per response.

The reward is exact match on the first number of the response: 1.0 when it equals the answer, else 0.0.
"12", "12." and "The answer is 12." score 1; "12.5" scores 0 (a decimal is a different number), and so do
"7 + 5 = 12" (its first number is 7) and a response with no number. It rewards what the prompt asks for, the
answer first; no other shaping.
"""

from __future__ import annotations

import random
import re
from typing import Any

TEMPLATE = "What is {a} {op} {b}? Answer with the number only."
SYSTEM = "You are a helpful assistant."
"""Without a system message SmolLM2's chat template inserts its default one, 10 tokens longer; the prompt is
most of every sequence's compute. Greedy accuracy is about the same with either (17% vs 18% of the 155
questions)."""
OPERATIONS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b}
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
"""An integer with an optional decimal part: "12.5" is one number, not 12; the full stop of "12." is not."""


def all_questions(largest_operand: int = 9) -> list[tuple[int, str, int, int]]:
    """Every ``(a, op, b, result)`` with operands 0..largest_operand: all additions, and the subtractions
    whose result is not negative, in a fixed order."""
    numbers = range(largest_operand + 1)
    additions = [(a, "+", b, a + b) for a in numbers for b in numbers]
    subtractions = [(a, "-", b, a - b) for a in numbers for b in numbers if a >= b]
    return additions + subtractions


def make_row(a: int, op: str, b: int) -> dict[str, Any]:
    """One prompt row: the chat messages (the system message, then the question as the user's), and the
    answer as a string."""
    question = TEMPLATE.format(a=a, op=op, b=b)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    return {"prompt": messages, "answer": str(OPERATIONS[op](a, b))}


def train_test_split(
    test_size: int = 50, seed: int = 0, largest_operand: int = 9
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The training rows and the held-out test rows: a seeded shuffle of :func:`all_questions`, the first
    ``test_size`` held out. Same seed, same split; no question is in both."""
    questions = all_questions(largest_operand)
    if not 0 < test_size < len(questions):
        raise ValueError(f"test_size must be between 1 and {len(questions) - 1}, got {test_size}.")
    random.Random(seed).shuffle(questions)
    rows = [make_row(a, op, b) for a, op, b, _ in questions]
    return rows[test_size:], rows[:test_size]


def first_number(text: str) -> float | None:
    """The first number in ``text`` (a leading minus sign and a decimal part included), or None when it has
    none."""
    match = NUMBER.search(text.strip())
    return float(match.group()) if match else None


def exact_match(prompts: list[str], responses: list[str], answer: list[str]) -> list[float]:
    """1.0 where the response's first number equals the row's ``answer``, else 0.0; one per response."""
    return [1.0 if first_number(r) == int(expected) else 0.0 for r, expected in zip(responses, answer)]
