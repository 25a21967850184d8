"""Every registered algorithm runs on every shipped config with only ``--model.algorithm`` changed: a config holds
the task's settings, and what belongs to one kind of algorithm defaults to the chosen algorithm's own (the group size
``generation.num_samples``, ``ppo.scale_rewards``, ``ppo.whiten_advantages``, the critic's optimizer), is scoped to
the algorithms that have it (``ppo.per_algorithm``), or is left out for the roles an algorithm lacks (a plan's
critic calls). docs/algorithms.md, "Settings of some algorithms only"."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from helpers import ROOT, fit_demo, run_cli

import lightning_app_rlhf.algorithms  # noqa: F401  (registers the built-in algorithms)
from lightning_app_rlhf.algorithms.base import ALGORITHMS
from lightning_app_rlhf.cli import RLHFCLI
from lightning_app_rlhf.data import PromptDataModule
from lightning_app_rlhf.module import RLHFModule
from lightning_app_rlhf.strategies.placement_strategy import PlacementStrategy

SHIPPED_CONFIGS = sorted((ROOT / "examples/configs").glob("*.yaml"))
ALGORITHM_NAMES = sorted(ALGORITHMS)
VLLM_CONFIGS = {"demo_vllm_cpu"}
"""Configs that generate on vLLM: they build only where vLLM is installed, and their fits are
tests/test_vllm_backend.py's (each starts a vLLM engine, 30-60 s on 2 cores; what vLLM samples does not depend on
the algorithm), so the per-algorithm fit matrix leaves them out."""


SMOLLM2_CONFIGS = {"agent_calculator_cpu"}
"""Configs of the 135M model: building it once per algorithm takes 45 s on 2 cores, so they build in the slow run,
and they stay out of the per-algorithm fit matrix (1-3 minutes a fit): tests/test_agents_docs.py fits
agent_calculator_cpu as docs/agents.md prints it. (Switched to PPO, its LoRA's ``layers_to_transform`` is refused by
peft on the critic's bare backbone, whose module names have no prefix before ``layers``; with DAPO its 2 questions
rarely give an informative group, so the update is skipped.)"""


def _needs_missing_vllm(config: Path) -> bool:
    from lightning_app_rlhf.generation import vllm_available

    return config.stem in VLLM_CONFIGS and not vllm_available()

SIZE = ("--data.batch_size", "8", "--trainer.check_val_every_n_epoch", "1000")
"""The only other changes: 8 prompts (2 minibatches of at least one sample per rank of demo_tp_cpu's 4), no
validation; ``fit_demo`` adds one iteration, 4 new tokens, no checkpoint and the log directory."""


def _devices(config: Path) -> int:
    return int(((yaml.safe_load(config.read_text()) or {}).get("trainer") or {}).get("devices", 1))


def test_the_matrix_covers_the_shipped_configs_and_the_named_algorithms():
    """The tests below read examples/configs/*.yaml and the registry: a new config or algorithm joins them."""
    assert {"demo_cpu.yaml", "demo_grpo_cpu.yaml", "demo_lora_cpu.yaml", "demo_tp_cpu.yaml"} <= {
        p.name for p in SHIPPED_CONFIGS}
    assert {"ppo", "grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"} <= set(ALGORITHM_NAMES)


@pytest.mark.parametrize("config", [pytest.param(c, marks=pytest.mark.slow) if c.stem in SMOLLM2_CONFIGS else c
                                    for c in SHIPPED_CONFIGS], ids=lambda c: c.stem)
def test_every_algorithm_builds_from_the_shipped_config(tmp_path, monkeypatch, config):
    """The CLI builds the module, the data and the Trainer of ``config`` with each ``--model.algorithm``, and the
    strategy's plan places exactly that algorithm's roles. The config is parsed once: what changes per algorithm is
    the instantiation, where a setting the algorithm does not have would be refused."""
    if _needs_missing_vllm(config):
        pytest.skip("vLLM is not installed (scripts/setup.sh installs it)")
    monkeypatch.chdir(tmp_path)  # the Trainer's default_root_dir and the logger's directory are relative
    monkeypatch.setattr("sys.argv", ["lightning_app_rlhf"])  # LightningCLI warns of pytest's own arguments
    cli = RLHFCLI(RLHFModule, PromptDataModule, args=["--config", str(config)], run=False,
                  auto_configure_optimizers=False)
    for name in ALGORITHM_NAMES:
        parsed = cli.config.clone()
        parsed.model.algorithm = name
        built = cli.parser.instantiate(parsed)
        algorithm = built.model.algorithm
        assert algorithm.name == name
        assert built.model.generation.num_samples >= algorithm.min_group_size, name
        assert built.model.has_critic == ("critic" in algorithm.roles), name
        strategy = built.trainer.strategy
        if isinstance(strategy, PlacementStrategy):
            plan = strategy.build_plan(strategy.num_processes, algorithm.roles)
            plan.check_roles(algorithm.roles, name)


# One iteration of a switched algorithm on each one-process config in the default run (a group algorithm on the PPO
# demos, the critic's algorithm and a critic-free one without GRPO's settings on the GRPO demo); every pair, and the
# 4-process demo_tp_cpu, in the slow set (about 3 minutes on 2 cores).
FIT_PAIRS = [("demo_cpu", "grpo"), ("demo_lora_cpu", "rloo"), ("demo_grpo_cpu", "ppo"), ("demo_grpo_cpu", "rloo")]


@pytest.mark.parametrize("config,name", [
    pytest.param(c, n, id=f"{c.stem}-{n}",
                 marks=[] if (c.stem, n) in FIT_PAIRS and _devices(c) == 1 else [pytest.mark.slow])
    for c in SHIPPED_CONFIGS if c.stem not in VLLM_CONFIGS | SMOLLM2_CONFIGS for n in ALGORITHM_NAMES])
def test_every_algorithm_trains_on_the_shipped_config(tmp_path, config, name):
    """One iteration of ``name`` on ``config`` with ``--model.algorithm name`` and sizes only: it trains."""
    rows = fit_demo(tmp_path, name, "--model.algorithm", name, *SIZE, config=config, steps=1, max_new_tokens=4)
    assert [r["step"] for r in rows if "policy/loss" in r] == [0], rows


def test_a_setting_the_algorithm_does_not_have_names_the_fix_without_a_traceback(tmp_path):
    """``--model.ppo.scale_rewards batch`` with ``rloo``: one line that says what to change, exit status 2."""
    result = run_cli("fit", "--config", ROOT / "examples/configs/demo_grpo_cpu.yaml", "--model.algorithm", "rloo",
                     "--model.ppo.scale_rewards", "batch", cwd=tmp_path, check=False)
    assert result.returncode == 2, result.stderr[-2000:]
    assert ("error: ppo.scale_rewards='batch' is a setting of ['cispo', 'dapo', 'grpo', 'gspo', 'gspo_token'], not "
            "of algorithm 'rloo'. Remove it") in result.stderr
    assert "ppo.per_algorithm: {cispo: {scale_rewards: batch}" in result.stderr
    assert "Traceback" not in result.stderr
