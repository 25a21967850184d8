"""``FabricPlacementStrategy``: the Fabric strategy that runs an RLHFModule under a PlacementPlan.

Registered in Fabric's registry as ``rlhf_flattening``, ``rlhf_interleaving`` and ``rlhf_separation``::

    fabric = Fabric(accelerator="cpu", devices=4, strategy="rlhf_interleaving")
    fabric.launch()
    module = fabric.strategy.setup_rlhf(fabric, RLHFModule(...))
    for batch in loader:
        module.training_step(batch, batch_idx)
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric import Fabric
from lightning.fabric.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning.fabric.strategies.parallel import ParallelStrategy
from lightning.fabric.utilities.distributed import _distributed_is_initialized, _sync_ddp_if_available
from lightning.fabric.utilities.rank_zero import rank_zero_only
from torch import nn
from typing_extensions import override

from lightning_app_rlhf.placement import DEFAULT_TIMEOUT, Placement
from lightning_app_rlhf.plan import PlacementPlan
from lightning_app_rlhf.strategies.placement_setup import place, start_distributed, wrap_roles


class FabricPlacementStrategy(ParallelStrategy):
    """Places the algorithm's roles by a :class:`PlacementPlan` under Fabric; the Fabric twin of
    :class:`~lightning_app_rlhf.strategies.PlacementStrategy`, sharing its core (plan, placement, wrappers).

    Args:
        plan: A function from the world size (and the algorithm's ``roles``) to a plan (the registered presets pass
            one), or a plan. The plan is built in :meth:`setup_rlhf`, when the module's algorithm is known.
        timeout: Limit of every collective and transfer.
        start_method: ``popen`` re-runs the script per process; ``fork``/``spawn`` otherwise.
        process_group_backend: ``gloo``/``nccl``; default by device.
        threads_per_process: CPU threads per process (default: cores / local processes).
    """

    def __init__(
        self,
        plan: PlacementPlan | Callable[[int], PlacementPlan],
        timeout: datetime.timedelta | float = DEFAULT_TIMEOUT,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        process_group_backend: str | None = None,
        threads_per_process: int | None = None,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision: Any = None,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision=precision,
        )
        self._plan = plan
        self._timeout = timeout if isinstance(timeout, datetime.timedelta) else datetime.timedelta(seconds=timeout)
        self._start_method = start_method
        self._process_group_backend = process_group_backend
        self._threads_per_process = threads_per_process
        self._num_nodes = 1
        self.placement: Placement | None = None

    @property
    @override
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

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Every rank reads the same global batch; each call's group shards it.
        return {"num_replicas": 1, "rank": 0}

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self._start_method == "popen":
            if not self.cluster_environment.creates_processes_externally:
                self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = _MultiProcessingLauncher(self, start_method=self._start_method)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank
        start_distributed(self.cluster_environment, self.root_device, self.num_processes,
                          self._process_group_backend, self._threads_per_process, self._timeout)

    def setup_rlhf(self, fabric: Fabric, module: nn.Module) -> nn.Module:
        """Build the roles this rank holds, wrap each trainable role on its train group, and set up its optimizers
        with Fabric. Returns the module, ready for ``module.training_step(batch, batch_idx)``."""
        if not hasattr(module, "placement"):
            raise TypeError(f"setup_rlhf takes an RLHFModule; got {type(module).__name__}.")
        self.placement = place(self._plan, module, self.world_size, self.global_rank, self.root_device,
                               self._timeout)
        module.placement = self.placement
        module.configure_model()
        wrap_roles(module, self.placement, self.root_device)  # before the optimizers: FSDP2 replaces parameters
        optimizers, schedulers = module.configure_optimizers()
        # Fabric returns the module alone when a rank trains nothing (Separation's generation ranks).
        fabric_module, *fabric_optimizers = fabric.setup(module, *optimizers) if optimizers else (fabric.setup(module),)
        module.fabric_schedulers = schedulers
        module.attach_optimizers(fabric_optimizers)
        return fabric_module.module if hasattr(fabric_module, "module") else fabric_module

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        return module  # roles are wrapped one by one on their own groups in setup_rlhf

    @override
    def module_to_device(self, module: nn.Module) -> None:
        module.to(self.root_device)

    @override
    def all_reduce(self, tensor: torch.Tensor, group: Any | None = None, reduce_op: Any = "mean") -> torch.Tensor:
        return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if _distributed_is_initialized():
            dist.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]
