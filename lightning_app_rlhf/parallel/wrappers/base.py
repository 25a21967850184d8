"""``RoleWrapper``: how one role runs on its process group. Plain PyTorch, no Lightning."""

from __future__ import annotations

import contextlib
import math
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.distributed as dist
from torch import nn

from lightning_app_rlhf.core.wrapper_names import WRAPPER_TRAITS
from lightning_app_rlhf.parallel.wrappers.sharded_io import load_dcp, save_dcp

Backward = Callable[[torch.Tensor], None]
OptimizerStep = Callable[[torch.optim.Optimizer], None]

REALLOCATION_BUCKET_NUMEL = 25 << 20
"""Elements per bucket when a role's full weights stream out of its wrapper (100 MiB of float32): a sharded role is
never whole on a rank to reallocate it, only one bucket of it (or one larger parameter)."""

OPTIMIZER_SLOTS = {torch.optim.Adam: 2, torch.optim.AdamW: 2, torch.optim.SGD: 1, torch.optim.RMSprop: 1}
"""State tensors per parameter element kept by common optimizers (SGD counts its momentum buffer)."""


@dataclass(frozen=True)
class StepResult:
    """What :meth:`RoleWrapper.step` did."""

    grad_norm: float
    """The gradients' global norm before clipping, the same on every rank of the group; NaN when the step was
    skipped before measuring it."""
    stepped: bool
    """Whether the optimizer stepped. False: the gradients were zeroed, the weights and optimizer state untouched."""


@dataclass
class SkippedUpdates:
    """The engine's record of a role's updates skipped in a row on this rank (non-finite loss or gradient norm).

    It lives on the wrapper, which lasts the whole run (the engine is rebuilt every iteration); it is not
    checkpointed, so a resumed run counts from 0.
    """

    in_a_row: int = 0
    """Skipped updates since the last one that stepped, across minibatches and iterations."""
    last_finite: dict[str, float] = field(default_factory=dict)
    """The last finite value of each loss term and of the gradient norm, for the error."""
    last_step: str | None = None
    """Where the last update that stepped was (iteration, epoch, minibatch)."""
    diverged: str | None = None
    """The divergence error's message, once the role must stop."""


class RoleWrapper(ABC):
    """One role on the ranks of one call: wrapping, the module each call runs, backward, clipping, the optimizer
    step, full parameters on demand, memory accounting and checkpoint state.

    A trainable role is wrapped on its train group; a frozen role (reference, reward model) on its forward group,
    when the plan gives it a wrapper. The class attributes describe what each rank keeps, for the plan's
    validation, the planner's memory and cost model, and its search space.

    Args:
        module: The role's module on this rank.
        group: The process group of the call (None when it has one rank).
        group_size: Ranks in that group.
        group_rank: This rank's index in the group.
        device: This rank's device.
    """

    name: ClassVar[str]
    """The plan's name for the wrapper (``PlacementPlan.wrappers`` values). A class that sets it takes
    :attr:`shards_params`, :attr:`wraps_frozen`, :attr:`package` and :attr:`extra` from that name's row of
    :data:`~lightning_app_rlhf.core.wrapper_names.WRAPPER_TRAITS`."""
    shards_params: ClassVar[bool] = False
    """No rank holds the full parameters: a forward gathers them, collectively over the group."""
    shards_grads: ClassVar[bool] = False
    """Each rank keeps only its part of the gradients."""
    shards_optimizer: ClassVar[bool] = False
    """Each rank keeps only its part of the optimizer state."""
    wraps_frozen: ClassVar[bool] = False
    """Can shard a frozen role over its forward group."""
    lockstep_when_unsharded: ClassVar[bool] = False
    """Inside :meth:`unsharded`, a forward may still run a collective over the group, so its ranks must still run
    the same number of forwards (generation in lockstep)."""
    forwards_in_inference_mode: ClassVar[bool] = True
    """Its module's gradient-free calls (generate, the scoring forwards) may run under ``torch.inference_mode``: no
    forward leaves a tensor behind that training later writes in place. False where a forward gathers parameters
    into buffers kept for the next one (FSDP2, DeepSpeed): those calls run under ``torch.no_grad``."""
    package: ClassVar[str | None] = None
    """The package it needs beyond torch; absent, the planner does not search it and a plan asking for it fails."""
    extra: ClassVar[str | None] = None
    """This project's pip extra that installs :attr:`package`."""
    checkpoint_format: ClassVar[str] = "dcp"
    """What :meth:`save_sharded` writes: ``dcp`` (``torch.distributed.checkpoint``, loadable under any sharding
    and number of ranks) or ``deepspeed`` (DeepSpeed's own files, loadable on as many ranks as saved them)."""

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if "name" in vars(cls):  # the plan's table holds what it must know without importing a wrapper
            traits = WRAPPER_TRAITS[cls.name]
            cls.shards_params, cls.wraps_frozen = traits.shards_params, traits.wraps_frozen
            cls.package, cls.extra = traits.package, traits.extra

    def __init__(
        self, module: nn.Module, group: dist.ProcessGroup | None, group_size: int, group_rank: int,
        device: torch.device,
    ) -> None:
        self.module = module
        self.group = group
        self.group_size = group_size
        self.group_rank = group_rank
        self.device = device
        self.optimizer: torch.optim.Optimizer | None = None
        self.max_grad_norm: float | None = None
        self._backward: Backward = _plain_backward
        self._optimizer_step: OptimizerStep = _plain_step
        self.skipped = SkippedUpdates()

    # ---- set-up ----

    @abstractmethod
    def wrap(self) -> None:
        """Wrap (or shard) the module for training, before its optimizer exists."""

    def wrap_frozen(self) -> None:
        """Shard a frozen role over its forward group."""
        raise ValueError(f"Wrapper {self.name!r} cannot wrap a frozen role.")

    def attach_optimizer(
        self, optimizer: torch.optim.Optimizer, max_grad_norm: float | None, backward: Backward | None = None,
        optimizer_step: OptimizerStep | None = None,
    ) -> None:
        """Take the role's optimizer (built over :attr:`module`'s parameters after :meth:`wrap`).

        Args:
            optimizer: The role's optimizer.
            max_grad_norm: Clip the gradients' global norm to this before each step (None: no clipping; the norm is
                still measured, for the guard against non-finite updates).
            backward: Runs ``loss.backward()`` (Lightning passes ``manual_backward``, for its precision plugin
                and hooks). Wrappers that own backward ignore it.
            optimizer_step: Steps the optimizer (Lightning passes its strategy's, for the same reasons).
        """
        self.optimizer = optimizer
        self.max_grad_norm = max_grad_norm
        self._backward = backward or _plain_backward
        self._optimizer_step = optimizer_step or _plain_step

    # ---- the calls ----

    @property
    def train_module(self) -> nn.Module:
        """The module the train call runs forward and backward through: the role's own, unless the wrapper wraps it
        in another (DDP, a DeepSpeed engine)."""
        return self.module

    def running(self) -> contextlib.AbstractContextManager[None]:
        """Enter around any call of the role on this rank (forward, generate, backward, step, gathers)."""
        return contextlib.nullcontext()

    def accumulating(self, last: bool) -> contextlib.AbstractContextManager[None]:
        """Enter around the forward and backward of one micro-batch; ``last`` for the last of a minibatch, after
        which the gradients are complete (earlier ones may skip their gradient synchronisation)."""
        return contextlib.nullcontext()

    def unsharded(self) -> contextlib.AbstractContextManager[None]:
        """Enter around a whole rollout's generation (no gradients): a wrapper that shards parameters gathers them
        once on entry, keeps them whole through every forward inside, so that those forwards run no collective, and
        frees the full copies on exit (the hybrid engine's unshard-once generation). Entering is a collective over the
        group: every rank of it enters, whatever it runs inside. Wrappers that keep the parameters whole (DDP,
        ZeRO-1/2, any wrapper on one rank) do nothing."""
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        self._backward(loss)

    def step(self, skip: bool = False) -> StepResult:
        """Clip, step and zero the gradients; only zero them when ``skip`` or when their global norm is not finite,
        leaving the weights and the optimizer state untouched.

        Args:
            skip: Take no step (the group found a non-finite loss). Every rank of the group passes the same value:
                measuring the norm is a collective when the gradients are sharded.
        """
        assert self.optimizer is not None
        norm = math.nan if skip else self.clip_gradients()
        stepped = math.isfinite(norm)
        if stepped:
            self._optimizer_step(self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)
        return StepResult(norm, stepped)

    def clip_gradients(self) -> float:
        """Clip the gradients' global norm to ``max_grad_norm`` (None: only measure it) and return the norm before
        clipping, the same on every rank of the group (a collective when the gradients are sharded)."""
        limit = self.max_grad_norm if self.max_grad_norm is not None else math.inf
        norm = torch.nn.utils.clip_grad_norm_(self.module.parameters(), limit)
        if hasattr(norm, "full_tensor"):  # FSDP2's sharded gradients give a DTensor norm
            norm = norm.full_tensor()
        return float(norm)

    def full_parameter_buckets(self, bucket_numel: int = REALLOCATION_BUCKET_NUMEL) -> Iterator[list[torch.Tensor]]:
        """The trainable parameters, full, in ``parameters()`` order, one bucket of :func:`parameter_buckets` at a
        time: a bucket is valid until the next one is drawn, so a sharded role is never whole on a rank at once.
        Collective over the group when sharded (a gather per bucket): every rank of it draws every bucket."""
        params = [p for p in self.module.parameters() if p.requires_grad]
        for bucket in parameter_buckets(params, bucket_numel):
            yield params[bucket]

    # ---- checkpoints ----

    def save_sharded(self, directory: str | os.PathLike[str], optimizer: bool = True) -> None:
        """Write the role under ``directory``, each rank of the group its own shard (weights, and with ``optimizer``
        the optimizer state). Collective over the group: every rank of it calls this with the same directory.

        The default writes with ``torch.distributed.checkpoint`` over the group: FSDP2's shards as they are, and
        one copy of a replicated tensor."""
        save_dcp(self.module, self.optimizer if optimizer else None, directory, self.group, self.group_size)

    def load_sharded(self, directory: str | os.PathLike[str], optimizer: bool = True) -> None:
        """Read what :meth:`save_sharded` wrote into this rank's part of the role (and of its optimizer state),
        weights-only. Collective over the group. The default reads ``torch.distributed.checkpoint`` files, resharded
        to this group whatever the wrapper and number of ranks that saved them."""
        load_dcp(self.module, self.optimizer if optimizer else None, directory, self.group, self.group_size)

    # ---- memory ----

    def memory_bytes(self) -> tuple[int, int, int]:
        """This rank's ``(parameter, gradient, optimizer)`` bytes for the role, from the tensors it keeps.
        Gradients and optimizer state count only with an optimizer (a trainable role on its train group)."""
        params = list(self.module.parameters())
        param_bytes = sum(_local(p).numel() * p.element_size() for p in params)
        if self.optimizer is None:
            return param_bytes, 0, 0
        trainable = sum(_local(p).numel() * p.element_size() for p in params if p.requires_grad)
        return param_bytes, trainable, optimizer_slots(self.optimizer) * trainable

    @classmethod
    def predicted_bytes(
        cls, shapes: Sequence[tuple[int, ...]], trainable: Sequence[bool], element_size: int, group_size: int,
        group_rank: int, slots: int, trains: bool,
    ) -> tuple[int, int, int]:
        """What :meth:`memory_bytes` will measure, from the parameter shapes alone (the planner's memory model).

        Args:
            shapes: Every parameter's shape, in ``module.parameters()`` order.
            trainable: Whether each parameter trains.
            element_size: Bytes per element.
            group_size: Ranks in the group.
            group_rank: The rank's index in the group.
            slots: Optimizer state tensors per trainable element (AdamW: 2).
            trains: Whether the rank runs the role's train call (gradients and optimizer state).
        """
        local = [cls.local_numel(shape, group_size, group_rank) for shape in shapes]
        params = sum(local) * element_size
        if not trains:
            return params, 0, 0
        grads = sum(n for n, t in zip(local, trainable) if t) * element_size
        return params, grads, slots * grads

    @classmethod
    def local_numel(cls, shape: tuple[int, ...], group_size: int, group_rank: int) -> int:
        """Elements of one parameter that a rank keeps (all of them unless the wrapper shards parameters)."""
        return math.prod(shape)


def parameter_buckets(params: Sequence[torch.Tensor], bucket_numel: int) -> list[slice]:
    """Consecutive runs of ``params`` of one dtype and at most ``bucket_numel`` elements together (a larger parameter
    alone), counted on the full shapes (a DTensor's global size, a ZeRO-3 partition's ``ds_numel``): the same runs on
    a rank that holds shards as on one that holds whole copies of the same parameters."""
    buckets: list[slice] = []
    start, size = 0, 0
    for i, p in enumerate(params):
        numel = getattr(p, "ds_numel", None) or p.numel()
        if i > start and (size + numel > bucket_numel or params[i - 1].dtype != p.dtype):
            buckets.append(slice(start, i))
            start, size = i, 0
        size += numel
    if start < len(params):
        buckets.append(slice(start, len(params)))
    return buckets


def optimizer_slots(optimizer: torch.optim.Optimizer) -> int:
    """State tensors per trainable element that ``optimizer`` keeps (unknown optimizers: Adam-like, 2)."""
    for cls, slots in OPTIMIZER_SLOTS.items():
        if type(optimizer) is cls:
            if cls is torch.optim.SGD and not optimizer.defaults.get("momentum"):
                return 0
            return slots
    return 2


def _local(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if hasattr(param, "to_local") else param


def _plain_backward(loss: torch.Tensor) -> None:
    loss.backward()


def _plain_step(optimizer: torch.optim.Optimizer) -> None:
    optimizer.step()
