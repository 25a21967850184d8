"""Test helper: a callback that prints the world this process joined (loaded by tests/test_multinode.py through the
CLI), as Lightning and torch.distributed each see it."""

from __future__ import annotations

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from typing_extensions import override


class PrintWorld(Callback):
    """At setup (the process group exists), print one line on every rank: ``WORLD global_rank=... world_size=...
    node_rank=... local_rank=... dist_rank=... dist_world_size=... environment=<cluster environment class>``."""

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        environment = type(trainer.strategy.cluster_environment).__name__
        print(f"WORLD global_rank={trainer.global_rank} world_size={trainer.world_size} node_rank={trainer.node_rank} "
              f"local_rank={trainer.local_rank} dist_rank={dist.get_rank()} dist_world_size={dist.get_world_size()} "
              f"environment={environment}", flush=True)
