"""``FSDP2Wrapper``: ``fully_shard`` over the group; each rank keeps one dim-0 shard of every parameter."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from typing_extensions import override

from lightning_app_rlhf.wrappers.base import RoleWrapper


class FSDP2Wrapper(RoleWrapper):
    """PyTorch FSDP2 on the role's group: every transformer block (the model's ``_no_split_modules``) and the root
    are sharded in place; a forward all-gathers a block's weights and frees them after."""

    name = "fsdp2"
    shards_params = True
    shards_grads = True
    shards_optimizer = True
    wraps_frozen = True

    @override
    def wrap(self) -> None:
        if self.group_size > 1:
            shard_with_fsdp2(self.module, DeviceMesh.from_group(self.group, device_type=self.device.type))

    @override
    def wrap_frozen(self) -> None:
        self.wrap()

    @property
    @override
    def train_module(self) -> nn.Module:
        return self.module

    @override
    def accumulating(self, last: bool) -> contextlib.AbstractContextManager[None]:
        return _gradient_sync(self.module, last)

    @override
    @contextlib.contextmanager
    def full_parameters(self) -> Iterator[list[torch.Tensor]]:
        params = [p for p in self.module.parameters() if p.requires_grad]
        yield [p.full_tensor() if hasattr(p, "full_tensor") else p for p in params]

    @classmethod
    @override
    def local_numel(cls, shape: tuple[int, ...], group_size: int, group_rank: int) -> int:
        # torch.chunk along dim 0: ceil(rows / n) rows per rank, the last ranks get fewer (or none).
        rows = shape[0] if shape else 1
        chunk = -(-rows // group_size)
        mine = max(0, min(chunk, rows - chunk * group_rank))
        return mine * math.prod(shape[1:])


@contextlib.contextmanager
def _gradient_sync(module: nn.Module, sync: bool) -> Iterator[None]:
    """Skip the reduce-scatter of gradients for all but the last micro-batch of a minibatch."""
    if not isinstance(module, FSDPModule) or sync:
        yield
        return
    module.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        module.set_requires_gradient_sync(True)


def shard_with_fsdp2(module: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """``fully_shard`` each transformer block (the model's ``_no_split_modules`` classes), then the root."""
    block_names: set[str] = set()
    for sub in module.modules():
        block_names.update(getattr(sub, "_no_split_modules", None) or [])
    for sub in module.modules():
        if type(sub).__name__ in block_names:
            fully_shard(sub, mesh=mesh)
    fully_shard(module, mesh=mesh)
    return module
