"""``PlacedRoles``: what a placement strategy hands the module, once. Plain PyTorch, no Lightning.

Lightning's ``ModelParallelStrategy`` hands its module one device mesh; a placement strategy hands an
:class:`~lightning_app_rlhf.RLHFModule` one :class:`PlacedRoles`: the :class:`~lightning_app_rlhf.parallel.placement.Placement`
(which ranks run each call, and the collectives between them) before any model is built, then, once this rank's
models exist, its wrappers (:meth:`PlacedRoles.wrap`) and its tensor-parallel copies. The engine reads everything
from it; nothing else writes to the module.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_app_rlhf.core.role_table import ROLES
from lightning_app_rlhf.models.roles import AdapterDisabledReference, hold_in
from lightning_app_rlhf.parallel.pipeline import PipelinedRole
from lightning_app_rlhf.parallel.pipeline_checks import same_pipeline
from lightning_app_rlhf.parallel.placement import Placement
from lightning_app_rlhf.parallel.tensor_parallel import INFERENCE_CALLS, TensorParallelCopy
from lightning_app_rlhf.parallel.whole_copy import WholeCopy
from lightning_app_rlhf.parallel.wrappers import DDPWrapper, RoleWrapper, wrapper_class
from lightning_app_rlhf.parallel.wrappers.base import Backward, OptimizerStep
from lightning_app_rlhf.parallel.wrappers.pipeline_ddp import PipelineDDPWrapper
from lightning_app_rlhf.parallel.wrappers.tensor_parallel import TensorParallelFSDP2Wrapper

Models = Callable[[str], nn.Module | None]
"""Role -> its module on this rank (None where this rank does not hold it)."""


@dataclass
class PlacedRoles:
    """The roles as placed on this rank.

    Args:
        placement: Which ranks run each call, and the collectives between them.
        wrappers: Role -> its wrapper on this rank: the roles this rank trains, and the frozen roles the plan shards
            here. Filled by :meth:`wrap` (or :meth:`wrap_whole`).
        tp_copies: Call -> this rank's copy of its role in the call's own layout: a tensor-parallel copy for each
            generate or forward call with a degree above 1 that this rank runs, or a whole copy
            (:class:`~lightning_app_rlhf.parallel.whole_copy.WholeCopy`) beside a pipelined train call. Filled by
            :meth:`wrap`.
        pipelines: Call -> this rank's stage of its role, for each pipelined scoring call this rank runs (a trained
            role's is its train call's stage). Filled by :meth:`wrap`.
    """

    placement: Placement
    wrappers: dict[str, RoleWrapper] = field(default_factory=dict)
    tp_copies: dict[str, TensorParallelCopy | WholeCopy] = field(default_factory=dict)
    pipelines: dict[str, PipelinedRole] = field(default_factory=dict)

    @classmethod
    def single_process(cls, device: torch.device, roles: tuple[str, ...]) -> PlacedRoles:
        """Every call of ``roles`` on one process (the module without a placement strategy)."""
        return cls(Placement.single_process(device, roles))

    @property
    def wrapped(self) -> bool:
        return bool(self.wrappers)

    def wrap(
        self, models: Models, trained_roles: Sequence[str], shadow_precisions: Mapping[str, str], device: torch.device
    ) -> None:
        """Wrap each role this rank trains on its own train group (never the whole module), and shard the frozen
        roles the plan gives a wrapper over their forward call's group. First, each call with a tensor-parallel degree
        that this rank runs gets its copy of the role, cut from the whole module before any wrapper shards it.

        Args:
            models: This rank's module of each role.
            trained_roles: The roles whose train call runs on this rank, in optimizer order.
            shadow_precisions: Trained role -> ``bf16-true`` where its copies that do not train are held in bfloat16.
            device: This rank's device.
        """
        self._build_tp_copies(models, shadow_precisions, device)
        self._build_whole_copies(models, shadow_precisions)
        plan = self.placement.plan
        for role in trained_roles:
            wrapper = self._wrapper(models, role, f"{role}.train", device)
            wrapper.wrap()
            forward = f"{role}.forward"
            if isinstance(wrapper, PipelineDDPWrapper) and plan.pp_degree(forward) > 1 \
                    and same_pipeline(plan, forward, f"{role}.train"):
                self.pipelines[forward] = wrapper.stage  # scored on the stages that train it
        for role in (entry.name for entry in ROLES if not entry.trainable):
            call = f"{role}.forward"
            if not self.placement.runs(call):
                continue
            if plan.pp_degree(call) > 1:
                self.pipelines[call] = self._frozen_stage(models(role), role, call, device)
            elif role in plan.wrappers and models(role) is not None:
                self._wrapper(models, role, call, device).wrap_frozen()

    def _frozen_stage(self, module: nn.Module | None, role: str, call: str, device: torch.device) -> PipelinedRole:
        """This rank's stage of a frozen role pipelined on its forward call, cut in place from its module."""
        if not isinstance(module, nn.Module) or isinstance(module, AdapterDisabledReference):
            what = "is a reward function" if module is None or not isinstance(module, nn.Module) else \
                "is the LoRA actor's base with its adapters off"
            raise ValueError(f"Call {call!r} is pipelined, but {role!r} {what}: there is no model of its own to cut "
                             f"into stages. Remove {call!r} from the plan's `pp`.")
        return PipelinedRole(module, self.placement.pipelines[call], self.placement.rank, device, call)

    def wrap_whole(self, models: Models, trained_roles: Sequence[str], device: torch.device) -> None:
        """One process: each trained role in a plain wrapper (no group)."""
        for role in trained_roles:
            self.wrappers[role] = DDPWrapper(models(role), None, 1, 0, device)
            self.wrappers[role].wrap()

    def attach_optimizers(
        self, trained_roles: Sequence[str], optimizers: Sequence[Any], max_grad_norm: float | None,
        backward: Backward, optimizer_step: OptimizerStep,
    ) -> None:
        """Give each trained role's wrapper its optimizer (:meth:`RoleWrapper.attach_optimizer`), in
        ``trained_roles`` order; a Fabric or Lightning optimizer is unwrapped to the torch one it holds."""
        for role, optimizer in zip(trained_roles, optimizers, strict=True):
            self.wrappers[role].attach_optimizer(getattr(optimizer, "optimizer", optimizer), max_grad_norm, backward,
                                                 optimizer_step)

    def _build_tp_copies(self, models: Models, shadow_precisions: Mapping[str, str], device: torch.device) -> None:
        """This rank's :class:`TensorParallelCopy` of the role of every generate / forward call with ``tp > 1`` that it
        runs (a train call with a degree cuts the role itself: :class:`TensorParallelFSDP2Wrapper`), held in bfloat16
        where the role's ``shadow_precision`` is ``bf16-true``. Raises a ``ValueError`` naming the fix when the role
        has no model here (a reward function)."""
        placement = self.placement
        for call in placement.plan.tp:
            if call not in INFERENCE_CALLS or not placement.runs(call):
                continue
            role = call.split(".")[0]
            source = models(role)
            if source is None:
                raise ValueError(f"Call {call!r} has a tensor-parallel degree, but role {role!r} has no model here (a "
                                 f"reward function runs whole on each rank): remove {call!r} from the plan's `tp`.")
            copy = TensorParallelCopy.build(call, source, placement.tp_group(call), placement.tp_degree(call), device)
            # A trained role's copy is refreshed from float32 weights (a cast on copy), so it may be held in bf16.
            hold_in(copy.module, shadow_precisions.get(role))
            self.tp_copies[call] = copy

    def _build_whole_copies(self, models: Models, shadow_precisions: Mapping[str, str]) -> None:
        """This rank's :class:`WholeCopy` of the role of every generate / forward call that runs beside its pipelined
        train call here (:meth:`~lightning_app_rlhf.parallel.plan.PlacementPlan.runs_on_whole_copy`), taken before the
        train call cuts the role into stages."""
        placement = self.placement
        for call in placement.plan.calls:
            if placement.plan.runs_on_whole_copy(call) and placement.runs(call) \
                    and placement.runs(call.split(".")[0] + ".train"):
                copy = WholeCopy.build(call, models(call.split(".")[0]))
                hold_in(copy.module, shadow_precisions.get(call.split(".")[0]))
                self.tp_copies[call] = copy

    def _wrapper(self, models: Models, role: str, call: str, device: torch.device) -> RoleWrapper:
        placement = self.placement
        args = (models(role), placement.groups.get(call), placement.group_size(call), placement.group_rank(call),
                device)
        degree = placement.tp_degree(call)
        if call.endswith(".train") and placement.pp_degree(call) > 1:  # one stage here; a LoRA role is refused there
            wrapper: RoleWrapper = PipelineDDPWrapper(
                *args, pipeline=placement.pipelines[call], stage_group=placement.stage_groups.get(call),
                rank=placement.rank, call=call, schedule=placement.plan.pipeline_schedule)
        elif call.endswith(".train") and degree > 1:  # a data x tensor mesh (check_tensor_parallel: FSDP2 only)
            ranks = torch.tensor(placement.plan.ranks(call)).view(-1, degree)
            wrapper = TensorParallelFSDP2Wrapper(*args, tp_group=placement.tp_group(call),
                                                 dp_group=placement.dp_groups[call], mesh_ranks=ranks, call=call)
        else:
            wrapper = wrapper_class(placement.plan.wrappers[role], role)(*args)
        self.wrappers[role] = wrapper
        return wrapper
