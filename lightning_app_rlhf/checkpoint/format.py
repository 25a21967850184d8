"""Checkpoint files we can trust: weights-only reading, a checksum of every tensor, finite weights, and one entry
per role. Plain PyTorch, no Lightning.

A placement spreads the roles over ranks, so no rank holds the whole job's state. The checkpoint keeps one copy of
each role: its weights (in ``state_dict``, as in any Lightning checkpoint), and its optimizer and LR scheduler
state (``rlhf_optimizers`` and ``rlhf_schedulers``, by role). Each copy comes from the role's owner rank, and a
rank rebuilds its own state from the roles it holds, under any placement that holds them whole.

A role whose wrapper shards it (FSDP2, ZeRO) is never gathered: each rank of its group writes its own shard. The
checkpoint is then a directory (``step=2.ckpt/``) holding :data:`META_FILE`, the file above without the sharded
roles' weights and optimizer state, and one subdirectory per sharded role, written by its wrapper
(:meth:`~lightning_app_rlhf.parallel.wrappers.RoleWrapper.save_sharded`). The meta file lists every shard file with its
CRC-32 (:data:`FILES_KEY`) and each role's wrapper and group size (:data:`LAYOUT_KEY`), from which a resumed run
decides how each role loads under its own plan (:func:`restore_modes`).
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

from lightning_app_rlhf.core.role_table import ROLES, TRAINABLE_ROLES, role_of
from lightning_app_rlhf.parallel.plan import PlacementPlan
from lightning_app_rlhf.parallel.wrappers import WRAPPERS

CHECKSUM_KEY = "rlhf_checksum"
OPTIMIZERS_KEY = "rlhf_optimizers"
SCHEDULERS_KEY = "rlhf_schedulers"
LAYOUT_KEY = "rlhf_roles"
"""Role -> how the saving run held it: ``wrapper`` (None: a frozen role held whole), ``group_size`` (ranks of its
train call, or of its forward call for a frozen role), ``format`` (``whole``, ``dcp`` or ``deepspeed``)."""
FILES_KEY = "rlhf_files"
"""Shard file (relative to the checkpoint directory) -> its CRC-32 and size."""
CHECKED_KEYS = ("state_dict", OPTIMIZERS_KEY, SCHEDULERS_KEY, "optimizer_states", "lr_schedulers", "rlhf",
                LAYOUT_KEY, FILES_KEY)
"""The entries the checksum covers: weights, optimizer and scheduler state, the module's own state, and the
sharded roles' layout and shard files."""
META_FILE = "meta.ckpt"
"""Rank 0's file inside a checkpoint directory."""
SHARDS_LOADER_KEY = "_rlhf_shards_loader"
"""Set in a loaded checkpoint by a strategy that restores the sharded roles itself (never saved)."""


class CheckpointError(ValueError):
    """A checkpoint file that cannot be trusted: empty, truncated, corrupted, not loadable weights-only, or holding
    non-finite weights."""


# ---- reading ----


def checkpoint_file(path: str | os.PathLike[str]) -> Path:
    """The file to read for a checkpoint: ``path`` itself, or the meta file of a checkpoint directory."""
    path = Path(path)
    return path / META_FILE if path.is_dir() else path


def is_sharded_checkpoint(path: Any) -> bool:
    """Whether ``path`` is a local checkpoint directory (a checkpoint with sharded roles)."""
    return isinstance(path, (str, os.PathLike)) and "://" not in str(path) and Path(path).is_dir()


def check_checkpoint_file(path: str | os.PathLike[str]) -> None:
    """Raise a :class:`CheckpointError` naming ``path`` unless it is a non-empty ``torch.save`` archive, or a
    checkpoint directory whose meta file is one.

    Cheap (reads the zip directory only), so it runs before a load that would otherwise fail with a bare
    ``EOFError`` or a ``PytorchStreamReader`` error that names no file.
    """
    path = Path(path)
    if path.is_dir():
        meta = path / META_FILE
        if not meta.is_file():
            raise CheckpointError(f"Checkpoint {path} is a directory without its {META_FILE} (not a checkpoint of this "
                                  f"package, or an incomplete copy of one). Resume from an earlier checkpoint in "
                                  f"{path.parent}, or copy the whole directory again.")
        path = meta
    if not path.is_file():
        raise CheckpointError(f"Checkpoint {path} does not exist. Pass the path of a .ckpt file (or directory).")
    if path.stat().st_size == 0:
        raise CheckpointError(f"Checkpoint {path} is empty (0 bytes): its save was interrupted. Resume from an "
                              f"earlier checkpoint in {path.parent}, or start without a checkpoint.")
    if not zipfile.is_zipfile(path):
        raise CheckpointError(f"Checkpoint {path} is not a complete torch.save archive (truncated or corrupted, "
                              f"{path.stat().st_size} bytes). Resume from an earlier checkpoint in {path.parent}.")


def load_checkpoint_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a checkpoint (a file, or a directory's meta file) on the CPU with ``weights_only=True``: tensors and
    plain containers only, so a crafted file cannot run code. Errors name the file."""
    check_checkpoint_file(path)
    path = checkpoint_file(path)
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as err:
        raise not_weights_only(path, err) from err
    except (RuntimeError, EOFError, ValueError) as err:
        damaged = damaged_record(path)
        what = f"is corrupted: its record {damaged} fails its CRC-32" if damaged else "could not be read"
        raise CheckpointError(f"Checkpoint {path} {what} ({type(err).__name__}: {err}). Resume from an "
                              f"earlier checkpoint in {Path(path).parent}.") from err


def damaged_record(path: str | os.PathLike[str]) -> str | None:
    """The first record of a ``torch.save`` archive, other than its tensors' bytes (which :func:`verify` checks),
    whose bytes fail the CRC-32 stored in the zip; None when they all match or the file cannot be read as a zip."""
    try:
        with zipfile.ZipFile(path) as archive:
            for info in archive.infolist():
                if "/data/" in info.filename:
                    continue
                try:
                    with archive.open(info) as record:
                        while record.read(1 << 20):
                            pass
                except zipfile.BadZipFile:
                    return info.filename
    except (OSError, zipfile.BadZipFile):
        return None
    return None


def not_weights_only(path: str | os.PathLike[str], err: BaseException) -> CheckpointError:
    """The error for a file that only a full unpickle could load, or for a damaged one whose pickled record only
    looks like such a file (its zip CRC-32 tells them apart)."""
    damaged = damaged_record(path)
    if damaged is not None:
        return CheckpointError(f"Checkpoint {path} is corrupted: its record {damaged} fails its CRC-32 (disk or copy "
                               f"corruption). Resume from an earlier checkpoint in {Path(path).parent}, or copy it "
                               "again.")
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
    checkpoint: dict[str, Any], roles: list[str], trained: list[str], scheduled: list[str],
    sharded: list[str] | tuple[str, ...] = (),
) -> dict[str, dict[str, Any]]:
    """This rank's part of the checkpoint: for each role in ``roles``, its weights, and where it trains here its
    optimizer and scheduler state.

    Args:
        checkpoint: This rank's Lightning checkpoint (its ``state_dict``, ``optimizer_states`` and
            ``lr_schedulers`` list the roles this rank holds and trains, in optimizer order).
        roles: The roles this rank owns.
        trained: The roles this rank trains, in optimizer order.
        scheduled: The trained roles that have an LR scheduler, in order.
        sharded: Roles saved as shards by their wrappers: only their scheduler state goes in the file.
    """
    attributes = {entry.name: entry.attribute for entry in ROLES}
    state_dict = checkpoint.get("state_dict", {})
    optimizers, schedulers = checkpoint.get("optimizer_states") or [], checkpoint.get("lr_schedulers") or []
    out = {}
    for role in roles:
        prefix = attributes[role] + "."
        whole = role not in sharded
        out[role] = {"state_dict": {k: v for k, v in state_dict.items() if whole and k.startswith(prefix)}}
        if role in trained and optimizers and whole:
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
    sharded = [role for role, layout in checkpoint.get(LAYOUT_KEY, {}).items() if layout["format"] != "whole"]
    if sharded and not checkpoint.pop(SHARDS_LOADER_KEY, False):
        raise CheckpointError(f"Checkpoint {path} keeps {sharded} as shards in the directory beside its meta file, "
                              "which only a placement strategy reads. Resume from the checkpoint directory under a "
                              "placement strategy (e.g. --trainer.strategy rlhf_flattening, with any number of "
                              "devices for FSDP2 roles, the saved one for ZeRO roles).")
    attributes = tuple(entry.attribute + "." for entry in ROLES if entry.name in held)
    checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if k.startswith(attributes)}
    missing = [role for role in trained if role not in checkpoint[OPTIMIZERS_KEY] and role not in sharded]
    if missing:
        raise CheckpointError(f"Checkpoint {path} has no optimizer state for {missing}, which this run trains. "
                              "Resume with the algorithm and roles it was saved with.")
    # A sharded role's optimizer state is read from its shards (None here: the strategy skips it).
    checkpoint["optimizer_states"] = [checkpoint[OPTIMIZERS_KEY].get(role) for role in trained]
    checkpoint["lr_schedulers"] = [checkpoint[SCHEDULERS_KEY][role] for role in scheduled
                                   if role in checkpoint[SCHEDULERS_KEY]]


# ---- sharded roles ----


def home_call(role: str) -> str:
    """The call whose group holds a role's own copy: its train call, or a frozen role's forward call."""
    return f"{role}.train" if role in TRAINABLE_ROLES else f"{role}.forward"


def role_layout(plan: PlacementPlan) -> dict[str, dict[str, Any]]:
    """How ``plan`` holds each of its roles, as :data:`LAYOUT_KEY` stores it."""
    layout = {}
    for role in plan.roles:
        wrapper = plan.wrappers.get(role)
        size = len(plan.ranks(home_call(role)))
        cls = WRAPPERS.get(wrapper) if wrapper is not None else None
        shards = cls is not None and (cls.shards_params or cls.shards_optimizer) and size > 1
        layout[role] = {"wrapper": wrapper, "group_size": size, "format": cls.checkpoint_format if shards else "whole"}
    return layout


def sharded_roles(plan: PlacementPlan) -> list[str]:
    """The roles whose wrapper keeps only a part of their state on each rank of their group (FSDP2 and ZeRO over
    more than one rank): a checkpoint keeps them as shards."""
    return [role for role, layout in role_layout(plan).items() if layout["format"] != "whole"]


def restore_modes(checkpoint: dict[str, Any], plan: PlacementPlan, path: Any) -> dict[str, str]:
    """How each role of ``plan`` loads from ``checkpoint``, or a ``ValueError`` naming the fix.

    ``whole``: from the meta file's one copy (weights, optimizer state by role), as any placement holding it whole
    reads it. ``shards``: from the role's shard directory through its wrapper (DCP reshards to any group; DeepSpeed
    needs the saved stage and number of ranks). ``full_into_sharded``: a role saved whole that this run shards with
    FSDP2, each rank keeping its shard of the full weights.
    """
    saved_plan = checkpoint.get("rlhf_plan", {})
    saved = checkpoint.get(LAYOUT_KEY) or {}
    now = role_layout(plan)
    where = f"the {saved_plan.get('name')!r} plan on {saved_plan.get('world_size')} ranks"
    modes = {}
    for role, layout in now.items():
        before = saved.get(role, {"wrapper": None, "group_size": None, "format": "whole"})
        call = home_call(role)
        if before["format"] == "deepspeed":
            if (layout["wrapper"], layout["group_size"], layout["format"]) != (before["wrapper"], before["group_size"],
                                                                                "deepspeed"):
                raise ValueError(
                    f"Checkpoint {path}: role {role!r} was saved by DeepSpeed {before['wrapper']} over the "
                    f"{before['group_size']} ranks of {call!r} ({where}); this run has {_ranks(layout['group_size'])} "
                    f"there with wrapper {layout['wrapper'] or 'none'}. DeepSpeed reads its ZeRO partitions back only "
                    "with the same stage on as many ranks as wrote them (another number needs its universal-checkpoint "
                    "conversion, which this package does not read). Resume with the saved plan, "
                    f"{_strategy_arguments(saved_plan, before['wrapper'])} --trainer.devices "
                    f"{saved_plan.get('world_size')}, so that {call!r} has {before['group_size']} ranks with "
                    f"{before['wrapper']} again.")
            modes[role] = "shards"
        elif layout["format"] == "deepspeed":
            how = f"with wrapper {before['wrapper']}" if before["wrapper"] else "whole"
            raise ValueError(
                f"Checkpoint {path}: role {role!r} was saved {how} ({where}), and this run shards it with DeepSpeed "
                f"{layout['wrapper']} over the {layout['group_size']} ranks of {call!r}; a DeepSpeed engine loads only "
                f"its own checkpoints. Resume with wrapper {before['wrapper'] or 'ddp'} (or fsdp2, which reshards any "
                f"checkpoint), then save again to switch; or start the {layout['wrapper']} run without a checkpoint.")
        elif before["format"] == "dcp":
            modes[role] = "shards"
        else:
            modes[role] = "full_into_sharded" if layout["format"] == "dcp" else "whole"
    return modes


def _ranks(n: int) -> str:
    return f"{n} rank" if n == 1 else f"{n} ranks"


def _strategy_arguments(saved_plan: dict[str, Any], wrapper: str) -> str:
    """The command-line strategy of a saved plan: a preset's class and wrapper, or the same custom plan."""
    name = saved_plan.get("name")
    if name in ("flattening", "interleaving", "separation"):
        return (f"--trainer.strategy lightning_app_rlhf.strategies.{name.capitalize()}Strategy "
                f"--trainer.strategy.wrapper {wrapper}")
    return f"the same custom plan {name!r} (the strategy's plan: {saved_plan.get('calls')}, wrappers " \
           f"{saved_plan.get('wrappers')}),"


def shard_files(directory: str | os.PathLike[str], roles: list[str]) -> list[str]:
    """Every file under the roles' subdirectories of a checkpoint directory, relative to it, sorted."""
    root = Path(directory)
    return sorted(str(p.relative_to(root)) for role in roles for p in (root / role).rglob("*") if p.is_file())


def file_checksum(path: str | os.PathLike[str], chunk: int = 16 << 20) -> dict[str, Any]:
    """CRC-32 and size of a file, read in chunks (never whole in memory); fsyncs it on the way."""
    crc = 0
    with open(path, "rb") as file:
        while block := file.read(chunk):
            crc = zlib.crc32(block, crc)
        os.fsync(file.fileno())
    return {"crc32": f"{crc:08x}", "bytes": Path(path).stat().st_size}


def check_shard_files(
    directory: str | os.PathLike[str], expected: dict[str, dict[str, Any]], names: list[str]
) -> str | None:
    """The first problem among ``names`` (shard files of a checkpoint directory): missing, or not the bytes saved;
    None when they match ``expected`` (:data:`FILES_KEY`)."""
    root = Path(directory)
    for name in names:
        path = root / name
        if not path.is_file():
            return (f"Checkpoint {directory} is missing its shard file {path} (an incomplete copy). Copy the whole "
                    "directory again, or resume from an earlier checkpoint.")
        if file_checksum(path) != expected[name]:
            return (f"Checkpoint {directory}: shard file {path} fails its checksum (its contents changed after it was "
                    "saved: disk or copy corruption). Resume from an earlier checkpoint, or copy it again.")
    return None
