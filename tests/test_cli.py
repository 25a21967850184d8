"""The command line, as a user runs it: `python -m lightning_app_rlhf fit --config ...`."""

from __future__ import annotations

import csv
import re

import pytest
from helpers import ROOT, run_cli

METRICS = [
    "reward/mean", "reward/std", "kl/mean", "kl/coef", "policy/loss", "policy/clipfrac", "policy/approx_kl",
    "policy/entropy", "value/loss", "value/clipfrac", "response/length_mean", "perf/samples_per_sec",
    "perf/gen_tokens_per_sec", "time/generate_s", "time/score_s", "time/train_s",
]


def test_demo_config_runs_and_logs_every_metric(tmp_path):
    """The demo config runs a few iterations from the CLI, prints no deprecation (a warning, or transformers' logged
    notice: each is a future failure), and metrics.csv has every documented metric."""
    result = run_cli(
        "fit", "--config", str(ROOT / "examples/configs/demo_cpu.yaml"), "--trainer.max_steps", "3",
        "--trainer.logger.init_args.save_dir", str(tmp_path / "runs"),  # its ModelCheckpoint writes there too
        cwd=tmp_path,
        fresh_interpreter=True,  # a forked command's import-time warnings would print in the server, not here
    )
    assert "RLHF run summary" in result.stdout
    printed = result.stdout + result.stderr
    assert "DeprecationWarning" not in printed and "FutureWarning" not in printed, printed[-3000:]
    assert "deprecated" not in printed.lower(), printed[-3000:]
    (metrics_file,) = (tmp_path / "runs").rglob("metrics.csv")
    logged = list(csv.DictReader(metrics_file.open()))
    rows = [r for r in logged if r["reward/mean"]]
    assert [int(r["step"]) for r in rows] == [0, 1, 2]
    (memory,) = [r for r in logged if r["memory/param_bytes_rank0"]]
    assert float(memory["memory/param_bytes_rank0"]) > float(memory["memory/state_bytes_rank0"]) / 3 > 0
    missing = [m for m in METRICS if m not in rows[0] or rows[0][m] == ""]
    assert not missing, missing
    assert all(float(r["response/length_mean"]) > 0 for r in rows)


def test_cli_help_lists_ppo_options(tmp_path):
    """`fit --help` documents the PPO fields from the dataclass docstrings."""
    result = run_cli("fit", "--help", cwd=tmp_path)
    assert "--model.ppo.kl_estimator" in result.stdout
    assert "--model.generation.max_new_tokens" in result.stdout
    assert "Passes over each rollout batch" in result.stdout  # field docstrings reach --help


@pytest.mark.parametrize("args,shows", [
    (["fit", "--help"], True), (["plan", "-h"], True), (["fit", "--trainer.callbacks.help", "ModelCheckpoint"], True),
    (["fit", "--print_config=comments"], True), (["fit", "--print_config", "comments"], True),
    (["fit", "--print_config"], False), (["fit", "--config", "help.yaml"], False), (["plan", "--json"], False),
])
def test_field_docstrings_are_read_only_for_help(args, shows):
    """Reading dataclass field docstrings parses each class's source (60% of building the parser): only a command
    that prints the options' descriptions reads them."""
    from lightning_app_rlhf.cli import _shows_option_help

    assert _shows_option_help(args) is shows


def test_unknown_strategy_name_suggests_the_right_one(monkeypatch, capsys):
    """Lightning's own error lists no registered names; ours names the closest one and the placement strategies, as
    one ``error:`` line (exit 2)."""
    from lightning_app_rlhf.cli import main

    monkeypatch.setattr("sys.argv", ["lightning-app-rlhf"])  # pytest's own arguments are not the command line
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(ROOT / "examples/configs/demo_cpu.yaml"), "--trainer.strategy", "rlhf_seperation"])
    assert exit_info.value.code == 2
    assert re.search(r"^error: Unknown --trainer.strategy 'rlhf_seperation'\. Did you mean 'rlhf_separation'\?.*"
                     r"rlhf_flattening, rlhf_interleaving", capsys.readouterr().err, re.MULTILINE)


def test_unknown_generation_backend_is_refused_with_the_registered_names(monkeypatch, capsys):
    """``generation.backend`` is a plain string checked against the backend registry: a mistyped name fails before
    any model is built, as one ``error:`` line naming the closest registered backend, all of them, and how to
    register another."""
    from lightning_app_rlhf.cli import main

    monkeypatch.setattr("sys.argv", ["lightning-app-rlhf"])  # pytest's own arguments are not the command line
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(ROOT / "examples/configs/demo_cpu.yaml"), "--model.generation.backend", "statik"])
    assert exit_info.value.code == 2
    assert re.search(r"^error: generation.backend must be one of \['eager', 'static', 'continuous', 'vllm'\], got 'statik'\. Did you mean "
                     r"'static'\?.*register_backend", capsys.readouterr().err, re.MULTILINE)
