"""The three placements on 2 and 4 CPU processes (gloo), launched from the CLI as a user would."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_app_rlhf.plan import flattening_plan, interleaving_plan, separation_plan

ROOT = Path(__file__).resolve().parents[1]
STRATEGIES = ("rlhf_flattening", "rlhf_interleaving", "rlhf_separation")
COMPARED = ("reward/mean", "reward/std", "kl/mean", "policy/loss", "policy/clipfrac", "policy/approx_kl",
            "policy/entropy", "value/loss", "value/clipfrac", "response/length_mean")


def run_demo(tmp_path: Path, name: str, *args: str, steps: int = 3) -> list[dict[str, float]]:
    """Run the demo config for a few iterations and return its metrics.csv rows."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-m", "lightning_app_rlhf", "fit", "--config", str(ROOT / "examples/configs/demo_cpu.yaml"),
         "--trainer.max_steps", str(steps), "--trainer.enable_checkpointing", "false",
         "--trainer.logger.init_args.save_dir", str(tmp_path),
         "--trainer.logger.init_args.name", name, "--model.generation.max_new_tokens", "12", *args],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    (metrics,) = (tmp_path / name).rglob("metrics.csv")
    return [{k: float(v) for k, v in row.items() if v} for row in csv.DictReader(metrics.open())]


@pytest.mark.parametrize("devices", [2, 4])
def test_placements_give_the_same_trajectory(tmp_path, devices):
    """Same seed and global batch: Flattening, Interleaving and Separation log the same values step by step."""
    runs = {s: run_demo(tmp_path, f"{s}_{devices}", "--trainer.devices", str(devices), "--trainer.strategy", s)
            for s in STRATEGIES}
    reference = runs["rlhf_flattening"]
    assert [r["step"] for r in reference] == [0, 1, 2]
    for strategy, rows in runs.items():
        for step, (got, want) in enumerate(zip(rows, reference)):
            for metric in COMPARED:
                assert got[metric] == pytest.approx(want[metric], rel=1e-4, abs=1e-6), (strategy, step, metric)
    # Only Separation has shadow copies to refresh: actor + critic trainable parameters, fp32.
    assert all(r["reallocate/bytes"] == 0 for r in runs["rlhf_flattening"] + runs["rlhf_interleaving"])
    assert all(r["reallocate/bytes"] > 1_000_000 for r in runs["rlhf_separation"])


def test_plan_presets_assign_the_documented_ranks():
    """The presets put each call on the ranks the docs describe."""
    flat = flattening_plan(4)
    assert all(ranks == (0, 1, 2, 3) for ranks in flat.calls.values())
    inter = interleaving_plan(4, reference_ratio=0.25, reward_ratio=0.75)
    assert inter.ranks("reference.forward") == (0,) and inter.ranks("reward.forward") == (1, 2, 3)
    assert inter.ranks("actor.train") == (0, 1, 2, 3) and inter.shadow_ranks("actor") == ()
    sep = separation_plan(4, generation_ranks=[0, 1, 2], training_ranks=[3])
    assert sep.ranks("actor.generate") == (0, 1, 2) and sep.ranks("critic.train") == (3,)
    assert sep.shadow_ranks("actor") == (0, 1, 2) and not sep.holds("reference", 3)
