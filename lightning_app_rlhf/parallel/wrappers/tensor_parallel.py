"""``TensorParallelFSDP2Wrapper``: a train call with a tensor-parallel degree, on a 2-D mesh (data x tensor).

The role is cut with its family's Hugging Face ``tp_plan`` over each replica's ``t`` ranks (the tensor dimension),
then sharded with FSDP2 over the ``n / t`` replicas (the data dimension): torchtitan's FSDP + TP layout. Each
replica trains on its share of every minibatch, its ``t`` ranks on the same rows. The cut itself
(:func:`cut_tensor_parallel`) also builds the tensor-parallel copies of :mod:`lightning_app_rlhf.parallel.tensor_parallel`.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from transformers import PreTrainedModel
from typing_extensions import override

from lightning_app_rlhf.models.roles import AdapterDisabledReference, ValueModel, is_lora
from lightning_app_rlhf.parallel.wrappers.fsdp2 import FSDP2Wrapper, shard_with_fsdp2


def hf_model(module: nn.Module, call: str) -> nn.Module:
    """The Hugging Face model inside a role's module that the family's ``tp_plan`` shards.

    Args:
        module: The role's module on this rank (a causal LM, a :class:`ValueModel`, a sequence classifier).
        call: The call, for the error message.
    """
    if isinstance(module, AdapterDisabledReference) or is_lora(module):
        raise ValueError(f"Call {call!r} has a tensor-parallel degree, but its role carries LoRA adapters (or is the "
                         "LoRA actor's base with adapters off), which the family's tp_plan does not cover: remove "
                         f"{call!r} from the plan's `tp`, or train without `lora`.")
    if isinstance(module, ValueModel):
        return module.backbone  # the value head stays whole on every rank (one output column)
    if not isinstance(module, PreTrainedModel):  # only a Hugging Face model carries a tp_plan
        raise ValueError(f"Call {call!r} has a tensor-parallel degree, but its role is a {type(module).__name__}, not "
                         "a Hugging Face model with a tp_plan: remove the call from the plan's `tp`.")
    return module


def family_tp_plan(model: nn.Module, degree: int, call: str) -> dict[str, str]:
    """The model family's ``tp_plan`` for ``model``: module and parameter names (a ``*`` for each layer index) to
    transformers' tensor-parallel styles, what ``apply_tensor_parallelism`` takes.

    Args:
        model: A Hugging Face model.
        degree: The tensor-parallel degree.
        call: The call, for error messages.
    """
    config = model.config
    # The public ``tp_plan`` property: the family's ``base_model_tp_plan`` with each head's own entries (an LM's
    # ``lm_head``), prefixed by where the base model sits in ``model``. It is what transformers' own resolution hands
    # ``apply_tensor_parallelism`` for a dense model cut with only a tensor-parallel degree (an expert-parallel plan
    # would take its modules out of it; we never set one). A family without a plan (GPT-2) gives an empty one.
    plan = dict(model.tp_plan)
    if not plan:
        raise ValueError(f"Call {call!r} has tensor-parallel degree {degree}, but {type(model).__name__} "
                         f"({config.model_type}) has no tp_plan in transformers: use a family that has one (llama, "
                         f"mistral, qwen2, ...), or remove {call!r} from the plan's `tp`.")
    for name in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(config, name, None)
        if heads is not None and heads % degree:
            raise ValueError(f"Call {call!r} has tensor-parallel degree {degree}, which does not divide the model's "
                             f"{name}={heads}: each rank holds whole heads. Use a degree that divides {heads}.")
    # transformers 5.19 names the input embedding in the plan only when the head is tied to it; an untied Llama's
    # would stay whole on every rank, a full vocabulary x hidden matrix per rank that the planner prices at 1/t.
    # Its own ``embedding_rowwise`` style cuts it by vocabulary rows (each rank looks up its rows, one all-reduce).
    embedding = model.get_input_embeddings()
    if isinstance(embedding, nn.Embedding):
        name = next(n for n, m in model.named_modules() if m is embedding)
        plan.setdefault(name, "embedding_rowwise")
    return plan


def cut_tensor_parallel(module: nn.Module, mesh: DeviceMesh, call: str, plan: dict[str, str] | None = None) -> None:
    """Cut the Hugging Face model inside ``module`` (:func:`hf_model`) in place, tensor-parallel over ``mesh``.

    Args:
        module: The role's module on this rank, whole, identical on every rank of ``mesh``.
        mesh: The replica's 1-D device mesh (its size is the tensor-parallel degree).
        call: The call, for error messages.
        plan: The family's ``tp_plan`` already resolved (:func:`family_tp_plan`); default: resolved here.
    """
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    model = hf_model(module, call)
    apply_tensor_parallelism(model, mesh, plan if plan is not None else family_tp_plan(model, mesh.size(), call))


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
        cut_tensor_parallel(self.module, self.mesh["tp"], self.call)
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
