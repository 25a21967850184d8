"""The soak run: resident memory of every rank over a long run, to show it stays flat (no leak).

``RSSRecorder`` is a callback that samples ``VmRSS`` every N iterations on every rank and writes one JSON record
per rank; :func:`rss_trend` reduces a record to what the docs report: RSS after warm-up, at the end, and the
least-squares slope in between.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_app_rlhf.bench.checkpoint_memory import read_status


class RSSRecorder(Callback):
    """Samples this rank's resident memory (``VmRSS``) every ``every`` iterations and at the end of fit; writes
    ``{path}/rank{r}.json`` with ``{"rank": r, "samples": [[iteration, bytes], ...]}``.

    Args:
        path: Folder of the per-rank records.
        every: Iterations between samples.
    """

    def __init__(self, path: str, every: int = 10) -> None:
        if every < 1:
            raise ValueError(f"RSSRecorder(every={every}): sample every 1 or more iterations.")
        self.path = Path(path)
        self.every = every
        self.samples: list[list[int]] = []

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if trainer.global_step % self.every == 0:
            self.samples.append([trainer.global_step, read_status("VmRSS")["VmRSS"]])

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        record = {"rank": trainer.global_rank, "samples": self.samples}
        (self.path / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


def rss_trend(samples: list[list[int]], warmup: int) -> dict[str, float]:
    """RSS after warm-up and at the end, and the least-squares growth per 100 iterations after warm-up.

    Args:
        samples: ``[iteration, bytes]`` pairs in order.
        warmup: Iterations whose samples are left out (allocator and caches settling).

    Returns:
        ``after_warmup_mib``, ``end_mib``, ``growth_mib`` (end - after warm-up), ``slope_mib_per_100``.
    """
    steady = [(step, rss / 2**20) for step, rss in samples if step >= warmup]
    if len(steady) < 2:
        raise ValueError(f"Need at least 2 samples after warm-up ({warmup} iterations); got {len(steady)}. Run "
                         "more iterations or sample more often.")
    steps, mib = zip(*steady)
    mean_step, mean_mib = sum(steps) / len(steps), sum(mib) / len(mib)
    covariance = sum((s - mean_step) * (m - mean_mib) for s, m in steady)
    variance = sum((s - mean_step) ** 2 for s in steps)
    return {"after_warmup_mib": mib[0], "end_mib": mib[-1], "growth_mib": mib[-1] - mib[0],
            "slope_mib_per_100": 100 * covariance / variance}


def soak_table(rows: list[dict[str, Any]]) -> str:
    """The markdown table of a soak run: one line per placement and rank."""
    lines = ["| placement | rank | RSS after warm-up (MiB) | RSS at end (MiB) | growth (MiB) | slope (MiB / 100 it) |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for row in rows:
        for rank in row["ranks"]:
            trend = rank["trend"]
            lines.append(f"| {row['strategy']} | {rank['rank']} | {trend['after_warmup_mib']:.1f} | "
                         f"{trend['end_mib']:.1f} | {trend['growth_mib']:+.1f} | {trend['slope_mib_per_100']:+.2f} |")
    return "\n".join(lines)


def plot_soak(rows: list[dict[str, Any]], path: Path) -> None:
    """One panel per placement: each rank's RSS against the iteration, the warm-up shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(rows), figsize=(4 * len(rows), 3.2), sharey=True, squeeze=False)
    for axis, row in zip(axes[0], rows):
        for rank in row["ranks"]:
            steps, rss = zip(*rank["samples"])
            axis.plot(steps, [b / 2**20 for b in rss], label=f"rank {rank['rank']}")
        axis.axvspan(0, row["warmup"], color="0.9")
        axis.set_title(row["strategy"])
        axis.set_xlabel("iteration")
    axes[0][0].set_ylabel("RSS (MiB)")
    axes[0][0].legend(fontsize=8)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
