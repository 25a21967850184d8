"""Tests for the callbacks' own logic: ``RLHFRunSummary``'s window, ``LogCompletions``' tables and loggers,
``RLHFProgressBar``'s description."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace
from typing import Any
from unittest import mock

import lightning.pytorch as pl
import pytest
import torch
from helpers import make_module
from lightning.pytorch.callbacks import Callback, RichProgressBar, TQDMProgressBar
from lightning.pytorch.callbacks.progress.rich_progress import RichProgressBarTheme
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger, WandbLogger
from typing_extensions import override

from lightning_app_rlhf import GenerationConfig, PPOConfig, PromptDataModule, demo
from lightning_app_rlhf.callbacks import LogCompletions, RLHFProgressBar, RLHFRunSummary
from lightning_app_rlhf.callbacks.log_completions import markdown_table


def flat(text: str) -> str:
    """Rich wraps and centres a long title over several lines: compare words only."""
    return " ".join(text.replace("┃", " ").replace("│", " ").split())


# ---- RLHFRunSummary ----


def _summary(rewards: list[float], window: int = 10, **others: list[float]) -> RLHFRunSummary:
    summary = RLHFRunSummary(window=window)
    summary.history["reward/mean"] = list(rewards)
    for name, values in others.items():
        summary.history[name.replace("_", "/")] = list(values)
    return summary


def test_run_summary_short_run_states_window_used(capsys):
    """4 iterations with window=10 average the first and last 2: the title says 2 (halves of a short run), not
    10, and the numbers are those means."""
    summary = _summary([0.0, 1.0, 2.0, 4.0], kl_mean=[0.1, 0.1, 0.3, 0.3])
    assert summary.start_end("reward/mean") == (0.5, 3.0)
    summary.on_fit_end(None, SimpleNamespace(algorithm=SimpleNamespace(name="grpo")))
    out = flat(capsys.readouterr().out)
    assert ("RLHF run summary: 4 GRPO iterations (means of first/last 2 of 4: halves, as the run is shorter than "
            "2 x window=10)") in out
    assert "first/last 10" not in out
    assert "reward/mean 0.500 3.000 +2.500" in out and "kl/mean 0.100 0.300 +0.200" in out
    assert "reward/mean rose: 0.500 -> 3.000 (+2.500)." in out


def test_run_summary_full_window_and_single_iteration(capsys):
    """A run of at least 2 x window states the configured window; a one-iteration run says start = end."""
    _summary([float(i) for i in range(8)], window=3).on_fit_end(None, None)
    out = flat(capsys.readouterr().out)
    assert "RLHF run summary: 8 RLHF iterations (means of first/last 3)" in out
    assert "reward/mean 1.000 6.000 +5.000" in out
    _summary([0.25]).on_fit_end(None, None)
    out = flat(capsys.readouterr().out)
    assert "RLHF run summary: 1 RLHF iteration (start and end are its one value)" in out
    assert "reward/mean 0.250 0.250 +0.000" in out


def test_run_summary_uneven_histories_show_each_window(capsys):
    """A metric recorded fewer times than the others gets a window column with its own window."""
    _summary([1.0, 2.0, 3.0, 4.0], kl_coef=[1.0, 2.0]).on_fit_end(None, None)
    out = flat(capsys.readouterr().out)
    assert "4 RLHF iterations (means of first/last 2 of 4" in out
    assert "reward/mean 1.500 3.500 +2.000 2 of 4" in out and "kl/coef 1.000 2.000 +1.000 1 of 2" in out


# ---- LogCompletions: stand-ins ----

ROWS = [
    {"prompt": "list some fruit:", "completion": " apple | pear\nplum\r", "reward": 1.0},
    {"prompt": "[bold]red[/bold]", "completion": " a <b>_x_</b> & *y*", "reward": -0.25},
    {"prompt": "blue sky", "completion": "", "reward": 0.5},
]


class StandInModule:
    """What LogCompletions reads of an RLHFModule: ``latest_completions(max_rows)``, recording each call."""

    def __init__(self, rows: list[dict[str, Any]]) -> None:
        self.rows = rows
        self.calls: list[int] = []

    def latest_completions(self, max_rows: int) -> list[dict[str, Any]]:
        self.calls.append(max_rows)
        return self.rows[:max_rows]


class RecordingWriter:
    """Stands in for TensorBoard's SummaryWriter (neither tensorboard nor tensorboardX need be installed)."""

    def __init__(self) -> None:
        self.texts: list[tuple[str, str, int]] = []

    def add_text(self, tag: str, text: str, global_step: int | None = None) -> None:
        self.texts.append((tag, text, global_step))

    def add_scalar(self, *args: Any, **kwargs: Any) -> None:
        pass

    def add_scalars(self, *args: Any, **kwargs: Any) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


class RecordingTensorBoardLogger(TensorBoardLogger):
    """A real TensorBoardLogger (so LogCompletions dispatches on it) whose writer records the text it gets."""

    def __init__(self, root_dir: str) -> None:
        with mock.patch("lightning.fabric.loggers.tensorboard._TENSORBOARDX_AVAILABLE", True):
            super().__init__(root_dir)  # refuses to construct when no writer package is installed
        self.writer = RecordingWriter()

    @property
    @override
    def experiment(self) -> RecordingWriter:
        return self.writer

    @override
    def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
        pass  # hparams need tensorboard's own summary protos


class FakeWandbLogger(WandbLogger):
    """A WandbLogger (for the isinstance dispatch) that records tables instead of importing wandb."""

    def __init__(self) -> None:  # WandbLogger's own needs the wandb package
        self.tables: list[dict[str, Any]] = []

    @override
    def log_table(self, key: str, columns: list[str] | None = None, data: list[list[Any]] | None = None,
                  dataframe: Any = None, step: int | None = None) -> None:
        self.tables.append({"key": key, "columns": columns, "data": data, "step": step})


def _trainer(loggers: list[Any], step: int = 0, rank_zero: bool = True) -> SimpleNamespace:
    return SimpleNamespace(global_step=step, loggers=loggers, is_global_zero=rank_zero)


def _run(callback: LogCompletions, module: StandInModule, trainer: SimpleNamespace, steps: range) -> None:
    callback.setup(trainer, module, "fit")
    for step in steps:
        trainer.global_step = step
        callback.on_train_batch_end(trainer, module, None, {}, step - 1)
    callback.on_train_end(trainer, module)


# ---- LogCompletions ----


def test_log_completions_every_n_steps_and_at_the_end(tmp_path, capsys):
    """Every 3 iterations of 7, then at train end: TensorBoard text, a W&B table and a console table at steps
    3, 6 and 7, with max_rows rows; CSVLogger is skipped without error."""
    tensorboard, wandb = RecordingTensorBoardLogger(str(tmp_path)), FakeWandbLogger()
    module = StandInModule(ROWS)
    callback = LogCompletions(every_n_steps=3, max_rows=2)
    _run(callback, module, _trainer([CSVLogger(tmp_path), tensorboard, wandb]), range(1, 8))
    assert [(tag, step) for tag, _, step in tensorboard.writer.texts] == [("completions", 3), ("completions", 6),
                                                                          ("completions", 7)]
    assert tensorboard.writer.texts[0][1] == markdown_table(ROWS[:2])
    assert [table["step"] for table in wandb.tables] == [3, 6, 7]
    assert wandb.tables[0] == {"key": "completions", "columns": ["prompt", "completion", "reward"], "step": 3,
                               "data": [[row["prompt"], row["completion"], row["reward"]] for row in ROWS[:2]]}
    assert module.calls == [2, 2, 2]
    out = capsys.readouterr().out
    assert [line.strip() for line in out.splitlines() if "Completions at step" in line] == [
        "Completions at step 3", "Completions at step 6", "Completions at step 7"]
    assert "[bold]red[/bold]" in out and "list some fruit:" in out and "-0.250" in out  # text shown verbatim
    assert "blue sky" not in out  # max_rows=2


def test_log_completions_end_step_logged_once(tmp_path):
    """A run ending on a logging step logs that step once; a run shorter than every_n_steps logs at its end."""
    tensorboard = RecordingTensorBoardLogger(str(tmp_path))
    _run(LogCompletions(every_n_steps=2, console=False), StandInModule(ROWS), _trainer([tensorboard]), range(1, 5))
    assert [step for *_, step in tensorboard.writer.texts] == [2, 4]
    wandb = FakeWandbLogger()
    _run(LogCompletions(every_n_steps=50, console=False), StandInModule(ROWS), _trainer([wandb]), range(1, 3))
    assert [table["step"] for table in wandb.tables] == [2]


def test_log_completions_nothing_before_rows_or_off_rank_zero(tmp_path, capsys):
    """No rows yet logs nothing; on ranks other than 0 the module is still asked (it may gather), but nothing is
    logged or printed."""
    tensorboard, wandb = RecordingTensorBoardLogger(str(tmp_path)), FakeWandbLogger()
    _run(LogCompletions(every_n_steps=1), StandInModule([]), _trainer([tensorboard, wandb]), range(1, 3))
    module = StandInModule(ROWS)
    _run(LogCompletions(every_n_steps=1), module, _trainer([tensorboard, wandb], rank_zero=False), range(1, 3))
    assert module.calls == [8, 8]
    assert tensorboard.writer.texts == [] and wandb.tables == [] and capsys.readouterr().out == ""


def test_markdown_table_escapes_cells():
    """Pipes, newlines, markdown emphasis and HTML are escaped so each row stays one table row, read verbatim."""
    assert markdown_table(ROWS).splitlines() == [
        "| prompt | completion | reward |",
        "| --- | --- | ---: |",
        "| list some fruit: |  apple \\| pear<br>plum<br> | 1.000 |",
        "| \\[bold\\]red\\[/bold\\] |  a &lt;b&gt;\\_x\\_&lt;/b&gt; &amp; \\*y\\* | -0.250 |",
        "| blue sky |  | 0.500 |",
    ]


def test_log_completions_checks_arguments_and_module(tmp_path):
    """Bad settings, a module without latest_completions, and malformed rows raise saying what to change."""
    with pytest.raises(ValueError, match=r"every_n_steps=0.*remove the callback"):
        LogCompletions(every_n_steps=0)
    with pytest.raises(ValueError, match=r"max_rows=0"):
        LogCompletions(max_rows=0)
    with pytest.raises(TypeError, match="latest_completions.*which BoringModel does not have"):
        LogCompletions().setup(_trainer([]), type("BoringModel", (), {})(), "fit")
    bad = StandInModule([{"prompt": "red", "reward": 1.0}])
    with pytest.raises(TypeError, match=r"keys \['prompt', 'completion', 'reward'\]"):
        _run(LogCompletions(every_n_steps=1), bad, _trainer([RecordingTensorBoardLogger(str(tmp_path))]), range(1, 2))


def test_log_completions_in_a_real_fit(demo_tokenizer, tmp_path):
    """A 2-iteration Trainer.fit of the demo RLHFModule with LogCompletions and a TensorBoardLogger writes a
    completions table at both steps (read back from the event file when tensorboard is installed)."""
    pl.seed_everything(0)
    module = make_module(
        generation=GenerationConfig(max_new_tokens=8),
        ppo=PPOConfig(kl_coef=0.01),
        actor_optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3),
        critic_optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3),
    )
    real = importlib.util.find_spec("tensorboard") is not None
    logger = TensorBoardLogger(str(tmp_path)) if real else RecordingTensorBoardLogger(str(tmp_path))
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=logger, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[LogCompletions(every_n_steps=1, max_rows=3, console=False)])
    trainer.fit(module, PromptDataModule(demo.prompts(16), demo_tokenizer, batch_size=4))
    if real:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
        from tensorboard.util.tensor_util import make_ndarray

        events = EventAccumulator(logger.log_dir, size_guidance={"tensors": 0})
        events.Reload()
        texts = [(e.step, make_ndarray(e.tensor_proto).item().decode()) for e in
                 events.Tensors("completions/text_summary")]
    else:
        texts = [(step, text) for tag, text, step in logger.writer.texts if tag == "completions"]
    assert [step for step, _ in texts] == [1, 2]
    for _, text in texts:
        lines = text.split("\n")  # generated text may hold other characters str.splitlines() splits at
        assert lines[0] == "| prompt | completion | reward |" and len(lines) == 2 + 3
        assert all(line.startswith("| ") and line.endswith(" |") for line in lines[2:])


# ---- RLHFProgressBar ----


class _Descriptions(Callback):
    """Records the training bar's text after each iteration (runs after the bar, which is listed first)."""

    def __init__(self, bar: RichProgressBar) -> None:
        self.bar, self.seen = bar, []

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.seen.append(self.bar.train_progress_bar.description.rstrip())


def _descriptions(tmp_path, bar: RichProgressBar, **limits: Any) -> list[str]:
    spy = _Descriptions(bar)
    trainer = pl.Trainer(default_root_dir=tmp_path, logger=False, enable_checkpointing=False,
                         enable_model_summary=False, accelerator="cpu", devices=1, limit_val_batches=0,
                         limit_train_batches=2, callbacks=[bar, spy], **limits)
    trainer.fit(BoringModel())
    return spy.seen


def test_progress_bar_counts_iterations_of_max_steps(tmp_path):
    """Under max_steps the bar reads iterations out of max_steps (and the epoch, without a total); under max_epochs
    Lightning's "Epoch i/last". Lightning's own bar reads "Epoch 0/-2" under max_steps."""
    assert _descriptions(tmp_path, RLHFProgressBar(), max_steps=5) == [
        "Iteration 1/5, epoch 0", "Iteration 2/5, epoch 0", "Iteration 3/5, epoch 1", "Iteration 4/5, epoch 1",
        "Iteration 5/5, epoch 2"]
    assert _descriptions(tmp_path, RLHFProgressBar(), max_epochs=2) == ["Epoch 0/1"] * 2 + ["Epoch 1/1"] * 2
    assert _descriptions(tmp_path, RLHFProgressBar(), max_steps=3, max_epochs=5) == [
        "Iteration 1/3, epoch 0/4", "Iteration 2/3, epoch 0/4", "Iteration 3/3, epoch 1/4"]
    # When this fails, Lightning's bar reads something true under max_steps and RLHFProgressBar may go.
    assert _descriptions(tmp_path, RichProgressBar(), max_steps=2) == ["Epoch 0/-2"] * 2


def test_rlhf_module_swaps_a_rich_progress_bar_for_one_with_its_settings():
    """A RichProgressBar given to the Trainer (or Lightning's default one) becomes an RLHFProgressBar with its refresh
    rate, leave, theme, console arguments and enabled state, in the Trainer's list (returned by configure_callbacks,
    Lightning would say it overrides a bar passed to the Trainer); another progress bar, or an RLHFProgressBar,
    stays."""
    module = make_module()

    def swapped(*callbacks: Callback) -> list[RLHFProgressBar]:
        module.trainer = SimpleNamespace(callbacks=list(callbacks))
        assert not [c for c in module.configure_callbacks() if isinstance(c, RichProgressBar)]
        return [c for c in module.trainer.callbacks if isinstance(c, RichProgressBar) and c not in callbacks]

    theme = RichProgressBarTheme(description="green")
    given = RichProgressBar(refresh_rate=3, leave=True, theme=theme, console_kwargs={"width": 80})
    given.disable()
    (bar,) = swapped(given)
    assert type(bar) is RLHFProgressBar and bar.refresh_rate == 3 and bar._leave and bar.theme is theme
    assert bar._console_kwargs == {"width": 80} and bar.is_disabled
    assert swapped(TQDMProgressBar()) == [] and swapped(RLHFProgressBar()) == []
