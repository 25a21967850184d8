"""``PredictionWriter``: ``predict``'s completions, one JSON line per prompt (prompt, completion, reward), written by
global rank 0. The CLI's ``predict`` adds one by default (``--predictions``)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, TextIO

import lightning.pytorch as pl
from lightning.pytorch.callbacks import BasePredictionWriter
from typing_extensions import override

DEFAULT_FILE_NAME = "predictions.jsonl"
"""The file's name in the run's log directory when no ``path`` is given."""
ROW_KEYS = ("index", "prompt", "completion", "reward")
"""The keys of each written line, in order (``completion_ids`` too with ``token_ids=True``)."""


class PredictionWriter(BasePredictionWriter):
    """Writes the rows ``RLHFModule.predict_step`` returns as JSONL, one line per prompt, in the order of the predict
    prompts: ``{"index": 0, "prompt": "...", "completion": "...", "reward": 0.5}`` (``index``: the prompt's position
    in ``data.predict_prompts``, else the held-out or training prompts). Each batch's lines are written and flushed
    as it finishes, so an interrupted run keeps the batches done; the file is replaced at the start of every
    ``predict``. At the end rank 0 prints where the lines went.

    Under a placement strategy every rank's ``predict_step`` returns the whole batch's rows (gathered from the call
    groups that generated them), so global rank 0 alone writes them, once.

    Args:
        path: The JSONL file. Default: ``predictions.jsonl`` in the run's log directory (``trainer.log_dir``, where
            the CLI saves the run's ``config.yaml``), else in ``trainer.default_root_dir``.
        token_ids: Also write each completion's token ids (``completion_ids``, up to and including the stop token).
    """

    def __init__(self, path: str | os.PathLike[str] | None = None, token_ids: bool = False) -> None:
        super().__init__(write_interval="batch")
        self.path = Path(path) if path is not None else None
        self.token_ids = token_ids
        self.written_path: Path | None = None
        """The file of the latest ``predict`` (set on every rank; only rank 0 writes it)."""
        self.rows_written = 0
        """Lines written by the latest ``predict`` (on rank 0)."""
        self._file: TextIO | None = None

    def output_path(self, trainer: pl.Trainer) -> Path:
        """Where this ``predict`` writes: ``path``, else :data:`DEFAULT_FILE_NAME` in the run's log directory. Call
        it on every rank: ``trainer.log_dir`` is a broadcast from rank 0."""
        if self.path is not None:
            return self.path
        return Path(trainer.log_dir or trainer.default_root_dir) / DEFAULT_FILE_NAME

    @override
    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.written_path = self.output_path(trainer)
        self.rows_written = 0
        if not trainer.is_global_zero:
            return
        try:
            self.written_path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.written_path.open("w", encoding="utf-8")
        except OSError as err:
            raise OSError(f"PredictionWriter cannot write {self.written_path}: {err}. Pass a writable file: "
                          "--predictions PATH.jsonl (or PredictionWriter(path=...)), or --predictions false to "
                          "write none.") from err

    @override
    def write_on_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, prediction: Any,
                           batch_indices: Any, batch: Any, batch_idx: int, dataloader_idx: int) -> None:
        if self._file is None:
            return  # not global rank 0
        if not isinstance(prediction, list) or not all(isinstance(row, dict) for row in prediction):
            raise TypeError(f"PredictionWriter writes the rows of RLHFModule.predict_step (a list of dicts); "
                            f"{type(pl_module).__name__}.predict_step returned {type(prediction).__name__}.")
        keys = (*ROW_KEYS, "completion_ids") if self.token_ids else ROW_KEYS
        for row in prediction:
            self._file.write(json.dumps({key: row[key] for key in keys if key in row}, ensure_ascii=False) + "\n")
        self._file.flush()
        self.rows_written += len(prediction)

    @override
    def on_predict_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._file is None:
            return
        self._close()
        print(f"predict: wrote {self.rows_written} completions (prompt, completion, reward; one JSON line each) to "
              f"{self.written_path.resolve()}")

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._close()  # the batches written so far stay in the file

    def _close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
