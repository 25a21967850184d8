"""PlacementTuner: picks a plan before the models are built, trains with it, logs it, and keeps it on resume."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import yaml
from test_placements import COMPARED, run_demo

from lightning_app_rlhf import RLHFModule
from lightning_app_rlhf.callbacks import PlacementTuner
from lightning_app_rlhf.callbacks.placement_tuner import _padded_prompt_length
from lightning_app_rlhf.config import GenerationConfig
from lightning_app_rlhf.data import PromptDataModule
from lightning_app_rlhf.demo import prompts, topic_reward
from lightning_app_rlhf.plan import PlacementPlan, interleaving_plan, separation_plan

TUNER = ["--trainer.callbacks+=lightning_app_rlhf.callbacks.PlacementTuner", "--trainer.callbacks.time_budget_s=2",
         "--trainer.callbacks.mcmc_steps=300"]


def test_tuner_picks_a_plan_trains_with_it_and_a_resume_keeps_it(tmp_path):
    """4 processes: the tuned run logs its plan, runs it (the strategy's plan is the tuner's), learns exactly what
    any on-policy placement learns; resumed from its step-2 checkpoint, it reuses the saved plan without searching
    (a presets-only search would have chosen differently) and logs the uninterrupted run's values."""
    checkpoints = ["--trainer.enable_checkpointing", "true",
                   "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
                   f"--trainer.callbacks.dirpath={tmp_path / 'ckpt'}", "--trainer.callbacks.every_n_train_steps=2",
                   "--trainer.callbacks.save_top_k=-1", "--trainer.callbacks.filename={step}"]
    common = ["--trainer.devices", "4", "--trainer.strategy", "rlhf_flattening"]
    tuned = run_demo(tmp_path, "tuned", *common, *TUNER, *checkpoints, steps=4)
    flat = [r for r in run_demo(tmp_path, "flat", *common, steps=4) if "reward/mean" in r]

    (hparams,) = (tmp_path / "tuned").rglob("hparams.yaml")
    logged = yaml.safe_load(hparams.read_text())
    assert logged["placement_tuner/source"] in ("preset", "app", "blocks", "mcmc")
    assert next(r for r in tuned if "placement_tuner/predicted_iteration_s" in r)[
        "placement_tuner/predicted_iteration_s"] > 0
    (step2,) = (tmp_path / "ckpt").glob("step=2*.ckpt")
    checkpoint = torch.load(step2, map_location="cpu", weights_only=False)
    state = checkpoint["callbacks"]["PlacementTuner"]
    chosen = PlacementPlan.from_dict(state["plan"])
    assert logged["placement_tuner/plan"].startswith(f"plan '{chosen.name}' on 4 ranks")
    assert checkpoint["rlhf_plan"]["calls"] == chosen.calls  # the strategy ran the tuner's plan
    tuned = [r for r in tuned if "reward/mean" in r]
    for got, want in zip(tuned, flat, strict=True):  # placement never changes what is learned
        for metric in COMPARED:
            assert got[metric] == pytest.approx(want[metric], rel=1e-4, abs=1e-6), metric

    resumed_tuner = [*TUNER, "--trainer.callbacks.search=presets"]
    resumed = run_demo(tmp_path, "resumed", *common, *resumed_tuner, *checkpoints, "--ckpt_path", str(step2), steps=4)
    (hparams,) = (tmp_path / "resumed").rglob("hparams.yaml")
    logged = yaml.safe_load(hparams.read_text())
    assert logged["placement_tuner/source"] == "checkpoint"
    assert logged["placement_tuner/plan"].startswith(f"plan '{chosen.name}' on 4 ranks")
    resumed = [r for r in resumed if "reward/mean" in r]
    assert [r["step"] for r in resumed] == [2, 3]
    for got, want in zip(resumed, tuned[2:], strict=True):
        for metric in COMPARED:
            assert got[metric] == pytest.approx(want[metric], rel=1e-5, abs=1e-7), metric


def test_plans_round_trip_through_checkpoint_state():
    for plan in (interleaving_plan(4, reference_ratio=0.25, reward_ratio=0.75),
                 separation_plan(4, generation_ranks=[0, 1, 2], training_ranks=[3], overlap=True)):
        assert PlacementPlan.from_dict(plan.to_dict()) == plan


def test_prompt_length_is_the_mean_of_per_batch_maxima():
    assert _padded_prompt_length([3, 5, 2, 2, 4, 9, 1], batch_size=2) == round((5 + 2 + 9) / 3)
    assert _padded_prompt_length([3, 5], batch_size=4) == 5  # fewer prompts than a batch


def test_tuner_needs_a_placement_strategy_and_a_known_search(tiny_gpt2_config, tokenizer):
    with pytest.raises(ValueError, match="search must be one of"):
        PlacementTuner(search="grid")
    module = RLHFModule(actor={"config": tiny_gpt2_config}, tokenizer=tokenizer, reward_fn=topic_reward)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, callbacks=[PlacementTuner()])
    with pytest.raises(TypeError, match="strategy='rlhf_flattening'"):
        trainer.fit(module, PromptDataModule(prompts(), tokenizer, batch_size=4))


def test_lightning_tuner_scales_the_rollout_batch(tmp_path, tiny_gpt2_config, tokenizer):
    """Lightning's own Tuner convention: ``batch_size`` on the datamodule is the rollout (generation) batch; the
    train minibatch is ``batch_size / ppo.num_minibatches``."""
    from lightning.pytorch.tuner import Tuner

    module = RLHFModule(actor={"config": tiny_gpt2_config}, tokenizer=tokenizer, reward_fn=topic_reward,
                        generation=GenerationConfig(max_new_tokens=4))
    data = PromptDataModule(prompts(), tokenizer, batch_size=2)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, default_root_dir=tmp_path)
    found = Tuner(trainer).scale_batch_size(module, datamodule=data, mode="power", steps_per_trial=1, init_val=2,
                                            max_trials=2)
    assert found == data.batch_size == 4  # two trials: 2, then 4 (no out-of-memory here)
