"""``ZeroWrapper``: a DeepSpeed ZeRO engine (stage 1, 2 or 3) for one role, on the role's group only.

DeepSpeed assumes that its engines span the whole job: ZeRO-3 checks its parameter order and synchronises with
world-wide barriers and broadcasts from global rank 0. A role here runs on a subgroup, so every DeepSpeed call of
a role runs inside :func:`deepspeed_world`, which makes DeepSpeed's default group that role's group.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn
from typing_extensions import override

from lightning_app_rlhf.parallel.wrappers.base import (
    REALLOCATION_BUCKET_NUMEL,
    RoleWrapper,
    StepResult,
    optimizer_slots,
    parameter_buckets,
)
from lightning_app_rlhf.parallel.wrappers.sharded_io import (
    DEEPSPEED_TAG,
    deepspeed_load,
    weights_only_deepspeed,
)

ALIGNMENT = 2
"""ZeRO-1/2 pad a role's flat parameter buffer to a multiple of ``ALIGNMENT x ranks`` elements (DeepSpeed's
``nccl_start_alignment_factor``) before splitting it into equal partitions."""


class ZeroWrapper(RoleWrapper):
    """A ``deepspeed.initialize`` engine whose data-parallel group is the role's group. DeepSpeed owns backward,
    gradient clipping (its ``gradient_clipping``), the optimizer step and zero-grad; the optimizer is the role's
    own (``zero_allow_untested_optimizer``), so LR schedulers and Lightning's optimizer list keep working.

    On a group of one rank there is nothing to partition: the role trains as a plain module (the same update).

    DeepSpeed decides inside ``engine.step()`` whether to step: on the fp32 engines built here it skips the update
    (and zeroes the gradients) when the gradients' global norm is not finite, and :meth:`backward` turns a
    non-finite loss into NaN gradients so that it skips then too. :meth:`step` reports what DeepSpeed did.
    """

    stage: ClassVar[int]
    # ZeRO-3's forward hooks re-record their module trace after any change of call pattern (train -> generate),
    # checking it against the other ranks with broadcasts at the start of a forward, gathered weights or not.
    lockstep_when_unsharded = True
    checkpoint_format = "deepspeed"
    # ZeRO-3's forward gathers parameters into the module's own tensors, and the engine keeps state across
    # forwards: kept on no_grad, as inference tensors there are untested.
    forwards_in_inference_mode = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.engine: Any = None

    @override
    def wrap(self) -> None:
        pass  # deepspeed.initialize needs the optimizer: see attach_optimizer

    @override
    def wrap_frozen(self) -> None:
        if self.group_size > 1:
            self.engine = self._initialize(None, None)

    @override
    def attach_optimizer(self, optimizer: torch.optim.Optimizer, max_grad_norm: float | None, *args: Any,
                         **kwargs: Any) -> None:
        super().attach_optimizer(optimizer, max_grad_norm, *args, **kwargs)
        if self.group_size > 1:
            self.engine = self._initialize(optimizer, max_grad_norm)

    def _initialize(self, optimizer: torch.optim.Optimizer | None, max_grad_norm: float | None) -> Any:
        deepspeed = import_deepspeed(self.device)
        config = {
            "train_micro_batch_size_per_gpu": 1,  # unused: the engine decides batches and micro-batches
            "gradient_accumulation_steps": 1,
            "gradient_clipping": max_grad_norm or 0.0,
            "zero_optimization": {"stage": self.stage},
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 2**62,
            "wall_clock_breakdown": False,
        }
        with deepspeed_world(self.group):
            engine, *_ = deepspeed.initialize(model=self.module, optimizer=optimizer, config=config,
                                              mpu=_GroupMPU(self.group), dist_init_required=False)
        return engine

    @property
    @override
    def train_module(self) -> nn.Module:
        return self.engine if self.engine is not None else self.module

    @override
    def running(self) -> contextlib.AbstractContextManager[None]:
        return deepspeed_world(self.group) if self.engine is not None else contextlib.nullcontext()

    @override
    @contextlib.contextmanager
    def accumulating(self, last: bool) -> Iterator[None]:
        if self.engine is not None:
            self.engine.set_gradient_accumulation_boundary(last)
        with self.running():
            yield

    @override
    def backward(self, loss: torch.Tensor) -> None:
        if self.engine is None:
            return super().backward(loss)
        with self.running():
            self.engine.backward(_nan_gradients_if_nonfinite(loss))

    @override
    def step(self, skip: bool = False) -> StepResult:
        """``engine.step()``, which clips and steps, or skips when the global gradient norm is not finite. ``skip``
        cannot stop it, and need not: :meth:`backward` made a rank's gradients NaN when its loss was not finite, and
        the gradient reduction carries them to every rank of the group."""
        if self.engine is None:
            return super().step(skip)
        skipped_before = self.engine.skipped_steps
        with self.running():
            self.engine.step()
        norm = self.engine.get_global_grad_norm()  # inf after a skipped step
        return StepResult(float(norm), stepped=self.engine.skipped_steps == skipped_before)

    @override
    def full_parameter_buckets(self, bucket_numel: int = REALLOCATION_BUCKET_NUMEL) -> Iterator[list[torch.Tensor]]:
        if self.engine is None or self.stage < 3:
            yield from super().full_parameter_buckets(bucket_numel)
            return
        import deepspeed

        params = [p for p in self.module.parameters() if p.requires_grad]
        for bucket in parameter_buckets(params, bucket_numel):
            with self.running(), deepspeed.zero.GatheredParameters(params[bucket]):
                yield params[bucket]

    @override
    @contextlib.contextmanager
    def unsharded(self) -> Iterator[None]:
        if self.engine is None or self.stage < 3:
            yield
            return
        import deepspeed
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        params = list(self.module.parameters())  # frozen ones too: a forward needs every weight
        with self.running():
            # One coalesced all-gather (as ZeRO-3's own fetch does), not GatheredParameters' one per parameter: it
            # then finds them all available and only re-partitions them on exit.
            missing = [p for p in params if p.ds_status == ZeroParamStatus.NOT_AVAILABLE]
            if missing:
                missing[0].all_gather_coalesced(missing).wait()
            with deepspeed.zero.GatheredParameters(params), _held_by_generation(params):
                yield

    @override
    def save_sharded(self, directory: str | os.PathLike[str], optimizer: bool = True) -> None:
        """DeepSpeed's ``engine.save_checkpoint`` on the role's group: the module's states from the group's first
        rank, each rank's ZeRO partition (fp32 master weights and optimizer state) in its own file, under
        ``directory/zero/``. DeepSpeed always writes the partitions, so ``optimizer`` changes nothing here."""
        if self.engine is None:
            return super().save_sharded(directory, optimizer)
        if self.optimizer is None:  # a frozen role's engine has no checkpoint engine: this rank's partitions
            path = self._frozen_file(directory)
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(_frozen_state(self.module), path)
            return
        with self.running():
            self.engine.save_checkpoint(os.fspath(directory), tag=DEEPSPEED_TAG, client_state={}, save_latest=False)

    @override
    def load_sharded(self, directory: str | os.PathLike[str], optimizer: bool = True) -> None:
        """DeepSpeed's ``engine.load_checkpoint``, weights-only, into an engine on as many ranks as saved it (DeepSpeed
        refuses another number when it reads optimizer state)."""
        if self.engine is None:
            return super().load_sharded(directory, optimizer)
        if self.optimizer is None:
            _load_frozen_state(self.module, deepspeed_load(os.fspath(self._frozen_file(directory))))
            return
        with self.running(), weights_only_deepspeed(self.engine):
            path, _ = self.engine.load_checkpoint(os.fspath(directory), tag=DEEPSPEED_TAG,
                                                  load_optimizer_states=self.optimizer is not None,
                                                  load_lr_scheduler_states=False)
        if path is None:
            raise FileNotFoundError(f"No DeepSpeed checkpoint of this role in {directory}/{DEEPSPEED_TAG}.")

    def _frozen_file(self, directory: str | os.PathLike[str]) -> Path:
        return Path(directory) / DEEPSPEED_TAG / f"frozen_rank_{self.group_rank}_of_{self.group_size}.pt"

    @override
    def memory_bytes(self) -> tuple[int, int, int]:
        if self.engine is None:
            return super().memory_bytes()
        params = list(self.module.parameters())
        size = params[0].element_size() if params else 4
        held = sum(p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel() for p in params)
        if self.optimizer is None:
            return held * size, 0, 0
        flat = getattr(self.engine.optimizer, "bit16_groups_flat", None)
        if flat:  # ZeRO-1/2: the trainable parameters are views into flat buffers, padded to ALIGNMENT x ranks
            held = sum(t.numel() for t in flat) + sum(p.numel() for p in params if not p.requires_grad)
        partition = sum(t.numel() for t in _master_partitions(self.engine.optimizer))
        trainable = sum(p.numel() for p in params if p.requires_grad)
        grads = trainable if self.stage == 1 else partition  # stage 1 reduces whole gradients
        # The fp32 master partition and the optimizer's slots over it (counted by slots, as for DDP: at fit start
        # the optimizer has not allocated them yet).
        return held * size, grads * size, partition * 4 * (1 + optimizer_slots(self.optimizer))

    @classmethod
    @override
    def predicted_bytes(
        cls, shapes: Sequence[tuple[int, ...]], trainable: Sequence[bool], element_size: int, group_size: int,
        group_rank: int, slots: int, trains: bool,
    ) -> tuple[int, int, int]:
        if group_size == 1:
            return RoleWrapper.predicted_bytes.__func__(cls, shapes, trainable, element_size, 1, 0, slots, trains)
        numels = [math.prod(shape) for shape in shapes]
        if cls.stage == 3:
            local = [-(-n // group_size) for n in numels]  # each parameter padded to a multiple of the ranks
            held = sum(local)
            partition = sum(n for n, t in zip(local, trainable) if t)
        else:
            held = sum(numels)
            total = sum(n for n, t in zip(numels, trainable) if t)
            align = ALIGNMENT * group_size
            partition = -(-total // align) * align // group_size
            if trains:  # the trainable parameters move into DeepSpeed's flat buffer, padded like the partitions
                held += partition * group_size - total
        if not trains:
            return held * element_size, 0, 0
        full = sum(n for n, t in zip(numels, trainable) if t)
        grads = full if cls.stage == 1 else partition
        return held * element_size, grads * element_size, partition * 4 * (1 + slots)


class Zero1Wrapper(ZeroWrapper):
    """ZeRO stage 1: optimizer state partitioned over the group."""

    name = "zero1"
    stage = 1
    shards_optimizer = True


class Zero2Wrapper(ZeroWrapper):
    """ZeRO stage 2: optimizer state and gradients partitioned."""

    name = "zero2"
    stage = 2
    shards_grads = True
    shards_optimizer = True


class Zero3Wrapper(ZeroWrapper):
    """ZeRO stage 3: parameters too; a forward gathers each module's weights. Also shards frozen roles."""

    name = "zero3"
    stage = 3
    shards_grads = True
    shards_optimizer = True


def import_deepspeed(device: torch.device) -> Any:
    """Import DeepSpeed for ``device`` (its CPU accelerator on a CPU) and bind its communication backend to the
    process group that already exists."""
    if device.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import deepspeed.comm.comm as ds_comm

    if device.type == "cpu" and "__compatible_ops__" not in vars(deepspeed.ops):
        # The engines here use the role's torch optimizer and none of DeepSpeed's compiled ops; without this,
        # its CPU backend probes compilers and JIT-builds a shared-memory collective (~40 s, needs a C++ compiler).
        vars(deepspeed.ops)["__compatible_ops__"] = {}

    if ds_comm.cdb is None:
        deepspeed.init_distributed(dist_backend=dist.get_backend(), auto_mpi_discovery=False,
                                   dist_init_required=False)
    return deepspeed


@contextlib.contextmanager
def deepspeed_world(group: dist.ProcessGroup | None) -> Iterator[None]:
    """Make ``group`` DeepSpeed's default group inside the block (see the module's docstring)."""
    import deepspeed.comm.comm as ds_comm

    backend = ds_comm.cdb
    if group is None or isinstance(backend, _GroupScopedBackend):
        yield
        return
    ds_comm.cdb = _GroupScopedBackend(backend, group)
    try:
        yield
    finally:
        ds_comm.cdb = backend


class _GroupScopedBackend:
    """DeepSpeed's torch backend with ``group=None`` read as one process group (ranks and sources within it)."""

    def __init__(self, backend: Any, group: dist.ProcessGroup) -> None:
        self._backend = backend
        self._group = group

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)

    def barrier(self, group: Any = None, **kwargs: Any) -> Any:
        return self._backend.barrier(group=group or self._group, **kwargs)

    def broadcast(self, tensor: torch.Tensor, src: int, group: Any = None, async_op: bool = False) -> Any:
        if group is None:
            group, src = self._group, dist.get_global_rank(self._group, src)
        return self._backend.broadcast(tensor=tensor, src=src, group=group, async_op=async_op)

    def all_reduce(self, tensor: torch.Tensor, op: Any = None, group: Any = None, async_op: bool = False) -> Any:
        return self._backend.all_reduce(tensor, op if op is not None else dist.ReduceOp.SUM, group or self._group,
                                        async_op)

    def get_rank(self, group: Any = None) -> int:
        return self._backend.get_rank(group or self._group)

    def get_world_size(self, group: Any = None) -> int:
        return self._backend.get_world_size(group or self._group)


class _GroupMPU:
    """DeepSpeed's "model parallel unit": data parallel over ``group``, no tensor or pipeline parallelism."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self._group = group

    def get_data_parallel_group(self) -> dist.ProcessGroup:
        return self._group

    def get_data_parallel_world_size(self) -> int:
        return dist.get_world_size(self._group)

    def get_data_parallel_rank(self) -> int:
        return dist.get_rank(self._group)

    def get_model_parallel_group(self) -> None:
        return None  # DeepSpeed reads None as "no model parallelism" and skips those collectives

    def get_tensor_model_parallel_group(self) -> None:
        return None

    def get_model_parallel_world_size(self) -> int:
        return 1

    def get_model_parallel_rank(self) -> int:
        return 0

    def get_tensor_model_parallel_world_size(self) -> int:
        return 1

    def get_tensor_model_parallel_rank(self) -> int:
        return 0

    def get_pipeline_model_parallel_world_size(self) -> int:
        return 1


GENERATION_HOLDER = -1
"""Stands for the whole generation in a ZeRO-3 parameter's ``ds_active_sub_modules`` (module ids are >= 0)."""


@contextlib.contextmanager
def _held_by_generation(params: list[torch.Tensor]) -> Iterator[None]:
    """Keep gathered ZeRO-3 parameters whole through the forwards inside the block.

    ZeRO-3's post-forward hook re-partitions every parameter of a module after its forward, even one that
    ``GatheredParameters`` gathered, unless another module still uses it (``ds_active_sub_modules`` not empty).
    Generation counts as such a user here; the hooks' pre-forward fetch skips parameters already available.
    """
    for param in params:
        param.ds_active_sub_modules.add(GENERATION_HOLDER)
    try:
        yield
    finally:
        for param in params:
            param.ds_active_sub_modules.discard(GENERATION_HOLDER)


def _nan_gradients_if_nonfinite(loss: torch.Tensor) -> torch.Tensor:
    """``loss``, or when it is not finite ``loss x NaN``, whose gradients are NaN: DeepSpeed checks the gradient
    norm, not the loss, and a non-finite loss can have finite gradients. No host sync."""
    factor = torch.where(torch.isfinite(loss.detach()), 1.0, math.nan).to(loss.dtype)
    return loss * factor


def _frozen_state(module: nn.Module) -> dict[str, dict[str, torch.Tensor]]:
    """A frozen ZeRO-3 module's partitions on this rank (``ds_tensor``), and its buffers, by name."""
    params = {name: getattr(p, "ds_tensor", p).detach().clone() for name, p in module.named_parameters()}
    return {"params": params, "buffers": {name: b.detach().clone() for name, b in module.named_buffers()}}


def _load_frozen_state(module: nn.Module, state: dict[str, dict[str, torch.Tensor]]) -> None:
    with torch.no_grad():
        for name, p in module.named_parameters():
            getattr(p, "ds_tensor", p).copy_(state["params"][name])
        for name, b in module.named_buffers():
            b.copy_(state["buffers"][name])


def _master_partitions(zero: Any) -> list[torch.Tensor]:
    """The fp32 master partitions that DeepSpeed's ZeRO optimizer steps (stage 1/2 and stage 3 name them apart)."""
    groups = getattr(zero, "single_partition_of_fp32_groups", None)
    return list(groups) if groups is not None else list(zero.fp32_partitioned_groups_flat)
