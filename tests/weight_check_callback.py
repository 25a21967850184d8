"""Test helper: after every iteration, check that every copy of actor and critic holds the same bytes."""

import hashlib
import json

import torch.distributed as dist
from lightning.pytorch.callbacks import Callback


def _digest(module) -> str:
    sha = hashlib.sha256()
    for p in module.parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p  # FSDP2 shard -> whole tensor (collective)
        sha.update(full.detach().cpu().contiguous().numpy().tobytes())
    return sha.hexdigest()


class WeightCopiesEqual(Callback):
    """Gathers a SHA-256 of each role's parameters from every rank that holds it; rank 0 writes them to ``path``."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.records = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        mine = {role: _digest(getattr(pl_module, role)) for role in ("actor", "critic")
                if getattr(pl_module, role) is not None}
        everyone = [None] * trainer.world_size
        dist.all_gather_object(everyone, mine)
        self.records.append(everyone)

    def on_fit_end(self, trainer, pl_module) -> None:
        if trainer.is_global_zero:
            with open(self.path, "w") as f:
                json.dump(self.records, f)
