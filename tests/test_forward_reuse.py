"""Fewer forwards per iteration: with one PPO epoch and one minibatch the critic's scoring forward is its training
forward (``ppo.reuse_critic_forward``), and the same run logs the same values with one critic forward fewer."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from helpers import fit_demo

from lightning_app_rlhf import GenerationConfig, PPOConfig, PromptDataModule, RLHFModule, demo
from lightning_app_rlhf.engine.engine import RLHFEngine
from lightning_app_rlhf.parallel.placed_roles import PlacedRoles

TINY = {
    "config": {
        "model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 512, "n_positions": 64,
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
    }
}
LOGGED = ("reward/mean", "kl/mean", "policy/loss", "policy/clipfrac", "policy/approx_kl", "policy/entropy",
          "value/loss", "value/clipfrac", "response/length_mean")


class CountCriticForwards(pl.Callback):
    """Counts the critic's forwards in every iteration (a forward hook on the real module) and keeps the logged
    values."""

    def __init__(self) -> None:
        self.forwards: list[int] = []
        self.logged: list[dict[str, float]] = []

    def on_train_start(self, trainer: pl.Trainer, pl_module: RLHFModule) -> None:
        pl_module.critic.register_forward_hook(lambda *_: self.forwards.__setitem__(-1, self.forwards[-1] + 1))

    def on_train_batch_start(self, *_: object) -> None:
        self.forwards.append(0)

    def on_train_batch_end(self, trainer: pl.Trainer, *_: object) -> None:
        self.logged.append({k: float(v) for k, v in trainer.callback_metrics.items() if k in LOGGED})


def _run(tokenizer, steps: int = 3, **ppo: object) -> CountCriticForwards:
    pl.seed_everything(0)
    module = RLHFModule(
        actor=TINY, tokenizer=tokenizer, reward_fn=demo.topic_reward, generation=GenerationConfig(max_new_tokens=12),
        ppo=PPOConfig(kl_coef=0.01, **ppo),
        actor_optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3),
        critic_optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3),
    )
    counter = CountCriticForwards()
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[counter])
    trainer.fit(module, PromptDataModule(demo.prompts(), tokenizer, batch_size=8))
    return counter


def test_reused_critic_forward_logs_the_same_values_with_one_forward_fewer(tokenizer):
    """Three iterations with and without the reuse: every logged value agrees (float tolerance), and the critic
    runs 1 forward per iteration instead of 2."""
    reused, separate = _run(tokenizer), _run(tokenizer, reuse_critic_forward=False)
    assert reused.forwards == [1, 1, 1]
    assert separate.forwards == [2, 2, 2]
    assert len(reused.logged) == len(separate.logged) == 3
    for got, want in zip(reused.logged, separate.logged, strict=True):
        assert got.keys() == want.keys() == set(LOGGED)
        for name in LOGGED:
            assert got[name] == pytest.approx(want[name], rel=1e-4, abs=1e-6), name
    assert reused.logged[-1]["value/loss"] != reused.logged[0]["value/loss"]  # the critic did train


def test_no_reuse_where_the_forwards_differ(tokenizer):
    """Two epochs (the second pass sees updated weights), two minibatches, or micro-batches (batch 8): the scoring
    forward and every training forward run."""
    for ppo, forwards in (({"ppo_epochs": 2}, 3), ({"num_minibatches": 2}, 3), ({"micro_batch_size": 2}, 5)):
        assert _run(tokenizer, steps=1, **ppo).forwards == [forwards], ppo


def test_reuse_needs_one_forward_per_rank(tokenizer):
    """Generation chunks smaller than the rank's rows mean several scoring forwards: no reuse."""
    module = RLHFModule(actor=TINY, tokenizer=tokenizer, reward_fn=demo.topic_reward, ppo=PPOConfig())
    engine = RLHFEngine(PlacedRoles.single_process(module.device, module.algorithm.roles), module.algorithm,
                        module.generation, module.ppo, tokenizer, module.shaping, module.role_module, module.reward_fn,
                        module.seed)
    calls = engine.calls
    calls.batch_rows = 8
    assert calls.reuses_critic_forward
    calls.generation = GenerationConfig(batch_size=4)
    assert not calls.reuses_critic_forward
    calls.generation = GenerationConfig(batch_size=8)
    assert calls.reuses_critic_forward
    calls.config = PPOConfig(reuse_critic_forward=False)
    assert not calls.reuses_critic_forward


@pytest.mark.slow  # ~50 s: two CLI runs on 2 processes
def test_two_ranks_reuse_gives_the_same_trajectory(tmp_path):
    """Flattening on 2 processes (the critic's DDP group scores and trains the same rows split across ranks): the
    run with the reuse logs the values of the run without it, step by step."""
    one_pass = ("--trainer.devices", "2", "--trainer.strategy", "rlhf_flattening", "--model.ppo.ppo_epochs", "1",
                "--model.ppo.num_minibatches", "1")
    reused = fit_demo(tmp_path, "reused", *one_pass)
    separate = fit_demo(tmp_path, "separate", *one_pass, "--model.ppo.reuse_critic_forward", "false")
    reused, separate = ([r for r in rows if "reward/mean" in r] for rows in (reused, separate))
    assert len(reused) == len(separate) == 3
    for got, want in zip(reused, separate, strict=True):
        for name in LOGGED:
            assert got[name] == pytest.approx(want[name], rel=1e-4, abs=1e-6), name
