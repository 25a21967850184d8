"""``RLHFRunSummary``: a short end-of-fit report of reward and KL, from the start and the end of the run."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_only
from rich.console import Console
from rich.table import Table
from typing_extensions import override


class RLHFRunSummary(Callback):
    """Records reward and KL at every iteration and prints start vs end when fit finishes.

    Args:
        window: Iterations averaged at each end (start = the first ``window``, end = the last ``window``).
        metrics: Logged metric names to report.
    """

    def __init__(self, window: int = 10, metrics: tuple[str, ...] = ("reward/mean", "kl/mean", "kl/coef")) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}.")
        self.window = window
        self.metrics = metrics
        self.history: dict[str, list[float]] = {name: [] for name in metrics}

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        for name in self.metrics:
            value = trainer.callback_metrics.get(name)
            if value is not None:
                self.history[name].append(float(value))

    def start_end(self, name: str) -> tuple[float, float]:
        """Mean of the first and of the last ``window`` recorded values of a metric."""
        values = self.history[name]
        if not values:
            raise ValueError(f"No values of {name!r} were recorded.")
        window = min(self.window, max(1, len(values) // 2))
        return sum(values[:window]) / window, sum(values[-window:]) / window

    @override
    @rank_zero_only
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        recorded = [name for name in self.metrics if self.history[name]]
        if not recorded:
            return
        iterations = len(self.history[recorded[0]])
        algorithm = getattr(getattr(pl_module, "algorithm", None), "name", "rlhf").upper()
        title = f"RLHF run summary: {iterations} {algorithm} iterations (means of first/last {self.window})"
        table = Table(title=title)
        for column in ("metric", "start", "end", "change"):
            table.add_column(column, justify="left" if column == "metric" else "right")
        for name in recorded:
            start, end = self.start_end(name)
            table.add_row(name, f"{start:.3f}", f"{end:.3f}", f"{end - start:+.3f}")
        console = Console()
        console.print(table)
        if "reward/mean" in recorded:
            start, end = self.start_end("reward/mean")
            verdict = "rose" if end > start else "did not rise"
            console.print(f"reward/mean {verdict}: {start:.3f} -> {end:.3f} ({end - start:+.3f}).")
