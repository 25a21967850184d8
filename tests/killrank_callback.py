"""Test helper: a callback that kills one rank mid-run (loaded by the dead-rank test through the CLI)."""

import os

from lightning.pytorch.callbacks import Callback


class KillRank(Callback):
    """Exit rank ``rank`` abruptly, without cleanup, at the start of global step ``step``."""

    def __init__(self, rank: int = 2, step: int = 1) -> None:
        self.rank, self.step = rank, step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            os._exit(17)
