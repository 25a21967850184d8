"""``PlacementStrategy``: the Trainer strategy that runs an RLHFModule under a PlacementPlan."""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from lightning_app_rlhf.checkpoint.format import (
    LAYOUT_KEY,
    SHARDS_LOADER_KEY,
    assemble,
    check_checkpoint_file,
    checkpoint_file,
    is_sharded_checkpoint,
    not_weights_only,
    owned_state,
    recv_state,
    restore_modes,
    role_layout,
    role_owner,
    seal,
    send_state,
    sharded_roles,
    verify,
)
from lightning_app_rlhf.core.role_table import ROLE_NAMES
from lightning_app_rlhf.parallel.heartbeat import before_exit
from lightning_app_rlhf.parallel.pipeline_checks import check_pipeline_parallel, check_pipelined_checkpoint
from lightning_app_rlhf.parallel.placed_roles import PlacedRoles
from lightning_app_rlhf.parallel.placement import create_placement
from lightning_app_rlhf.parallel.plan import PlacementPlan
from lightning_app_rlhf.parallel.tensor_parallel import check_tensor_parallel
from lightning_app_rlhf.strategies.placement_launcher import PlacementMultiProcessingLauncher
from lightning_app_rlhf.strategies.placement_setup import (
    PlacementProcesses,
    place,
    plan_for,
    wrap_roles,
)
from lightning_app_rlhf.strategies.sharded_checkpoint import (
    PendingRestore,
    check_shards,
    checksum_shards,
    load_whole_optimizers,
    load_whole_roles,
    publish,
    restore_special_roles,
    save_shards,
    staging_directory,
)
from lightning_app_rlhf.strategies.signal_connector import (
    LaggedSigtermCheck,
    lag_sigterm_check,
    use_placement_signal_connector,
)


class PlacementStrategy(PlacementProcesses, ParallelStrategy):
    """Places the algorithm's roles by a :class:`PlacementPlan`: each role lives on the ranks of its calls and is
    wrapped on its own process group, never the whole LightningModule.

    Every rank receives the same global batch (``data.batch_size`` prompts per iteration); each call's group
    splits it. Use the presets ``rlhf_flattening``, ``rlhf_interleaving`` and ``rlhf_separation``, or pass
    ``plan`` for a custom placement.

    Args:
        plan: A plan, or a function from the world size to a plan. Its calls must be those of the module's
            algorithm (no ``critic.*`` calls for a critic-free one).
        timeout: Limit of every collective and transfer; a dead rank becomes an error after it.
        heartbeat_timeout: Seconds a rank may wait in a collective for a stuck rank (its process frozen, or its
            main thread standing still outside any collective) before every rank stops naming it (default 60;
            None: off).
        start_method: ``popen`` re-runs the script per process (the default, as DDP); ``fork``/``spawn`` for
            notebooks and tests, after which the main process's module holds the trained roles
            (:class:`~lightning_app_rlhf.strategies.placement_launcher.PlacementMultiProcessingLauncher`).
        process_group_backend: ``gloo``/``nccl``; default by device.
        threads_per_process: CPU threads per process (default: cores / local processes).
        checkpoint_io: Writes and reads checkpoint files. Default: :class:`AtomicCheckpointIO` (local files
            written in place, atomically, without a copy of the whole file in memory).
    """

    strategy_name = "rlhf_placement"

    multiprocessing_launcher = PlacementMultiProcessingLauncher
    subprocess_launcher = _SubprocessScriptLauncher
    placement_plan: PlacementPlan | None = None
    _sigterm_check: LaggedSigtermCheck | None = None
    """The plan in force (set in ``setup_environment``, or by :meth:`apply_plan`)."""
    _pending_restore: PendingRestore | None = None

    def build_plan(self, world_size: int, roles: tuple[str, ...] = ROLE_NAMES) -> PlacementPlan:
        """The plan for this world size and the algorithm's ``roles``. Presets override this."""
        if self._plan is None:
            raise ValueError("PlacementStrategy needs a `plan` (a PlacementPlan, or a function of the world size). "
                             "Or use a preset: strategy='rlhf_flattening', 'rlhf_interleaving' or 'rlhf_separation'.")
        return plan_for(self._plan, world_size, roles)

    # `is_distributed` stays unset (False) on purpose: every rank must read the same global batch, which each
    # call's group then shards (Placement.shard), so Lightning must not inject a DistributedSampler. Metrics
    # are identical on every rank, so `self.log(sync_dist=True)` is never needed.

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self.set_world_ranks()
        module = self.lightning_module
        if not hasattr(module, "placed_roles"):
            raise TypeError(f"{type(self).__name__} runs an RLHFModule; got {type(module).__name__}.")
        self._start_distributed()
        module.placed_roles = place(self.build_plan, module, self.world_size, self.global_rank, self.root_device,
                                    self._timeout, self.num_processes)
        self.placement_plan = module.placed_roles.placement.plan

    def apply_plan(self, plan: PlacementPlan) -> None:
        """Replace the plan after the process group exists and before any model is built, e.g. from a callback's
        ``setup()`` (:class:`~lightning_app_rlhf.callbacks.PlacementTuner` does). Collective: every rank calls it
        with the same plan."""
        module = self.lightning_module
        if any(module.role_module(role) is not None for role in module.algorithm.roles):
            raise RuntimeError("apply_plan() must run before the models are built (in a callback's setup(), not "
                               "later): each rank builds only the roles its plan gives it.")
        if plan.world_size != self.world_size:
            raise ValueError(f"The plan covers {plan.world_size} ranks but the job runs {self.world_size}. Plan for "
                             f"{self.world_size} ranks, or launch {plan.world_size} processes.")
        plan.check_roles(module.algorithm.roles, module.algorithm.name)
        check_tensor_parallel(plan)
        check_pipeline_parallel(plan)
        module.placed_roles = PlacedRoles(create_placement(plan, self.global_rank, self.root_device, self._timeout))
        self.placement_plan = plan

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.model is not None and self.accelerator is not None
        # Lightning's SIGTERM handler runs a collective inside the handler, which under a placement pairs with another
        # collective on the other ranks (a hang): see PlacementSignalConnector. setup() runs before the Trainer
        # registers its handlers.
        use_placement_signal_connector(trainer)
        if self.placement_plan is not None and self.placement_plan.free_running:
            # Lightning's per-iteration SIGTERM broadcast would hold the generation side to the training side's pace.
            self._sigterm_check = lag_sigterm_check(trainer, self.placement_plan.run_ahead + 1)
        # A stuck rank ends every process from the heartbeat's thread: the loggers save what they buffer first
        # (Lightning saves a CSV log at every step; TensorBoard's and others' writers buffer).
        before_exit("loggers", lambda: [logger.save() for logger in trainer.loggers])
        self.accelerator.setup(trainer)
        self.model_to_device()
        module = self.lightning_module
        wrap_roles(module, self.root_device)
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            module.attach_optimizers(self.optimizers)
        self.setup_precision_plugin()

    @override
    def on_train_end(self) -> None:
        super().on_train_end()
        if self._sigterm_check is not None:
            self._sigterm_check.finish()

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """One checkpoint for the whole job: see :func:`save_placed_checkpoint`."""
        save_placed_checkpoint(self, self.lightning_module, self.placement_plan, checkpoint, filepath,
                               storage_options)

    @override
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """A sharded role's optimizer state is saved with its shards: nothing here (a ZeRO engine's optimizer cannot
        even produce a ``torch.optim`` state dict)."""
        sharded = sharded_roles(self.placement_plan) if self.placement_plan is not None else []
        for role, mine in zip(self.lightning_module.trained_roles(), self.optimizers, strict=False):
            if mine is optimizer and role in sharded:
                return {}
        return super().optimizer_state(optimizer)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Read the checkpoint weights-only and check that this plan can resume it (:func:`read_placed_checkpoint`);
        the module then checks its checksum and weights and takes the roles this rank holds."""
        self._pending_restore = None
        checkpoint, self._pending_restore = read_placed_checkpoint(self, checkpoint_path, self.placement_plan,
                                                                   weights_only)
        return checkpoint

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        """Restore after :meth:`setup` when this plan shards a role: its shards load into the wrapped role and its
        optimizer, which exist only then. (Lightning then no longer passes ``weights_only`` to
        :meth:`load_checkpoint`, which reads weights-only anyway.)"""
        return self.placement_plan is not None and bool(sharded_roles(self.placement_plan))

    @override
    def load_model_state_dict(self, checkpoint: dict[str, Any], strict: bool = True) -> None:
        """The roles that load whole as Lightning does; the others (shards, or whole weights into an FSDP2 role)
        once the roles are wrapped: now when restoring after setup, else with the optimizer states."""
        restore = self._pending_restore
        load_whole_roles(self.lightning_module, restore, checkpoint["state_dict"], strict)
        if restore is not None and restore.special and self.restore_checkpoint_after_setup:
            restore_special_roles(self.lightning_module, restore, checkpoint)

    @override
    def load_optimizer_state_dict(self, checkpoint: dict[str, Any]) -> None:
        restore = self._pending_restore
        if restore is not None and restore.special and not restore.done:
            restore_special_roles(self.lightning_module, restore, checkpoint)
        load_whole_optimizers(self.lightning_module, restore, self.optimizers, checkpoint["optimizer_states"],
                              self.root_device)
        self._pending_restore = None

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        if isinstance(tensor, torch.Tensor):
            return self.reduce_tensor(tensor, group, reduce_op)
        return tensor


def save_placed_checkpoint(
    strategy: Any, module: Any, plan: PlacementPlan, checkpoint: dict[str, Any], filepath: Any,
    storage_options: Any | None = None,
) -> None:
    """Write one file for the whole job from this rank's ``checkpoint`` (Lightning's layout: its ``state_dict``,
    ``optimizer_states`` and ``lr_schedulers`` cover the roles this rank holds and trains). Collective: every rank
    calls it; rank 0 writes, with one copy of each role taken from its owner rank
    (:func:`~lightning_app_rlhf.checkpoint.format.role_owner`). Only the roles that rank 0 does not own travel to it, one
    owner at a time, so a save holds at most one extra copy of those roles, never every rank's state.

    A role that its wrapper shards (FSDP2, ZeRO over more than one rank) is never gathered: each rank of its group
    writes its own shard, and the checkpoint becomes a directory (see
    :mod:`~lightning_app_rlhf.strategies.sharded_checkpoint`), put in place of ``filepath`` in one rename.

    Args:
        strategy: The Trainer or Fabric placement strategy (its ranks, device, ``checkpoint_io`` and collectives).
        module: The RLHFModule.
        plan: The plan the roles are placed by.
        checkpoint: This rank's checkpoint.
        filepath: Where the checkpoint goes.
        storage_options: For ``strategy.checkpoint_io``.
    """
    check_pipelined_checkpoint(plan)  # before any collective: every rank raises alike
    sharded = sharded_roles(plan)
    staging = staging_directory(strategy, filepath) if sharded else None
    if staging is not None:
        save_shards(module, sharded, staging, optimizer="optimizer_states" in checkpoint)
    owners = {role: role_owner(plan, role) for role in module.algorithm.roles}
    mine = owned_state(checkpoint, [r for r, owner in owners.items() if owner == strategy.global_rank],
                       module.trained_roles(), module.scheduled_roles(), sharded)
    senders = sorted({owner for owner in owners.values() if owner != 0})
    if not strategy.is_global_zero:
        if strategy.global_rank in senders:
            send_state(mine, dst=0)
        if staging is not None:
            checksum_shards(strategy, staging, sharded)
        return
    parts = dict(mine)
    for rank in senders:
        parts.update(recv_state(rank, strategy.root_device))
    checkpoint = assemble(checkpoint, parts)
    checkpoint["rlhf_plan"] = {"name": plan.name, "world_size": plan.world_size, "calls": plan.calls,
                               "wrappers": dict(plan.wrappers)}
    checkpoint[LAYOUT_KEY] = role_layout(plan)
    if staging is None:
        seal(checkpoint)
        strategy.checkpoint_io.save_checkpoint(checkpoint, filepath, storage_options=storage_options)
        return
    checkpoint["rlhf_files"] = checksum_shards(strategy, staging, sharded)
    publish(strategy, checkpoint, staging, filepath, seal)


def read_placed_checkpoint(
    strategy: Any, checkpoint_path: Any, plan: PlacementPlan, weights_only: bool | None = None
) -> tuple[dict[str, Any], PendingRestore | None]:
    """Read a checkpoint weights-only (a crafted file cannot run code) and check that ``plan`` can resume it.
    Collective when the checkpoint is a directory: every rank checks a slice of its shard files.

    Any plan that places the saved roles can resume: whole roles load from their one copy wherever this plan
    holds them, FSDP2 shards reshard to this run's groups, ZeRO shards need the saved stage and number of ranks
    (:func:`~lightning_app_rlhf.checkpoint.format.restore_modes` names the fix otherwise). A checkpoint directory's
    shard files are checked against the CRC-32 values its meta file lists, by every rank, before anything loads.

    Returns:
        The checkpoint, and how each role restores (None for a checkpoint saved without a placement, or in the
        per-rank layout of earlier versions, whose entry for this rank it returns).
    """
    refuse_unsafe_loading(strategy, weights_only)
    local = isinstance(checkpoint_path, (str, os.PathLike)) and "://" not in str(checkpoint_path)
    if local:
        check_checkpoint_file(checkpoint_path)
    file = checkpoint_file(checkpoint_path) if local else checkpoint_path
    try:
        checkpoint = strategy.checkpoint_io.load_checkpoint(file, weights_only=True)
    except pickle.UnpicklingError as err:
        raise not_weights_only(file, err) from err
    saved = checkpoint.get("rlhf_plan")
    if saved is None:
        return checkpoint, None  # saved without a placement: one process held every role
    if "rlhf_ranks" in checkpoint:  # the per-rank layout of earlier versions: this rank's entry
        if saved["world_size"] != plan.world_size or dict(saved["calls"]) != plan.calls:
            raise ValueError(f"The checkpoint was saved under the {saved['name']!r} plan on {saved['world_size']} "
                             f"ranks, in the per-rank layout of earlier versions; this run uses {plan.name!r} on "
                             f"{plan.world_size}. Resume with the same strategy, its arguments and "
                             "--trainer.devices.")
        mine = checkpoint.pop("rlhf_ranks")[strategy.global_rank]
        checkpoint.update({key: value for key, value in mine.items() if value is not None})
        return checkpoint, None
    sharded = is_sharded_checkpoint(checkpoint_path)
    if sharded:
        verify(checkpoint, file)  # the meta file first: its list of shard files is what the shards are checked by
    modes = restore_modes(checkpoint, plan, checkpoint_path)
    if sharded:
        check_shards(strategy, checkpoint, Path(checkpoint_path))
        checkpoint[SHARDS_LOADER_KEY] = True
    return checkpoint, PendingRestore(Path(str(checkpoint_path)), modes)


def refuse_unsafe_loading(strategy: Any, weights_only: bool | None) -> None:
    """Raise a ``ValueError`` naming the fix when a load asks for ``weights_only=False``."""
    if weights_only is False:
        raise ValueError(f"{type(strategy).__name__} loads checkpoints with weights_only=True only: unpickling "
                         "arbitrary objects would run code from the file. Drop weights_only=False; checkpoints "
                         "written by this package load weights-only.")
