"""``predict`` writes: the CLI's default PredictionWriter puts one JSON line per prompt (prompt, completion, reward)
in the run's log directory and says where; ``--predictions`` moves it or turns it off."""

from __future__ import annotations

import json
import re
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from helpers import DEMO_CONFIG, run_cli
from torch.utils.data import DataLoader

from lightning_app_rlhf.callbacks import PredictionWriter
from lightning_app_rlhf.cli import main
from lightning_app_rlhf.demo import topic_reward, val_prompts

WROTE = re.compile(r"predict: wrote (\d+) completions .* to (\S+)")


@pytest.fixture(scope="module")
def demo_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny demo fitted for 1 iteration from the CLI, its checkpoint saved after it."""
    tmp_path = tmp_path_factory.mktemp("fit")
    run_cli("fit", "--config", DEMO_CONFIG, "--trainer.max_steps", "1", "--model.generation.max_new_tokens", "6",
            "--trainer.logger.init_args.save_dir", tmp_path / "runs",
            "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
            f"--trainer.callbacks.dirpath={tmp_path / 'ckpt'}", "--trainer.callbacks.every_n_train_steps=1",
            "--trainer.callbacks.filename=last", cwd=tmp_path, timeout=240)
    return tmp_path / "ckpt" / "last.ckpt"


def _predict(tmp_path: Path, checkpoint: Path, *args: str | Path) -> str:
    result = run_cli("predict", "--config", DEMO_CONFIG, "--ckpt_path", checkpoint,
                     "--trainer.logger.init_args.save_dir", tmp_path / "runs",
                     "--model.eval_generation.max_new_tokens", "6", *args, cwd=tmp_path, timeout=240)
    # predict saves no checkpoint: no checkpoint callback restored from the fit's, so no "dirpath has changed"
    assert "dirpath has changed" not in result.stdout + result.stderr
    return result.stdout


def test_cli_predict_writes_one_json_line_per_prompt(tmp_path, demo_checkpoint):
    """By default predict writes predictions.jsonl next to the run's config.yaml: every held-out prompt in order,
    its completion and its reward (the demo reward of that completion), and prints the file's path; --predictions
    PATH writes there instead."""
    stdout = _predict(tmp_path, demo_checkpoint)
    (match,) = WROTE.finditer(stdout)
    path = Path(match[2])
    assert path.name == "predictions.jsonl" and (path.parent / "config.yaml").is_file()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    prompts = val_prompts()  # the demo has no predict_prompts: predict reads the held-out ones
    assert int(match[1]) == len(rows) == len(prompts)
    assert [r["index"] for r in rows] == list(range(len(prompts)))
    assert [r["prompt"] for r in rows] == prompts
    assert all(set(r) == {"index", "prompt", "completion", "reward"} for r in rows)
    assert all(isinstance(r["completion"], str) for r in rows)
    completions = [r["completion"] for r in rows]
    assert [r["reward"] for r in rows] == pytest.approx(topic_reward(prompts, completions))

    mine = ["which fruit do you know:", "name a few colors:", "which animals do you know:"]
    (tmp_path / "mine.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in mine))
    elsewhere = tmp_path / "out" / "mine_predicted.jsonl"
    stdout = _predict(tmp_path, demo_checkpoint, "--predictions", elsewhere, "--data.predict_prompts",
                      tmp_path / "mine.jsonl")
    (match,) = WROTE.finditer(stdout)
    assert Path(match[2]) == elsewhere.resolve()
    assert [json.loads(line)["prompt"] for line in elsewhere.read_text().splitlines()] == mine


def test_predict_under_a_placement_writes_each_prompt_once(tmp_path, demo_checkpoint):
    """Under Flattening on 2 processes (each rank generates half the batch; every rank's predict_step returns the
    whole batch, gathered) the file holds each prompt once, in order, written by rank 0 alone."""
    stdout = _predict(tmp_path, demo_checkpoint, "--trainer.devices", "2", "--trainer.strategy",
                      "lightning_app_rlhf.strategies.FlatteningStrategy", "--trainer.strategy.start_method", "fork")
    (match,) = WROTE.finditer(stdout)
    rows = [json.loads(line) for line in Path(match[2]).read_text().splitlines()]
    assert [r["index"] for r in rows] == list(range(len(val_prompts())))


def test_predictions_option_parses_a_switch_or_a_path(capsys, monkeypatch):
    """--predictions false turns the writer off; a path is a path; unset, it is on."""
    monkeypatch.setattr("sys.argv", ["lightning-app-rlhf"])  # pytest's own arguments are not the command line
    for value, parsed in (("false", "false"), ("out/p.jsonl", "out/p.jsonl"), (None, "true")):
        with pytest.raises(SystemExit):
            main(["predict", "--config", str(DEMO_CONFIG), *(["--predictions", value] if value else []),
                  "--print_config"])
        assert f"predictions: {parsed}\n" in capsys.readouterr().out


class _Rows(pl.LightningModule):
    """A stand-in for RLHFModule.predict_step: the rows of a batch of prompt indices."""

    def predict_step(self, batch: torch.Tensor, batch_idx: int) -> list[dict[str, object]]:
        return [{"index": int(i), "prompt": f"p{int(i)}", "completion": "é", "completion_ids": [1, 2],
                 "reward": float(i) / 2} for i in batch]


def test_writer_under_a_plain_trainer_writes_batches_in_order(tmp_path, capsys):
    """Used from Python: every batch's rows, in order, UTF-8; token ids only when asked; a second predict replaces
    the file."""
    data = DataLoader(torch.arange(5), batch_size=2)
    writer = PredictionWriter(tmp_path / "p.jsonl", token_ids=True)
    trainer = pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, callbacks=[writer])
    for _ in range(2):
        trainer.predict(_Rows(), dataloaders=data, return_predictions=False)
    lines = (tmp_path / "p.jsonl").read_text(encoding="utf-8").splitlines()
    assert [json.loads(line) for line in lines] == [
        {"index": i, "prompt": f"p{i}", "completion": "é", "reward": i / 2, "completion_ids": [1, 2]}
        for i in range(5)]
    assert writer.rows_written == 5
    assert f"wrote 5 completions (prompt, completion, reward; one JSON line each) to {tmp_path / 'p.jsonl'}" in \
        capsys.readouterr().out
