"""``TensorParallelFSDP2Wrapper``: a train call with a tensor-parallel degree, on a 2-D mesh (data x tensor).

The role is cut with its family's Hugging Face ``tp_plan`` over each replica's ``t`` ranks (the tensor dimension),
then sharded with FSDP2 over the ``n / t`` replicas (the data dimension): torchtitan's FSDP + TP layout. Each
replica trains on its share of every minibatch, its ``t`` ranks on the same rows.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from typing_extensions import override

from lightning_app_rlhf.wrappers.fsdp2 import FSDP2Wrapper, shard_with_fsdp2


class TensorParallelFSDP2Wrapper(FSDP2Wrapper):
    """FSDP2 over the data dimension of a 2-D (data x tensor) mesh, on a module cut tensor-parallel over its tensor
    dimension. The plan names it ``fsdp2`` with a degree in ``PlacementPlan.tp`` for the role's train call.

    Args:
        module: The role's module on this rank, whole (cut here).
        group: The train call's group (every rank of both dimensions).
        group_size: Ranks in that group.
        group_rank: This rank's index in it.
        device: This rank's device.
        tp_group: The ranks of this rank's tensor-parallel replica.
        dp_group: The ranks that hold the same tensor slice in every replica (this rank's data dimension).
        mesh_ranks: The train call's ranks as a ``[replicas, degree]`` grid (replica ``i``: row ``i``).
        call: The train call, for error messages.
    """

    def __init__(
        self, module: nn.Module, group: dist.ProcessGroup | None, group_size: int, group_rank: int,
        device: torch.device, *, tp_group: dist.ProcessGroup, dp_group: dist.ProcessGroup,
        mesh_ranks: torch.Tensor, call: str,
    ) -> None:
        super().__init__(module, group, group_size, group_rank, device)
        self.mesh = DeviceMesh.from_group([dp_group, tp_group], device.type, mesh=mesh_ranks,
                                          mesh_dim_names=("dp", "tp"))
        self.call = call

    @property
    def degree(self) -> int:
        """Ranks per tensor-parallel replica."""
        return self.mesh["tp"].size()

    @override
    def wrap(self) -> None:
        from transformers.distributed.tensor_parallel import apply_tensor_parallelism

        from lightning_app_rlhf.tensor_parallel import family_tp_plan, hf_model

        model = hf_model(self.module, self.call)
        apply_tensor_parallelism(model, self.mesh["tp"], family_tp_plan(model, self.degree, self.call))
        if self.mesh["dp"].size() > 1:
            shard_with_fsdp2(self.module, self.mesh["dp"])

    @override
    def wrap_frozen(self) -> None:
        raise ValueError(f"{self.call!r}: a tensor-parallel degree on a train call needs a trainable role.")

    @override
    def clip_gradients(self) -> float:
        """The global norm over parameters on different meshes (the tensor-parallel ones on the 2-D mesh, the
        replicated ones, e.g. norms, on the data dimension only): one norm per mesh, combined; clipped by a plain
        scale, which DTensor gradients of any mesh take."""
        grads: dict[object, list[torch.Tensor]] = {}
        for p in self.module.parameters():
            if p.grad is not None:
                key = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
                grads.setdefault(key, []).append(p.grad)
        squares = 0.0
        for group in grads.values():
            norm = torch.nn.utils.get_total_norm(group, 2.0)
            norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
            squares += float(norm) ** 2
        total = math.sqrt(squares)
        limit = self.max_grad_norm if self.max_grad_norm is not None else math.inf
        if math.isfinite(total) and total > limit:
            scale = limit / (total + 1e-6)  # torch's clip_grad_norm_ coefficient
            for group in grads.values():
                for grad in group:
                    grad.mul_(scale)
        return total
