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

from lightning_app_rlhf.parallel.wrappers.base import (
    REALLOCATION_BUCKET_NUMEL,
    RoleWrapper,
    parameter_buckets,
)


class FSDP2Wrapper(RoleWrapper):
    """PyTorch FSDP2 on the role's group: every transformer block (the model's ``_no_split_modules``) and the root
    are sharded in place; a forward all-gathers a block's weights and frees them after."""

    name = "fsdp2"
    shards_grads = True
    shards_optimizer = True
    # A forward's all-gather fills unsharded parameters that FSDP2 keeps and refills for training: made under
    # inference mode, they fail the next training step (measured: tests/test_unshard_generation.py's FSDP2 test).
    forwards_in_inference_mode = False

    @override
    def wrap(self) -> None:
        if self.group_size > 1:
            shard_with_fsdp2(self.module, DeviceMesh.from_group(self.group, device_type=self.device.type))

    @override
    def wrap_frozen(self) -> None:
        self.wrap()

    @override
    def accumulating(self, last: bool) -> contextlib.AbstractContextManager[None]:
        return _gradient_sync(self.module, last)

    @override
    def unsharded(self) -> contextlib.AbstractContextManager[None]:
        if not isinstance(self.module, FSDPModule):  # one rank: never sharded
            return contextlib.nullcontext()
        return keep_unsharded(self.module)

    @override
    def full_parameter_buckets(self, bucket_numel: int = REALLOCATION_BUCKET_NUMEL) -> Iterator[list[torch.Tensor]]:
        params = [p for p in self.module.parameters() if p.requires_grad]
        for bucket in parameter_buckets(params, bucket_numel):
            yield [p.full_tensor() if hasattr(p, "full_tensor") else p for p in params[bucket]]

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


@contextlib.contextmanager
def keep_unsharded(root: FSDPModule) -> Iterator[None]:
    """All-gather every FSDP unit under ``root`` (the root included) once, keep the full parameters through every
    forward inside the block, then reshard and free them. A collective over the mesh on entry only (the forwards
    inside gather nothing; resharding frees locally).

    ``set_reshard_after_forward(False)`` keeps units gathered, but FSDP2 has no public getter to put back what each
    unit had (the blocks reshard after a forward, the root does not, so that training does not gather it twice).
    So this saves each parameter group's post-forward setting, turns it off, and restores exactly that.
    """
    # Settle which unit is the root (and its no-reshard default) before saving: a first forward would do it later.
    root._get_fsdp_state()._lazy_init()
    units = [m for m in root.modules() if isinstance(m, FSDPModule)]
    groups = [g for unit in units for g in unit._get_fsdp_state()._fsdp_param_groups]
    saved = [g.post_forward_mesh_info for g in groups]
    try:
        for group in groups:
            group.post_forward_mesh_info = None  # what set_reshard_after_forward(False) sets
        handles = [unit.unshard(async_op=True) for unit in units]  # one all-gather per unit, all in flight together
        for handle in handles:
            if handle is not None:
                handle.wait()
        yield
    finally:
        for unit in units:
            unit.reshard()  # frees the full parameters; the module's parameters are the local shards again
        for group, info in zip(groups, saved, strict=True):
            group.post_forward_mesh_info = info


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
