"""Checkpoint files we can trust: weights-only reading, a checksum of every tensor, finite weights, and one entry
per role. Plain PyTorch, no Lightning.

A placement spreads the roles over ranks, so no rank holds the whole job's state. The checkpoint keeps one copy of
each role: its weights (in ``state_dict``, as in any Lightning checkpoint), and its optimizer and LR scheduler
state (``rlhf_optimizers`` and ``rlhf_schedulers``, by role). Each copy comes from the role's owner rank, and a
rank rebuilds its own state from the roles it holds, under any placement that holds them whole.
"""

from __future__ import annotations

import os
import pickle
import zipfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lightning_app_rlhf.plan import PlacementPlan
from lightning_app_rlhf.role_table import ROLES, TRAINABLE_ROLES, role_of

CHECKSUM_KEY = "rlhf_checksum"
OPTIMIZERS_KEY = "rlhf_optimizers"
SCHEDULERS_KEY = "rlhf_schedulers"
CHECKED_KEYS = ("state_dict", OPTIMIZERS_KEY, SCHEDULERS_KEY, "optimizer_states", "lr_schedulers", "rlhf")
"""The entries the checksum covers: weights, optimizer and scheduler state, and the module's own state."""


class CheckpointError(ValueError):
    """A checkpoint file that cannot be trusted: empty, truncated, corrupted, not loadable weights-only, or holding
    non-finite weights."""


# ---- reading ----


def check_checkpoint_file(path: str | os.PathLike[str]) -> None:
    """Raise a :class:`CheckpointError` naming ``path`` unless it is a non-empty ``torch.save`` archive.

    Cheap (reads the zip directory only), so it runs before a load that would otherwise fail with a bare
    ``EOFError`` or a ``PytorchStreamReader`` error that names no file.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"Checkpoint {path} does not exist. Pass the path of a .ckpt file.")
    if path.stat().st_size == 0:
        raise CheckpointError(f"Checkpoint {path} is empty (0 bytes): its save was interrupted. Resume from an "
                              f"earlier checkpoint in {path.parent}, or start without a checkpoint.")
    if not zipfile.is_zipfile(path):
        raise CheckpointError(f"Checkpoint {path} is not a complete torch.save archive (truncated or corrupted, "
                              f"{path.stat().st_size} bytes). Resume from an earlier checkpoint in {path.parent}.")


def load_checkpoint_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a checkpoint on the CPU with ``weights_only=True``: tensors and plain containers only, so a crafted
    file cannot run code. Errors name the file."""
    check_checkpoint_file(path)
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as err:
        raise not_weights_only(path, err) from err
    except (RuntimeError, EOFError, ValueError) as err:
        raise CheckpointError(f"Checkpoint {path} could not be read ({type(err).__name__}: {err}). Resume from an "
                              f"earlier checkpoint in {Path(path).parent}.") from err


def not_weights_only(path: str | os.PathLike[str], err: BaseException) -> CheckpointError:
    """The error for a file that only a full unpickle could load."""
    return CheckpointError(
        f"Checkpoint {path} holds objects that only a full unpickle can build, and unpickling runs code from the "
        f"file, so it is refused. Checkpoints written by this package load weights-only; resume from one of those. "
        f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})"
    )


# ---- integrity ----


def checksum(checkpoint: dict[str, Any]) -> str:
    """CRC-32 over the bytes, dtypes, shapes and key paths of every tensor and plain value in the
    :data:`CHECKED_KEYS` entries, in their order."""
    crc = 0
    for key, value in _leaves({k: checkpoint[k] for k in CHECKED_KEYS if k in checkpoint}):
        crc = zlib.crc32(key.encode(), crc)
        if isinstance(value, torch.Tensor):
            tensor = value.detach().cpu().contiguous()
            crc = zlib.crc32(f"{tensor.dtype}{tuple(tensor.shape)}".encode(), crc)
            if tensor.numel():
                crc = zlib.crc32(tensor.reshape(-1).view(torch.uint8).numpy(), crc)
        else:
            crc = zlib.crc32(repr(value).encode(), crc)
    return f"crc32:{crc:08x}"


def seal(checkpoint: dict[str, Any]) -> None:
    """Store the checksum of ``checkpoint`` in it, for :func:`verify` to check on load."""
    checkpoint[CHECKSUM_KEY] = checksum(checkpoint)


def verify(checkpoint: dict[str, Any], path: str | os.PathLike[str] | None) -> None:
    """Raise a :class:`CheckpointError` naming ``path`` when the checksum written at save time does not match, or
    when a weight is NaN or infinite. A checkpoint without a checksum (not written by this package) is checked for
    finite weights only."""
    saved = checkpoint.get(CHECKSUM_KEY)
    if saved is not None and saved != checksum(checkpoint):
        raise CheckpointError(f"Checkpoint {path} fails its checksum: its contents changed after it was saved "
                              "(disk or copy corruption). Resume from an earlier checkpoint, or copy it again.")
    bad = [key for key, tensor in checkpoint.get("state_dict", {}).items()
           if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all())]
    if bad:
        raise CheckpointError(f"Checkpoint {path} has NaN or infinite values in {len(bad)} weight tensors (first: "
                              f"{bad[:3]}). Training would go on with broken weights; resume from an earlier "
                              "checkpoint.")


def _leaves(value: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _leaves(item, f"{prefix}/{key}")
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _leaves(item, f"{prefix}/{i}")
    else:
        yield prefix, value


# ---- one entry per role ----


def role_owner(plan: PlacementPlan, role: str) -> int:
    """The rank whose copy of ``role`` the checkpoint keeps: the leader of its train call (the trained weights and
    the optimizer state), or for a frozen role the lowest rank that holds it."""
    if role in TRAINABLE_ROLES:
        return plan.ranks(f"{role}.train")[0]
    return min(rank for call in plan.calls if role_of(call) == role for rank in plan.ranks(call))


def owned_state(
    checkpoint: dict[str, Any], roles: list[str], trained: list[str], scheduled: list[str]
) -> dict[str, dict[str, Any]]:
    """This rank's part of the checkpoint: for each role in ``roles``, its weights, and where it trains here its
    optimizer and scheduler state.

    Args:
        checkpoint: This rank's Lightning checkpoint (its ``state_dict``, ``optimizer_states`` and
            ``lr_schedulers`` list the roles this rank holds and trains, in optimizer order).
        roles: The roles this rank owns.
        trained: The roles this rank trains, in optimizer order.
        scheduled: The trained roles that have an LR scheduler, in order.
    """
    attributes = {entry.name: entry.attribute for entry in ROLES}
    state_dict = checkpoint.get("state_dict", {})
    optimizers, schedulers = checkpoint.get("optimizer_states") or [], checkpoint.get("lr_schedulers") or []
    out = {}
    for role in roles:
        prefix = attributes[role] + "."
        out[role] = {"state_dict": {k: v for k, v in state_dict.items() if k.startswith(prefix)}}
        if role in trained and optimizers:
            out[role]["optimizer"] = optimizers[trained.index(role)]
        if role in scheduled and schedulers:
            out[role]["scheduler"] = schedulers[scheduled.index(role)]
    return out


@dataclass(frozen=True)
class _TensorSlot:
    """Where a tensor stood in a state sent by :func:`send_state`; its bytes follow as their own message."""

    index: int
    dtype: torch.dtype
    shape: tuple[int, ...]


def send_state(state: Any, dst: int) -> None:
    """Send a nested state (dicts, lists, tensors, plain values) to rank ``dst``: its structure as one pickled
    object, then each tensor's bytes as they are, with no pickled copy of the tensors on either side. A tensor that
    appears twice (tied weights) is sent once and arrives as one tensor."""
    tensors: list[torch.Tensor] = []
    slots: dict[tuple[Any, ...], _TensorSlot] = {}

    def strip(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            key = (value.data_ptr(), value.dtype, tuple(value.shape), value.stride())
            if key not in slots or not value.numel():
                slots[key] = _TensorSlot(len(tensors), value.dtype, tuple(value.shape))
                tensors.append(value.detach().contiguous())
            return slots[key]
        return _map_containers(value, strip)

    dist.send_object_list([strip(state)], dst=dst)
    for tensor in tensors:
        if tensor.numel():
            dist.send(tensor.reshape(-1).view(torch.uint8), dst=dst)


def recv_state(src: int, device: torch.device) -> Any:
    """Receive what :func:`send_state` sent from rank ``src``, its tensors on ``device``."""
    box: list[Any] = [None]
    dist.recv_object_list(box, src=src, device=device if device.type != "cpu" else None)
    received: dict[int, torch.Tensor] = {}

    def collect(value: Any) -> Any:
        if isinstance(value, _TensorSlot):
            received.setdefault(value.index, torch.empty(value.shape, dtype=value.dtype, device=device))
        else:
            _map_containers(value, collect)
        return value

    collect(box[0])
    for index in sorted(received):  # the order they were sent in
        if received[index].numel():
            dist.recv(received[index].reshape(-1).view(torch.uint8), src=src)

    def fill(value: Any) -> Any:
        return received[value.index] if isinstance(value, _TensorSlot) else _map_containers(value, fill)

    return fill(box[0])


def _map_containers(value: Any, function: Any) -> Any:
    if isinstance(value, dict):
        return {key: function(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(function(item) for item in value)
    return value


def assemble(checkpoint: dict[str, Any], parts: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The file's content: ``checkpoint``'s global entries, every role's weights in ``state_dict``, and the
    optimizer and scheduler states by role. The per-rank lists are left empty: :func:`rank_state` rebuilds them."""
    out = {key: value for key, value in checkpoint.items() if key not in ("state_dict", "optimizer_states",
                                                                           "lr_schedulers")}
    out["state_dict"] = {k: v for part in parts.values() for k, v in part["state_dict"].items()}
    out[OPTIMIZERS_KEY] = {role: part["optimizer"] for role, part in parts.items() if "optimizer" in part}
    out[SCHEDULERS_KEY] = {role: part["scheduler"] for role, part in parts.items() if "scheduler" in part}
    out["optimizer_states"], out["lr_schedulers"] = [], []
    return out


def rank_state(
    checkpoint: dict[str, Any], held: list[str], trained: list[str], scheduled: list[str], path: Any
) -> None:
    """Rewrite ``checkpoint`` in place into what one rank loads: the weights of the roles it holds, and the
    optimizer and scheduler states of the roles it trains, in its optimizer order.

    Args:
        checkpoint: A checkpoint with per-role entries (see :func:`assemble`).
        held: The roles this rank holds.
        trained: The roles this rank trains, in optimizer order.
        scheduled: The trained roles that have an LR scheduler, in order.
        path: The file, for error messages.
    """
    attributes = tuple(entry.attribute + "." for entry in ROLES if entry.name in held)
    checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if k.startswith(attributes)}
    missing = [role for role in trained if role not in checkpoint[OPTIMIZERS_KEY]]
    if missing:
        raise CheckpointError(f"Checkpoint {path} has no optimizer state for {missing}, which this run trains. "
                              "Resume with the algorithm and roles it was saved with.")
    checkpoint["optimizer_states"] = [checkpoint[OPTIMIZERS_KEY][role] for role in trained]
    checkpoint["lr_schedulers"] = [checkpoint[SCHEDULERS_KEY][role] for role in scheduled
                                   if role in checkpoint[SCHEDULERS_KEY]]
