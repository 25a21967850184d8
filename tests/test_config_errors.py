"""Config and command-line errors as a user meets them: one ``error:`` line that names the fix (exit status 2), no
traceback; ``--debug`` (or ``LIGHTNING_APP_RLHF_DEBUG=1``) raises with the traceback instead. Also the setup-time
prompt-length check, the frozen roles' eval mode and a shipped config's run without warnings."""

from __future__ import annotations

import argparse
import re
import warnings

import lightning.pytorch as pl
import pytest
from helpers import DEMO_CONFIG, ROOT, make_module, run_cli
from lightning.pytorch.callbacks import RichProgressBar

from lightning_app_rlhf import GenerationConfig, PromptDataModule
from lightning_app_rlhf.callbacks import RLHFProgressBar
from lightning_app_rlhf.cli import DEBUG_ENV, main, suggest_options
from lightning_app_rlhf.module_trainer import added_callbacks

LONG_PROMPT = "give me fruit, like apple banana cherry grape lemon mango:"


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    """The CLI in this process, in ``tmp_path`` (the demo's run directories are relative), with no pytest arguments
    in ``sys.argv`` (LightningCLI warns of those) and no debug variable from the environment."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.argv", ["lightning-app-rlhf"])
    monkeypatch.delenv(DEBUG_ENV, raising=False)
    return tmp_path


def fit_args(*extra: str) -> list[str]:
    """``fit`` of the demo config, without logger or checkpoints, and ``extra``."""
    return ["fit", "--config", str(DEMO_CONFIG), "--trainer.logger", "false", "--trainer.enable_checkpointing",
            "false", *extra]


def one_error_line(capsys: pytest.CaptureFixture[str], run: list[str]) -> str:
    """Run the CLI in this process; it exits 2 with stderr's last line ``error: ...``, and nothing traceback-like
    nor the usage (some 150 lines) before it. Returns that line."""
    with pytest.raises(SystemExit) as exit_info:
        main(run)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "usage:" not in err, err[-3000:]
    lines = err.strip().splitlines()
    assert lines[-1].startswith("error: "), err[-3000:]
    assert sum(line.startswith("error:") for line in lines) == 1, err[-3000:]
    return lines[-1]


# ---- a mistyped key ----


def test_a_mistyped_flag_suggests_the_nearest_option(in_tmp, capsys):
    """``--model.ppo.kl_coeff`` is one line naming ``--model.ppo.kl_coef`` (and ``--help``); ``--debug`` raises."""
    line = one_error_line(capsys, fit_args("--model.ppo.kl_coeff", "0.1"))
    assert "unrecognized arguments: --model.ppo.kl_coeff 0.1. Did you mean --model.ppo.kl_coef?" in line, line
    assert "fit --help" in line and "--debug" in line
    with pytest.raises(argparse.ArgumentError, match=r"Did you mean --model\.ppo\.kl_coef\?"):
        main(fit_args("--model.ppo.kl_coeff", "0.1", "--debug"))


def test_a_mistyped_key_in_a_config_file_suggests_the_nearest_option(in_tmp, capsys):
    """The same typo in the YAML file gets the same suggestion."""
    config = in_tmp / "typo.yaml"
    config.write_text(DEMO_CONFIG.read_text().replace("    kl_coef: 0.01", "    kl_coeff: 0.01"))
    line = one_error_line(capsys, ["fit", "--config", str(config)])
    assert "'model.ppo.kl_coeff'" in line and "Did you mean --model.ppo.kl_coef?" in line, line


def test_suggestions_name_each_mistyped_flag():
    options = ["--model.ppo.kl_coef", "--data.batch_size", "--trainer.max_steps"]
    assert suggest_options("unrecognized arguments: --model.ppo.kl_coeff=0.1 --data.batchsize 3", options) == (
        " Did you mean --model.ppo.kl_coef (for --model.ppo.kl_coeff), --data.batch_size (for --data.batchsize)?")
    assert suggest_options("unrecognized arguments: --something_else 1", options) == ""


# ---- refused settings: at instantiation, at the Trainer's setup ----


def test_an_unknown_strategy_is_one_line(in_tmp, capsys):
    line = one_error_line(capsys, fit_args("--trainer.strategy", "rlhf_seperation"))
    assert "Did you mean 'rlhf_separation'?" in line, line
    with pytest.raises(ValueError, match=r"Did you mean 'rlhf_separation'\?"):
        main(fit_args("--trainer.strategy", "rlhf_seperation", "--debug"))


def test_an_option_the_algorithm_does_not_have_is_one_line(in_tmp, capsys):
    """Refused when the module is built (jsonargparse wraps the error): one line naming the fix; ``--debug`` raises."""
    args = ["fit", "--config", str(ROOT / "examples/configs/demo_grpo_cpu.yaml"), "--model.algorithm", "rloo",
            "--model.ppo.scale_rewards", "batch"]
    line = one_error_line(capsys, args)
    assert line.startswith("error: ppo.scale_rewards='batch' is a setting of ['cispo', 'dapo', 'grpo', 'gspo', "
                           "'gspo_token'], not of algorithm 'rloo'. Remove it"), line
    with pytest.raises(ValueError, match=r"not of algorithm 'rloo'"):
        main([*args, "--debug"])


def test_an_impossible_batch_split_is_one_line(in_tmp, capsys, monkeypatch):
    """3 prompts do not split into ppo.num_minibatches=2: found at the Trainer's setup (before any model), one line;
    with ``LIGHTNING_APP_RLHF_DEBUG=1`` the error itself, raised from the split check."""
    line = one_error_line(capsys, fit_args("--data.batch_size", "3"))
    assert line == ("error: The rollout batch size 3 is not divisible by ppo.num_minibatches=2. Pick a data.batch_size "
                    "that makes it a multiple of it, or a num_minibatches that divides 3."), line
    monkeypatch.setenv(DEBUG_ENV, "1")
    with pytest.raises(ValueError, match="not divisible by ppo.num_minibatches=2") as error:
        main(fit_args("--data.batch_size", "3"))
    assert any(entry.name == "check_batch_split" for entry in error.traceback)


def test_an_over_long_prompt_is_one_line_at_setup(in_tmp, capsys):
    """60 new tokens leave 4 positions of the demo actor's 64 for a prompt: the longest prompt (16 tokens) is named
    by its row, at setup, before any model is built (``--debug`` shows where it was raised)."""
    line = one_error_line(capsys, fit_args("--model.generation.max_new_tokens", "60"))
    assert re.fullmatch(r"error: The longest prompt of the training rows \(data\.prompts\), row #\d+ \('.+'\), has 16 "
                        r"tokens: plus generation\.max_new_tokens=60 need 76 positions, but the actor's context holds "
                        r"64\. Lower generation\.max_new_tokens, cap prompts with data\.max_prompt_length \(<= 4\), or "
                        r"use a model with a longer context\.", line), line
    with pytest.raises(ValueError, match="has 16 tokens") as error:
        main(fit_args("--model.generation.max_new_tokens", "60", "--debug"))
    names = [entry.name for entry in error.traceback]
    assert "_check_prompt_lengths" in names and "configure_model" not in names, names


def test_errors_print_one_line_and_debug_prints_the_traceback(tmp_path):
    """As a user runs it: exit 2, one ``error:`` line and no traceback; ``--debug``: Python's traceback."""
    args = ["fit", "--config", DEMO_CONFIG, "--trainer.logger", "false", "--model.generation.max_new_tokens", "60"]
    result = run_cli(*args, cwd=tmp_path, check=False)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("error: The longest prompt of the training rows")
    debug = run_cli(*args, "--debug", cwd=tmp_path, check=False)
    assert debug.returncode == 1 and "Traceback (most recent call last)" in debug.stderr, debug.stderr[-3000:]
    assert debug.stderr.strip().splitlines()[-1].startswith("ValueError: The longest prompt of the training rows")


def test_only_this_package_s_refusals_are_shortened(tokenizer):
    """One line for a ``ValueError`` this package raised (also wrapped, as jsonargparse wraps it, or caused by a bad
    file); the traceback for another package's error, or for one of ours caused by an error of another kind."""
    from lightning_app_rlhf.cli import config_error

    def raised(function):
        try:
            function()
        except Exception as err:  # noqa: BLE001 (whatever it raised)
            return err
        raise AssertionError("nothing raised")

    datamodule = PromptDataModule(prompts=["red", "blue"], tokenizer=tokenizer, batch_size=1)
    ours = raised(lambda: datamodule.setup("bogus"))
    assert config_error(ours) is ours

    def wrap(cause: Exception, error: Exception) -> None:
        raise error from cause

    wrapped = raised(lambda: wrap(ours, ValueError("Problem with given class_path")))
    assert config_error(wrapped) is ours
    assert config_error(raised(lambda: int("x"))) is None  # not raised by this package
    ours.__cause__ = KeyError("answer")  # as if a user's function had failed under our check
    assert config_error(ours) is None


# ---- the over-long prompt at setup, without the CLI ----


def test_an_over_long_prompt_fails_at_setup_before_any_model(tokenizer, tiny_gpt2_config):
    """The longest prompt is found in the tokenised dataset at setup, named by its row; no model was built."""
    tiny_gpt2_config["n_positions"] = 16
    module = make_module(actor={"config": tiny_gpt2_config}, tokenizer=tokenizer,
                         generation=GenerationConfig(max_new_tokens=12))
    datamodule = PromptDataModule(prompts=["red", LONG_PROMPT, "blue"], tokenizer=tokenizer, batch_size=2)
    trainer = pl.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(ValueError, match=r"The longest prompt of the training rows \(data\.prompts\), row #1 \('give "
                                         r"me fruit.*'\), has \d+ tokens: plus generation\.max_new_tokens=12 .*"
                                         r"data\.max_prompt_length \(<= 4\)"):
        trainer.fit(module, datamodule=datamodule)
    assert module.actor is None


# ---- noise ----


def test_frozen_roles_are_in_eval_mode_and_trained_ones_in_train_mode():
    """The model summary shows the reference and a reward model as ``eval``; the actor and critic train."""
    module = make_module(reward_model={"config": {"model_type": "gpt2", "n_layer": 1, "n_embd": 32, "n_head": 2,
                                                  "vocab_size": 512, "n_positions": 64, "pad_token_id": 0}},
                         reward_fn=None)
    module.configure_model()
    assert module.actor.training and module.critic.training
    assert not any(m.training for m in module.reference.modules())
    assert not any(m.training for m in module.reward_model.modules())


def test_a_lora_actor_s_reference_takes_no_mode_of_its_own(tiny_gpt2_config):
    """A LoRA actor's reference is its base with the adapters off, no module of its own: the actor trains, and the
    start of fit finds no frozen module to expect in eval mode."""
    pytest.importorskip("peft")
    lora = {"r": 2, "lora_alpha": 4, "target_modules": ["c_attn"], "fan_in_fan_out": True}
    module = make_module(actor={"config": tiny_gpt2_config, "lora": lora})
    module.configure_model()
    module.on_fit_start()
    assert module.actor.training and not isinstance(module.role_module("reference"), pl.LightningModule)


def test_lightning_default_progress_bar_is_swapped_in_place():
    """Lightning's default RichProgressBar becomes ours in the Trainer's list, not through configure_callbacks'
    return value (Lightning would print that it overrides a bar "passed to Trainer" that nobody passed)."""
    callbacks: list[pl.Callback] = [RichProgressBar(leave=True)]
    added = added_callbacks(callbacks, preemption_checkpoint=False)
    assert not any(isinstance(c, RichProgressBar) for c in added)
    assert type(callbacks[0]) is RLHFProgressBar and callbacks[0]._leave


def test_the_frozen_roles_eval_mode_warning_is_silenced_for_exactly_their_count():
    """Lightning warns of modules in eval mode at the start of training: silenced only for the frozen roles' count."""
    from lightning.pytorch.utilities.warnings import PossibleUserWarning

    from lightning_app_rlhf.module_trainer import expect_frozen_roles_in_eval_mode

    module = make_module()
    module.configure_model()
    count = sum(1 for m in module.reference.modules())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        expect_frozen_roles_in_eval_mode(module, [module.reference])
        warnings.warn(f"Found {count} module(s) in eval mode at the start of training.", PossibleUserWarning)
        warnings.warn(f"Found {count + 1} module(s) in eval mode at the start of training.", PossibleUserWarning)
    assert [str(w.message) for w in caught] == [f"Found {count + 1} module(s) in eval mode at the start of training."]


def test_lightning_advice_that_does_not_apply_is_ignored():
    """Each inapplicable warning is ignored once the CLI or the module installed the filters; others still show."""
    from lightning.pytorch.utilities.warnings import PossibleUserWarning

    from lightning_app_rlhf.core.upstream_warnings import INAPPLICABLE_WARNINGS, ignore_upstream_warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ignore_upstream_warnings()
        warnings.warn("Using ModelCheckpoint with manual optimization and every_n_train_steps, but no "
                      "pre-optimization state was saved.", UserWarning)
        warnings.warn("The 'train_dataloader' does not have many workers which may be a bottleneck. Consider "
                      "increasing the value of the `num_workers` argument", PossibleUserWarning)
        warnings.warn("Some other advice.", UserWarning)
    assert [str(w.message) for w in caught] == ["Some other advice."]
    assert all(w.upstream for w in INAPPLICABLE_WARNINGS)  # each with its reason


@pytest.mark.parametrize("config", ["demo_cpu", "demo_grpo_cpu", "demo_lora_cpu"])
def test_a_shipped_config_runs_without_warnings(tmp_path, config):
    """A default run of a shipped config (one iteration) prints no warning: the ones this package caused are fixed
    where they arose, upstream ones nobody can act on are filtered (core/upstream_warnings.py)."""
    result = run_cli("fit", "--config", ROOT / f"examples/configs/{config}.yaml", "--trainer.max_steps", "1",
                     "--trainer.logger.init_args.save_dir", tmp_path / "runs", cwd=tmp_path,
                     fresh_interpreter=True)  # a forked command's import-time warnings would print in the server
    warned = [line for line in (result.stdout + result.stderr).splitlines() if re.search(r"warn", line, re.IGNORECASE)]
    assert not warned, "\n".join(warned)
