"""The Python API has what the command line has: the configs and the agent classes import from the package's top
level, and ``default_callbacks()`` gives a Python Trainer the CLI's progress bar, run summary and prediction writer
(docs/api.md, "default_callbacks")."""

from __future__ import annotations

import json
import re

import lightning.pytorch as pl
import torch
from helpers import ROOT, make_module
from lightning.pytorch.callbacks import BasePredictionWriter, RichProgressBar

import lightning_app_rlhf
from lightning_app_rlhf import GenerationConfig, PromptDataModule, default_callbacks, demo
from lightning_app_rlhf.callbacks import (
    PredictionWriter,
    RLHFProgressBar,
    RLHFRunSummary,
    missing_default_callbacks,
)


def test_configs_and_agent_classes_import_from_the_top_level():
    from lightning_app_rlhf.agents import Environment, StepResult, ToolEnvironment
    from lightning_app_rlhf.core import config

    for name, defined in {"AgentConfig": config.AgentConfig, "GenerationConfig": config.GenerationConfig,
                          "PPOConfig": config.PPOConfig, "Environment": Environment, "StepResult": StepResult,
                          "ToolEnvironment": ToolEnvironment}.items():
        assert getattr(lightning_app_rlhf, name) is defined, name
        assert name in lightning_app_rlhf.__all__
    assert "default_callbacks" in lightning_app_rlhf.__all__


def test_default_callbacks_are_the_command_lines(tmp_path):
    """The bar, the summary and the writer; ``predictions`` moves the writer's file or drops the writer."""
    bar, summary, writer = default_callbacks()
    assert type(bar) is RLHFProgressBar and type(summary) is RLHFRunSummary and summary.window == 10
    assert type(writer) is PredictionWriter and writer.path is None  # predictions.jsonl in the log directory
    assert default_callbacks(predictions=tmp_path / "p.jsonl", summary_window=3)[2].path == tmp_path / "p.jsonl"
    assert default_callbacks(predictions=tmp_path / "p.jsonl", summary_window=3)[1].window == 3
    assert [type(c) for c in default_callbacks(predictions=False)] == [RLHFProgressBar, RLHFRunSummary]
    assert default_callbacks() is not default_callbacks()  # fresh ones each call: a summary keeps its run's history


def test_missing_default_callbacks_adds_only_what_the_stage_lacks(tmp_path):
    """fit: a run summary unless there is one; predict: a writer unless there is any prediction writer (or
    ``predictions=False``); never a progress bar (the Trainer has one; the module makes Lightning's an RLHF one)."""
    bar = RichProgressBar()
    assert [type(c) for c in missing_default_callbacks([bar], "fit")] == [RLHFRunSummary]
    assert missing_default_callbacks([bar, RLHFRunSummary(window=2)], "fit") == []
    assert [type(c) for c in missing_default_callbacks([bar], "predict")] == [PredictionWriter]
    (added,) = missing_default_callbacks([], "predict", predictions=str(tmp_path / "p.jsonl"))
    assert str(added.path) == str(tmp_path / "p.jsonl")
    assert missing_default_callbacks([], "predict", predictions=False) == []
    own = BasePredictionWriter(write_interval="batch")
    assert missing_default_callbacks([own], "predict") == []
    assert missing_default_callbacks([], "validate") == missing_default_callbacks([], "test") == []


def test_a_python_trainer_with_default_callbacks_runs_like_the_cli(tmp_path, capsys):
    """``Trainer(callbacks=default_callbacks())``: fit shows "Iteration N/max_steps" and ends with the run summary;
    predict then writes predictions.jsonl in the run's log directory."""
    pl.seed_everything(0)
    module = make_module(algorithm="grpo", generation=GenerationConfig(max_new_tokens=6, num_samples=2),
                         actor_optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3))
    data = PromptDataModule(demo.prompts(8), module.tokenizer, batch_size=2)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=2, default_root_dir=tmp_path,
                         enable_checkpointing=False, enable_model_summary=False, callbacks=default_callbacks())
    trainer.fit(module, data)
    bar = trainer.progress_bar_callback
    assert isinstance(bar, RLHFProgressBar) and bar.describe_training(trainer).startswith("Iteration 2/2, epoch")
    (summary,) = [c for c in trainer.callbacks if isinstance(c, RLHFRunSummary)]
    assert len(summary.history["reward/mean"]) == 2
    assert "RLHF run summary: 2 GRPO iterations" in " ".join(capsys.readouterr().out.split())
    trainer.predict(module, data, return_predictions=False)
    lines = (tmp_path / "lightning_logs" / "version_0" / "predictions.jsonl").read_text().splitlines()
    assert len(lines) == 8 and set(json.loads(lines[0])) == {"index", "prompt", "completion", "reward"}


def test_the_default_callbacks_example_in_docs_api_runs(tmp_path, monkeypatch, capsys):
    """docs/api.md's ``default_callbacks`` example, cut to 2 iterations and 16 prompts: the summary is printed and
    predict writes its file."""
    text = (ROOT / "docs/api.md").read_text()
    block = next(b for b in re.findall(r"```python\n(.*?)```", text, re.DOTALL) if "callbacks=default_callbacks()" in b)
    assert "max_steps=20" in block and "prompts()" in block
    monkeypatch.chdir(tmp_path)
    pl.seed_everything(0)
    exec(block.replace("max_steps=20", "max_steps=2").replace("prompts()", "prompts(16)"), {})  # noqa: S102
    assert "RLHF run summary: 2 GRPO iterations" in " ".join(capsys.readouterr().out.split())
    assert len((tmp_path / "lightning_logs/version_0/predictions.jsonl").read_text().splitlines()) == 16
