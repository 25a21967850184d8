"""Lightning's ``fork`` / ``spawn`` launcher for the placement strategy: the main process gets the trained roles."""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher
from lightning.pytorch.strategies.launchers.multiprocessing import _WorkerOutput
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from lightning_app_rlhf.engine.export import gather_trained_weights, load_trained_weights


class PlacementMultiProcessingLauncher(_MultiProcessingLauncher):
    """Starts the ranks with ``fork`` or ``spawn`` (a notebook, or a script that must not be re-run per rank) and
    hands the trained weights back to the main process.

    Lightning's own launcher sends rank 0's ``state_dict()`` back. Under a placement, rank 0 may hold a shard of a
    role (a DTensor that the main process cannot load), a shadow, or no copy of it at all, and the main process has
    built no model. Here every rank takes part in
    :func:`~lightning_app_rlhf.engine.export.gather_trained_weights` (each trained role, whole, from its
    train group to rank 0), and the main process builds every role and loads them: after ``trainer.fit(model)``,
    ``model.actor`` is the trained actor. The frozen roles are built from their specs, as the ranks built them.
    """

    @override
    def _collect_rank_zero_results(self, trainer: pl.Trainer, results: Any) -> _WorkerOutput | None:
        module = trainer.lightning_module
        fitting = trainer.state.fn == TrainerFn.FITTING
        weights = None
        if fitting:  # collective: every rank
            weights = gather_trained_weights(module.role_module, module.placed_roles, module.algorithm.trainable_roles)
        if self._strategy.global_rank != 0:
            return None
        weights_path = None
        if weights is not None:
            weights_path = os.path.join(tempfile.mkdtemp(), "trained_roles.pt")
            torch.save(weights, weights_path)
        callback = trainer.checkpoint_callback
        best_model_path = getattr(callback, "best_model_path", None) if callback is not None else None
        return _WorkerOutput(best_model_path, weights_path, trainer.state, results, self.get_extra_results(trainer))

    @override
    def _recover_results_in_main_process(self, worker_output: _WorkerOutput, trainer: pl.Trainer) -> None:
        path = worker_output.weights_path
        if path is not None:
            module = trainer.lightning_module
            if all(module.role_module(role) is None for role in module.algorithm.roles):
                module.configure_model()  # the main process built no model
            load_trained_weights(module.role_module, torch.load(path, weights_only=True))
            shutil.rmtree(os.path.dirname(path), ignore_errors=True)
        super()._recover_results_in_main_process(worker_output._replace(weights_path=None), trainer)
