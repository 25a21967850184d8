"""Reward functions: this package's positional convention and TRL's keywords (``GRPOTrainer``'s ``reward_funcs``),
the setup-time check of a reward's parameters against the dataset's fields, and import paths to a module in the
current folder under the console script (``models/reward_args.py``, ``models/roles.py:resolve_import``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
from helpers import make_module

from lightning_app_rlhf import GenerationConfig, PromptDataModule
from lightning_app_rlhf.models.reward_args import RewardSignature, RewardSignatureError, RewardState
from lightning_app_rlhf.models.roles import resolve_import

ROWS = [{"prompt": p, "answer": a} for p, a in [("red", "r"), ("list some fruit:", "f"), ("blue", "b"),
                                                 ("name a few animals:", "a")]]


def _trainer() -> pl.Trainer:
    return pl.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False)


# ---- which convention ----


def ours(prompts, responses, **fields): ...
def ours_named(prompts, responses, answer): ...
def trl(completions, **kwargs): ...
def trl_full(prompts, completions, answer, **kwargs): ...
def trl_prompts_only(prompts, **kwargs): ...
def trl_keyword_only(*, completions, answer): ...


@pytest.mark.parametrize(("function", "trl_style"), [
    (ours, False), (ours_named, False), (lambda p, r: None, False), (trl, True), (trl_full, True),
    (trl_prompts_only, True), (trl_keyword_only, True), (len, False),
])
def test_convention_read_from_the_signature(function, trl_style):
    """TRL's keywords when a parameter is named `completions`, or `prompts` with no second positional parameter;
    else (prompts, responses) positionally. Read once per function."""
    assert RewardSignature.of(function).trl_style is trl_style
    assert RewardSignature.of(function) is RewardSignature.of(function) or function is len


def test_arguments_of_each_convention():
    """Positional: the two lists and the fields it takes. TRL: all by name, completion_ids and trainer_state only
    when taken (by name or **kwargs)."""
    fields = {"answer": ["x", "y"], "level": [1, 2]}
    args, kwargs = RewardSignature.of(ours_named).arguments(["p", "q"], ["a", "b"], fields, lambda: [[1], [2]], 3)
    assert args == (["p", "q"], ["a", "b"]) and kwargs == {"answer": ["x", "y"]}
    args, kwargs = RewardSignature.of(trl).arguments(["p", "q"], ["a", "b"], fields, lambda: [[1], [2]], 3)
    assert args == () and kwargs == {"prompts": ["p", "q"], "completions": ["a", "b"], "completion_ids": [[1], [2]],
                                     "trainer_state": RewardState(global_step=3), **fields}
    args, kwargs = RewardSignature.of(trl_keyword_only).arguments(["p"], ["a"], {"answer": ["x"]}, None, None)
    assert kwargs == {"completions": ["a"], "answer": ["x"]}  # no **kwargs: only what it names
    RewardSignature.of(trl_keyword_only).check(trl_keyword_only, ["answer"])


# ---- a TRL reward, unchanged, in a run ----


def test_trl_reward_runs_unchanged(tokenizer):
    """A reward written for TRL's GRPOTrainer, `(completions, answer, **kwargs)`, trains as it is: completions as
    text, the `answer` column aligned with them, and TRL's other keywords in **kwargs."""
    seen: list[dict[str, Any]] = []

    def reward(completions, answer, **kwargs):
        seen.append({"completions": completions, "answer": answer, **kwargs})
        return [1.0 if a in c else 0.0 for c, a in zip(completions, answer)]

    module = make_module(reward_fn=reward, algorithm="grpo", generation=GenerationConfig(max_new_tokens=3,
                                                                                         num_samples=2))
    trainer = _trainer()
    trainer.fit(module, PromptDataModule(ROWS, tokenizer, batch_size=2))
    assert trainer.global_step == 1 and len(seen) == 1
    call = seen[0]
    assert set(call) == {"completions", "answer", "prompts", "completion_ids", "trainer_state"}
    assert len(call["completions"]) == len(call["prompts"]) == len(call["answer"]) == 4
    assert all(isinstance(c, str) for c in call["completions"])
    by_prompt = {row["prompt"]: row["answer"] for row in ROWS}
    assert call["answer"] == [by_prompt[p] for p in call["prompts"]]
    assert all(isinstance(ids, list) and len(ids) <= 3 for ids in call["completion_ids"])
    assert [tokenizer.decode(ids, skip_special_tokens=True) for ids in call["completion_ids"]] == call["completions"]
    assert call["trainer_state"].global_step == 0


# ---- parameters that cannot be bound fail at setup ----


def needs_solution(completions, solution):
    return [0.0] * len(completions)


def answer_positional(prompts, answer):
    return [0.0] * len(prompts)


def test_unbindable_reward_fails_at_setup(tokenizer):
    """A reward asking for a field the rows lack fails in setup, before any model is built or anything generated,
    naming the function, its signature and the rows' fields."""
    module = make_module(reward_fn=needs_solution, algorithm="grpo", generation=GenerationConfig(max_new_tokens=2))
    with pytest.raises(RewardSignatureError) as info:
        _trainer().fit(module, PromptDataModule(ROWS, tokenizer, batch_size=2))
    message = str(info.value)
    assert "needs_solution(completions, solution)" in message
    assert "needs 'solution'" in message and "have the fields ['answer']" in message
    assert "training rows (data.prompts)" in message and "give it a default" in message
    assert module.actor is None  # configure_model never ran: nothing was generated


def test_field_taken_as_the_responses_names_completions(tokenizer):
    """(prompts, answer) with an `answer` field: the positional convention would give `answer` the responses; the
    error says to name the parameter `completions` (TRL) or `responses`."""
    module = make_module(reward_fn=answer_positional, generation=GenerationConfig(max_new_tokens=2))
    with pytest.raises(RewardSignatureError, match=r"answer_positional\(prompts, answer\).*takes the responses "
                                                   r"positionally.*`completions`"):
        _trainer().fit(module, PromptDataModule(ROWS, tokenizer, batch_size=2))


def test_one_positional_parameter_names_both_conventions():
    """`(responses)` cannot take the two lists: the error shows both signatures."""
    def only_responses(responses):
        return responses

    with pytest.raises(RewardSignatureError, match=r"only_responses\(responses\).*\(prompts, responses, \*\*fields\)"
                                                   r".*\(completions, \*\*kwargs\)"):
        RewardSignature.of(only_responses).check(only_responses, [])


# ---- import paths to a module in the current folder ----


@pytest.fixture
def console_script_cwd(tmp_path, monkeypatch):
    """A current folder outside sys.path, as under the console script (sys.path[0] is the script's bin folder)."""
    monkeypatch.chdir(tmp_path)
    here = os.path.realpath(tmp_path)
    monkeypatch.setattr(sys, "path", [str(tmp_path / "bin")] + [p for p in sys.path
                                                                  if p and os.path.realpath(p) != here])
    made: list[str] = []
    yield tmp_path, made
    for name in made:
        sys.modules.pop(name, None)


def test_resolve_import_from_the_current_folder(console_script_cwd):
    """`my_module:name` loads from the current folder even when it is not on sys.path, as under `python -m`."""
    folder, made = console_script_cwd
    (folder / "cwd_reward_a1.py").write_text("def reward(completions, **kwargs):\n"
                                             "    return [1.0] * len(completions)\n")
    made.append("cwd_reward_a1")
    function = resolve_import("cwd_reward_a1:reward")
    assert function.__name__ == "reward" and sys.path[-1] == os.getcwd()
    assert resolve_import("cwd_reward_a1.reward") is function


def test_resolve_import_errors_name_the_folders_and_the_cause(console_script_cwd):
    """A module found nowhere: the folders searched, and that the syntax is right. A missing attribute: what the
    module defines. A failing import inside the module: that import."""
    folder, made = console_script_cwd
    with pytest.raises(ValueError, match=r"no module 'no_such_reward_b2' in the current folder \(.*\) and sys.path "
                                         r"\(.*bin.*The path's syntax \('package.module:name'\) is right"):
        resolve_import("no_such_reward_b2:reward")
    (folder / "cwd_reward_b2.py").write_text("def other(prompts, responses):\n    return []\n")
    made.append("cwd_reward_b2")
    with pytest.raises(ValueError, match=r"has no attribute 'reward'.*syntax.*is right; the module defines: other"):
        resolve_import("cwd_reward_b2:reward")
    (folder / "cwd_reward_c3.py").write_text("import not_installed_dependency_c3\n")
    made.append("cwd_reward_c3")
    with pytest.raises(ValueError, match=r"No module named 'not_installed_dependency_c3' \(an import inside it\)"):
        resolve_import("cwd_reward_c3:reward")


def test_reward_fn_import_path_from_the_current_folder(console_script_cwd):
    """`--model.reward_fn my_module.name` (a string) resolves from the current folder in RLHFModule."""
    folder, made = console_script_cwd
    (folder / "cwd_reward_d4.py").write_text("def reward(completions, answer, **kwargs):\n    return []\n")
    made.append("cwd_reward_d4")
    module = make_module(reward_fn="cwd_reward_d4.reward")
    assert module.reward_fn.__module__ == "cwd_reward_d4" and RewardSignature.of(module.reward_fn).trl_style
    assert Path(sys.modules["cwd_reward_d4"].__file__).parent == folder


def test_profiler_times_a_reward_that_reads_fields(tokenizer):
    """The PlacementTuner's reward timing hands the rows' fields over, so a reward needing `answer` can be timed."""
    from types import SimpleNamespace

    from lightning_app_rlhf.planner.profiler import measure_reward_fn

    answers: list[list[str]] = []

    def reward(completions, answer, **kwargs):
        answers.append(answer)
        return [0.0] * len(completions)

    workload = SimpleNamespace(prompt_length=4, generation_length=3)
    rows = [{"answer": row["answer"]} for row in ROWS]
    seconds = measure_reward_fn(reward, tokenizer, workload, [row["prompt"] for row in ROWS], fields=rows)
    assert seconds > 0 and answers[0][:5] == ["r", "f", "b", "a", "r"]
    with pytest.raises(RewardSignatureError, match=r"needs 'answer', but this batch's rows have the fields \[\]"):
        measure_reward_fn(reward, tokenizer, workload, None)


def test_a_field_named_like_a_positional_parameter_is_named():
    """A row field that the positional convention also fills (`prompts`) is named in the error; TRL-style, the call's
    own `prompts` wins over a field of that name, as TRL drops its prompt column."""
    with pytest.raises(RewardSignatureError, match=r"takes the prompts positionally in its parameter 'prompts'.*"
                                                   r"Rename that field"):
        RewardSignature.of(ours).check(ours, ["prompts"])
    _, kwargs = RewardSignature.of(trl).arguments(["p"], ["c"], {"prompts": ["field"], "answer": ["a"]})
    assert kwargs["prompts"] == ["p"] and kwargs["answer"] == ["a"]


# ---- the console script and `python -m`, from a folder holding the reward ----

CONSOLE_SCRIPT = """import sys
from lightning_app_rlhf.cli import console_main
if __name__ == "__main__":
    sys.exit(console_main())
"""
"""What pip writes for the ``lightning-app-rlhf`` entry point (pyproject.toml): run as a file, its folder is
``sys.path[0]``, not the current folder."""


def test_console_script_and_python_m_load_a_reward_from_the_current_folder(tmp_path):
    """`lightning-app-rlhf fit` (sys.path[0]: the script's folder) loads `my_reward.py` from the current folder as
    `python -m` does, runs a TRL reward unchanged and exits 0; a reward needing a field the rows lack fails at setup
    with one message naming the fields, whichever way the CLI is started."""
    from helpers import DEMO_CONFIG, output_tail

    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "lightning-app-rlhf").write_text(CONSOLE_SCRIPT)
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "Name a colour of the sky.", "answer": "blue"}\n' * 8)
    (tmp_path / "cwd_trl_reward.py").write_text(
        "def contains_answer(completions, answer, **kwargs):\n"
        "    return [1.0 if a in c else 0.0 for c, a in zip(completions, answer)]\n\n\n"
        "def needs_solution(completions, solution):\n"
        "    return [0.0] * len(completions)\n")
    common = ["fit", "--config", str(DEMO_CONFIG.with_name("demo_grpo_cpu.yaml")), "--data.prompts", "prompts.jsonl",
              "--trainer.max_steps", "1", "--trainer.enable_checkpointing", "false",
              "--model.generation.max_new_tokens", "4"]
    for start in ([sys.executable, str(tmp_path / "bin" / "lightning-app-rlhf")],
                  [sys.executable, "-m", "lightning_app_rlhf"]):
        ok = _run([*start, *common, "--model.reward_fn", "cwd_trl_reward.contains_answer"], tmp_path)
        assert ok.returncode == 0, output_tail(ok)
        if start[1] == "-m":  # the setup-time error, once: the same module and the same check either way
            continue
        bad = _run([*start, *common, "--model.reward_fn", "cwd_trl_reward:needs_solution"], tmp_path)
        assert bad.returncode != 0 and "needs 'solution'" in bad.stderr and "['answer']" in bad.stderr, \
            output_tail(bad)
        assert "Traceback" not in bad.stderr, output_tail(bad)


def _run(command: list[str], cwd: Path) -> subprocess.CompletedProcess:
    from helpers import one_thread_env

    return subprocess.run(command, cwd=cwd, env=one_thread_env(), capture_output=True, text=True, timeout=300,
                          check=False)
