"""Free-running bounded staleness (``SeparationStrategy(max_staleness=k, free_running=True)``): the generation side
runs ahead of the training side by at most k policy versions, each at its own pace. Launched from the CLI as a user
would, on 2 and 4 processes: the bound under load, the on-policy case against the fixed schedule, a run that learns,
and clean stops (SIGTERM) that resume. The exact resume without staleness runs in
``tests/test_placements.py::test_resumed_run_logs_what_the_uninterrupted_run_logged``."""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers import fit_demo, one_thread_env
from test_placements import COMPARED
from test_placements import FREE_RUNNING as FREE
from test_preemption import common
from test_preemption import fit as fit_with_signals

from lightning_app_rlhf.parallel.plan import PlacementPlan, flattening_plan, separation_plan
from lightning_app_rlhf.strategies import SeparationStrategy


def free(k: int) -> tuple[str, ...]:
    """The ``--trainer.strategy`` arguments of free-running Separation with staleness bound ``k``."""
    return ("--trainer.strategy", *FREE, "--trainer.strategy.max_staleness", str(k))


def test_a_free_running_plan_splits_the_world_in_two():
    """Free-running needs disjoint sides (generate and forwards together, train calls elsewhere), whole shadows;
    it lets the generation side run ``max_staleness + 1`` iterations ahead, and survives ``to_dict``."""
    plan = separation_plan(4, max_staleness=2, free_running=True)
    assert (plan.generation_ranks, plan.training_ranks, plan.run_ahead) == ((0, 1), (2, 3), 3)
    assert PlacementPlan.from_dict(plan.to_dict()) == plan
    assert separation_plan(4, max_staleness=2).run_ahead == 0  # the fixed schedule: every iteration in lockstep
    assert SeparationStrategy(max_staleness=1, free_running=True).build_plan(2).free_running
    with pytest.raises(ValueError, match=r"'actor.train' runs on ranks \[0, 1\], which also generate"):
        PlacementPlan.from_dict({**flattening_plan(2).to_dict(), "free_running": True})
    fields = separation_plan(4).to_dict()
    fields["calls"]["reward.forward"] = [0]
    with pytest.raises(ValueError, match=r"'reward.forward' runs on ranks \[0\], not on the generation ranks \[0, 1\]"):
        PlacementPlan.from_dict({**fields, "free_running": True})


def test_free_running_without_staleness_logs_the_on_policy_run(tmp_path):
    """``max_staleness=0``: the generation side waits for every update, so each rollout is the on-policy run's, bit
    for bit; the generation side's rank 0 logs each update with the next rollout (it learns it from the training
    side's announcement), one row later than the fixed schedule."""
    args = ("--trainer.devices", "2", "--trainer.max_steps", "4")
    fixed = [r for r in fit_demo(tmp_path, "fixed", *args, "--trainer.strategy", "rlhf_separation")
             if "reward/mean" in r]
    running = [r for r in fit_demo(tmp_path, "free", *args, *free(0)) if "reward/mean" in r]
    assert [r["rollout/staleness_max"] for r in running] == [0, 0, 0, 0]
    assert [r["rollout/policy_version"] for r in running] == [0, 1, 2, 3]
    for step, (got, want) in enumerate(zip(running, fixed, strict=True)):
        for metric in ("reward/mean", "reward/std", "kl/mean", "response/length_mean"):
            assert got[metric] == pytest.approx(want[metric], rel=1e-5, abs=1e-7), (step, metric)
    assert "policy/loss" not in running[0]
    for got, want in zip(running[1:], fixed, strict=False):
        for metric in ("policy/loss", "policy/entropy", "value/loss"):
            assert got[metric] == pytest.approx(want[metric], rel=1e-5), metric


def test_free_running_never_trains_beyond_its_bound_under_load(tmp_path):
    """4 processes, ``max_staleness=2``, training 8 epochs per rollout (the training side is the slow one) while a
    busy process shares the 2 cores: the generation side runs ahead until the bound holds it, every rollout is
    trained on at most 2 versions after it was generated (the training side checks each one and raises otherwise),
    and the bound is reached."""
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        rows = [r for r in fit_demo(tmp_path, "bounded", "--trainer.devices", "4", *free(2), "--model.ppo.ppo_epochs",
                                    "8", steps=10, env=one_thread_env(tests=True)) if "reward/mean" in r]
    finally:
        hog.kill()
    assert [r["step"] for r in rows] == list(range(10))
    staleness = [r["rollout/staleness_max"] for r in rows]
    assert all(0 <= s <= 2 for s in staleness) and max(staleness) == 2, staleness
    for row in rows:  # the version that generated rollout i, and what the training side logs trained on it
        assert row["step"] - 2 <= row["rollout/policy_version"] <= row["step"]
        assert row["rollout/staleness_max"] == row["step"] - row["rollout/policy_version"]
    assert all(r["time/wait_for_weights_s"] >= 0 for r in rows)
    assert sum("policy/loss" in r for r in rows) >= 7  # the updates the generation side took, logged as it went


@pytest.mark.slow  # 300 iterations on 4 processes (about 2 minutes on 2 cores)
def test_a_free_running_demo_learns(tmp_path):
    """The PPO demo, free-running Separation with ``max_staleness=1`` on 4 processes for 300 iterations: the reward
    of the last 50 is far above the first 50's (on-policy, the shipped demo's means are 0.06 and about 0.5 there)."""
    rows = [r for r in fit_demo(tmp_path, "learns", "--trainer.devices", "4", *free(1), steps=300,
                                max_new_tokens=24, timeout=900) if "reward/mean" in r]
    rewards = [r["reward/mean"] for r in rows]
    assert len(rewards) == 300
    start, end = sum(rewards[:50]) / 50, sum(rewards[-50:]) / 50
    assert start < 0.1 and end > 0.25, (start, end)
    assert max(r["rollout/staleness_max"] for r in rows) <= 1


@pytest.mark.slow  # two fits and a resume on 4 processes
def test_sigterm_stops_a_free_running_run_cleanly_and_it_resumes(tmp_path):
    """SIGTERM to the launcher during iteration 1 of a free-running run (``max_staleness=2``, 4 processes): every
    rank agrees to stop at the same iteration, ``run_ahead + 1`` iterations on (the agreement lags so that it never
    holds the generation side back), saves one checkpoint and exits 0; resumed, the run continues from the saved
    weights (version = iterations done, staleness 0 at first) within the bound to the last step."""
    args = [*common(tmp_path, "ckpt", FREE[0], 4), *FREE[1:], "--trainer.strategy.max_staleness", "2"]
    stopped, before = fit_with_signals(tmp_path, "stopped", *args, "--trainer.callbacks+=sigterm_callback.SendSigterm",
                                       "--trainer.callbacks.step=1", steps=12)
    output = stopped.stdout + stopped.stderr
    assert stopped.returncode == 0, output[-4000:]
    saved = len(before)
    assert 2 < saved < 12, [r["step"] for r in before]
    assert f"SIGTERM received at iteration {saved}: saved" in output
    resumed_result, resumed = fit_with_signals(tmp_path, "resumed", *args, "--ckpt_path", "last", steps=12)
    assert resumed_result.returncode == 0, resumed_result.stderr[-4000:]
    assert [r["step"] for r in resumed] == list(range(saved, 12))
    assert resumed[0]["rollout/policy_version"] == saved  # the checkpoint's weights: saved iterations of updates
    assert all(0 <= r["rollout/staleness_max"] <= 2 for r in resumed)
    for metric in COMPARED:
        assert metric in resumed[-1], metric

