"""Frozen roles (reference, reward model) sharded with FSDP2 over their forward call's group, on 2 gloo processes."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from helpers import ROOT, fit_demo

from lightning_app_rlhf.parallel.plan import PlacementPlan, flattening_plan

COMPARED = (
    "reward/mean",
    "reward/std",
    "kl/mean",
    "policy/loss",
    "policy/approx_kl",
    "value/loss",
    "response/length_mean",
)


def run_plan(tmp_path: Path, name: str, plan: PlacementPlan) -> list[dict[str, float]]:
    """The demo config with a reward model instead of the reward function, under ``plan``, for 3 iterations."""
    config = yaml.safe_load((ROOT / "examples/configs/demo_cpu.yaml").read_text())
    extra = {
        "trainer": {
            "strategy": {
                "class_path": "lightning_app_rlhf.strategies.PlacementStrategy",
                "init_args": {
                    "plan": plan.to_dict()
                },
            }
        },
        "model": {
            "reward_fn": None,
            "reward_model": {"config": config["model"]["actor"]["config"], "init_seed": 7},
        },
    }
    extra_file = tmp_path / f"{name}.yaml"
    extra_file.write_text(yaml.safe_dump(extra))
    return fit_demo(tmp_path, name, "--config", extra_file, "--trainer.devices", str(plan.world_size))


def test_sharded_reference_and_reward_log_what_whole_copies_log(tmp_path):
    """Sharding the frozen roles (the reference with FSDP2, the reward model with ZeRO-3 inference where
    deepspeed is installed) changes where their bytes live (half on each rank), not what is learned."""
    from lightning_app_rlhf.parallel.wrappers import is_available

    whole = flattening_plan(2)
    reward = "zero3" if is_available("zero3") else "fsdp2"
    sharded = PlacementPlan(
        2, whole.calls, {**whole.wrappers, "reference": "fsdp2", "reward": reward}, name="sharded-frozen"
    )
    runs = {plan.name: run_plan(tmp_path, plan.name, plan) for plan in (whole, sharded)}
    steps = {name: [r for r in rows if "reward/mean" in r] for name, rows in runs.items()}
    assert len(steps["flattening"]) == 3
    for got, want in zip(steps["sharded-frozen"], steps["flattening"], strict=True):
        for metric in COMPARED:
            assert got[metric] == pytest.approx(want[metric], rel=1e-4, abs=1e-6), metric
    memory = {name: next(r for r in rows if "memory/param_bytes_rank0" in r) for name, rows in runs.items()}
    from lightning_app_rlhf.models.roles import as_model_spec, build_causal_lm, build_reward_model

    config = yaml.safe_load((ROOT / "examples/configs/demo_cpu.yaml").read_text())
    spec = as_model_spec(config["model"]["actor"])
    reference = sum(p.numel() for p in build_causal_lm(spec).parameters()) * 4
    reward = sum(p.numel() for p in build_reward_model(spec, 0).parameters()) * 4
    for rank in (0, 1):
        saved = (
            memory["flattening"][f"memory/param_bytes_rank{rank}"]
            - memory["sharded-frozen"][f"memory/param_bytes_rank{rank}"]
        )
        # FSDP2 splits every tensor on dim 0 (the larger half on rank 0), ZeRO-3 every flattened tensor (padded):
        # each rank keeps about half of each model.
        assert saved == pytest.approx((reference + reward) / 2, rel=0.01), rank
        assert (
            memory["sharded-frozen"][f"memory/state_bytes_rank{rank}"]
            == memory["flattening"][f"memory/state_bytes_rank{rank}"]
        )


def test_frozen_role_wrappers_are_validated():
    whole = flattening_plan(2)
    with pytest.raises(ValueError, match="frozen role is either held whole"):
        PlacementPlan(2, whole.calls, {**whole.wrappers, "reference": "ddp"})
    with pytest.raises(ValueError, match="unknown roles"):
        PlacementPlan(2, whole.calls, {**whole.wrappers, "value_head": "fsdp2"})
