"""Tensor parallelism per call, and reallocation of a role's weights into a call's tensor-parallel layout.

A call with tensor-parallel degree ``t`` (``PlacementPlan.tp``) on ``n`` ranks runs as ``n / t`` data-parallel
replicas; each replica's ``t`` ranks hold one DTensor tensor-parallel copy of the role, built with the model family's
own Hugging Face ``tp_plan`` (``transformers.distributed.tensor_parallel.apply_tensor_parallelism``), and compute the
same rows together. For generation and the scoring forwards the copy is a separate module: the role's own module
keeps its training layout (DDP, FSDP2, a 2-D data x tensor mesh, a shadow), and after every update its trained
weights are redistributed into the copy (ReaLHF's parameter reallocation), bit for bit. A train call with a degree
cuts the role itself (:class:`~lightning_app_rlhf.parallel.wrappers.tensor_parallel.TensorParallelFSDP2Wrapper`). Plain
PyTorch + transformers, no Lightning.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor

from lightning_app_rlhf.core.role_table import TRAINABLE_ROLES, role_of
from lightning_app_rlhf.parallel.plan import PlacementPlan
from lightning_app_rlhf.parallel.wrappers.tensor_parallel import cut_tensor_parallel, family_tp_plan, hf_model

INFERENCE_CALLS = ("actor.generate", "reference.forward", "reward.forward", "critic.forward")
"""Generation and the scoring forwards: with a degree they run on a tensor-parallel copy of the role."""


def check_node_boundaries(plan: PlacementPlan, ranks_per_node: int) -> None:
    """Raise a ``ValueError`` naming the fix when a tensor-parallel replica spans nodes: its every layer's
    all-reduce would cross the slow link between them (the planner never proposes such a plan). Nodes hold
    consecutive ranks, ``ranks_per_node`` each, as torchrun and SLURM number them.

    Args:
        plan: The placement plan, already validated.
        ranks_per_node: Processes per node (``trainer.devices``).
    """
    for call, degree in plan.tp.items():
        ranks = plan.ranks(call)
        for start in range(0, len(ranks), degree):
            replica = ranks[start : start + degree]
            nodes = sorted({rank // ranks_per_node for rank in replica})
            if len(nodes) > 1:
                raise ValueError(
                    f"Call {call!r}: the tensor-parallel replica on ranks {list(replica)} spans nodes {nodes} "
                    f"({ranks_per_node} ranks per node). Keep each replica inside a node: a degree that divides "
                    f"{ranks_per_node}, on ranks that start at a multiple of it (or plan with --cluster NODESx"
                    f"{ranks_per_node}xDEVICE, which does).")


def check_tensor_parallel(plan: PlacementPlan) -> None:
    """Raise a ``ValueError`` naming the fix for a ``tp`` degree the engine cannot run yet.

    Args:
        plan: The placement plan, already validated (every degree divides its call's group size).
    """
    for call, degree in plan.tp.items():
        if call in INFERENCE_CALLS:
            continue
        role = role_of(call)
        wrapper = plan.wrappers.get(role)
        if wrapper != "fsdp2":
            raise ValueError(
                f"Call {call!r} has tensor-parallel degree {degree} with wrapper {wrapper!r}: tensor-parallel training "
                f"runs FSDP2 over the replicas (a data x tensor mesh). Set wrappers: {{{role}: fsdp2}}, or remove "
                f"{call!r} from the plan's `tp` (generation and the scoring forwards take a degree of their own).")
        train = set(plan.ranks(call))
        for other in plan.calls:
            if role_of(other) == role and other != call and set(plan.ranks(other)) & train \
                    and plan.tp_degree(other) == 1:
                raise ValueError(
                    f"{call!r} trains tensor-parallel (degree {degree}), so the role's module on ranks "
                    f"{sorted(train)} is laid out for training; {other!r} runs there without a degree. Give "
                    f"{other!r} a tensor-parallel degree too (its own copy, refreshed after every update), or run "
                    "it on other ranks.")


@dataclass(eq=False)
class TensorParallelCopy:
    """One call's tensor-parallel copy of a role on this rank: a DTensor module over the replica's ranks."""

    call: str
    """The call it runs."""
    module: nn.Module
    """The copy, its sharded parameters DTensors on :attr:`mesh`."""
    mesh: DeviceMesh
    """The replica's 1-D device mesh."""
    trainable: list[nn.Parameter]
    """The copy's parameters that mirror the role's trainable ones, in the role's ``parameters()`` order (what
    :meth:`load` takes); frozen ones never change, so they never move."""
    stale: bool
    """True until :meth:`load` gave it the current trained weights (a trainable role starts stale: a resumed run
    loads its checkpoint into the role after the copy was built)."""

    @classmethod
    def build(cls, call: str, source: nn.Module, group: dist.ProcessGroup, degree: int,
              device: torch.device) -> TensorParallelCopy:
        """Copy ``source`` (whole on this rank, identical on every rank of the replica) and shard the copy with its
        family's ``tp_plan`` over ``group``. Each rank keeps its slice of its own copy: nothing is sent.

        Args:
            call: The call the copy runs.
            source: The role's module, not yet wrapped (sharding it first would leave no whole copy).
            group: The replica's ranks.
            degree: The tensor-parallel degree (the group's size).
            device: This rank's device.
        """
        plan = family_tp_plan(hf_model(source, call), degree, call)  # before copying: a bad degree fails here
        trainable_names = [name for name, p in source.named_parameters() if p.requires_grad]
        replica = copy.deepcopy(source)
        mesh = DeviceMesh.from_group(group, device_type=device.type)
        cut_tensor_parallel(replica, mesh, call, plan)
        params = dict(replica.named_parameters())
        trainable = [params[name] for name in trainable_names]
        replica.requires_grad_(False)  # generation and scoring need no gradients
        stale = role_of(call) in TRAINABLE_ROLES
        return cls(call, replica, mesh, trainable, stale)

    @torch.no_grad()
    def load(self, full: Iterable[torch.Tensor]) -> int:
        """Copy the role's full trainable weights into this rank's slices, bit for bit; return the bytes written.

        Args:
            full: The role's trainable parameters, whole, in its ``parameters()`` order; each is used once, as it
                comes (a stream of buckets keeps only one whole bucket alive).
        """
        written, count = 0, 0
        for target, source in zip(self.trainable, full):
            if tuple(target.shape) != tuple(source.shape):
                raise RuntimeError(f"The tensor-parallel copy of {self.call!r} has a parameter of shape "
                                   f"{tuple(target.shape)} where the role has {tuple(source.shape)}.")
            local = local_slice(source.detach(), target)
            destination = target.to_local() if isinstance(target, DTensor) else target
            destination.copy_(local)
            written += destination.numel() * destination.element_size()
            count += 1
        if count != len(self.trainable):
            raise RuntimeError(f"The tensor-parallel copy of {self.call!r} holds {len(self.trainable)} trainable "
                               f"parameters but the role gave {count}: the copy no longer matches the role.")
        self.stale = False
        return written

    def full_parameters(self) -> list[torch.Tensor]:
        """The copy's trainable parameters, whole (an all-gather over the replica): for checks, not the hot path."""
        return [p.full_tensor() if isinstance(p, DTensor) else p.detach() for p in self.trainable]

    def local_bytes(self) -> int:
        """Bytes of the copy's parameters that this rank keeps."""
        return sum(_local(p).numel() * p.element_size() for p in self.module.parameters())


def local_slice(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This rank's slice of ``full`` in the layout of ``like`` (a DTensor: its mesh and placements, cut locally with no
    communication, exactly as DTensor cuts uneven shards); ``full`` itself for a plain tensor."""
    if not isinstance(like, DTensor):
        return full
    return distribute_tensor(full.to(like.device), like.device_mesh, like.placements, src_data_rank=None).to_local()


def received_bytes(params: Iterable[torch.Tensor]) -> int:
    """Bytes this rank receives to hold ``params`` whole: each sharded parameter's full size minus its local shard
    (a DTensor of FSDP2 or of a data x tensor mesh; a ZeRO-3 partition); 0 for tensors already whole here."""
    total = 0
    for p in params:
        if isinstance(p, DTensor):
            total += (p.numel() - p.to_local().numel()) * p.element_size()
        elif hasattr(p, "ds_tensor"):  # DeepSpeed ZeRO-3: ds_numel elements in all, ds_tensor kept here
            total += (p.ds_numel - p.ds_tensor.numel()) * p.element_size()
    return total


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if isinstance(p, DTensor) else p
