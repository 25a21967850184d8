"""Pipelined calls inside the engine (``PlacementPlan.pp``), through the CLI on gloo CPU processes.

A pipelined train call gives the unpipelined trajectory; pipelined scoring the unpipelined scores; a whole copy of
the actor that generates beside its pipelined train call takes the trained weights bit for bit after every update;
a checkpoint of a pipelined role is refused with the fix. Tolerance: rel 1e-5 (float32), abs 1e-6 for values near 0
(the first iteration's KL is ~1e-9 either way).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from helpers import ROOT, fit_demo, fit_demo_args, forked_ranks, one_thread_env, run_cli

COMPARED = ("reward/mean", "reward/std", "kl/mean", "policy/loss", "policy/clipfrac", "policy/approx_kl",
            "policy/entropy", "value/loss", "value/clipfrac", "response/length_mean")
GRPO_COMPARED = ("reward/mean", "reward/std", "kl/mean", "policy/loss", "policy/clipfrac", "policy/approx_kl",
                 "policy/entropy", "policy/kl_loss", "response/length_mean")
GRPO_CONFIG = ROOT / "examples/configs/demo_grpo_cpu.yaml"
GRPO_BATCH = ("--data.batch_size", "3", "--model.generation.num_samples", "4")


def plan_config(tmp_path: Path, world_size: int, roles: tuple[str, ...], pp: dict[str, int],
                schedule: str = "1f1b") -> Path:
    """A ``--config`` file: Flattening's calls of ``roles`` on ``world_size`` ranks, with ``pp`` degrees."""
    ranks = list(range(world_size))
    calls = {"actor.generate": ranks, "reference.forward": ranks, "reward.forward": ranks, "critic.forward": ranks,
             "actor.train": ranks, "critic.train": ranks}
    calls = {call: r for call, r in calls.items() if call.split(".")[0] in roles}
    wrappers = {role: "ddp" for role in ("actor", "critic") if role in roles}
    plan = {"name": f"pp{max(pp.values(), default=1)}", "world_size": world_size, "calls": calls,
            "wrappers": wrappers, "pp": pp, "pipeline_schedule": schedule}
    strategy = {"class_path": "lightning_app_rlhf.strategies.PlacementStrategy", "init_args": {"plan": plan}}
    path = tmp_path / f"plan_{plan['name']}_{world_size}_{'_'.join(sorted(pp))}.yaml"
    path.write_text(yaml.safe_dump({"trainer": {"devices": world_size, "strategy": strategy}}))
    return path


def run(tmp_path: Path, name: str, *args: str | Path, config: Path | None = None) -> list[dict[str, float]]:
    """The demo (or ``config``) for 3 iterations, no validation; the rows that carry ``reward/mean``."""
    extra = {"config": config} if config is not None else {}
    rows = fit_demo(tmp_path, name, "--trainer.check_val_every_n_epoch", "1000", *args, timeout=400,
                    env=one_thread_env(tests=True), **extra)
    return [r for r in rows if "reward/mean" in r]


def assert_same_trajectory(rows: list[dict[str, float]], reference: list[dict[str, float]],
                           metrics: tuple[str, ...]) -> float:
    """Every metric of every step at rel 1e-5; returns the largest relative difference of values above 1e-6."""
    assert [r["step"] for r in reference] == [0, 1, 2]
    largest = 0.0
    for step, (got, want) in enumerate(zip(rows, reference, strict=True)):
        for metric in metrics:
            assert got[metric] == pytest.approx(want[metric], rel=1e-5, abs=1e-6), (step, metric)
            if abs(want[metric]) > 1e-6:
                largest = max(largest, abs(got[metric] - want[metric]) / abs(want[metric]))
    return largest


def test_ppo_pp2_training_and_scoring_follow_the_unpipelined_trajectory_and_reallocate_bit_exactly(tmp_path):
    """PPO on 2 processes: actor and critic train as 2-stage pipelines (1F1B), the critic and the reference score on
    pipelines, the actor generates data parallel (dp=2) on whole copies refreshed by name after every update. The
    trajectory is Flattening's (DDP, nothing pipelined) at rel 1e-5; every copy holds the trained weights bit for
    bit after every update; each rank receives the stage it does not hold."""
    flat = run(tmp_path, "flat", "--trainer.devices", "2", "--trainer.strategy", "rlhf_flattening")
    digests = tmp_path / "digests.json"
    config = plan_config(tmp_path, 2, ("actor", "critic", "reference", "reward"),
                         {"actor.train": 2, "critic.train": 2, "critic.forward": 2, "reference.forward": 2})
    rows = run(tmp_path, "pp2", "--config", config, "--trainer.callbacks+=test_tensor_parallel.LayoutCheck",
               f"--trainer.callbacks.path={digests}")
    print("largest relative difference vs flattening:", assert_same_trajectory(rows, flat, COMPARED))
    records = json.loads(digests.read_text())
    assert len(records) == 3
    for ranks in records:
        assert all(set(rank) == {"actor.generate"} for rank in ranks)  # the critic scores on its train pipeline
        assert len({digest for rank in ranks for digest in rank["actor.generate"]}) == 1  # trained == copy, all ranks
    assert len({ranks[0]["actor.generate"][0] for ranks in records}) == 3  # the weights moved every iteration
    assert all(r["reallocate/bytes"] > 0 for r in rows)
    printed = (tmp_path / "pp2.out").read_text()  # the placement summary: each call's layout, the copies
    table = {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:-1]]
             for line in printed.splitlines() if line.startswith("│") and "." in line.split("│")[1]}
    assert table["actor.train"] == ["0,1 pp2 1f1b", "ddp"], table
    assert table["reference.forward"] == ["0,1 pp2", "frozen"], table
    assert table["actor.generate"] == ["0,1", "whole copy"], table
    assert "actor (whole copy)" in printed


def test_grpo_pp2_training_follows_the_unpipelined_trajectory(tmp_path):
    """GRPO (no critic) on 2 processes, the actor trained as a 2-stage GPipe pipeline and scored unpipelined: the
    trajectory of Flattening at rel 1e-5."""
    flat = run(tmp_path, "flat", *GRPO_BATCH, "--trainer.devices", "2", "--trainer.strategy", "rlhf_flattening",
               config=GRPO_CONFIG)
    config = plan_config(tmp_path, 2, ("actor", "reference", "reward"), {"actor.train": 2}, schedule="gpipe")
    rows = run(tmp_path, "pp2", *GRPO_BATCH, "--config", config, config=GRPO_CONFIG)
    print("largest relative difference vs flattening:", assert_same_trajectory(rows, flat, GRPO_COMPARED))
    assert not any(key.startswith("value/") for row in rows for key in row)


@pytest.mark.slow  # 2 x 3 iterations on 4 processes (2 cores); the default run covers pp=2 on 2 processes
def test_ppo_pp2_by_dp2_on_4_processes_follows_the_unpipelined_trajectory(tmp_path):
    """Two 2-stage pipelines per trained role (ranks 0-1 and 2-3), each stage's gradients summed over ranks 0, 2
    and 1, 3: Flattening's trajectory on 4 processes at rel 1e-5."""
    flat = run(tmp_path, "flat", "--trainer.devices", "4", "--trainer.strategy", "rlhf_flattening")
    config = plan_config(tmp_path, 4, ("actor", "critic", "reference", "reward"),
                         {"actor.train": 2, "critic.train": 2, "critic.forward": 2, "reference.forward": 2})
    rows = run(tmp_path, "pp2dp2", "--config", config)
    print("largest relative difference vs flattening:", assert_same_trajectory(rows, flat, COMPARED))


def test_a_checkpoint_of_a_pipelined_role_is_refused_naming_the_fix(tmp_path):
    """Checkpointing a run whose plan pipelines a role stops at the save with the fix, rather than writing a
    checkpoint that holds only the first stage."""
    config = plan_config(tmp_path, 2, ("actor", "critic", "reference", "reward"), {"actor.train": 2})
    args = fit_demo_args(tmp_path, "ckpt", "--config", config, "--trainer.check_val_every_n_epoch", "1000",
                         "--trainer.enable_checkpointing", "true",
                         "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
                         f"--trainer.callbacks.dirpath={tmp_path / 'ckpt'}", "--trainer.callbacks.every_n_train_steps=1",
                         steps=1)
    result = run_cli(*forked_ranks(args), cwd=tmp_path, timeout=300, check=False)
    assert result.returncode != 0
    assert "checkpoints of a pipelined role are not written yet" in result.stdout + result.stderr
    assert "--trainer.enable_checkpointing false" in result.stdout + result.stderr
    assert not list(tmp_path.rglob("*.ckpt"))
