"""What an ``RLHFModule`` keeps in a Lightning checkpoint beyond its weights and optimizers, and the checks on load.

Its hyperparameters as plain data (a weights-only load reads them), a tokenizer object as its files, the RLHF state
(the engine's :meth:`~lightning_app_rlhf.engine.engine.RLHFEngine.state_dict`, the seed, the algorithm); on load, the checksum, this rank's
share of a per-role checkpoint, and role shapes that fit the run's models, each with an error naming the fix.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from lightning_app_rlhf.checkpoint.format import (
    LAYOUT_KEY,
    OPTIMIZERS_KEY,
    SCHEDULERS_KEY,
    CheckpointError,
    rank_state,
    seal,
    verify,
)
from lightning_app_rlhf.core.role_table import REFERENCE, ROLES
from lightning_app_rlhf.models.roles import resolve_import, tokenizer_files

if TYPE_CHECKING:
    from lightning_app_rlhf.module import RLHFModule

RLHF_STATE_KEY = "rlhf"
"""The checkpoint entry of the RLHF state: plain tensors and ints, so a weights-only load accepts it."""


def plain_hyperparameters(arguments: dict[str, Any]) -> dict[str, Any]:
    """The module's arguments as plain data: specs and configs as dicts (no objects, so a weights-only load reads
    them); a tokenizer object as a placeholder (its files are embedded at save: :func:`save_rlhf_state`); a reward
    function, and an environment's class, as its import path when it has one; optimizer and scheduler builders (code)
    not at all."""
    plain = {}
    for name, value in arguments.items():
        if name in ("self", "__class__"):
            continue
        if dataclasses.is_dataclass(value):
            value = dataclasses.asdict(value)
        elif isinstance(value, PreTrainedTokenizerBase):
            value = f"<{type(value).__name__}: embedded in checkpoints>"
        elif name == "environment" and value is not None:  # its class (or factory), restorable when it takes no arguments
            instance = not isinstance(value, type) and hasattr(value, "reset")  # not a class or a factory
            value = import_path(type(value) if instance else value)
        elif callable(value):
            value = import_path(value) if name == "reward_fn" else None
        plain[name] = value
    return plain


def import_path(function: Any) -> str | None:
    """``"package.module.name"`` when that path imports back to ``function`` (not a lambda, closure or partial)."""
    path = f"{getattr(function, '__module__', '')}.{getattr(function, '__qualname__', '')}"
    try:
        return path if resolve_import(path) is function else None
    except (ImportError, AttributeError, ValueError):
        return None


def save_rlhf_state(module: RLHFModule, checkpoint: dict[str, Any]) -> None:
    """``on_save_checkpoint``: a tokenizer object's files, and the RLHF state; sealed here when no placement
    strategy assembles the file."""
    hparams = checkpoint.get(module.CHECKPOINT_HYPER_PARAMS_KEY)
    if hparams is not None and str(hparams.get("tokenizer", "")).startswith("<"):
        # A tokenizer object: its files, so load_from_checkpoint rebuilds it without the original.
        checkpoint[module.CHECKPOINT_HYPER_PARAMS_KEY] = {**hparams, "tokenizer": tokenizer_files(module.tokenizer)}
    checkpoint[RLHF_STATE_KEY] = {**module.engine.state_dict(), "seed": module.seed, "algorithm": module.algorithm.name}
    if not module.placed_roles.placement.distributed:  # a placement strategy seals the file it assembles on rank 0
        seal(checkpoint)


def load_rlhf_state(module: RLHFModule, checkpoint: dict[str, Any], path: Any) -> None:
    """``on_load_checkpoint``: check the file and that it fits, take this rank's share, restore the RLHF state."""
    verify(checkpoint, path)
    placed = module.placed_roles is not None and module.placed_roles.placement.distributed
    if OPTIMIZERS_KEY not in checkpoint and "rlhf_ranks" not in checkpoint and placed:
        by_role(module, checkpoint)  # a one-process run saved it: every role whole, in one process's order
    if OPTIMIZERS_KEY in checkpoint:  # one entry per role (a placement strategy saved it): take this rank's
        held = [role for role in module.algorithm.roles if module.role_module(role) is not None]
        rank_state(checkpoint, held, module.trained_roles(), module.scheduled_roles(), path)
    elif "rlhf_ranks" in checkpoint:
        saved = checkpoint["rlhf_plan"]
        raise CheckpointError(f"Checkpoint {path} keeps each of its {saved['world_size']} ranks' state apart (the "
                              "layout of earlier versions), and this run has no placement strategy to pick its "
                              f"rank's part. Resume with the strategy it was saved with ({saved['name']!r}) and "
                              f"--trainer.devices {saved['world_size']}.")
    check_role_shapes(module, checkpoint, path)  # before any weight loads, which would name no role nor fix
    state = checkpoint.get(RLHF_STATE_KEY)
    if state is None:
        return
    saved = state.get("algorithm", "ppo")
    if saved != module.algorithm.name:
        raise ValueError(f"The checkpoint was trained with algorithm {saved!r}; this run uses "
                         f"{module.algorithm.name!r}. Resume with --model.algorithm {saved}, or start a new run.")
    module.seed = state["seed"]
    try:
        module.engine.load_state_dict(state)
    except ValueError as err:  # the engine names what does not fit and the fix; this names the file
        raise CheckpointError(f"Checkpoint {path} {err}") from None


def by_role(module: RLHFModule, checkpoint: dict[str, Any]) -> None:
    """Give a one-process checkpoint the per-role entries a placement strategy writes (see
    :func:`~lightning_app_rlhf.checkpoint.format.assemble`), so that a placement resumes from it: one process trained
    every trainable role, so its optimizer (and scheduler) states are in the algorithm's role order."""
    trained = list(module.algorithm.trainable_roles)
    scheduled = [role for role in trained if getattr(module, f"{role}_scheduler") is not None]
    checkpoint[OPTIMIZERS_KEY] = dict(zip(trained, checkpoint.get("optimizer_states") or [], strict=False))
    checkpoint[SCHEDULERS_KEY] = dict(zip(scheduled, checkpoint.get("lr_schedulers") or [], strict=False))


def check_role_shapes(module: RLHFModule, checkpoint: dict[str, Any], path: Any) -> None:
    """Raise a :class:`CheckpointError` naming the role and the parameters when the weights saved for a role this
    rank holds do not fit its module: a shape changed (``saved [512, 32], now [512, 64]``), or parameters are
    missing or extra (another number of layers, LoRA on or off), with the model settings that differ from the
    saved hyperparameters. A role the checkpoint keeps as shards (FSDP2, ZeRO) is left to its wrapper's loader; a
    role this rank does not hold is checked by the ranks that hold it."""
    saved = checkpoint.get("state_dict")
    if not isinstance(saved, dict):
        return
    if REFERENCE.name not in module.algorithm.roles and any(k.startswith(REFERENCE.attribute + ".") for k in saved):
        raise CheckpointError(f"Checkpoint {path} holds a reference model: it was saved by a run with a KL term. This "
                              "run has no KL (ppo.kl_coef and ppo.kl_loss_coef 0), so no reference. Resume with the "
                              "KL coefficients it was saved with, or start a new run without --ckpt_path.")
    layout = checkpoint.get(LAYOUT_KEY) or {}
    strict = getattr(module, "strict_loading", True)
    problems, attributes = [], []
    for entry in ROLES:
        held = module.role_module(entry.name) if entry.name in module.algorithm.roles else None
        if not isinstance(held, nn.Module) or layout.get(entry.name, {}).get("format", "whole") != "whole":
            continue
        start = entry.attribute + "."
        now = {start + k: tuple(getattr(v, "ds_shape", v.shape)) for k, v in held.state_dict(keep_vars=True).items()}
        then = {k: tuple(v.shape) for k, v in saved.items() if k.startswith(start) and isinstance(v, torch.Tensor)}
        changed = [f"{k} saved {list(then[k])}, now {list(now[k])}" for k in then if k in now and then[k] != now[k]]
        missing = [k for k in now if k not in then] if strict else []
        extra = [k for k in then if k not in now] if strict else []
        parts = [f"{len(names)} {what} (e.g. {'; '.join(names[:3])})"
                 for what, names in (("changed shape", changed), ("missing from the checkpoint", missing),
                                     ("in the checkpoint but not in this model", extra)) if names]
        if entry.name == REFERENCE.name and not then:
            parts = ["none in the checkpoint: it was saved by a run without KL (ppo.kl_coef and ppo.kl_loss_coef 0), "
                     "which has no reference; resume with both at 0"]
        if parts:
            problems.append(f"role {entry.name!r}: {', '.join(parts)}")
            attributes.append(entry.attribute)
    if not problems:
        return
    before = checkpoint.get(module.CHECKPOINT_HYPER_PARAMS_KEY) or {}
    differences = [f"{key} saved {value!r}, now {current!r}" for attribute in attributes
                   for key, value, current in _differences(before.get(attribute), module.hparams.get(attribute),
                                                           f"model.{attribute}")]
    settings = f" Its settings differ: {'; '.join(differences[:5])}." if differences else ""
    raise CheckpointError(
        f"Checkpoint {path} does not fit this run's model: {' | '.join(problems)}.{settings} Resume with the model "
        "config it was saved with, or start a new run without --ckpt_path (to start from its weights in a new run, "
        "export them with RLHFModule.load_from_checkpoint(...).export_actor(directory) and pass --model.actor.path "
        "directory).")


def _differences(saved: Any, current: Any, prefix: str) -> Iterable[tuple[str, Any, Any]]:
    """``(key path, saved, current)`` for each plain setting that differs between two nested dicts."""
    if isinstance(saved, dict) and isinstance(current, dict):
        for key in dict.fromkeys([*saved, *current]):
            yield from _differences(saved.get(key), current.get(key), f"{prefix}.{key}")
    elif saved != current and (saved is None or isinstance(saved, (str, int, float, bool, list, tuple))):
        yield prefix, saved, current
