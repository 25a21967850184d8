"""Steps shared by the Trainer and Fabric placement strategies (two class trees, as in Lightning itself)."""

from __future__ import annotations

import datetime
import inspect
import os
from collections.abc import Callable, Mapping
from typing import Any, Literal

import torch
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.rank_zero import rank_zero_only
from torch import nn

from lightning_app_rlhf.parallel.failures import DEFAULT_TIMEOUT
from lightning_app_rlhf.parallel.heartbeat import DEFAULT_HEARTBEAT_TIMEOUT, start_heartbeat
from lightning_app_rlhf.parallel.pipeline_checks import check_pipeline_parallel
from lightning_app_rlhf.parallel.placed_roles import PlacedRoles
from lightning_app_rlhf.parallel.placement import create_placement, world_collective
from lightning_app_rlhf.parallel.plan import PlacementPlan
from lightning_app_rlhf.parallel.tensor_parallel import check_node_boundaries, check_tensor_parallel
from lightning_app_rlhf.strategies.atomic_checkpoint_io import AtomicCheckpointIO


def start_distributed(
    cluster_environment: Any,
    root_device: torch.device,
    local_processes: int,
    backend: str | None,
    threads_per_process: int | None,
    timeout: datetime.timedelta,
    heartbeat_timeout: float | None = DEFAULT_HEARTBEAT_TIMEOUT,
) -> None:
    """Initialise torch.distributed, start this rank's heartbeat (so that a failed collective's error names the rank
    that died, and a stuck rank stops the job after ``heartbeat_timeout`` seconds) and size the CPU threads of this
    process."""
    check_elastic_restarts(os.environ)
    backend = backend or _get_default_process_group_backend_for_device(root_device)
    _init_dist_connection(cluster_environment, backend, timeout=timeout)
    start_heartbeat(torch.distributed.get_rank(), torch.distributed.get_world_size(),
                    heartbeat_timeout=heartbeat_timeout)
    if root_device.type == "cpu":  # processes sharing cores must not each run a thread per core: OpenMP crawls
        torch.set_num_threads(threads_per_process or max(1, (os.cpu_count() or 1) // max(1, local_processes)))

def check_elastic_restarts(environment: Mapping[str, str]) -> None:
    """Refuse a ``torchrun --max-restarts N`` launch whose workers share the agent's rendezvous store: torch keeps it
    across restarts, so a restarted attempt reads the previous attempt's addresses and cannot connect
    (pytorch/pytorch#135712). The fix is an environment variable of torchrun's own process."""
    restarts = int(environment.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0)
    if restarts > 0 and environment.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        raise RuntimeError(
            f"torchrun --max-restarts {restarts} with the rendezvous store shared with the workers (torch's default): "
            "a restarted attempt would read the failed attempt's addresses from it and fail to connect "
            "(pytorch/pytorch#135712). Set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in torchrun's environment on every "
            "node (export it before torchrun, or `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun ...`).")


HEARTBEAT_TIMEOUT_MIN = 3.0
"""The shortest ``heartbeat_timeout``: a few beats of one second."""


class PlacementProcesses:
    """What the Trainer's and Fabric's placement strategies share (two class trees, as in Lightning itself): their
    settings, one process per device, their world ranks and launcher, and the placement they hand the module.

    Args:
        plan: A plan, or a function from the world size (and the algorithm's ``roles``) to a plan.
        timeout: Limit of every collective and transfer; a dead rank becomes an error after it.
        heartbeat_timeout: Seconds a rank may wait in a collective for a rank that is stuck (its process frozen, or
            its main thread standing still outside any collective: a deadlocked reward function, a stalled file
            system) before every rank stops with an error naming the stuck rank, its host and its last call.
            Above the longest step a rank runs without a collective; None turns the watch off (then ``timeout``).
        start_method: ``popen`` re-runs the script per process (the default, as DDP); ``fork``/``spawn`` for
            notebooks and tests.
        process_group_backend: ``gloo``/``nccl``; default by device.
        threads_per_process: CPU threads per process (default: cores / local processes).
        checkpoint_io: Writes and reads checkpoint files. Default: :class:`AtomicCheckpointIO` (local files written in
            place, atomically, without a copy of the whole file in memory).
        **strategy_arguments: The Trainer's or Fabric's ``ParallelStrategy`` arguments (``accelerator``,
            ``parallel_devices``, ``cluster_environment``, ``precision_plugin`` or ``precision``).
    """

    parallel_devices: list[torch.device] | None
    local_rank: int
    node_rank: int
    global_rank: int
    cluster_environment: Any
    multiprocessing_launcher: Any
    """The launcher of ``start_method`` ``fork``/``spawn``/``forkserver`` (the Trainer's or Fabric's)."""
    subprocess_launcher: Any
    """The launcher of ``start_method="popen"`` (the Trainer's or Fabric's)."""

    def __init__(
        self,
        plan: PlacementPlan | Callable[..., PlacementPlan] | None = None,
        timeout: datetime.timedelta | float = DEFAULT_TIMEOUT,
        heartbeat_timeout: float | None = DEFAULT_HEARTBEAT_TIMEOUT,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        process_group_backend: str | None = None,
        threads_per_process: int | None = None,
        checkpoint_io: Any = None,
        **strategy_arguments: Any,
    ) -> None:
        super().__init__(checkpoint_io=checkpoint_io if checkpoint_io is not None else AtomicCheckpointIO(),
                         **strategy_arguments)
        self._plan = plan
        self._timeout = timeout if isinstance(timeout, datetime.timedelta) else datetime.timedelta(seconds=timeout)
        if heartbeat_timeout is not None and heartbeat_timeout < HEARTBEAT_TIMEOUT_MIN:
            raise ValueError(f"heartbeat_timeout={heartbeat_timeout} s is shorter than {HEARTBEAT_TIMEOUT_MIN} s: a "
                             "rank beats once a second, so a healthy rank would look stuck. Pass at least "
                             f"{HEARTBEAT_TIMEOUT_MIN} (default {DEFAULT_HEARTBEAT_TIMEOUT}), or None to turn the "
                             "watch off.")
        self._heartbeat_timeout = heartbeat_timeout
        self._start_method = start_method
        self._process_group_backend = process_group_backend
        self._threads_per_process = threads_per_process
        self._num_nodes = 1

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self._start_method == "popen":
            if not self.cluster_environment.creates_processes_externally:
                self._launcher = self.subprocess_launcher(self.cluster_environment, self.num_processes,
                                                          self.num_nodes)
        else:
            self._launcher = self.multiprocessing_launcher(self, start_method=self._start_method)

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if _distributed_is_initialized():
            with world_collective(self.global_rank, "barrier", self._timeout):
                torch.distributed.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        with world_collective(self.global_rank, "broadcast", self._timeout):
            torch.distributed.broadcast_object_list(box, src)
        return box[0]

    def reduce_tensor(self, tensor: torch.Tensor, group: Any | None, reduce_op: Any) -> torch.Tensor:
        """Lightning's reduce (the Trainer's ``reduce``, Fabric's ``all_reduce``), its failure naming the dead rank."""
        if not _distributed_is_initialized():
            return tensor
        with world_collective(self.global_rank, "reduce", self._timeout):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)

    def _start_distributed(self) -> None:
        """Initialise torch.distributed and this rank's heartbeat (:func:`start_distributed`)."""
        start_distributed(self.cluster_environment, self.root_device, self.num_processes, self._process_group_backend,
                          self._threads_per_process, self._timeout, self._heartbeat_timeout)

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


def plan_for(
    plan: PlacementPlan | Callable[..., PlacementPlan], world_size: int, roles: tuple[str, ...]
) -> PlacementPlan:
    """``plan`` itself, or built by it: a builder ``(world_size, roles=...)`` gets the algorithm's ``roles``, a
    user's ``(world_size)`` the world size alone; either way without the calls of roles outside ``roles``
    (:meth:`PlacementPlan.for_roles`: a plan written for PPO runs a critic-free algorithm too)."""
    if not callable(plan):
        return plan.for_roles(roles)
    takes_roles = "roles" in inspect.signature(plan).parameters
    return (plan(world_size, roles=roles) if takes_roles else plan(world_size)).for_roles(roles)


def checked_plan(
    plan: PlacementPlan | Callable[..., PlacementPlan],
    roles: tuple[str, ...],
    algorithm: str,
    world_size: int,
    ranks_per_node: int | None = None,
) -> PlacementPlan:
    """The plan for the algorithm's ``roles`` on ``world_size`` ranks, checked: its world size, roles,
    tensor-parallel and pipeline degrees, and replicas that span nodes of ``ranks_per_node`` processes (default: one
    node). No process group needed: the command line calls it before launching any rank, so that a plan these
    settings cannot build is one error, printed once.

    ``plan`` is a plan, a preset builder ``(world_size, roles=...) -> plan``, or a user's ``(world_size) -> plan``.
    """
    plan = plan_for(plan, world_size, roles)
    if plan.world_size != world_size:
        raise ValueError(f"The plan covers {plan.world_size} ranks but the job runs {world_size} processes "
                         f"(devices x num_nodes). Set --trainer.devices (and --trainer.num_nodes; Fabric: devices, "
                         f"num_nodes) so that they multiply to {plan.world_size}, or build the plan for {world_size} "
                         "ranks.")
    plan.check_roles(roles, algorithm)
    check_tensor_parallel(plan)
    check_pipeline_parallel(plan)
    check_node_boundaries(plan, ranks_per_node or world_size)
    return plan


def place(
    plan: PlacementPlan | Callable[..., PlacementPlan],
    module: nn.Module,
    world_size: int,
    global_rank: int,
    root_device: torch.device,
    timeout: datetime.timedelta,
    ranks_per_node: int | None = None,
) -> PlacedRoles:
    """Build the plan for the module's algorithm, validate it (:func:`checked_plan`), and create every call's group
    (collective); the module's :class:`PlacedRoles`, wrapped once its models exist. Bad plans fail here, before any
    model is built."""
    algorithm = module.algorithm
    plan = checked_plan(plan, algorithm.roles, algorithm.name, world_size, ranks_per_node)
    return PlacedRoles(create_placement(plan, global_rank, root_device, timeout))


def wrap_roles(module: nn.Module, device: torch.device) -> None:
    """Wrap the roles of ``module`` that this rank holds, by its plan (:meth:`PlacedRoles.wrap`): after its models
    are built, before its optimizers (FSDP2 replaces parameters)."""
    module.placed_roles.wrap(module.role_module, module.trained_roles(), module.specs.shadow_precisions(), device)
