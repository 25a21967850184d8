"""``default_callbacks``: what a command-line run has besides the module's own callbacks, for a Trainer built in
Python: the iteration progress bar, the run summary and the prediction writer."""

from __future__ import annotations

import os

import lightning.pytorch as pl
from lightning.pytorch.callbacks import BasePredictionWriter

from lightning_app_rlhf.callbacks.prediction_writer import PredictionWriter
from lightning_app_rlhf.callbacks.progress_bar import RLHFProgressBar
from lightning_app_rlhf.callbacks.run_summary import RLHFRunSummary

Predictions = bool | str | os.PathLike[str] | None
"""Where ``predict`` writes its completions: True (or None) for ``predictions.jsonl`` in the run's log directory, a
file path, or False for no file (the CLI's ``--predictions``)."""


def default_callbacks(predictions: Predictions = True, summary_window: int = 10) -> list[pl.Callback]:
    """The callbacks a command-line run has, for ``Trainer(callbacks=default_callbacks())``: an
    :class:`RLHFProgressBar` (``Iteration N/max_steps``), an :class:`RLHFRunSummary` (reward and KL at the start and
    the end of ``fit``, printed when it ends) and, unless ``predictions`` is False, a :class:`PredictionWriter`
    (``predict``'s completions as JSONL). Each acts in its own stage only, so one Trainer may ``fit`` and then
    ``predict`` with them. Add your own next to them: ``callbacks=[*default_callbacks(), MyCallback()]``.

    Args:
        predictions: Where ``predict`` writes: True (or None) for ``predictions.jsonl`` in the run's log directory,
            a file path, or False for no writer.
        summary_window: The run summary's ``window``: iterations averaged at each end.
    """
    callbacks: list[pl.Callback] = [RLHFProgressBar(), RLHFRunSummary(window=summary_window)]
    return callbacks + _writer(predictions)


def missing_default_callbacks(callbacks: list[pl.Callback], stage: str, predictions: Predictions = True
                              ) -> list[pl.Callback]:
    """The callbacks of :func:`default_callbacks` that ``stage`` uses and ``callbacks`` (a Trainer's) lacks, by
    kind: for ``fit`` an :class:`RLHFRunSummary`, for ``predict`` a prediction writer (any
    ``BasePredictionWriter`` counts). The progress bar is never added here: the Trainer has one unless
    ``enable_progress_bar=False``, and :class:`~lightning_app_rlhf.RLHFModule` turns Lightning's default one into
    an :class:`RLHFProgressBar`.

    Args:
        callbacks: The Trainer's callbacks (``trainer.callbacks``).
        stage: ``fit``, ``validate``, ``test`` or ``predict``.
        predictions: As in :func:`default_callbacks`.
    """
    if stage == "fit" and not any(isinstance(c, RLHFRunSummary) for c in callbacks):
        return [RLHFRunSummary()]
    if stage == "predict" and not any(isinstance(c, BasePredictionWriter) for c in callbacks):
        return _writer(predictions)
    return []


def _writer(predictions: Predictions) -> list[pl.Callback]:
    if predictions is False:
        return []
    return [PredictionWriter(None if predictions is True or predictions is None else predictions)]


__all__ = ["default_callbacks", "missing_default_callbacks"]
