"""``DDPWrapper``: every rank of the group holds the whole role; gradients are all-reduced."""

from __future__ import annotations

import contextlib

from torch import nn
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_app_rlhf.parallel.wrappers.base import RoleWrapper


class DDPWrapper(RoleWrapper):
    """``DistributedDataParallel`` on the role's train group (the module itself on one rank)."""

    name = "ddp"

    @override
    def wrap(self) -> None:
        if self.group_size == 1:
            self._train_module = self.module
            return
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        self._train_module = DistributedDataParallel(self.module, process_group=self.group, device_ids=device_ids)

    @property
    @override
    def train_module(self) -> nn.Module:
        return self._train_module

    @override
    def accumulating(self, last: bool) -> contextlib.AbstractContextManager[None]:
        # All-reduce once per minibatch, after its last micro-batch.
        if last or not isinstance(self._train_module, DistributedDataParallel):
            return contextlib.nullcontext()
        return self._train_module.no_sync()
