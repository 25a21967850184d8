"""The engine owns its state across iterations: ``RLHFEngine.state_dict`` / ``load_state_dict`` round-trip the queue of
scored rollouts, the policy version, the KL controller and the reward moments; checkpoints of earlier versions (one
``pending_experience``, no version) still load; a queue longer than the plan's bound is refused with the fix."""

from __future__ import annotations

import pytest
import torch
from helpers import make_module

from lightning_app_rlhf import PPOConfig
from lightning_app_rlhf.models.calls import Experience


def _experience(iteration: int) -> dict[str, object]:
    """An experience's fields as a checkpoint keeps them (``vars(experience)``)."""
    rows, width = 2, 3
    zeros = torch.zeros(rows, width)
    return vars(Experience(sequences=torch.ones(rows, width + 2, dtype=torch.long),
                           attention_mask=torch.ones(rows, width + 2, dtype=torch.long),
                           response_mask=torch.ones(rows, width), logprobs=zeros, ref_logprobs=zeros, values=zeros,
                           advantages=torch.full((rows, width), float(iteration)), returns=zeros,
                           prompt_length=2, iteration=iteration))


def _separated_engine(max_staleness: int):
    """The engine of a one-process module under a plan with ``max_staleness`` (the fixed schedule)."""
    from lightning_app_rlhf.parallel.placed_roles import PlacedRoles
    from lightning_app_rlhf.parallel.placement import Placement
    from lightning_app_rlhf.parallel.plan import flattening_plan

    module = make_module(ppo=PPOConfig(kl_target=6.0, reward_norm=True))
    plan = flattening_plan(1, roles=module.algorithm.roles)
    object.__setattr__(plan, "max_staleness", max_staleness)
    module.placed_roles = PlacedRoles(Placement(plan, 0, torch.device("cpu"), {}), {})
    return module.engine


def test_the_engine_state_round_trips():
    engine = _separated_engine(max_staleness=2)
    engine.pending_experiences = [Experience(**_experience(3)), Experience(**_experience(4))]
    engine.policy_version, engine.iterations_done = 3, 5
    engine.shaping.kl_controller.update(0.5, n_samples=8)
    engine.shaping.reward_moments.update(torch.tensor([1.0, 3.0, 5.0]))
    saved = engine.state_dict()

    restored = _separated_engine(max_staleness=2)
    restored.load_state_dict(saved)
    assert [e.iteration for e in restored.pending_experiences] == [3, 4]
    assert torch.equal(restored.pending_experiences[1].advantages, torch.full((2, 3), 4.0))
    assert (restored.policy_version, restored.iterations_done) == (3, 5)
    assert restored.shaping.kl_controller.value == pytest.approx(engine.shaping.kl_controller.value)
    torch.testing.assert_close(restored.shaping.state_dict(), engine.shaping.state_dict())


def test_a_checkpoint_of_an_earlier_version_loads():
    """Saved before bounded staleness: one ``pending_experience`` (or None), no policy version or iteration count."""
    engine = _separated_engine(max_staleness=1)
    old = {**engine.shaping.state_dict(), "pending_experience": _experience(7)}
    engine.load_state_dict(old)
    assert [e.iteration for e in engine.pending_experiences] == [7]
    assert (engine.policy_version, engine.iterations_done) == (0, 0)
    engine.load_state_dict({**engine.shaping.state_dict(), "pending_experience": None})
    assert engine.pending_experiences == []


def test_more_stale_rollouts_than_the_bound_are_refused_with_the_fix():
    engine = _separated_engine(max_staleness=1)
    state = {**engine.shaping.state_dict(), "pending_experiences": [_experience(1), _experience(2)]}
    with pytest.raises(ValueError, match=r"max_staleness=2\) \(--trainer.strategy.max_staleness 2\)"):
        engine.load_state_dict(state)
