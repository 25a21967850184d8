"""``plan`` prints the ``fit`` flags that run its best plan, and ``fit`` runs them."""

from __future__ import annotations

import json
import re
import shlex

from helpers import DEMO_CONFIG, metrics_rows, run_cli

from lightning_app_rlhf.parallel.plan import PlacementPlan
from lightning_app_rlhf.planner.command import FIT_STRATEGY, PlanOptions, fit_flags, plan_named_sizes


def _flag(flags: list[str], name: str) -> str:
    return flags[flags.index(name) + 1]


def test_fit_flags_carry_the_whole_plan_and_its_batch_sizes():
    """The flags give the cluster's accelerator, nodes and devices, the plan as JSON that reads back as the same
    PlacementPlan (tensor-parallel degrees included), and the plan's generation and micro-batch sizes."""
    result = plan_named_sizes(PlanOptions(cluster="2x8xA100-80GB", search="presets")).result
    best = result.best
    flags = fit_flags(best, result.cluster)
    assert (_flag(flags, "--trainer.accelerator"), _flag(flags, "--trainer.num_nodes"),
            _flag(flags, "--trainer.devices"), _flag(flags, "--trainer.strategy")) == ("gpu", "2", "8", FIT_STRATEGY)
    assert PlacementPlan.from_dict(json.loads(_flag(flags, "--trainer.strategy.plan"))) == best.plan
    for flag, size in (("--model.generation.batch_size", best.choice.generation_batch),
                       ("--model.ppo.micro_batch_size", best.choice.micro_batch)):
        assert (_flag(flags, flag) if flag in flags else None) == (None if size is None else str(size))


def test_fit_runs_the_flags_plan_prints(tmp_path):
    """plan on the demo config (FSDP2 only, so its best differs from the config's own DDP) prints the flags under
    its tables; fit with exactly those flags trains one iteration under that plan."""
    out = run_cli("plan", "--config", DEMO_CONFIG, "--search", "presets", "--wrappers", "fsdp2", "--profile", "none",
                  cwd=tmp_path,
                  timeout=180).stdout
    lines = out.splitlines()
    (heading,) = [i for i, line in enumerate(lines) if line.startswith("fit flags that run #1")]
    assert re.search(r"best: #1 flattening .*", out)
    flags = shlex.split(lines[heading + 1])
    assert json.loads(_flag(flags, "--trainer.strategy.plan"))["wrappers"] == {"actor": "fsdp2", "critic": "fsdp2"}
    fit = run_cli("fit", "--config", DEMO_CONFIG, *flags, "--trainer.max_steps", "1",
                  "--trainer.enable_checkpointing", "false", "--model.generation.max_new_tokens", "6",
                  "--trainer.logger.init_args.save_dir", tmp_path, "--trainer.logger.init_args.name", "planned",
                  cwd=tmp_path, timeout=240).stdout
    assert "Placement plan: flattening, 1 rank(s)" in fit
    for call in ("actor.train", "critic.train"):  # the placement summary's wrapper column
        assert re.search(rf"{re.escape(call)}\s*│\s*0\s*│\s*fsdp2", fit), fit[-3000:]
    assert [row["step"] for row in metrics_rows(tmp_path / "planned") if "reward/mean" in row] == [0]
