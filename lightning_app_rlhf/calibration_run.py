"""A few iterations of a training config on this machine's processes, phase by phase: ``plan`` measures them before it
searches, so that the cost model prices the engine's own work (its Python and small tensor ops, and what the processes
lose to each other) beside the calls it profiles (:func:`~lightning_app_rlhf.planner.cost_model.calibrate_engine`).
Lightning glue."""

from __future__ import annotations

import contextlib
import copy
import io
import json
import statistics
import tempfile
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist
from typing_extensions import override

from lightning_app_rlhf.parallel.plan import PlacementPlan

PHASES = ("generate", "score", "train")
"""The phases of an iteration the engine logs as ``time/{phase}_s`` (rank 0) that the calibration reads."""


class PhaseTimes(pl.Callback):
    """Rank 0 appends each iteration's ``time/{phase}_s`` to a JSON-lines file (the ranks are forked processes: the
    file is how the figures reach the caller)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.is_global_zero:
            metrics = trainer.callback_metrics
            times = {p: float(metrics[f"time/{p}_s"]) for p in PHASES if f"time/{p}_s" in metrics}
            with self.path.open("a") as file:
                file.write(json.dumps(times) + "\n")


def measure_phases(module: pl.LightningModule, datamodule: pl.LightningDataModule, plan: PlacementPlan,
                   iterations: int = 12, skip: int = 4) -> dict[str, float]:
    """Median seconds of each phase on rank 0 over ``iterations - skip`` iterations of a copy of ``module`` trained
    under ``plan`` on ``plan.world_size`` forked CPU processes of this machine, nothing saved, logged or printed.

    Args:
        module: The configured RLHF module (copied: the caller's stays untrained).
        datamodule: Its prompts.
        plan: The placement the processes run (the calibration's reference: Flattening with DDP).
        iterations: Iterations run.
        skip: First iterations left out (warm-up: allocations, first compilations).

    Raises:
        RuntimeError: The iterations logged no phase times, naming what ran.
    """
    from lightning_app_rlhf.strategies import PlacementStrategy

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "phases.jsonl"
        trainer = pl.Trainer(
            accelerator="cpu", devices=plan.world_size, strategy=PlacementStrategy(plan=plan, start_method="fork"),
            max_steps=iterations, logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0, callbacks=[PhaseTimes(path)],
            default_root_dir=tmp,
        )
        if dist.is_initialized():  # a group of this process's own would be inherited by the forked ranks
            dist.destroy_process_group()
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            trainer.fit(copy.deepcopy(module), datamodule=datamodule)
        logged = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    measured = logged[skip:]
    if not measured or any(p not in measured[0] for p in PHASES):
        raise RuntimeError(f"The calibration run of {plan.name} on {plan.world_size} process(es) logged no phase times "
                           f"in {len(logged)} iteration(s) (got {sorted(logged[-1]) if logged else []}).")
    return {p: statistics.median(it[p] for it in measured) for p in PHASES}
