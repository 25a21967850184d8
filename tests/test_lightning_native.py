"""RLHFModule used like any LightningModule: epoch metrics, hyperparameters, the LR monitor, validation, predict,
and the Tuner's finders, which do not apply to RLHF."""

from __future__ import annotations

import json
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import yaml
from helpers import ROOT, make_module, metrics_rows, run_python
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.tuner import Tuner

from lightning_app_rlhf import GenerationConfig, PPOConfig, PromptDataModule, RLHFModule
from lightning_app_rlhf.demo import prompts, topic_reward, val_prompts


def _module(tokenizer, tiny_gpt2_config, **kwargs) -> RLHFModule:
    return RLHFModule(actor={"config": tiny_gpt2_config}, tokenizer=tokenizer,
                      reward_fn="lightning_app_rlhf.demo.topic_reward", generation=GenerationConfig(max_new_tokens=6),
                      ppo=PPOConfig(num_minibatches=2), **kwargs)


def _trainer(tmp_path: Path, **kwargs) -> pl.Trainer:
    options = {"accelerator": "cpu", "devices": 1, "logger": CSVLogger(tmp_path, name="run"), "log_every_n_steps": 1,
               "enable_checkpointing": False, "enable_progress_bar": False, "enable_model_summary": False}
    return pl.Trainer(**{**options, **kwargs})


def _metrics(tmp_path: Path) -> list[dict[str, float]]:
    return metrics_rows(tmp_path)


def test_epoch_metrics_are_the_mean_of_the_epoch(tmp_path, tokenizer, tiny_gpt2_config):
    """ModelCheckpoint and EarlyStopping judge ``reward/mean_epoch``: the mean over the epoch's iterations, not the
    epoch's last batch."""
    trainer = _trainer(tmp_path, max_epochs=2)
    trainer.fit(_module(tokenizer, tiny_gpt2_config), datamodule=PromptDataModule(prompts(12), tokenizer, batch_size=4))
    rows = _metrics(tmp_path)
    steps = [r for r in rows if "reward/mean" in r]
    epochs = [r for r in rows if "reward/mean_epoch" in r]
    assert len(steps) == 6 and len(epochs) == 2
    for epoch, row in enumerate(epochs):
        mine = [r["reward/mean"] for r in steps[3 * epoch : 3 * epoch + 3]]
        assert row["reward/mean_epoch"] == pytest.approx(sum(mine) / 3, rel=1e-6)
        assert row["epoch"] == epoch
    assert float(trainer.callback_metrics["reward/mean_epoch"]) == pytest.approx(epochs[-1]["reward/mean_epoch"])


def test_hyperparameters_are_saved_and_restore_the_module(tmp_path, tokenizer, tiny_gpt2_config):
    """hparams.yaml holds the model specs and configs, and load_from_checkpoint needs neither actor nor tokenizer
    (a tokenizer object is embedded in the checkpoint as its files)."""
    trainer = _trainer(tmp_path, max_steps=1)
    module = _module(tokenizer, tiny_gpt2_config, seed=3)
    trainer.fit(module, datamodule=PromptDataModule(prompts(8), tokenizer, batch_size=4))
    (hparams_file,) = tmp_path.rglob("hparams.yaml")
    hparams = yaml.safe_load(hparams_file.read_text())
    assert hparams["actor"]["config"] == tiny_gpt2_config
    assert hparams["generation"]["max_new_tokens"] == 6 and hparams["ppo"]["num_minibatches"] == 2
    assert hparams["reward_fn"] == "lightning_app_rlhf.demo.topic_reward" and hparams["seed"] == 3
    path = tmp_path / "model.ckpt"
    trainer.save_checkpoint(path)
    restored = RLHFModule.load_from_checkpoint(path)
    assert restored.tokenizer("list some fruit:").input_ids == tokenizer("list some fruit:").input_ids
    assert restored.generation.max_new_tokens == 6 and restored.seed == 3
    for name, tensor in module.actor.state_dict().items():
        torch.testing.assert_close(restored.actor.state_dict()[name], tensor, rtol=0, atol=0)


def test_reward_functions_are_saved_by_import_path_only(tmp_path, tokenizer):
    """An importable reward function is saved as its path; a lambda is not saved, and loading names the fix."""
    for reward_fn in (topic_reward, lambda prompts, responses: topic_reward(prompts, responses)):
        module = make_module(reward_fn=reward_fn, generation=GenerationConfig(max_new_tokens=4))
        trainer = _trainer(tmp_path, max_steps=1)
        trainer.fit(module, datamodule=PromptDataModule(prompts(4), tokenizer, batch_size=4))
        trainer.save_checkpoint(tmp_path / "model.ckpt")
        if reward_fn is topic_reward:
            assert RLHFModule.load_from_checkpoint(tmp_path / "model.ckpt").reward_fn is topic_reward
            continue
        with pytest.raises(ValueError, match=r"load_from_checkpoint\(path, reward_fn=\.\.\.\)"):
            RLHFModule.load_from_checkpoint(tmp_path / "model.ckpt")
        assert RLHFModule.load_from_checkpoint(tmp_path / "model.ckpt", reward_fn=reward_fn).reward_fn is reward_fn


def test_lr_find_is_refused_naming_the_alternatives(tmp_path, tokenizer, tiny_gpt2_config):
    """lr_find's loss-vs-lr sweep means nothing for RLHF: a clear error (it was an AttributeError), not a sweep.
    Tuner.scale_batch_size works (tests/test_tuner.py)."""
    trainer = _trainer(tmp_path, max_steps=1)
    data = PromptDataModule(prompts(8), tokenizer, batch_size=4)
    with pytest.raises(ValueError, match=r"model\.actor_optimizer.*PlacementTuner"):
        Tuner(trainer).lr_find(_module(tokenizer, tiny_gpt2_config), datamodule=data)


def test_validation_logs_greedy_rewards_at_the_trainers_interval(tmp_path, tokenizer, tiny_gpt2_config):
    """val/reward/mean is the reward of greedy completions of the held-out prompts, once per validation."""
    module = _module(tokenizer, tiny_gpt2_config)
    trainer = _trainer(tmp_path, max_epochs=2, check_val_every_n_epoch=1)
    data = PromptDataModule(prompts(8), tokenizer, batch_size=4, val_prompts=val_prompts(6), val_batch_size=4)
    trainer.fit(module, datamodule=data)
    validations = [r for r in _metrics(tmp_path) if "val/reward/mean" in r]
    assert [r["step"] for r in validations] == [1, 3]
    # The last validation, recomputed by hand from the trained actor: greedy completions, then the reward.
    (predictions,) = [trainer.predict(module, dataloaders=data.val_dataloader())]
    rows = [row for batch in predictions for row in batch]
    assert len(rows) == 6
    expected = topic_reward([r["prompt"] for r in rows], [r["completion"] for r in rows])
    assert validations[-1]["val/reward/mean"] == pytest.approx(sum(expected) / 6, rel=1e-6)
    lengths = [len(r["completion_ids"]) for r in rows]
    assert validations[-1]["val/response/length_mean"] == pytest.approx(sum(lengths) / 6, rel=1e-6)


@pytest.mark.parametrize("strategy", ["rlhf_flattening", "rlhf_separation"])
def test_lr_monitor_validation_and_predict_on_two_processes(tmp_path, strategy):
    """A user's LearningRateMonitor logs lr-actor and lr-critic whichever ranks hold the optimizers (rank 0 holds
    none under Separation); validation runs where actor.generate runs; trainer.predict returns the same
    completions on every rank."""
    run_python(ROOT / "tests/lightning_native_run.py", "--strategy", strategy, "--devices", "2", "--out", tmp_path,
               cwd=tmp_path)
    rows = _metrics(tmp_path)
    lrs = [r for r in rows if "lr-actor" in r]
    assert [r["lr-actor"] for r in lrs] == pytest.approx([1e-3, 5e-4, 2.5e-4, 1.25e-4])  # StepLR, gamma 0.5
    # No critic_optimizer: the critic takes the actor's optimizer (its lr), not its scheduler.
    assert [r["lr-critic"] for r in lrs] == pytest.approx([1e-3] * 4)
    assert not any(key.startswith("lr-AdamW") for r in rows for key in r)
    assert len([r for r in rows if "val/reward/mean" in r]) == 2  # 16 prompts / 8 per batch: 2 epochs of 2
    ranks = [json.loads((tmp_path / f"predict_rank{rank}.json").read_text()) for rank in (0, 1)]
    assert ranks[0] == ranks[1]
    assert [row["index"] for row in ranks[0]] == [0, 1, 2, 3, 4]
    assert [row["prompt"] for row in ranks[0]] == val_prompts(5)
    assert all(0 < len(row["completion_ids"]) <= 8 for row in ranks[0])
    assert [row["reward"] for row in ranks[0]] == pytest.approx(
        topic_reward([r["prompt"] for r in ranks[0]], [r["completion"] for r in ranks[0]]))
