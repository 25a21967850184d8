"""``FabricPlacementStrategy``: the Fabric strategy that runs an RLHFModule under a PlacementPlan.

Registered in Fabric's registry as ``rlhf_flattening``, ``rlhf_interleaving`` and ``rlhf_separation``::

    fabric = Fabric(accelerator="cpu", devices=4, strategy="rlhf_interleaving")
    fabric.launch()
    module = fabric.strategy.setup_rlhf(fabric, RLHFModule(...))
    fabric.load("last.ckpt", {"model": module})  # to resume
    for batch in loader:
        module.training_step(batch, batch_idx)
    fabric.save("last.ckpt", {"model": module})
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric import Fabric
from lightning.fabric.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning.fabric.strategies.parallel import ParallelStrategy
from lightning.fabric.strategies.strategy import _validate_keys_for_strict_loading
from lightning.fabric.utilities.types import _PATH, _Stateful
from lightning.pytorch import LightningModule
from torch import nn
from typing_extensions import override

from lightning_app_rlhf.checkpoint.format import (
    CHECKED_KEYS,
    CHECKSUM_KEY,
    SHARDS_LOADER_KEY,
    CheckpointError,
    sharded_roles,
    verify,
)
from lightning_app_rlhf.parallel.placement import Placement
from lightning_app_rlhf.strategies.placement_setup import (
    PlacementProcesses,
    place,
    wrap_roles,
)
from lightning_app_rlhf.strategies.placement_strategy import (
    read_placed_checkpoint,
    refuse_unsafe_loading,
    save_placed_checkpoint,
)
from lightning_app_rlhf.strategies.sharded_checkpoint import (
    PendingRestore,
    load_whole_optimizers,
    load_whole_roles,
    restore_special_roles,
)

if TYPE_CHECKING:
    from lightning_app_rlhf.module import RLHFModule

_TRAINING_STATE = (torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler,
                   torch.optim.lr_scheduler.ReduceLROnPlateau)
"""Objects saved with the module, by role: its optimizers and LR schedulers."""
_RESERVED_KEYS = (*CHECKED_KEYS, CHECKSUM_KEY, "rlhf_plan", "global_step", LightningModule.CHECKPOINT_HYPER_PARAMS_KEY)
"""Entries of a checkpoint that hold the module's state (as in a Trainer checkpoint), not the user's."""


class FabricPlacementStrategy(PlacementProcesses, ParallelStrategy):
    """Places the algorithm's roles by a :class:`PlacementPlan` under Fabric; the Fabric twin of
    :class:`~lightning_app_rlhf.strategies.PlacementStrategy`, sharing its core (plan, placement, wrappers) and its
    checkpoints.

    Checkpoints: ``fabric.save(path, {"model": module})`` writes what the Trainer's checkpoints hold, whichever
    ranks own it: every role's weights once, every trained role's optimizer and LR scheduler state (taken from the
    ranks that train it, e.g. Separation's training ranks, not rank 0), the module's RLHF state (adaptive KL,
    reward statistics, a pending rollout) and its iteration; sealed with a checksum, written atomically, and with
    sharded roles (FSDP2, ZeRO) as a directory of shards. ``fabric.load(path, {"model": module})`` reads it
    weights-only, checks it, and gives each rank its roles, optimizers and schedulers; call it after
    :meth:`setup_rlhf`, under the same placement (or any that the Trainer could resume it with). Both are
    collectives: call them on every rank.

    The state passed to ``fabric.save`` / ``fabric.load`` must hold the module that :meth:`setup_rlhf` returned,
    once, under any key. Its optimizers and LR schedulers are saved with it, by role: leave them out, or pass the
    module's own (``"optimizers": module.optimizers()``, an empty list on a rank that trains nothing), which adds
    nothing to the file. Other entries are your plain values or objects with ``state_dict()``, saved as rank 0
    holds them; ``fabric.load`` restores those in the state and returns the file's others.

    Args:
        plan: A function from the world size (and the algorithm's ``roles``) to a plan (the registered presets pass
            one), or a plan. The plan is built in :meth:`setup_rlhf`, when the module's algorithm is known.
        timeout: Limit of every collective and transfer.
        heartbeat_timeout: Seconds a rank may wait in a collective for a stuck rank (its process frozen, or its
            main thread standing still outside any collective) before every rank stops naming it (default 60;
            None: off).
        start_method: ``popen`` re-runs the script per process; ``fork``/``spawn`` otherwise.
        process_group_backend: ``gloo``/``nccl``; default by device.
        threads_per_process: CPU threads per process (default: cores / local processes).
        checkpoint_io: Writes and reads checkpoint files. Default: :class:`AtomicCheckpointIO`.
    """

    multiprocessing_launcher = _MultiProcessingLauncher
    subprocess_launcher = _SubprocessScriptLauncher
    placement: Placement | None = None
    """This rank's placement, once :meth:`setup_rlhf` built it."""
    lr_schedulers: tuple[Any, ...] = ()
    """The LR schedulers of the roles this rank trains, once :meth:`setup_rlhf` built them (the module steps them
    once per iteration; Fabric has no scheduler of its own)."""
    _module: RLHFModule | None = None
    _optimizers: tuple[torch.optim.Optimizer, ...] = ()

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Every rank reads the same global batch; each call's group shards it.
        return {"num_replicas": 1, "rank": 0}

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self.set_world_ranks()
        self._start_distributed()

    def setup_rlhf(self, fabric: Fabric, module: nn.Module) -> nn.Module:
        """Build the roles this rank holds, wrap each trainable role on its train group, and set up its optimizers
        with Fabric. Returns the module, ready for ``module.training_step(batch, batch_idx)``."""
        if not hasattr(module, "placed_roles"):
            raise TypeError(f"setup_rlhf takes an RLHFModule; got {type(module).__name__}.")
        module.placed_roles = place(self._plan, module, self.world_size, self.global_rank, self.root_device,
                                    self._timeout, self.num_processes)
        self.placement = module.placed_roles.placement
        if self.placement.plan.free_running:
            # Its two sides meet only at the Trainer's hooks (validation, the end of the fit; lagged SIGTERM checks).
            raise ValueError("free_running runs under the Trainer (rlhf_separation with free_running=True); under "
                             "Fabric use the fixed schedule: free_running=False, with the same max_staleness.")
        module.configure_model()
        wrap_roles(module, self.root_device)  # before the optimizers: FSDP2 replaces parameters
        optimizers, schedulers = module.configure_optimizers()
        # Fabric returns the module alone when a rank trains nothing (Separation's generation ranks).
        fabric_module, *fabric_optimizers = fabric.setup(module, *optimizers) if optimizers else (fabric.setup(module),)
        module.attach_optimizers(fabric_optimizers)
        self._module, self._optimizers = module, tuple(optimizer.optimizer for optimizer in fabric_optimizers)
        self.lr_schedulers = tuple(schedulers)
        return fabric_module.module if hasattr(fabric_module, "module") else fabric_module

    @override
    def save_checkpoint(
        self,
        path: _PATH,
        state: dict[str, nn.Module | torch.optim.Optimizer | Any],
        storage_options: Any | None = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        """Write one checkpoint for the whole job (the class docstring says what ``state`` holds): each rank's part
        of the module in the Trainer's layout, assembled on rank 0 from each role's owner rank by
        :func:`~lightning_app_rlhf.strategies.placement_strategy.save_placed_checkpoint`. Collective."""
        key, module, extras = self._split_state(state, "save")
        if filter and key in filter:
            raise ValueError(f"fabric.save(filter={{{key!r}: ...}}) would leave out weights of the module's roles, and "
                             "the checkpoint could not resume. Drop that filter; to save the actor alone, use "
                             "module.export_actor(directory).")
        checkpoint = self._module_checkpoint(module)
        clash = sorted(set(extras) & {*checkpoint, *_RESERVED_KEYS})
        if clash:
            raise ValueError(f"fabric.save's state has entries named {clash}, which the module's checkpoint uses. "
                             "Rename those entries.")
        checkpoint.update(self._convert_stateful_objects_in_state(extras, filter=filter or {}))
        save_placed_checkpoint(self, module, self._placed().plan, checkpoint, path, storage_options)

    @override
    def load_checkpoint(
        self,
        path: _PATH,
        state: nn.Module | torch.optim.Optimizer | dict[str, nn.Module | torch.optim.Optimizer | Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Restore what :meth:`save_checkpoint` saved: each rank takes the weights of the roles it holds, the
        optimizer and scheduler states of those it trains, the module's RLHF state and its iteration. The file is
        read weights-only and checked (checksum, finite weights, shard files) before anything loads. Collective.

        Returns:
            The file's entries that ``state`` did not ask for; with no ``state``, the whole checkpoint (checked).
        """
        if isinstance(state, (nn.Module, torch.optim.Optimizer)):  # fabric.load_raw: a bare state dict
            refuse_unsafe_loading(self, weights_only)
            return super().load_checkpoint(path, state, strict, weights_only=True)
        if not state:
            checkpoint, _ = read_placed_checkpoint(self, path, self._placed().plan, weights_only)
            verify(checkpoint, path)
            checkpoint.pop(SHARDS_LOADER_KEY, None)
            return checkpoint
        _, module, extras = self._split_state(state, "load")
        checkpoint, restore = read_placed_checkpoint(self, path, self._placed().plan, weights_only)
        self._restore_module(module, checkpoint, restore, path, strict)
        _validate_keys_for_strict_loading(extras, checkpoint, strict=strict)
        for name, obj in extras.items():
            if name not in checkpoint:
                continue
            if isinstance(obj, nn.Module):
                self.load_module_state_dict(obj, checkpoint.pop(name), strict=strict)
            elif isinstance(obj, _Stateful):
                obj.load_state_dict(checkpoint.pop(name))
            else:
                state[name] = checkpoint.pop(name)
        return {key: value for key, value in checkpoint.items() if key not in _RESERVED_KEYS}

    def _placed(self) -> Placement:
        if self.placement is None:
            raise RuntimeError(f"{type(self).__name__} saves and loads checkpoints of the module it set up: call "
                               "fabric.strategy.setup_rlhf(fabric, module) before fabric.save / fabric.load.")
        return self.placement

    def _split_state(self, state: dict[str, Any], action: str) -> tuple[str, RLHFModule, dict[str, Any]]:
        """The key of the module in ``state``, the module, and the other entries less the module's own optimizers
        and LR schedulers (saved with it, by role)."""
        self._placed()
        keys = [key for key, value in state.items() if value is self._module]
        if len(keys) != 1:
            raise ValueError(f"fabric.{action} under {type(self).__name__} takes the module that setup_rlhf returned, "
                             f"once, in its state: fabric.{action}(path, {{'model': module}}). Got the entries "
                             f"{sorted(state)}.")
        own = {id(obj) for obj in (*self._optimizers, *self.lr_schedulers)}
        extras = {}
        for key, value in state.items():
            # A list of optimizers is empty on a rank that trains nothing (Separation's generation ranks).
            objects = list(value) if isinstance(value, (list, tuple)) else [value]
            if key == keys[0]:
                continue
            if not all(isinstance(obj, _TRAINING_STATE) for obj in objects):
                extras[key] = value
            elif not all(id(obj) in own for obj in objects):
                raise ValueError(f"fabric.{action}'s entry {key!r} holds an optimizer or LR scheduler that the module "
                                 "does not train with; the module's own are saved with it, by role. Drop the entry, "
                                 "or put that object's state_dict() under it.")
        return keys[0], self._module, extras

    def _module_checkpoint(self, module: RLHFModule) -> dict[str, Any]:
        """This rank's part of the module's checkpoint, as the Trainer's strategy gets it: the roles it holds, the
        optimizer and scheduler states of those it trains (empty for a sharded role: its shards hold it), the
        module's own state (``on_save_checkpoint``) and the iteration."""
        sharded = sharded_roles(self._placed().plan)
        checkpoint = {
            "state_dict": module.state_dict(),
            "optimizer_states": [{} if role in sharded else self.get_optimizer_state(optimizer)
                                 for role, optimizer in zip(module.trained_roles(), self._optimizers, strict=True)],
            "lr_schedulers": [scheduler.state_dict() for scheduler in self.lr_schedulers],
            "global_step": module.iteration,
        }
        if module.hparams:
            checkpoint[module.CHECKPOINT_HYPER_PARAMS_KEY] = dict(module.hparams)
        module.on_save_checkpoint(checkpoint)
        return checkpoint

    def _restore_module(self, module: RLHFModule, checkpoint: dict[str, Any], restore: PendingRestore | None,
                        path: _PATH, strict: bool) -> None:
        """Load this rank's part of ``checkpoint`` into the module, its optimizers and schedulers, as the Trainer
        does: the module's hook first (checksum, this rank's roles, RLHF state), then weights, then optimizers."""
        if "state_dict" not in checkpoint:
            raise CheckpointError(f"Checkpoint {path} holds no module weights ('state_dict'): it was written neither "
                                  "by fabric.save(path, {'model': module}) under a placement strategy nor by the "
                                  "Trainer. Pass such a checkpoint, or read this one with fabric.load(path).")
        verify(checkpoint, path)  # here, so that errors name the file (the module's hook checks it again)
        module.on_load_checkpoint(checkpoint)
        load_whole_roles(module, restore, checkpoint["state_dict"], strict)
        if restore is not None and restore.special:
            restore_special_roles(module, restore, checkpoint)
        load_whole_optimizers(module, restore, self._optimizers, checkpoint.get("optimizer_states") or [],
                              self.root_device)
        schedulers = checkpoint.get("lr_schedulers") or []
        if len(schedulers) != len(self.lr_schedulers):
            raise CheckpointError(f"Checkpoint {path} has {len(schedulers)} LR scheduler states for this rank's roles "
                                  f"{module.trained_roles()}, which run {len(self.lr_schedulers)}. Resume with "
                                  "the schedulers it was saved with.")
        for scheduler, saved in zip(self.lr_schedulers, schedulers, strict=True):
            scheduler.load_state_dict(saved)

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        return module  # roles are wrapped one by one on their own groups in setup_rlhf

    @override
    def module_to_device(self, module: nn.Module) -> None:
        module.to(self.root_device)

    @override
    def all_reduce(self, tensor: torch.Tensor, group: Any | None = None, reduce_op: Any = "mean") -> torch.Tensor:
        return self.reduce_tensor(tensor, group, reduce_op)

