"""Test helper: after every iteration, check that every copy of actor and critic holds the same bytes."""

import hashlib
import json

import torch.distributed as dist
from lightning.pytorch.callbacks import Callback


def _digest(params) -> str:
    sha = hashlib.sha256()
    for p in params:
        sha.update(p.detach().cpu().contiguous().numpy().tobytes())
    return sha.hexdigest()


def _role_digest(pl_module, role: str) -> str:
    """The trained parameters of ``role``: gathered through its wrapper where this rank trains it (FSDP2 and ZeRO-3
    shards -> whole tensors, a collective over the train group), the shadow's own elsewhere."""
    wrapper = pl_module.placed_roles.wrappers.get(role)
    if wrapper is None:
        return _digest(p for p in getattr(pl_module, role).parameters() if p.requires_grad)
    return _digest(p for bucket in wrapper.full_parameter_buckets() for p in bucket)


class WeightCopiesEqual(Callback):
    """Gathers a SHA-256 of each role's parameters from every rank that holds it; rank 0 writes them to ``path``."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.records = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        mine = {role: _role_digest(pl_module, role) for role in ("actor", "critic")
                if getattr(pl_module, role) is not None}
        everyone = [None] * trainer.world_size
        dist.all_gather_object(everyone, mine)
        self.records.append(everyone)

    def on_fit_end(self, trainer, pl_module) -> None:
        if trainer.is_global_zero:
            with open(self.path, "w") as f:
                json.dump(self.records, f)
