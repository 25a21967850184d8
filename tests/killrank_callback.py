"""Test helper: a callback that kills one rank mid-run (loaded by the dead-rank test through the CLI)."""

import os

from lightning.pytorch.callbacks import Callback


class KillRank(Callback):
    """Exit rank ``rank`` abruptly, without cleanup, at the start of global step ``step``; with ``attempt``, only in
    that attempt of an elastic job (``TORCHELASTIC_RESTART_COUNT``: 0 for the first, 1 after a restart, ...)."""

    def __init__(self, rank: int = 2, step: int = 1, attempt: int | None = None) -> None:
        self.rank, self.step, self.attempt = rank, step, attempt

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        this_attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        if self.attempt is not None and this_attempt != self.attempt:
            return
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            os._exit(17)
