"""RLHFModule under a real Lightning Trainer: learning, step counting, schedulers, checkpoint state."""

from __future__ import annotations

import csv
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from helpers import ROOT, run_cli
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_app_rlhf import GenerationConfig, PPOConfig, PromptDataModule, RLHFModule, demo
from lightning_app_rlhf.callbacks import RLHFRunSummary

DEMO_ACTOR = {
    "config": {
        "model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 512, "n_positions": 64,
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
    }
}


def _trainer(max_steps: int, **kwargs) -> pl.Trainer:
    defaults = {
        "accelerator": "cpu", "devices": 1, "max_steps": max_steps, "logger": False, "enable_checkpointing": False,
        "enable_progress_bar": False, "enable_model_summary": False,
    }
    return pl.Trainer(**{**defaults, **kwargs})


def _module(tokenizer, lr: float = 1e-3, **ppo_kwargs) -> RLHFModule:
    return RLHFModule(
        actor=DEMO_ACTOR,
        tokenizer=tokenizer,
        reward_fn=demo.topic_reward,
        generation=GenerationConfig(max_new_tokens=16),
        ppo=PPOConfig(**{"kl_coef": 0.01, **ppo_kwargs}),
        actor_optimizer=lambda p: torch.optim.AdamW(p, lr=lr),
        critic_optimizer=lambda p: torch.optim.AdamW(p, lr=lr),
    )


@pytest.mark.slow  # 200 PPO iterations (about 2 minutes on 2 cores); the default run trains the shipped GRPO demo below
def test_reward_rises_on_demo_task(demo_tokenizer):
    """With fixed seeds, PPO raises the demo reward far above its start within 200 iterations."""
    pl.seed_everything(0)
    module = _module(demo_tokenizer, lr=1e-3, ppo_epochs=4, num_minibatches=2)
    module.generation = GenerationConfig(max_new_tokens=24)
    data = PromptDataModule(demo.prompts(), demo_tokenizer, batch_size=32)
    summary = RLHFRunSummary(window=20)
    _trainer(200, callbacks=[summary]).fit(module, data)
    start, end = summary.start_end("reward/mean")
    assert start < 0.08, start  # a random-init policy names almost no topic words
    # Seeds 0-3 on the 2-core AMD EPYC CI machine: 0.049 -> 1.15, 0.042 -> 1.06, 0.033 -> 0.48, 0.037 -> 1.13 (means
    # of the first / last 20 iterations). The trajectory changes with the CPU's kernels (lr 3e-3 rose to 0.20 on an
    # Intel machine and only to 0.08 here), so the bar sits well below the worst seed.
    assert end > start + 0.3, (start, end)


def test_global_step_is_one_per_iteration(demo_tokenizer):
    """Two optimizers x 2 epochs x 2 minibatches still count one global step (and one LR step) per iteration."""
    module = _module(demo_tokenizer, ppo_epochs=2, num_minibatches=2)
    module.actor_scheduler = lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    data = PromptDataModule(demo.prompts(64), demo_tokenizer, batch_size=8)
    trainer = _trainer(3)
    trainer.fit(module, data)
    assert trainer.global_step == 3
    actor_opt, critic_opt = (opt.optimizer for opt in module.optimizers())
    # AdamW counts its own steps: 3 iterations x 2 epochs x 2 minibatches.
    assert all(state["step"].item() == 12 for state in actor_opt.state.values())
    assert all(state["step"].item() == 12 for state in critic_opt.state.values())
    assert actor_opt.param_groups[0]["lr"] == pytest.approx(1e-3 * 0.5**3)
    assert critic_opt.param_groups[0]["lr"] == pytest.approx(1e-3)


def test_adaptive_kl_and_state_survive_checkpoint(demo_tokenizer, tmp_path):
    """The adaptive KL coefficient moves during training and is restored from a checkpoint."""
    module = _module(demo_tokenizer, kl_coef=0.1, kl_target=0.01, kl_horizon=100, reward_norm=True)
    module.seed = 3
    data = PromptDataModule(demo.prompts(64), demo_tokenizer, batch_size=8)
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    _trainer(2, enable_checkpointing=True, callbacks=[checkpoint]).fit(module, data)
    assert module.shaping.kl_controller.value != 0.1
    assert module.shaping.reward_moments.count == 16

    restored = _module(demo_tokenizer, kl_coef=0.1, kl_target=0.01, kl_horizon=100, reward_norm=True)
    restored.seed = 5
    assert restored.engine.calls.seed == 5  # built before the resume: it takes the checkpoint's seed all the same
    state = torch.load(tmp_path / "last.ckpt", weights_only=False)
    restored.on_load_checkpoint(state)
    assert restored.seed == restored.engine.calls.seed == 3
    assert restored.shaping.kl_controller.value == module.shaping.kl_controller.value
    assert restored.shaping.reward_moments.state_dict() == module.shaping.reward_moments.state_dict()
    actor_keys = [k for k in state["state_dict"] if k.startswith("actor.")]
    assert actor_keys and all(k.replace("actor.", "reference.", 1) in state["state_dict"] for k in actor_keys)


def test_reference_stays_frozen_while_actor_moves(demo_tokenizer):
    """After updates the actor differs from its start; the reference still equals the initial actor."""
    pl.seed_everything(0)
    module = _module(demo_tokenizer)
    module.configure_model()
    initial = {k: v.clone() for k, v in module.actor.state_dict().items()}
    _trainer(2).fit(module, PromptDataModule(demo.prompts(64), demo_tokenizer, batch_size=8))
    reference = module.reference.state_dict()
    assert all(torch.equal(reference[k], v) for k, v in initial.items())
    assert any(not torch.equal(module.actor.state_dict()[k], v) for k, v in initial.items())


GRPO_CHECK_STEPS = 150
GRPO_CHECK_REWARD = 0.15
"""Iterations 100-149 of the shipped GRPO demo (2-core CI machine, 2 threads): 0.42, 0.24, 0.22 for seeds 0, 1, 2
(it starts at 0.04-0.06). Before: 0.006 for seed 0; with float64 group statistics but each group's std, 0.007 and
0.016 for seeds 1 and 2; all three then fell to 0."""
PROMPT_BLIND_CEILING = 1.05
"""The demo reward a policy earns by listing words of every topic without reading the prompt (README, "The demo")."""


def shipped_grpo_rewards(tmp_path: Path, seed: int, steps: int | None = None, algorithm: str = "grpo") -> list[float]:
    """Run ``examples/configs/demo_grpo_cpu.yaml`` as shipped through the CLI, with torch's default threads as the
    README's command (``--seed_everything seed``, ``--model.algorithm algorithm``, and ``--trainer.max_steps steps``
    when given); return ``reward/mean`` of every iteration."""
    args = ["fit", "--config", str(ROOT / "examples/configs/demo_grpo_cpu.yaml"), "--seed_everything", str(seed),
            "--model.algorithm", algorithm, "--trainer.logger.init_args.save_dir", str(tmp_path / "runs")]
    steps_args = ["--trainer.max_steps", str(steps)] if steps else []
    run_cli(*args, *steps_args, cwd=tmp_path, timeout=1200, one_thread=False)
    (metrics,) = (tmp_path / "runs").rglob("metrics.csv")
    rows = sorted((r for r in csv.DictReader(metrics.open()) if r["reward/mean"]), key=lambda r: int(r["step"]))
    return [float(r["reward/mean"]) for r in rows]


# DAPO and GSPO in the slow set: their losses are checked by hand in test_algorithms.py, and the default run keeps
# one learning run of the group family (about 30 s each on 2 cores).
@pytest.mark.parametrize("algorithm", ["grpo", *(pytest.param(a, marks=pytest.mark.slow) for a in ("dapo", "gspo"))])
def test_the_shipped_grpo_demo_learns(tmp_path, algorithm):
    """The README's GRPO command, shortened to GRPO_CHECK_STEPS iterations, as shipped and with ``--model.algorithm
    dapo`` / ``gspo``: the reward of the last 50 is far above its start. Before the float64 group statistics and
    ``scale_rewards: batch``, GRPO's seeds 0-2 sat at or fell to 0 by then (the policy learnt to say nothing); so did
    DAPO before the config scaled its overlong penalty to the task's rewards. Measured on 2 cores (last 50): grpo
    0.42, dapo 0.19 (with its dynamic sampling; 0.22 without), gspo 0.21."""
    rewards = shipped_grpo_rewards(tmp_path, seed=0, steps=GRPO_CHECK_STEPS, algorithm=algorithm)
    assert len(rewards) == GRPO_CHECK_STEPS
    start, end = sum(rewards[:50]) / 50, sum(rewards[-50:]) / 50
    assert start < 0.1, start
    assert end > GRPO_CHECK_REWARD, (start, end)


@pytest.mark.slow  # 3 x 800 iterations (about 4 minutes each on 2 cores); the default run trains a shorter one
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_shipped_grpo_demo_passes_the_prompt_blind_ceiling(tmp_path, seed):
    """The README's GRPO command as shipped (800 iterations): the mean reward of the last 50 iterations is above the
    prompt-blind ceiling, so the policy reads the topic, for seeds 0, 1 and 2."""
    rewards = shipped_grpo_rewards(tmp_path, seed=seed)
    assert len(rewards) == 800
    assert sum(rewards[-50:]) / 50 > PROMPT_BLIND_CEILING, rewards[-50:]
