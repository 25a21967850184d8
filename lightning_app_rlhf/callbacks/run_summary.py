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
        window: Iterations averaged at each end (start = the first ``window``, end = the last ``window``). A run
            shorter than ``2 x window`` averages its halves instead; the title names the window used.
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

    def window_used(self, count: int) -> int:
        """Values averaged at each end of ``count`` recorded ones: ``window``, or each half of a run shorter than
        two windows (so start and end never overlap), and at least the one value of a one-iteration run."""
        return min(self.window, max(1, count // 2))

    def start_end(self, name: str) -> tuple[float, float]:
        """Mean of the first and of the last :meth:`window_used` recorded values of a metric."""
        values = self.history[name]
        if not values:
            raise ValueError(f"No values of {name!r} were recorded.")
        window = self.window_used(len(values))
        return sum(values[:window]) / window, sum(values[-window:]) / window

    def title(self, iterations: int, algorithm: str) -> str:
        """The table's title, naming the window actually averaged."""
        plural = "" if iterations == 1 else "s"
        return f"RLHF run summary: {iterations} {algorithm} iteration{plural} ({self._means(iterations)})"

    def _means(self, count: int) -> str:
        window = self.window_used(count)
        if count == 1:
            return "start and end are its one value"
        if window < self.window:
            return (f"means of first/last {window} of {count}: halves, as the run is shorter than "
                    f"2 x window={self.window}")
        return f"means of first/last {window}"

    @override
    @rank_zero_only
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        recorded = [name for name in self.metrics if self.history[name]]
        if not recorded:
            return
        counts = {name: len(self.history[name]) for name in recorded}
        iterations = max(counts.values())
        algorithm = getattr(getattr(pl_module, "algorithm", None), "name", "rlhf").upper()
        table = Table(title=self.title(iterations, algorithm))
        # The title's window is the longest history's; a metric recorded fewer times may average fewer values.
        uneven = len(set(counts.values())) > 1
        columns = ("metric", "start", "end", "change") + (("window",) if uneven else ())
        for column in columns:
            table.add_column(column, justify="left" if column == "metric" else "right")
        for name in recorded:
            start, end = self.start_end(name)
            extra = (f"{self.window_used(counts[name])} of {counts[name]}",) if uneven else ()
            table.add_row(name, f"{start:.3f}", f"{end:.3f}", f"{end - start:+.3f}", *extra)
        console = Console()
        console.print(table)
        if "reward/mean" in recorded:
            start, end = self.start_end("reward/mean")
            verdict = "rose" if end > start else "did not rise"
            console.print(f"reward/mean {verdict}: {start:.3f} -> {end:.3f} ({end - start:+.3f}).")
