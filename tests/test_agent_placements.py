"""Multi-turn episodes under every placement, launched from the CLI as a user would: the same trajectory as one
process on 2 and 4 processes, after a resume, and one version stale within the bound (``tests/agent_task.py``'s
environment, which answers every turn and rewards each)."""

from __future__ import annotations

import pytest
from helpers import ROOT, approx_or_none, fit_demo

from lightning_app_rlhf.algorithms.base import ALGORITHMS

GRPO_CONFIG = ROOT / "examples/configs/demo_grpo_cpu.yaml"
STRATEGIES = ("rlhf_flattening", "rlhf_interleaving", "rlhf_separation")
AGENT = ("--model.tokenizer", "agent_task:tokenizer", "--model.reward_fn", "null",
         "--model.environment", "{class_path: agent_task.LetterCount, init_args: {turns: 3}}",
         "--model.agent.max_episode_tokens", "96", "--model.actor.config.n_positions", "256",
         # A random-init model rarely samples its end token: these 100 of its 512 ids end a turn too.
         "--model.generation.stop_token_ids", str(list(range(100, 200))),
         "--data.batch_size", "3", "--model.generation.num_samples", "4")
COMPARED = ("reward/mean", "reward/std", "kl/mean", "policy/loss", "policy/clipfrac", "policy/approx_kl",
            "policy/entropy", "policy/kl_loss", "response/length_mean", "episode/turns_mean",
            "episode/truncated_frac")


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The multi-turn GRPO demo on one process: the trajectory every placement must log."""
    rows = [r for r in fit_demo(tmp_path_factory.mktemp("agent"), "single", *AGENT, config=GRPO_CONFIG)
            if "reward/mean" in r]
    # Episodes of several turns, some cut: the masks have gaps, and the trajectory moves.
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(1.5 < r["episode/turns_mean"] <= 3 for r in rows), [r["episode/turns_mean"] for r in rows]
    assert len({r["reward/mean"] for r in rows}) == 3 and all(r["policy/kl_loss"] > 0 for r in rows[1:])
    return rows


def check_same(rows: list[dict[str, float]], reference: list[dict[str, float]], what: str) -> None:
    for got, want in zip(rows, reference, strict=True):
        for metric in COMPARED:
            assert got[metric] == pytest.approx(want[metric], rel=1e-4, abs=1e-6), (what, got["step"], metric)


@pytest.mark.parametrize("devices", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_multi_turn_placements_give_the_same_trajectory_as_one_process(tmp_path, devices, one_process):
    """3 prompts x 4 episodes, environments stepping on the generating ranks; a prompt's group spans shards."""
    for strategy in STRATEGIES:
        rows = fit_demo(tmp_path, f"{strategy}_{devices}", *AGENT, "--trainer.devices", str(devices),
                        "--trainer.strategy", strategy, config=GRPO_CONFIG)
        check_same([r for r in rows if "reward/mean" in r], one_process, f"{strategy} on {devices}")


@pytest.mark.slow  # the default run resumes single-turn runs under every schedule (test_placements.py)
def test_a_resumed_multi_turn_run_logs_what_the_uninterrupted_run_logged(tmp_path):
    common = [*AGENT, "--trainer.devices", "2", "--trainer.strategy", "rlhf_separation",
              "--trainer.enable_checkpointing", "true",
              "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
              f"--trainer.callbacks.dirpath={tmp_path / 'ckpt'}", "--trainer.callbacks.every_n_train_steps=2",
              "--trainer.callbacks.save_top_k=-1", "--trainer.callbacks.filename={step}"]
    full = [r for r in fit_demo(tmp_path, "full", *common, config=GRPO_CONFIG, steps=4) if "reward/mean" in r]
    (checkpoint,) = (tmp_path / "ckpt").glob("step=2*.ckpt")
    resumed = [r for r in fit_demo(tmp_path, "resumed", *common, "--ckpt_path", str(checkpoint), config=GRPO_CONFIG,
                                   steps=4) if "reward/mean" in r]
    assert [r["step"] for r in resumed] == [2, 3]
    check_same(resumed, full[2:], "resumed")


def test_multi_turn_one_version_stale_stays_within_its_bound(tmp_path, one_process):
    """Separation with overlap (``max_staleness=1``): iteration k trains on iteration k-1's episodes; the first
    rollout is the on-policy one, and the first update equals the on-policy run's first."""
    rows = [r for r in fit_demo(tmp_path, "overlap", *AGENT, "--trainer.devices", "2", "--trainer.strategy",
                                "lightning_app_rlhf.strategies.SeparationStrategy", "--trainer.strategy.overlap",
                                "true", config=GRPO_CONFIG) if "reward/mean" in r]
    assert [r.get("rollout/staleness_max") for r in rows] == [None, 0, 1]
    assert rows[0]["reward/mean"] == pytest.approx(one_process[0]["reward/mean"])
    assert rows[0]["episode/turns_mean"] == one_process[0]["episode/turns_mean"]
    for metric in ("policy/loss", "policy/entropy"):
        assert rows[1][metric] == approx_or_none(one_process[0][metric], rel=1e-5), metric


@pytest.mark.slow  # the fixed schedule's staleness bound is in the default run, above
def test_free_running_multi_turn_stays_within_its_staleness_bound(tmp_path):
    """Free-running Separation (``max_staleness=1``): the generation side runs its episodes a version ahead of the
    training side, and every update trains on episodes at most one version stale."""
    rows = [r for r in fit_demo(tmp_path, "free", *AGENT, "--trainer.devices", "2", "--trainer.strategy",
                                "lightning_app_rlhf.strategies.SeparationStrategy", "--trainer.strategy.free_running",
                                "true", "--trainer.strategy.max_staleness", "1", config=GRPO_CONFIG, steps=4)
            if "reward/mean" in r]
    assert len(rows) == 4 and all(r["episode/turns_mean"] > 1 for r in rows)
    assert all(r["rollout/staleness_max"] <= 1 for r in rows) and any(r["rollout/staleness_max"] == 1 for r in rows)
    assert any("policy/loss" in r for r in rows)


@pytest.mark.slow  # GRPO runs every placement above; PPO (GAE over the sampled tokens) in tests/test_faults.py
@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_every_algorithm_trains_on_episodes(tmp_path, algorithm):
    rows = [r for r in fit_demo(tmp_path, algorithm, *AGENT, "--model.algorithm", algorithm, config=GRPO_CONFIG,
                                steps=2) if "reward/mean" in r]
    assert [r["step"] for r in rows] == [0, 1]
    assert all(r["episode/turns_mean"] > 1 for r in rows) and "policy/loss" in rows[-1]
