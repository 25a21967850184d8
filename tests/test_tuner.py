"""PlacementTuner: picks a plan before the models are built, trains with it, logs it, and keeps it on resume."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import yaml
from helpers import DEMO_CONFIG, fit_demo, make_module
from test_placements import COMPARED

from lightning_app_rlhf import RLHFModule
from lightning_app_rlhf.callbacks import PlacementTuner
from lightning_app_rlhf.callbacks.placement_tuner import _check_saved_plan
from lightning_app_rlhf.checkpoint.format import load_checkpoint_file
from lightning_app_rlhf.core.config import GenerationConfig, PPOConfig
from lightning_app_rlhf.data import PromptDataModule
from lightning_app_rlhf.demo import prompts, topic_reward
from lightning_app_rlhf.parallel.plan import (
    PlacementPlan,
    flattening_plan,
    interleaving_plan,
    separation_plan,
)
from lightning_app_rlhf.planner.workload import padded_prompt_length

TUNER = ["--trainer.callbacks+=lightning_app_rlhf.callbacks.PlacementTuner", "--trainer.callbacks.time_budget_s=2",
         "--trainer.callbacks.mcmc_steps=300"]


@pytest.mark.slow  # 4 processes, two runs; the default run keeps the tuner on 2 processes with checkpoints
def test_tuner_picks_a_plan_trains_with_it_and_a_resume_keeps_it(tmp_path):
    """4 processes: the tuned run logs its plan, runs it (the strategy's plan is the tuner's), learns exactly what
    any on-policy placement learns; resumed from its step-2 checkpoint, it reuses the saved plan without searching
    (a presets-only search would have chosen differently) and logs the uninterrupted run's values."""
    checkpoints = ["--trainer.enable_checkpointing", "true",
                   "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
                   f"--trainer.callbacks.dirpath={tmp_path / 'ckpt'}", "--trainer.callbacks.every_n_train_steps=2",
                   "--trainer.callbacks.save_top_k=-1", "--trainer.callbacks.filename={step}"]
    common = ["--trainer.devices", "4", "--trainer.strategy", "rlhf_flattening"]
    tuned = fit_demo(tmp_path, "tuned", *common, *TUNER, *checkpoints, steps=4)
    flat = [r for r in fit_demo(tmp_path, "flat", *common, steps=4) if "reward/mean" in r]

    (hparams,) = (tmp_path / "tuned").rglob("hparams.yaml")
    logged = yaml.safe_load(hparams.read_text())
    assert logged["placement_tuner/source"] in ("preset", "app", "blocks", "mcmc")
    assert next(r for r in tuned if "placement_tuner/predicted_iteration_s" in r)[
        "placement_tuner/predicted_iteration_s"] > 0
    (step2,) = (tmp_path / "ckpt").glob("step=2*.ckpt")
    checkpoint = load_checkpoint_file(step2)  # a file, or the meta file of a sharded plan's directory
    state = checkpoint["callbacks"]["PlacementTuner"]
    chosen = PlacementPlan.from_dict(state["plan"])
    assert logged["placement_tuner/plan"].startswith(f"plan '{chosen.name}' on 4 ranks")
    assert checkpoint["rlhf_plan"]["calls"] == chosen.calls  # the strategy ran the tuner's plan
    tuned = [r for r in tuned if "reward/mean" in r]
    for got, want in zip(tuned, flat, strict=True):  # placement never changes what is learned
        for metric in COMPARED:
            assert got[metric] == pytest.approx(want[metric], rel=1e-4, abs=1e-6), metric

    resumed_tuner = [*TUNER, "--trainer.callbacks.search=presets"]
    resumed = fit_demo(tmp_path, "resumed", *common, *resumed_tuner, *checkpoints, "--ckpt_path", str(step2), steps=4)
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
                 separation_plan(4, generation_ranks=[0, 1, 2], training_ranks=[3], max_staleness=1)):
        assert PlacementPlan.from_dict(plan.to_dict()) == plan


def test_prompt_length_is_the_mean_of_per_batch_maxima():
    assert padded_prompt_length([3, 5, 2, 2, 4, 9, 1], batch_size=2) == round((5 + 2 + 9) / 3)
    assert padded_prompt_length([3, 5], batch_size=4) == 5  # fewer prompts than a batch


def test_tuner_needs_a_placement_strategy_and_a_known_search(tokenizer):
    with pytest.raises(ValueError, match="search must be one of"):
        PlacementTuner(search="grid")
    module = make_module()
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, callbacks=[PlacementTuner()])
    with pytest.raises(TypeError, match="strategy='rlhf_flattening'"):
        trainer.fit(module, PromptDataModule(prompts(), tokenizer, batch_size=4))


def test_lightning_tuner_scales_the_rollout_batch(tmp_path, tokenizer):
    """Lightning's own Tuner convention: ``batch_size`` on the datamodule is the rollout (generation) batch; the
    train minibatch is ``batch_size / ppo.num_minibatches``."""
    from lightning.pytorch.tuner import Tuner

    module = make_module(generation=GenerationConfig(max_new_tokens=4))
    data = PromptDataModule(prompts(), tokenizer, batch_size=2)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, default_root_dir=tmp_path)
    found = Tuner(trainer).scale_batch_size(module, datamodule=data, mode="power", steps_per_trial=1, init_val=2,
                                            max_trials=2)
    assert found == data.batch_size == 4  # two trials: 2, then 4 (no out-of-memory here)


def grpo_module(config: dict) -> RLHFModule:
    """A small critic-free module: GRPO, 2 responses per prompt, the KL in the loss."""
    return RLHFModule(actor={"config": config}, tokenizer="lightning_app_rlhf.demo:build_tokenizer",
                      reward_fn=topic_reward, algorithm="grpo",
                      generation=GenerationConfig(num_samples=2, max_new_tokens=4),
                      ppo=PPOConfig(kl_coef=0.0, kl_loss_coef=0.04))


def test_tuner_plans_a_critic_free_module_without_critic_calls(tmp_path, tiny_gpt2_config, tokenizer):
    """GRPO: the tuner profiles and plans the actor, reference and reward only; the strategy runs that plan, fit
    trains, and the checkpointed tuner state names the algorithm."""
    module = grpo_module(tiny_gpt2_config)
    tuner = PlacementTuner(time_budget_s=1, mcmc_steps=50)
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy="rlhf_flattening", max_steps=2, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, default_root_dir=tmp_path,
                         callbacks=[tuner])
    trainer.fit(module, PromptDataModule(prompts(), tokenizer, batch_size=4))
    plan = tuner.optimal_plan
    assert plan is not None and plan.roles == ("actor", "reference", "reward")
    assert not [call for call in plan.calls if call.startswith("critic.")] and "critic" not in plan.wrappers
    assert trainer.strategy.placement_plan == plan and module.critic is None and trainer.global_step == 2
    assert tuner.prediction["iteration_s"] > 0
    assert tuner.state_dict()["algorithm"] == "grpo"


def test_a_saved_plan_of_another_algorithm_is_refused_with_the_fix(tiny_gpt2_config):
    module = grpo_module(tiny_gpt2_config)
    grpo_plan = flattening_plan(2, roles=module.algorithm.roles)
    _check_saved_plan(grpo_plan, {"algorithm": "grpo"}, module)
    _check_saved_plan(grpo_plan, {}, module)  # saved before the tuner recorded the algorithm: the roles agree
    with pytest.raises(ValueError, match=r"made for algorithm 'ppo' .*Resume with --model.algorithm ppo"):
        _check_saved_plan(flattening_plan(2), {"algorithm": "ppo"}, module)
    with pytest.raises(ValueError, match=r"made for another algorithm .*'critic'.*start a new run"):
        _check_saved_plan(flattening_plan(2), {}, module)


def test_tuner_on_two_processes_runs_a_critic_free_plan_and_checkpoints_it(tmp_path):
    """The GRPO demo on 2 processes: the tuned plan (no critic calls) is the one the strategy runs and saves."""
    checkpoints = ["--trainer.enable_checkpointing", "true",
                   "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
                   f"--trainer.callbacks.dirpath={tmp_path / 'ckpt'}", "--trainer.callbacks.every_n_train_steps=2"]
    rows = fit_demo(tmp_path, "grpo", "--trainer.devices", "2", "--trainer.strategy", "rlhf_flattening", *TUNER,
                    *checkpoints, steps=2, config=DEMO_CONFIG.with_name("demo_grpo_cpu.yaml"))
    assert [r["step"] for r in rows if "reward/mean" in r] == [0, 1]
    (saved,) = (tmp_path / "ckpt").glob("*.ckpt")
    checkpoint = load_checkpoint_file(saved)
    state = checkpoint["callbacks"]["PlacementTuner"]
    chosen = PlacementPlan.from_dict(state["plan"])
    assert state["algorithm"] == "grpo" and chosen.roles == ("actor", "reference", "reward")
    assert checkpoint["rlhf_plan"]["calls"] == chosen.calls
