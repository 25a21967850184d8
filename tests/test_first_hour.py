"""The first hour of a new user, from the command line (issue 64): every placement line the README and
docs/placements.md print works as printed, a registered strategy name takes its class's options (also a name from a
config file), an impossible split is one message before any process starts, and every error a user can cause is one
``error:`` line naming the fix, without a traceback (a reward function that raises keeps its own frames)."""

from __future__ import annotations

import re
import shlex

import pytest
import yaml
from helpers import DEMO_CONFIG, ROOT, fit_demo_args, metrics_rows, run_cli
from lightning.pytorch.strategies import StrategyRegistry

from lightning_app_rlhf import PromptDataModule, RLHFModule
from lightning_app_rlhf.cli import DEBUG_ENV, RLHFArgumentParser, RLHFCLI, check_placement, main
from lightning_app_rlhf.strategies import FlatteningStrategy, InterleavingStrategy, SeparationStrategy

DOCS = (ROOT / "README.md", ROOT / "docs/placements.md")
CLASSES = {cls.strategy_name: cls for cls in (FlatteningStrategy, InterleavingStrategy, SeparationStrategy)}
RAISING_REWARD = "def reward(prompts, completions, **kwargs):\n    return [1.0 / 0 for _ in completions]\n"


def placement_lines() -> list[tuple[str, list[str]]]:
    """Every ``--trainer.strategy ...`` command (or fragment) of the docs, as ``(where, its words)``: the command
    lines of their code blocks (continuation lines joined), and their inline code; an inline fragment of options
    alone (README: "`--trainer.strategy.max_staleness 1` overlaps them") goes with the strategy its paragraph names."""
    found = []
    for doc in DOCS:
        commands, prose, in_block = [], [], False
        for line in doc.read_text().replace("\\\n", " ").splitlines():
            if line.startswith("```"):
                in_block = not in_block
            elif in_block:
                commands.append(line)
            else:
                prose.append(line)
        for paragraph in re.split(r"\n(?=- |\s*\n)", "\n".join(prose)):
            for code in re.findall(r"`([^`]*--trainer\.strategy[ .][^`]*)`", paragraph):
                named = re.findall(r"`(rlhf_\w+)`", paragraph)
                commands.append(code if "--trainer.strategy " in code or not named else
                                f"--trainer.strategy {named[-1]} {code}")
        for command in commands:
            if "--trainer.strategy " in command:
                words = shlex.split(command.split(" #", 1)[0])
                found.append((f"{doc.name}: {' '.join(words)[-120:]}", words))
    return found


def strategy_arguments(words: list[str]) -> tuple[list[str], int]:
    """The ``--trainer.strategy`` words of a documented command, and its processes (``--trainer.devices``, else 2
    for a placement that needs 2)."""
    kept, devices = [], None
    for i, word in enumerate(words[:-1]):
        if word == "--trainer.strategy" or word.startswith("--trainer.strategy."):
            kept += [word, words[i + 1]]
        elif word == "--trainer.devices":
            devices = int(words[i + 1])
    return kept, devices or (1 if "flattening" in kept[1].lower() else 2)


def build(args: list[str]) -> RLHFCLI:
    """The demo's trainer and module from ``args``, as ``fit`` builds them, without running anything."""
    return RLHFCLI(RLHFModule, PromptDataModule, args=["--config", str(DEMO_CONFIG), "--trainer.logger", "false",
                                                       "--trainer.enable_checkpointing", "false", *args],
                   run=False, auto_configure_optimizers=False, parser_class=RLHFArgumentParser)


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    """The CLI in this process, in ``tmp_path``, with no pytest arguments in ``sys.argv`` and no debug variable."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.argv", ["lightning-app-rlhf"])
    monkeypatch.delenv(DEBUG_ENV, raising=False)
    return tmp_path


def one_error_line(capsys: pytest.CaptureFixture[str], args: list[str], status: int = 2) -> str:
    """Run the CLI in this process: it exits ``status`` with one ``error:`` line, the last, and nothing
    traceback-like. Returns that line."""
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == status
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert "Traceback" not in err and lines[-1].startswith("error: "), err[-3000:]
    assert sum(line.startswith("error:") for line in lines) == 1, err[-3000:]
    return lines[-1]


def fit_args(*extra: str) -> list[str]:
    return ["fit", "--config", str(DEMO_CONFIG), "--trainer.logger", "false", "--trainer.enable_checkpointing",
            "false", *extra]


# ---- 1. registered strategies take options ----


def test_the_docs_print_placement_lines_with_options():
    """The extraction finds the lines the issue names (README's `max_staleness 1`, placements.md's class path)."""
    lines = placement_lines()
    assert len(lines) >= 6, lines
    assert any("--trainer.strategy.max_staleness" in " ".join(words) for _, words in lines)
    assert any("rlhf_separation" in words for _, words in lines)


@pytest.mark.parametrize("where,words", placement_lines(), ids=lambda value: value if isinstance(value, str) else "")
def test_every_documented_placement_line_builds_its_strategy(in_tmp, where, words):
    """Each documented ``--trainer.strategy`` line parses, builds its strategy with the options it gives, and its plan
    builds for its number of processes (what a launch would do first)."""
    strategy_args, devices = strategy_arguments(words)
    cli = build(["--trainer.devices", str(devices), *strategy_args])
    strategy = cli.trainer.strategy
    name = strategy_args[1]
    expected = CLASSES.get(name) or CLASSES[next(n for n, c in CLASSES.items() if name.endswith(c.__name__))]
    assert isinstance(strategy, expected), where
    for flag, value in zip(strategy_args[2::2], strategy_args[3::2], strict=True):
        assert str(getattr(strategy, flag.rsplit(".", 1)[1])).lower() == value.lower(), (where, flag)
    check_placement(cli.trainer, cli.model)


@pytest.mark.parametrize("name,options", [
    ("rlhf_separation", {"max_staleness": "1", "wrapper": "fsdp2", "free_running": "true", "generation_ratio": "0.5",
                         "partial_rollout": "true", "timeout": "120"}),
    ("rlhf_flattening", {"wrapper": "fsdp2", "threads_per_process": "1"}),
    ("rlhf_interleaving", {"reference_ratio": "0.5", "reward_ratio": "0.5", "wrapper": "ddp"}),
])
def test_a_registered_name_takes_its_class_s_options(in_tmp, name, options):
    """``--trainer.strategy rlhf_X --trainer.strategy.OPTION V``: the name's class, with the options set; the same
    when the name comes from a config file."""
    flags = [word for key, value in options.items() for word in (f"--trainer.strategy.{key}", value)]
    config = in_tmp / "named.yaml"
    config.write_text(yaml.safe_dump({"trainer": {"strategy": name, "devices": 2}}))
    for args in (["--trainer.devices", "2", "--trainer.strategy", name, *flags], ["--config", str(config), *flags]):
        strategy = build(args).trainer.strategy
        assert type(strategy) is CLASSES[name]
        for key, value in options.items():
            got = getattr(strategy, key, None)
            got = getattr(strategy, f"_{key}") if got is None else got
            got = got.total_seconds() if hasattr(got, "total_seconds") else got
            assert str(got).lower().removesuffix(".0") == value, (args, key, got)


def test_a_lightning_registered_name_takes_options_too(in_tmp):
    strategy = build(["--trainer.strategy", "ddp_spawn", "--trainer.strategy.find_unused_parameters", "true",
                      "--trainer.devices", "2"]).trainer.strategy
    assert strategy._start_method == "spawn" and strategy._ddp_kwargs["find_unused_parameters"] is True
    assert StrategyRegistry["ddp_spawn"]["init_params"] == {"start_method": "spawn"}  # the registry is untouched


def test_a_registered_name_with_options_from_a_config_file_trains(tmp_path):
    """The README's line with the name in the config file and the option on the command line: 1 iteration on 2
    processes, off-policy by one step (nothing trained at iteration 0)."""
    config = tmp_path / "separation.yaml"
    config.write_text(DEMO_CONFIG.read_text().replace("  devices: 1\n", "  devices: 2\n  strategy: rlhf_separation\n"))
    args = fit_demo_args(tmp_path, "named", "--trainer.strategy.max_staleness", "1", "--trainer.strategy.start_method",
                         "fork", config=config, steps=2, max_new_tokens=4)
    result = run_cli(*args, cwd=tmp_path)
    assert "rlhf_separation" not in result.stderr or "error" not in result.stderr
    rows = metrics_rows(tmp_path / "named")
    assert any("rollout/staleness_max" in row for row in rows), rows


# ---- 2. impossible splits: one message, before any process starts ----


@pytest.mark.parametrize("strategy,flags", [
    ("rlhf_separation", ["--trainer.strategy.generation_ratio (generation_ratio=) to one of 0.3333, 0.6667",
                         "or run 2 or 4 processes (--trainer.devices)"]),
    ("rlhf_interleaving", ["--trainer.strategy.reference_ratio and --trainer.strategy.reward_ratio to multiples of 1/3",
                           "(e.g. 0.3333 and 0.6667)", "or run 2 or 4 processes (--trainer.devices)"]),
])
def test_an_impossible_split_is_one_message_before_launch(in_tmp, capsys, strategy, flags):
    line = one_error_line(capsys, fit_args("--trainer.devices", "3", "--trainer.strategy", strategy))
    assert line.startswith(f"error: {strategy}: the "), line
    assert "ratio 0.5 on 3 ranks gives 1.5 ranks" in line, line
    for flag in flags:
        assert flag in line, line
    assert "Initializing distributed" not in capsys.readouterr().out


def test_the_suggested_ratio_then_works(in_tmp):
    cli = build(["--trainer.devices", "3", "--trainer.strategy", "rlhf_separation",
                 "--trainer.strategy.generation_ratio", "0.3333"])
    check_placement(cli.trainer, cli.model)
    assert cli.trainer.strategy.build_plan(3).calls["actor.generate"] == (0,)


def test_separation_on_one_device_names_the_fix(in_tmp, capsys):
    line = one_error_line(capsys, fit_args("--trainer.strategy", "rlhf_separation"))
    assert "needs at least 2 ranks" in line and "--trainer.devices 2" in line and "rlhf_flattening" in line, line


# ---- 3. every error a user can cause: one line naming the fix ----


@pytest.mark.parametrize("args,expected", [
    (["--trainer.strategy", "rlhf_separation", "--trainer.strategy.max_stalenes", "1"],
     "error: --trainer.strategy.max_stalenes is not an option of lightning_app_rlhf.strategies.separation."
     "SeparationStrategy. Did you mean --trainer.strategy.max_staleness? The options of SeparationStrategy: "),
    (["--trainer.strategy", "rlhf_separation", "--trainer.strategy.max_staleness", "abc"],
     "error: --trainer.strategy.max_staleness 'abc': expected int or None"),
    (["--trainer.strategy", "rlhf_seperation", "--trainer.strategy.wrapper", "ddp"],
     "error: --trainer.strategy.wrapper sets an option of --trainer.strategy, but 'rlhf_seperation' is no registered "
     "strategy. Did you mean 'rlhf_separation'?"),
    (["--trainer.devices", "2", "--trainer.strategy", "rlhf_flattening", "--trainer.strategy.wrapper", "bogus"],
     "error: rlhf_flattening: wrapper='bogus' (--trainer.strategy.wrapper) is no wrapper: choose one of ['ddp', "),
    (["--model.generation.max_new_token", "16"],
     "error: unrecognized arguments: --model.generation.max_new_token 16. Did you mean "
     "--model.generation.max_new_tokens?"),
    (["--model.actor.model_name_or_path", "does/not-exist"],
     "error: --model.actor.model_name_or_path: a model spec has no field 'model_name_or_path'. Did you mean "
     "--model.actor.path?"),
], ids=["unknown option", "bad value", "unknown name", "unknown wrapper", "prefix", "model key"])
def test_a_command_line_mistake_is_one_line(in_tmp, capsys, args, expected):
    line = one_error_line(capsys, fit_args(*args))
    assert line.startswith(expected), line


def test_a_missing_logger_package_is_one_line(in_tmp, capsys, monkeypatch):
    """``--trainer.logger TensorBoardLogger`` without tensorboard (simulated where it is installed): the class, the
    missing package and the ``pip install``, in one line."""
    monkeypatch.setattr("lightning.fabric.loggers.tensorboard._TENSORBOARD_AVAILABLE", False)
    monkeypatch.setattr("lightning.fabric.loggers.tensorboard._TENSORBOARDX_AVAILABLE", False)
    args = fit_args("--trainer.logger", "TensorBoardLogger")
    args.remove("false")  # the first one: --trainer.logger false
    args.remove("--trainer.logger")
    line = one_error_line(capsys, args)
    assert line.startswith("error: lightning.pytorch.loggers.TensorBoardLogger cannot be built: Neither `tensorboard` "
                           "nor `tensorboardX` is available. Install it (`pip install tensorboard`)"), line


@pytest.mark.parametrize("devices,strategy", [("1", "auto"), ("2", "rlhf_interleaving")])
def test_a_reward_that_raises_shows_its_own_frames_and_one_line(tmp_path, devices, strategy):
    """The user's reward raises: its file, line and exception as Python prints them, then one ``error:`` line; no
    frame of Lightning, jsonargparse or this package, no ``Traceback`` heading, and on 2 processes (the reward on
    rank 1, rank 0 stopped by its failure) still only one report."""
    (tmp_path / "my_reward.py").write_text(RAISING_REWARD)
    result = run_cli(*fit_args("--model.reward_fn", "my_reward.reward", "--trainer.max_steps", "1",
                               "--trainer.devices", devices, "--trainer.strategy", strategy,
                               "--model.generation.max_new_tokens", "4"),
                     cwd=tmp_path, check=False)
    # 1, or SIGKILL where Lightning's watch of the ranks it started ends rank 0 first ("Child process with PID ...
    # terminated with code 1. Forcefully terminating all other processes", one line of its own)
    assert result.returncode in (1, -9), result.stderr[-3000:]
    err = result.stderr
    frames = re.findall(r'^  File "([^"]+)"', err, re.MULTILINE)
    assert "Traceback" not in err and set(frames) == {str(tmp_path / "my_reward.py")}, err[-3000:]
    assert sum(line.startswith("error:") for line in err.splitlines()) == 1, err[-3000:]
    report = err[err.index('  File "'):].splitlines()
    report = report[:next(i for i, line in enumerate(report) if line.startswith("error:")) + 1]
    assert report[0].startswith(f'  File "{tmp_path / "my_reward.py"}", line 2, in reward'), report
    assert "ZeroDivisionError: float division by zero" in report
    assert report[-1].startswith("error: The reward function 'my_reward.reward' raised ZeroDivisionError"), report
    assert len(report) <= 8, report
