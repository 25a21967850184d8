"""Steps shared by the Trainer and Fabric placement strategies (two class trees, as in Lightning itself)."""

from __future__ import annotations

import datetime
import inspect
import os
from collections.abc import Callable
from typing import Any

import torch
from lightning.fabric.utilities.distributed import (
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
)
from torch import nn

from lightning_app_rlhf.placement import Placement, create_placement, start_heartbeat
from lightning_app_rlhf.plan import PlacementPlan
from lightning_app_rlhf.role_table import ROLES
from lightning_app_rlhf.roles import hold_in
from lightning_app_rlhf.tensor_parallel import INFERENCE_CALLS, TensorParallelCopy, check_tensor_parallel
from lightning_app_rlhf.wrappers import RoleWrapper, wrapper_class
from lightning_app_rlhf.wrappers.tensor_parallel import TensorParallelFSDP2Wrapper


def start_distributed(
    cluster_environment: Any,
    root_device: torch.device,
    local_processes: int,
    backend: str | None,
    threads_per_process: int | None,
    timeout: datetime.timedelta,
) -> None:
    """Initialise torch.distributed, start this rank's heartbeat (so that a failed collective's error names the rank
    that died) and size the CPU threads of this process."""
    backend = backend or _get_default_process_group_backend_for_device(root_device)
    _init_dist_connection(cluster_environment, backend, timeout=timeout)
    start_heartbeat(torch.distributed.get_rank(), torch.distributed.get_world_size())
    if root_device.type == "cpu":  # processes sharing cores must not each run a thread per core: OpenMP crawls
        torch.set_num_threads(threads_per_process or max(1, (os.cpu_count() or 1) // max(1, local_processes)))


def place(
    plan: PlacementPlan | Callable[..., PlacementPlan],
    module: nn.Module,
    world_size: int,
    global_rank: int,
    root_device: torch.device,
    timeout: datetime.timedelta,
) -> Placement:
    """Build the plan for the module's algorithm, validate it, and create every call's group (collective).

    ``plan`` is a plan, a preset builder ``(world_size, roles=...) -> plan``, or a user's ``(world_size) -> plan``.
    Bad plans fail here, before any model is built.
    """
    algorithm = module.algorithm
    if callable(plan):
        takes_roles = "roles" in inspect.signature(plan).parameters
        plan = plan(world_size, roles=algorithm.roles) if takes_roles else plan(world_size)
    if plan.world_size != world_size:
        raise ValueError(f"The plan covers {plan.world_size} ranks but the job runs {world_size} processes "
                         f"(devices x num_nodes). Set --trainer.devices (and --trainer.num_nodes; Fabric: devices, "
                         f"num_nodes) so that they multiply to {plan.world_size}, or build the plan for {world_size} "
                         "ranks.")
    plan.check_roles(algorithm.roles, algorithm.name)
    check_tensor_parallel(plan)
    return create_placement(plan, global_rank, root_device, timeout)


def wrap_roles(module: nn.Module, placement: Placement, device: torch.device) -> None:
    """Wrap each trainable role this rank trains on its own train group (never the whole module), and shard the
    frozen roles the plan gives a wrapper over their forward call's group. The wrappers land in
    ``module.role_wrappers``; the trained ones get their optimizers from ``module.attach_optimizers``.

    First, each call with a tensor-parallel degree that this rank runs gets its copy of the role
    (``placement.tp_copies``), cut from the whole module before any wrapper shards it."""
    plan = placement.plan
    build_tp_copies(module, placement, device)
    for role in module.trained_roles():
        wrapper = _wrapper(module, placement, role, f"{role}.train", device)
        wrapper.wrap()
    for role in (entry.name for entry in ROLES if not entry.trainable):
        call = f"{role}.forward"
        if role in plan.wrappers and module.role_module(role) is not None and placement.runs(call):
            _wrapper(module, placement, role, call, device).wrap_frozen()


def build_tp_copies(module: nn.Module, placement: Placement, device: torch.device) -> None:
    """This rank's :class:`TensorParallelCopy` of the role of every generate / forward call with ``tp > 1`` that it
    runs (a train call with a degree cuts the role itself: :class:`TensorParallelFSDP2Wrapper`), held in bfloat16
    where the role's ``shadow_precision`` is ``bf16-true``.

    Raises a ``ValueError`` naming the fix when the role has no model here (a reward function) or its family no
    ``tp_plan``."""
    for call in placement.plan.tp:
        if call not in INFERENCE_CALLS or not placement.runs(call):
            continue
        role = call.split(".")[0]
        source = module.role_module(role)
        if source is None:
            raise ValueError(f"Call {call!r} has a tensor-parallel degree, but role {role!r} has no model here (a "
                             f"reward function runs whole on each rank): remove {call!r} from the plan's `tp`.")
        copy = TensorParallelCopy.build(call, source, placement.tp_group(call), placement.tp_degree(call), device)
        # A trained role's copy is refreshed from float32 weights (a cast on copy), so it may be held in bf16.
        hold_in(copy.module, module.shadow_precisions().get(role))
        placement.tp_copies[call] = copy


def _wrapper(module: nn.Module, placement: Placement, role: str, call: str, device: torch.device) -> RoleWrapper:
    cls = wrapper_class(placement.plan.wrappers[role], role)
    args = (module.role_module(role), placement.groups.get(call), placement.group_size(call),
            placement.group_rank(call), device)
    degree = placement.tp_degree(call)
    if call.endswith(".train") and degree > 1:  # a data x tensor mesh (check_tensor_parallel: FSDP2 only)
        ranks = torch.tensor(placement.plan.ranks(call)).view(-1, degree)
        wrapper = TensorParallelFSDP2Wrapper(*args, tp_group=placement.tp_group(call),
                                             dp_group=placement.dp_groups[call], mesh_ranks=ranks, call=call)
    else:
        wrapper = cls(*args)
    module.role_wrappers[role] = wrapper
    return wrapper
