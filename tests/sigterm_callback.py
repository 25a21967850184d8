"""Test helper: a callback that sends SIGTERM to its own process mid-run (loaded by tests/test_preemption.py
through the CLI), as a scheduler preempting the job would."""

import os
import signal

from lightning.pytorch.callbacks import Callback


class SendSigterm(Callback):
    """Send SIGTERM to this process at the start of global step ``step``: on rank 0 only (the launcher, which
    must forward it) or, with ``every_rank``, on every rank (as SLURM and Kubernetes signal every process)."""

    def __init__(self, step: int = 2, every_rank: bool = False) -> None:
        self.step, self.every_rank = step, every_rank

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step and (self.every_rank or trainer.global_rank == 0):
            os.kill(os.getpid(), signal.SIGTERM)
