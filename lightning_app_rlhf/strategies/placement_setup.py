"""Steps shared by the Trainer and Fabric placement strategies (two class trees, as in Lightning itself)."""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable
from typing import Any

import torch
from lightning.fabric.utilities.distributed import (
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
)
from torch import nn

from lightning_app_rlhf.placement import Placement, create_placement
from lightning_app_rlhf.plan import PlacementPlan
from lightning_app_rlhf.wrappers import shard_frozen, wrap_for_training


def start_placement(
    plan: PlacementPlan | Callable[[int], PlacementPlan],
    cluster_environment: Any,
    world_size: int,
    global_rank: int,
    root_device: torch.device,
    local_processes: int,
    backend: str | None,
    threads_per_process: int | None,
    timeout: datetime.timedelta,
) -> Placement:
    """Initialise torch.distributed, size CPU threads, build and validate the plan, create every group.

    Bad plans fail here, before any model is built.
    """
    backend = backend or _get_default_process_group_backend_for_device(root_device)
    _init_dist_connection(cluster_environment, backend, timeout=timeout)
    if root_device.type == "cpu":  # processes sharing cores must not each run a thread per core: OpenMP crawls
        torch.set_num_threads(threads_per_process or max(1, (os.cpu_count() or 1) // max(1, local_processes)))
    plan = plan(world_size) if callable(plan) else plan
    if plan.world_size != world_size:
        raise ValueError(f"The plan covers {plan.world_size} ranks but the job runs {world_size} (devices x nodes). "
                         "Set the number of devices so they match, or rebuild the plan.")
    return create_placement(plan, global_rank, root_device, timeout)


def wrap_trained_roles(module: nn.Module, placement: Placement, device: torch.device) -> None:
    """Wrap each trainable role this rank trains on its own train group (never the whole module), and shard the
    frozen roles the plan gives a wrapper over their forward call's group."""
    for role in module.trained_roles():
        call = f"{role}.train"
        module.train_modules[role] = wrap_for_training(
            getattr(module, role), placement.plan.wrappers[role], placement.groups.get(call),
            placement.group_size(call), device,
        )
    for role, attribute in (("reference", "reference"), ("reward", "reward_model")):
        call = f"{role}.forward"
        frozen = getattr(module, attribute)
        if role in placement.plan.wrappers and frozen is not None and placement.runs(call):
            shard_frozen(frozen, placement.plan.wrappers[role], placement.groups.get(call),
                         placement.group_size(call), device)
