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

from lightning_app_rlhf.parallel.heartbeat import start_heartbeat
from lightning_app_rlhf.parallel.placed_roles import PlacedRoles
from lightning_app_rlhf.parallel.placement import DEFAULT_TIMEOUT, create_placement
from lightning_app_rlhf.parallel.plan import PlacementPlan
from lightning_app_rlhf.parallel.tensor_parallel import check_tensor_parallel


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


class PlacementProcesses:
    """What the Trainer's and Fabric's placement strategies share (two class trees, as in Lightning itself): their
    settings, one process per device, and the placement they hand the module.

    Args:
        plan: A plan, or a function from the world size (and the algorithm's ``roles``) to a plan.
        timeout: Limit of every collective and transfer; a dead rank becomes an error after it.
        start_method: ``popen`` re-runs the script per process; ``fork``/``spawn`` otherwise.
        process_group_backend: ``gloo``/``nccl``; default by device.
        threads_per_process: CPU threads per process (default: cores / local processes).
    """

    parallel_devices: list[torch.device] | None
    local_rank: int

    def _set_placement_settings(
        self,
        plan: PlacementPlan | Callable[..., PlacementPlan] | None,
        timeout: datetime.timedelta | float = DEFAULT_TIMEOUT,
        start_method: str = "popen",
        process_group_backend: str | None = None,
        threads_per_process: int | None = None,
    ) -> None:
        self._plan = plan
        self._timeout = timeout if isinstance(timeout, datetime.timedelta) else datetime.timedelta(seconds=timeout)
        self._start_method = start_method
        self._process_group_backend = process_group_backend
        self._threads_per_process = threads_per_process
        self._num_nodes = 1

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0


def place(
    plan: PlacementPlan | Callable[..., PlacementPlan],
    module: nn.Module,
    world_size: int,
    global_rank: int,
    root_device: torch.device,
    timeout: datetime.timedelta,
) -> PlacedRoles:
    """Build the plan for the module's algorithm, validate it, and create every call's group (collective); the
    module's :class:`PlacedRoles`, wrapped once its models exist.

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
    return PlacedRoles(create_placement(plan, global_rank, root_device, timeout))


def wrap_roles(module: nn.Module, device: torch.device) -> None:
    """Wrap the roles of ``module`` that this rank holds, by its plan (:meth:`PlacedRoles.wrap`): after its models
    are built, before its optimizers (FSDP2 replaces parameters)."""
    module.placed_roles.wrap(module.role_module, module.trained_roles(), module.shadow_precisions(), device)
