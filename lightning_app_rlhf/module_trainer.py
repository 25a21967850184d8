"""What an ``RLHFModule`` asks of the ``Trainer`` it runs under: the settings it refuses or adjusts (checked once, in
``setup``), the callbacks it adds, how one iteration's metrics are logged, and its optimizer steps, of which the
Trainer must count one per iteration.

The Trainer-side twin of :mod:`~lightning_app_rlhf.module_checkpoint`, in the spirit of Lightning's own connectors.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch.callbacks import LearningRateFinder, LearningRateMonitor, RichProgressBar
from lightning.pytorch.utilities.warnings import PossibleUserWarning

from lightning_app_rlhf.callbacks import PlacementSummary, PreemptionCheckpoint, RLHFProgressBar
from lightning_app_rlhf.callbacks.role_lr_monitor import RoleLearningRateMonitor
from lightning_app_rlhf.checkpoint.format import check_checkpoint_file
from lightning_app_rlhf.core.upstream_warnings import ignore_upstream_warnings
from lightning_app_rlhf.strategies.atomic_checkpoint_io import AtomicCheckpointIO

if TYPE_CHECKING:
    from lightning_app_rlhf.engine.engine import RLHFEngine
    from lightning_app_rlhf.module import RLHFModule

EPOCH_METRICS = ("reward/mean", "kl/mean", "response/length_mean")
"""Also logged as ``{name}_epoch``: the mean over the epoch's iterations, for ``ModelCheckpoint`` and
``EarlyStopping`` to judge the epoch rather than its last batch."""
PROGRESS_BAR_METRICS = ("reward/mean", "kl/mean")
EPOCH_SYNC_ADVICE = (r"It is recommended to use `self\.log\('((val|test)/(reward/mean|response/length_mean)|"
                     r"(reward/mean|kl/mean|response/length_mean)_epoch)', \.\.\., sync_dist=True\)`")
"""Lightning's warning about our epoch metrics, which are equal on every rank (silenced in :func:`check_trainer`)."""
LR_FINDER_REFUSAL = (
    "lr_find / LearningRateFinder does not apply to RLHF: its sweep reads the lr off a loss curve, and an RLHF loss is "
    "measured on rollouts the policy itself keeps changing, so its minimum says nothing about the lr. Set the lr in "
    "the optimizers (model.actor_optimizer, model.critic_optimizer) and watch reward/mean and kl/mean. For batch "
    "sizes, Tuner.scale_batch_size scales data.batch_size, and the PlacementTuner callback picks the generation and "
    "micro-batch sizes per placement.")


def check_trainer(trainer: pl.Trainer, stage: str, engine: Callable[[], RLHFEngine]) -> None:
    """Refuse the settings an RLHF run cannot honour, each naming the fix, before any model is built; make the
    Trainer's checkpoint writes atomic and its reads checked; then build the engine (``engine()``: the role
    precisions resolve there, so a contradiction fails before any model is built too), check the batch against the
    plan, and turn validation off when there are no held-out prompts."""
    if any(isinstance(callback, LearningRateFinder) for callback in trainer.callbacks):
        raise ValueError(LR_FINDER_REFUSAL)
    if str(trainer.precision).startswith("16"):
        raise ValueError(f"precision={trainer.precision!r} needs a gradient scaler, which the update does not use. "
                         "Use precision='bf16-mixed' (or 'bf16-true', '32-true').")
    # Our epoch-level metrics are already global and equal on every rank (gathered, then logged everywhere), so
    # Lightning's advice to sync them does not apply (placement strategies leave `is_distributed` unset).
    warnings.filterwarnings("ignore", message=EPOCH_SYNC_ADVICE, category=PossibleUserWarning)
    ignore_upstream_warnings()  # also when the module runs without the CLI
    if type(trainer.strategy.checkpoint_io) is TorchCheckpointIO:
        trainer.strategy.checkpoint_io = AtomicCheckpointIO()
    built = engine()
    if stage != "fit":
        return
    datamodule = trainer.datamodule
    if getattr(datamodule, "batch_size", None) is not None:
        built.check_batch(datamodule.batch_size)
    if getattr(datamodule, "has_val_prompts", True) is False:
        trainer.limit_val_batches = 0  # no held-out prompts: no validation, and no warning about it
    if trainer.ckpt_path is not None and "://" not in str(trainer.ckpt_path):
        check_checkpoint_file(trainer.ckpt_path)  # a bare EOFError would name no file


_HELD_OUT = "the held-out rows (data.val_prompts / data.val_split)"
STAGE_DATASETS = {
    "fit": (("dataset", "the training rows (data.prompts)"), ("val_dataset", _HELD_OUT)),
    "validate": (("val_dataset", _HELD_OUT),),
    "test": (("val_dataset", _HELD_OUT),),
    "predict": (("predict_dataset", "the predict rows (data.predict_prompts)"),),
}
"""Per stage, the datamodule's datasets whose rows the stage scores (``PromptDataModule``'s attributes), each with
how the errors name them."""


def stage_datasets(datamodule: object | None, stage: str) -> list[tuple[str, Any]]:
    """``(description, dataset)`` of each dataset ``stage`` scores that the datamodule has built (its ``setup`` runs
    before the module's); none without a datamodule (bare dataloaders: the reward is checked on the first batch)."""
    built = [(where, getattr(datamodule, name, None)) for name, where in STAGE_DATASETS.get(stage, ())]
    return [(where, dataset) for where, dataset in built if dataset is not None]


def added_callbacks(callbacks: list[pl.Callback], preemption_checkpoint: bool) -> list[pl.Callback]:
    """What ``configure_callbacks`` adds to, or replaces in, the Trainer's ``callbacks``."""
    # Once per trainer: validate and predict after fit would otherwise replace it, with a note saying so.
    added: list[pl.Callback] = [] if any(isinstance(c, PlacementSummary) for c in callbacks) else [PlacementSummary()]
    # Lightning replaces a callback with a subclass of it returned here (and says so): a user's LearningRateMonitor
    # sees only this rank's optimizers, named by class.
    added += [RoleLearningRateMonitor.like(c) for c in callbacks if type(c) is LearningRateMonitor][:1]
    # Lightning's RichProgressBar reads "Epoch 0/-2" under max_steps. It is Lightning's default bar when rich is
    # installed, so it is swapped in place, with its settings: returned here, Lightning would print that it overrides
    # a RichProgressBar "passed to Trainer" that nobody passed.
    for i, callback in enumerate(callbacks):
        if type(callback) is RichProgressBar:
            callbacks[i] = RLHFProgressBar.like(callback)
    # A clean stop on SIGTERM by default; a user's own (e.g. with a dirpath) is kept.
    if preemption_checkpoint and not any(isinstance(c, PreemptionCheckpoint) for c in callbacks):
        added.append(PreemptionCheckpoint())
    return added


def expect_frozen_roles_in_eval_mode(module: pl.LightningModule, frozen: list[torch.nn.Module]) -> None:
    """Silence Lightning's "Found N module(s) in eval mode" warning at the start of training when the modules in
    eval mode are exactly those of the frozen roles (the reference, the reward model, a trained role's shadow), which
    ``configure_model`` puts there on purpose. The filter names that count, so a module of the user's own in eval
    mode still gets the warning.

    Args:
        module: The LightningModule whose modules Lightning counts.
        frozen: The frozen roles' models on this rank.
    """
    in_eval = {id(m) for _, m in module.named_modules() if not m.training}
    frozen_in_eval = {id(m) for model in frozen for m in model.modules() if not m.training}
    if in_eval and in_eval == frozen_in_eval:
        warnings.filterwarnings("ignore", message=rf"Found {len(in_eval)} module\(s\) in eval mode at the start of "
                                r"training", category=PossibleUserWarning)


def log_iteration(module: RLHFModule, values: dict[str, float], samples: int) -> None:
    """Log one iteration's statistics under the Trainer: the reward and KL on the progress bar, and the
    :data:`EPOCH_METRICS` also as epoch means."""
    module.log_dict({k: v for k, v in values.items() if k in PROGRESS_BAR_METRICS}, prog_bar=True,
                    batch_size=samples)
    module.log_dict({k: v for k, v in values.items() if k not in PROGRESS_BAR_METRICS}, batch_size=samples)
    epoch = {f"{k}_epoch": values[k] for k in EPOCH_METRICS if k in values and not math.isnan(values[k])}
    module.log_dict(epoch, on_step=False, on_epoch=True, batch_size=samples)


def optimizer_step(module: RLHFModule, optimizer: torch.optim.Optimizer) -> None:
    """Step through the Trainer's strategy (precision plugin, hooks) but not the ``LightningOptimizer``, which would
    add one to ``global_step`` for every minibatch (see :func:`count_one_global_step`)."""
    module.trainer.strategy.optimizer_step(optimizer, closure=_no_closure, model=module)


def count_one_global_step(trainer: pl.Trainer) -> None:
    """Advance ``global_step`` by exactly one per iteration, however many optimizer steps it took: Lightning counts
    every ``LightningOptimizer.step`` as a global step, so ``max_steps`` and checkpoint names would drift from the
    iteration count with two optimizers and many minibatches."""
    progress = trainer.fit_loop.epoch_loop.manual_optimization.optim_step_progress
    progress.increment_ready()
    progress.increment_completed()


def _no_closure() -> None:
    return None
