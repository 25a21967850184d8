"""``RLHFProgressBar``: Lightning's ``RichProgressBar`` with a training description that is true under ``max_steps``."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import RichProgressBar
from lightning.pytorch.callbacks.progress.rich_progress import ProcessingSpeedColumn
from rich.progress import Task
from rich.text import Text
from typing_extensions import override


class IterationSpeedColumn(ProcessingSpeedColumn):
    """Lightning's speed column, in seconds per iteration below one iteration per second: an RLHF iteration takes
    seconds, and ``it/s`` reads ``0.00it/s`` for one of over 200 s."""

    @override
    def render(self, task: Task) -> Text:
        speed = task.speed
        if speed is None:
            return Text("", style=self.style)
        return Text(f"{speed:.2f}it/s" if speed >= 1 else f"{1 / speed:.1f}s/it", style=self.style)


class RLHFProgressBar(RichProgressBar):
    """Lightning's ``RichProgressBar`` whose training bar reads what bounds the run: ``Iteration 37/600, epoch 2``
    when ``max_steps`` does (an RLHF iteration is one step), ``Epoch 2/9`` when only ``max_epochs`` does (Lightning's
    reading: this epoch's index over the last one's), ``Epoch 2`` when nothing does. The bar itself still counts the
    epoch's batches, all of them (Lightning's counts only those before ``max_steps``: ``1/1`` in the last epoch of
    a run that stops after its first of 2 batches); its speed reads seconds per iteration below one per second
    (:class:`IterationSpeedColumn`), and the logger's version ``v_num`` is printed as the integer it is.

    Lightning's own bar prints ``max_epochs - 1`` as the total, and ``max_epochs`` is -1 when only ``max_steps`` is set:
    ``Epoch 37/-2``. :class:`~lightning_app_rlhf.RLHFModule` replaces a ``RichProgressBar`` given to the Trainer with
    this one, keeping its settings, so either class in a config shows the same.

    Args:
        refresh_rate: Refresh the bars every this many batches (0 disables them).
        leave: Leave each epoch's finished bar on the console.
        theme: Colours and styles of the bars.
        console_kwargs: Arguments of the ``rich.console.Console`` the bars are drawn on.
    """

    @classmethod
    def like(cls, bar: RichProgressBar) -> RLHFProgressBar:
        """This bar with ``bar``'s settings (refresh rate, ``leave``, theme, console arguments, enabled or not).

        Args:
            bar: The ``RichProgressBar`` to replace.
        """
        # RichProgressBar keeps `leave` and `console_kwargs` only in private attributes (no public accessor): read
        # with the constructor's defaults, so a Lightning release that renames them loses a setting, not the run.
        new = cls(refresh_rate=int(bar.refresh_rate), leave=getattr(bar, "_leave", False), theme=bar.theme,
                  console_kwargs=dict(getattr(bar, "_console_kwargs", None) or {}))
        if not getattr(bar, "_enabled", True):  # (refresh_rate 0, the other way to disable it, is copied above)
            new.disable()
        return new

    @staticmethod
    def describe_training(trainer: pl.Trainer) -> str:
        """The training bar's text for ``trainer``'s current iteration and epoch.

        Args:
            trainer: The Trainer whose progress is shown (``global_step``, ``max_steps``, ``current_epoch``,
                ``max_epochs``).
        """
        epoch = str(trainer.current_epoch)
        if trainer.max_epochs is not None and trainer.max_epochs > 0:  # -1: no epoch limit
            epoch += f"/{trainer.max_epochs - 1}"
        if trainer.max_steps >= 0:  # -1: no step limit
            return f"Iteration {trainer.global_step}/{trainer.max_steps}, epoch {epoch}"
        return f"Epoch {epoch}"

    @property
    @override
    def total_train_batches(self) -> int | float:
        return self.trainer.num_training_batches

    @override
    def configure_columns(self, trainer: pl.Trainer) -> list:
        return [IterationSpeedColumn(style=self.theme.processing_speed) if isinstance(column, ProcessingSpeedColumn)
                else column for column in super().configure_columns(trainer)]

    @override
    def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, int | str | float]:
        metrics = super().get_metrics(trainer, pl_module)
        if isinstance(metrics.get("v_num"), (int, float)):  # else the bar formats it as a float: "v_num: 7.000"
            metrics["v_num"] = str(int(metrics["v_num"]))
        return metrics

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_epoch_start(trainer, pl_module)
        self._describe(trainer)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        self._describe(trainer)

    def _describe(self, trainer: pl.Trainer) -> None:
        """Set the training task's description, right after Lightning's hooks set theirs. Lightning computes its text
        in a private method (``_get_train_description``); this goes through public hooks and the rich task instead,
        so a change of Lightning's internals cannot bring the wrong total back."""
        if self.is_disabled or self.progress is None or self.train_progress_bar_id is None:
            return
        # Padded as Lightning pads its own, so that the training and validation bars line up.
        text = f"{self.describe_training(trainer):{len(self.validation_description)}}"
        if self.theme.description:
            text = f"[{self.theme.description}]{text}"
        self.progress.update(self.train_progress_bar_id, description=text)
        self.refresh()


__all__ = ["RLHFProgressBar"]
