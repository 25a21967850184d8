"""A callback that records each PPO iteration's wall time, phase split and peak memory, one JSON file per rank;
under the bench's turn server (:mod:`~lightning_app_rlhf.bench.turns`) it also takes turns, one iteration each."""

from __future__ import annotations

import json
import resource
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from typing_extensions import override

from lightning_app_rlhf.bench.turns import TurnClient

PHASES = ("time/generate_s", "time/score_s", "time/train_s", "time/reallocate_s", "time/wait_for_rollout_s")


class IterationTimer(pl.Callback):
    """Writes ``{out_dir}/rank{r}.json``: per-iteration wall seconds (between successive iteration ends, so data
    loading, logging and the Trainer's own work count), the module's phase split, generated tokens, and peak memory.

    Started by the bench's turn server (:func:`~lightning_app_rlhf.bench.turns.run_in_turns`), it runs each iteration
    only in its turn, and the wait for a turn is not counted.

    Args:
        out_dir: Folder for the per-rank JSON files.
    """

    def __init__(self, out_dir: str) -> None:
        self.out_dir = Path(out_dir)
        self.iterations: list[dict[str, float]] = []
        self._last_end = 0.0
        self._turns: TurnClient | None = None
        self._turns_over = False

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._turns = TurnClient.from_env()
        if self._turns is not None:
            if trainer.world_size > 1:
                raise ValueError(f"Taking turns measures one process; this run has {trainer.world_size}. Run it "
                                 "without the bench's turn server (`--interleave false`).")
            self._turns_over = not self._turns.wait()
        self._last_end = time.perf_counter()

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._turns_over:
            raise RuntimeError("The bench's turn server ended the run, but the Trainer goes on: its max_steps is more "
                               "than the rounds the server runs.")

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        now = time.perf_counter()
        metrics = trainer.callback_metrics
        row = {"wall_s": now - self._last_end, "prompt_tokens": float(batch["attention_mask"].sum())}
        row.update({name: float(metrics[name]) for name in PHASES if name in metrics})
        if "response/length_mean" in metrics:
            row["gen_tokens"] = float(metrics["response/length_mean"]) * trainer.datamodule.batch_size
        self.iterations.append(row)
        if self._turns is not None:
            self._turns.done()
            self._turns_over = not self._turns.wait()
            now = time.perf_counter()
        self._last_end = now

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        record = {"rank": trainer.global_rank, "iterations": self.iterations, **peak_memory()}
        (self.out_dir / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


def peak_memory() -> dict[str, float]:
    """Peak resident memory of this process (and peak CUDA allocation on a GPU), in bytes."""
    out = {"peak_rss_bytes": float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)}
    if torch.cuda.is_available():
        out["peak_cuda_bytes"] = float(torch.cuda.max_memory_allocated())
    return out
