"""Bad placement plans fail up front, before any model is built, with errors that name the fix."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_app_rlhf.plan import CALLS, PlacementPlan, flattening_plan, interleaving_plan, separation_plan

ROOT = Path(__file__).resolve().parents[1]


def _calls(**overrides):
    calls = {call: (0, 1) for call in CALLS}
    calls.update({k.replace("__", "."): v for k, v in overrides.items()})
    return calls


@pytest.mark.parametrize(
    "calls,match",
    [
        (_calls(actor__generate=(0,), reference__forward=(0,), reward__forward=(0,), critic__forward=(0,),
                actor__train=(0,), critic__train=(0,)), r"Ranks \[1\] run no call.*cover the world of 2"),
        (_calls(reward__forward=()), r"'reward.forward' has an empty group: give it at least one rank"),
        (_calls(critic__train=(0, 5)), r"ranks \[5\] outside the world of 2"),
        ({c: (0, 1) for c in CALLS if c != "reference.forward"}, r"missing \['reference.forward'\]"),
    ],
)
def test_invalid_plans_name_the_fix(calls, match):
    """Uncovered ranks, an empty group, out-of-range ranks and a role with no call are rejected."""
    with pytest.raises(ValueError, match=match):
        PlacementPlan(2, calls)


def test_impossible_ratios_and_groups_name_the_fix():
    """Ratios must give whole, disjoint groups; separation groups must not overlap; presets need enough ranks."""
    with pytest.raises(ValueError, match=r"reference ratio 0.3 on 4 ranks gives 1.2 ranks.*multiple of 1/4"):
        interleaving_plan(4, reference_ratio=0.3)
    with pytest.raises(ValueError, match=r"sum to more than 1.*at most 1"):
        interleaving_plan(4, reference_ratio=0.75, reward_ratio=0.5)
    with pytest.raises(ValueError, match=r"Ranks \[1\] are in both the generation and the training group"):
        separation_plan(4, generation_ranks=[0, 1], training_ranks=[1, 2, 3])
    with pytest.raises(ValueError, match=r"Separation needs at least 2 ranks"):
        separation_plan(1)
    with pytest.raises(ValueError, match=r"overlap=True needs generation and training on disjoint ranks.*separation"):
        PlacementPlan(2, _calls(), overlap=True)


def test_wrapper_errors_name_the_fix():
    """Unknown wrappers, DeepSpeed without deepspeed, and a sharded role split across a call are rejected."""
    with pytest.raises(ValueError, match=r"choose one of \['ddp', 'fsdp2'"):
        flattening_plan(2, wrapper="fsdp")
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        with pytest.raises(ValueError, match=r"deepspeed is not installed.*lightning-app-rlhf\[deepspeed\]"):
            flattening_plan(2, wrapper="zero3")
    with pytest.raises(ValueError, match=r"a sharded role can only run a call on all of its train ranks"):
        PlacementPlan(2, _calls(actor__generate=(0,)), {"actor": "fsdp2", "critic": "ddp"})


def test_bad_plan_fails_before_any_model_is_built(tmp_path):
    """From the CLI, an impossible ratio stops the run in the strategy's setup, before the model summary."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-m", "lightning_app_rlhf", "fit", "--config", str(ROOT / "examples/configs/demo_cpu.yaml"),
         "--trainer.devices", "2", "--trainer.strategy", "lightning_app_rlhf.strategies.InterleavingStrategy",
         "--trainer.strategy.reference_ratio", "0.25", "--trainer.logger.init_args.save_dir", str(tmp_path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode != 0
    assert "reference ratio 0.25 on 2 ranks gives 0.5 ranks" in result.stderr
    assert "Trainable params" not in result.stdout  # no model was built


@pytest.mark.parametrize("plan,holdings", [
    (interleaving_plan(4), ["actor critic reference", "actor critic reference", "actor critic reward",
                            "actor critic reward"]),
    (separation_plan(4), ["actor critic reference reward", "actor critic reference reward", "actor critic",
                          "actor critic"]),
])
def test_each_rank_builds_only_the_roles_its_calls_need(plan, holdings, tokenizer, tiny_gpt2_config):
    """With a reward *model*: Interleaving keeps reference and reward on their own ranks; Separation keeps both
    off the training ranks."""
    from lightning_app_rlhf import RLHFModule
    from lightning_app_rlhf.placement import Placement

    for rank, expected in enumerate(holdings):
        module = RLHFModule(actor={"config": tiny_gpt2_config}, tokenizer=tokenizer,
                            reward_model={"config": tiny_gpt2_config})
        module.placement = Placement(plan, rank)
        module.configure_model()
        held = [name for name, attr in (("actor", "actor"), ("critic", "critic"), ("reference", "reference"),
                                        ("reward", "reward_model")) if getattr(module, attr) is not None]
        assert " ".join(held) == expected, rank


CRITIC_FREE = ("actor", "reference", "reward")


@pytest.mark.parametrize("preset", [flattening_plan, interleaving_plan, separation_plan])
def test_critic_free_presets_place_no_critic(preset):
    """A critic-free algorithm's plan gives ranks only to its own calls, and wraps only the actor."""
    plan = preset(4, roles=CRITIC_FREE)
    assert plan.roles == CRITIC_FREE and plan.trainable_roles == ("actor",)
    assert sorted(plan.calls) == ["actor.generate", "actor.train", "reference.forward", "reward.forward"]
    assert plan.wrappers == {"actor": "ddp"} and plan.shadow_ranks("critic") == ()
    assert PlacementPlan.from_dict(plan.to_dict()) == plan


def test_plan_roles_must_match_the_algorithm():
    """A PPO plan under GRPO (or the reverse) is refused with the calls to remove or add."""
    with pytest.raises(ValueError, match=r"algorithm 'grpo' uses \['actor', 'reference', 'reward'\]: remove the calls "
                                         r"of \['critic'\]"):
        flattening_plan(2).check_roles(CRITIC_FREE, "grpo")
    with pytest.raises(ValueError, match=r"give ranks to the calls of \['critic'\]"):
        flattening_plan(2, roles=CRITIC_FREE).check_roles(("actor", "reference", "reward", "critic"), "ppo")


def test_a_plan_needs_every_call_of_its_roles():
    """Half a critic (a forward without a train call) or no reward call is refused, naming the missing calls."""
    calls = {c: (0,) for c in flattening_plan(1).calls if c != "critic.train"}
    with pytest.raises(ValueError, match=r"missing \['critic.train'\]"):
        PlacementPlan(1, calls)
    calls = {c: (0,) for c in flattening_plan(1, roles=CRITIC_FREE).calls if c != "reward.forward"}
    with pytest.raises(ValueError, match=r"missing \['reward.forward'\]"):
        PlacementPlan(1, calls)
    with pytest.raises(ValueError, match=r"Wrappers name unknown roles \['critic'\], which the plan does not place"):
        PlacementPlan(1, flattening_plan(1, roles=CRITIC_FREE).calls, {"actor": "ddp", "critic": "ddp"})
