"""Checkpoints with sharded roles, for :class:`~lightning_app_rlhf.strategies.PlacementStrategy`: each rank of a
sharded role's group writes its own shard into a staging directory beside the target, rank 0 adds the meta file,
and the directory then replaces the target in one rename. On resume each role loads by its
:func:`~lightning_app_rlhf.checkpoint.format.restore_modes` entry, once the roles are wrapped and their optimizers exist.

Layout of ``epoch=0-step=2.ckpt/``::

    meta.ckpt             rank 0's file: loops, callbacks, module state, whole roles, LR schedulers, and the
                          sharded roles' layout and shard files with their CRC-32 (sealed like a one-file checkpoint)
    actor/                a role sharded with FSDP2: torch.distributed.checkpoint files (.metadata, __0_0.distcp, ...)
    critic/zero/          a role sharded with ZeRO: DeepSpeed's files (mp_rank_00_model_states.pt,
                          zero_pp_rank_0_mp_rank_00_optim_states.pt, ...), and its zero_to_fp32.py script
"""

from __future__ import annotations

import contextlib
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.optimizer import _optimizer_to_device

from lightning_app_rlhf.checkpoint.format import (
    FILES_KEY,
    META_FILE,
    OPTIMIZERS_KEY,
    CheckpointError,
    check_shard_files,
    file_checksum,
    home_call,
    shard_files,
)
from lightning_app_rlhf.core.files import remove_path, replace_atomically
from lightning_app_rlhf.core.role_table import ROLES, TRAINABLE_ROLES
from lightning_app_rlhf.parallel.reallocation import shadow_buckets, trained_buckets
from lightning_app_rlhf.parallel.wrappers.sharded_io import load_dcp, load_full


@dataclass
class PendingRestore:
    """What a strategy must still restore from the checkpoint it loaded: the roles that do not load whole."""

    path: Path
    """The checkpoint (a directory when it has shards)."""
    modes: dict[str, str]
    """Role -> ``whole``, ``shards`` or ``full_into_sharded``."""
    done: bool = False
    """Whether the roles that do not load whole are restored."""

    @property
    def special(self) -> list[str]:
        """The roles that do not load from the meta file's one copy through Lightning's hooks."""
        return [role for role, mode in self.modes.items() if mode != "whole"]


def prefix(role: str) -> str:
    return next(entry.attribute for entry in ROLES if entry.name == role) + "."


# ---- save ----


def staging_directory(strategy: Any, filepath: Any) -> Path:
    """Create the hidden sibling directory a sharded save writes into, on rank 0, and tell every rank its name."""
    if "://" in str(filepath):
        raise ValueError(f"Checkpoints with sharded roles are written as directories by every rank, on a local or "
                         f"shared file system; got {filepath}. Save to a path every rank can write.")
    target = Path(filepath)
    staging = None
    if strategy.is_global_zero:
        staging = target.with_name(f".{target.name}.partial-{secrets.token_hex(4)}")
        staging.mkdir(parents=True)
    return Path(strategy.broadcast(str(staging) if staging else None))


def save_shards(module: Any, roles: list[str], staging: Path, optimizer: bool) -> None:
    """Each rank writes its shard of every sharded role it holds a part of, role by role in the same order on
    every rank (each role's save is a collective over its own group)."""
    placement = module.placed_roles.placement
    for role in roles:
        wrapper = module.placed_roles.wrappers.get(role)
        if wrapper is not None and placement.runs(home_call(role)):
            trains = role in TRAINABLE_ROLES and role in module.trained_roles()
            wrapper.save_sharded(staging / role, optimizer=optimizer and trains)


def checksum_shards(strategy: Any, staging: Path, roles: list[str]) -> dict[str, dict[str, Any]]:
    """After every rank wrote its shards: each rank checksums (and fsyncs) a slice of the files; rank 0 gets them
    all. Collective over the world."""
    strategy.barrier("rlhf_sharded_save")
    names = shard_files(staging, roles)
    mine = {name: file_checksum(staging / name) for name in names[strategy.global_rank :: strategy.world_size]}
    everyone: list[Any] = [mine]
    if strategy.world_size > 1:
        everyone = [None] * strategy.world_size
        dist.all_gather_object(everyone, mine)
    return {name: sums[name] for sums in everyone for name in sorted(sums)}


def publish(strategy: Any, checkpoint: dict[str, Any], staging: Path, filepath: Any, seal: Any) -> None:
    """Rank 0: write the meta file into the staging directory and put the directory in place of ``filepath``
    (replacing an older checkpoint there in one step). On failure the staging directory is removed and the old
    checkpoint stays."""
    try:
        seal(checkpoint)
        strategy.checkpoint_io.save_checkpoint(checkpoint, staging / META_FILE)
        replace_atomically(staging, filepath)
    except BaseException:
        with contextlib.suppress(OSError):
            remove_path(staging)
        raise


# ---- load ----


def check_shards(strategy: Any, checkpoint: dict[str, Any], directory: Path) -> None:
    """Every shard file listed in the meta file is there with the bytes it was saved with; each rank checks a slice,
    and every rank raises the first problem found. Collective over the world."""
    expected = checkpoint.get(FILES_KEY) or {}
    names = sorted(expected)[strategy.global_rank :: strategy.world_size]
    problem = check_shard_files(directory, expected, names)
    problems: list[Any] = [problem]
    if strategy.world_size > 1:
        problems = [None] * strategy.world_size
        dist.all_gather_object(problems, problem)
    first = next((p for p in problems if p), None)
    if first:
        raise CheckpointError(first)


def restore_special_roles(module: Any, restore: PendingRestore, checkpoint: dict[str, Any]) -> None:
    """Load the roles that do not load whole: from their shards through this rank's wrapper (or, for a frozen role
    held whole here, every shard read on this rank), or whole weights into an FSDP2 role's shards. Shadow copies of
    a trained role restored from shards get its weights by reallocation, as after an update. Every rank calls it,
    after the roles are wrapped and their optimizers attached."""
    placement = module.placed_roles.placement
    trained = module.trained_roles()
    for role in module.algorithm.roles:
        mode = restore.modes.get(role, "whole")
        if mode == "whole" or not placement.holds(role):
            continue
        wrapper = module.placed_roles.wrappers.get(role)
        home = wrapper is not None and placement.runs(home_call(role))
        trains = role in trained
        if mode == "shards":
            if home:
                wrapper.load_sharded(restore.path / role, optimizer=trains)
            elif role not in TRAINABLE_ROLES:  # a frozen role this plan holds whole: read every shard here
                load_dcp(module.role_module(role), None, restore.path / role, None, 1)
        elif home:  # full_into_sharded
            weights = {k[len(prefix(role)) :]: v for k, v in checkpoint["state_dict"].items()
                       if k.startswith(prefix(role))}
            optimizer_state = checkpoint.get(OPTIMIZERS_KEY, {}).get(role) if trains else None
            load_full(wrapper.module, wrapper.optimizer if trains else None, weights, optimizer_state)
        else:  # a shadow of a role sharded elsewhere: its whole weights, as a whole role
            load_role_weights(module, role, checkpoint["state_dict"], strict=True)
    for role in module.algorithm.trainable_roles:
        if restore.modes.get(role) != "shards" or not placement.plan.shadow_ranks(role):
            continue
        if placement.runs(f"{role}.train"):
            placement.reallocate_weights(role, trained_buckets(module.placed_roles.wrappers[role],
                                                                module.specs.shadow_precisions().get(role)))
        elif placement.rank in placement.plan.shadow_ranks(role):
            placement.reallocate_weights(role, shadow_buckets(module.role_module(role)))
    restore.done = True


def load_role_weights(module: Any, role: str, state_dict: dict[str, torch.Tensor], strict: bool) -> None:
    """Load one whole role's weights from a module-level state dict."""
    weights = {k[len(prefix(role)) :]: v for k, v in state_dict.items() if k.startswith(prefix(role))}
    module.role_module(role).load_state_dict(weights, strict=strict)


def load_whole_roles(module: Any, restore: PendingRestore | None, state_dict: dict[str, torch.Tensor],
                     strict: bool) -> None:
    """Lightning's ``load_model_state_dict`` for the roles that load whole; the others are left to
    :func:`restore_special_roles`."""
    if restore is None or not restore.special:
        module.load_state_dict(state_dict, strict=strict)
        return
    whole = [role for role in module.algorithm.roles
             if module.role_module(role) is not None and role not in restore.special
             and isinstance(module.role_module(role), torch.nn.Module)]
    for role in whole:
        load_role_weights(module, role, state_dict, strict)
    known = tuple(prefix(role) for role in module.algorithm.roles)
    unexpected = [k for k in state_dict if not k.startswith(known)]
    if strict and unexpected:
        raise RuntimeError(f"Unexpected key(s) in the checkpoint's state_dict: {unexpected[:5]}.")


def load_whole_optimizers(module: Any, restore: PendingRestore | None, optimizers: list[Any],
                          states: list[Any], device: torch.device) -> None:
    """Lightning's ``load_optimizer_state_dict`` for the roles that load whole (in optimizer order)."""
    special = set(restore.special) if restore is not None else set()
    for role, optimizer, state in zip(module.trained_roles(), optimizers, states, strict=False):
        if role in special or state is None:
            continue
        optimizer.load_state_dict(state)
        _optimizer_to_device(optimizer, device)
