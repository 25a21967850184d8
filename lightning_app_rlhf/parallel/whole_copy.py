"""A whole copy of a role beside its pipelined train call. Plain PyTorch.

A pipelined train call cuts the role's module on its ranks into one stage per rank
(:class:`~lightning_app_rlhf.parallel.pipeline.PipelinedRole`). The role's other calls on those ranks that do not run
on the same pipelines (``actor.generate``, which stays data x tensor parallel as in ReaLHF, or an unpipelined
``critic.forward``) run on a whole copy taken before the cut, and after every update the trained weights, gathered
from the stages by name, are copied into it (ReaLHF's parameter reallocation, here into a degree-1 layout). It offers
what the engine asks of a tensor-parallel copy (:class:`~lightning_app_rlhf.parallel.tensor_parallel.TensorParallelCopy`):
``call``, ``module``, ``stale``, :meth:`WholeCopy.load`, :meth:`WholeCopy.full_parameters` and
:meth:`WholeCopy.local_bytes`.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(eq=False)
class WholeCopy:
    """One call's whole copy of a role on this rank."""

    call: str
    """The call it runs."""
    module: nn.Module
    """The copy (no gradients)."""
    trainable: list[nn.Parameter]
    """The copy's parameters that mirror the role's trainable ones, in the unpipelined role's ``parameters()`` order
    (what :meth:`load` takes)."""
    stale: bool = True
    """True until :meth:`load` gave it the current trained weights (a resumed run loads its checkpoint into the role
    after the copy was taken)."""

    @classmethod
    def build(cls, call: str, source: nn.Module) -> WholeCopy:
        """Copy ``source`` before anything cuts or wraps it.

        Args:
            call: The call the copy runs.
            source: The role's whole module on this rank.
        """
        names = [name for name, p in source.named_parameters() if p.requires_grad]
        replica = copy.deepcopy(source)  # keeps the source's train/eval mode, as the role's own module would run
        params = dict(replica.named_parameters())
        trainable = [params[name] for name in names]
        replica.requires_grad_(False)  # generation and scoring need no gradients
        return cls(call, replica, trainable)

    @torch.no_grad()
    def load(self, full: Iterable[torch.Tensor]) -> int:
        """Copy the role's whole trainable weights into the copy, bit for bit; returns the bytes written.

        Args:
            full: The role's trainable parameters, whole, in the unpipelined role's ``parameters()`` order (a stream
                of buckets: each is used once, as it comes).
        """
        written, count = 0, 0
        for target, source in zip(self.trainable, full):
            if tuple(target.shape) != tuple(source.shape):
                raise RuntimeError(f"The whole copy of {self.call!r} has a parameter of shape {tuple(target.shape)} "
                                   f"where the role has {tuple(source.shape)}.")
            target.copy_(source.detach())
            written += target.numel() * target.element_size()
            count += 1
        if count != len(self.trainable):
            raise RuntimeError(f"The whole copy of {self.call!r} holds {len(self.trainable)} trainable parameters but "
                               f"the role gave {count}: the copy no longer matches the role.")
        self.stale = False
        return written

    def full_parameters(self) -> list[torch.Tensor]:
        """The copy's trainable parameters (for checks)."""
        return [p.detach() for p in self.trainable]

    def local_bytes(self) -> int:
        """Bytes of the copy's parameters on this rank."""
        return sum(p.numel() * p.element_size() for p in self.module.parameters())
