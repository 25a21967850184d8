"""``LogCompletions``: every N iterations, a table of prompts, completions and rewards from the latest rollout, to
TensorBoard (text), Weights & Biases (a table) and the console."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger, WandbLogger
from rich.console import Console
from rich.table import Table
from rich.text import Text
from typing_extensions import override

COLUMNS = ("prompt", "completion", "reward")
"""The keys of each row of ``latest_completions`` and the columns of every table."""

_MARKDOWN_ESCAPES = {
    **{c: "\\" + c for c in "\\`*_[]|"},  # would format the text or split the table's cells
    "&": "&amp;", "<": "&lt;", ">": "&gt;",  # would read as HTML
    "\r\n": "<br>", "\r": "<br>", "\n": "<br>",  # a line break would end the table's row
}


class LogCompletions(Callback):
    """Every ``every_n_steps`` iterations, and once more when training ends, logs the prompts, completions and
    rewards of the latest rollout (as TRL's ``log_completions``): to TensorBoard as a markdown table
    (``add_text``), to Weights & Biases as a ``wandb.Table`` (``WandbLogger.log_table``), and to the console
    as a rich table on global rank 0. Loggers with neither text nor tables (``CSVLogger``, ...) are skipped.

    The rows come from the module's ``latest_completions(max_rows)``: a list of
    ``{"prompt": str, "completion": str, "reward": float}`` for the last training iteration, empty before the
    first one. It is called on every rank at the same iterations (so it may be a collective); rank 0 logs.

    Args:
        every_n_steps: Log after every this many iterations (global steps).
        max_rows: Rows per table: the first ``max_rows`` samples of the rollout.
        console: Also print the table to the console.
        key: The TensorBoard tag and W&B key of the tables.
    """

    def __init__(self, every_n_steps: int = 50, max_rows: int = 8, console: bool = True,
                 key: str = "completions") -> None:
        if every_n_steps < 1:
            raise ValueError(f"LogCompletions(every_n_steps={every_n_steps}): log every 1 or more iterations; "
                             "to log none, remove the callback.")
        if max_rows < 1:
            raise ValueError(f"LogCompletions(max_rows={max_rows}): log at least 1 row.")
        self.every_n_steps = every_n_steps
        self.max_rows = max_rows
        self.console = console
        self.key = key
        self._logged_step: int | None = None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit" and not callable(getattr(pl_module, "latest_completions", None)):
            raise TypeError(f"LogCompletions reads the module's latest_completions(max_rows), which "
                            f"{type(pl_module).__name__} does not have: train an RLHFModule, or remove the callback.")

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if trainer.global_step % self.every_n_steps == 0:
            self.log_completions(trainer, pl_module)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # A run that stops between two logging steps (or before the first) still shows its last rollout.
        self.log_completions(trainer, pl_module)

    def log_completions(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Log the latest rollout's rows at ``trainer.global_step`` (once per step). Call it on every rank."""
        step = trainer.global_step
        if step == 0 or step == self._logged_step:
            return
        self._logged_step = step
        rows = _check_rows(pl_module.latest_completions(self.max_rows))[: self.max_rows]
        if not rows or not trainer.is_global_zero:
            return
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                data = [[row["prompt"], row["completion"], float(row["reward"])] for row in rows]
                logger.log_table(key=self.key, columns=list(COLUMNS), data=data, step=step)
            elif isinstance(logger, TensorBoardLogger):
                logger.experiment.add_text(self.key, markdown_table(rows), global_step=step)
        if self.console:
            Console().print(rich_table(rows, f"Completions at step {step}"))


def markdown_table(rows: Sequence[dict[str, Any]]) -> str:
    """A markdown table of the rows (prompt, completion, reward to 3 decimals), its text escaped so that it reads
    verbatim in TensorBoard's text tab."""
    lines = ["| prompt | completion | reward |", "| --- | --- | ---: |"]
    lines += [f"| {_escape(row['prompt'])} | {_escape(row['completion'])} | {float(row['reward']):.3f} |"
              for row in rows]
    return "\n".join(lines)


def rich_table(rows: Sequence[dict[str, Any]], title: str) -> Table:
    """A rich table of the rows, the texts shown as they are (not read as rich markup)."""
    table = Table(title=title, show_lines=True)
    table.add_column("prompt", overflow="fold")
    table.add_column("completion", overflow="fold")
    table.add_column("reward", justify="right")
    for row in rows:
        table.add_row(Text(row["prompt"]), Text(row["completion"]), f"{float(row['reward']):.3f}")
    return table


def _escape(text: str) -> str:
    for plain, escaped in _MARKDOWN_ESCAPES.items():
        text = text.replace(plain, escaped)
    return text


def _check_rows(rows: Any) -> list[dict[str, Any]]:
    for row in rows:
        if not (isinstance(row, dict) and set(COLUMNS) <= set(row)):
            raise TypeError(f"latest_completions() must return dicts with the keys {list(COLUMNS)}; got {row!r}.")
    return list(rows)
