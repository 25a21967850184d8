"""Reading and writing a role's shards: ``torch.distributed.checkpoint`` (DCP) and DeepSpeed's checkpoint files,
both read weights-only. Plain PyTorch, no Lightning.

Neither format reads weights-only by itself: DCP unpickles its ``.metadata`` file and ``torch.load``\\ s its
non-tensor items with ``weights_only=False``, and DeepSpeed's checkpoint engine loads every file with
``weights_only=False``. A crafted shard could then run code, which this package's checkpoints never allow. The
readers here are weights-only instead: torch's weights-only ``torch.load`` (DeepSpeed's files, DCP's items), and
for DCP's metadata a ``pickle.Unpickler`` that can reach no global but the plain classes that file holds.
"""

from __future__ import annotations

import collections
import contextlib
import io
import os
import pickle
from collections.abc import Iterator
from pathlib import PurePosixPath, PureWindowsPath
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

DEEPSPEED_TAG = "zero"
"""The tag (subdirectory) of a role's DeepSpeed checkpoint."""


def _dcp_globals() -> dict[tuple[str, str], Any]:
    """What DCP's ``.metadata`` pickle may name: its own plain dataclasses, and torch's sizes, dtypes and layouts."""
    from torch.distributed.checkpoint import filesystem, metadata

    allowed: dict[tuple[str, str], Any] = {
        (cls.__module__, cls.__qualname__): cls
        for cls in (metadata.Metadata, metadata.TensorStorageMetadata, metadata.BytesStorageMetadata,
                    metadata.ChunkStorageMetadata, metadata.TensorProperties, metadata.MetadataIndex,
                    metadata.StorageMeta, metadata._MEM_FORMAT_ENCODING, filesystem._StorageInfo)
    }
    allowed[("torch", "Size")] = torch.Size
    allowed[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    allowed[("pathlib", "PosixPath")] = PurePosixPath  # the checkpoint id, a path: kept as a plain path
    allowed[("pathlib", "WindowsPath")] = PureWindowsPath
    allowed[("collections", "OrderedDict")] = collections.OrderedDict
    return allowed


class WeightsOnlyUnpicklingError(pickle.UnpicklingError):
    """A shard file holds objects outside the weights-only allow-list."""


class _RestrictedUnpickler(pickle.Unpickler):
    """``pickle``'s unpickler, which can reach no global but the allowed ones (so it calls no other code)."""

    def __init__(self, file: Any, allowed: dict[tuple[str, str], Any], name: str) -> None:
        super().__init__(file)
        self._allowed = allowed
        self._name = name

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self._allowed:
            return self._allowed[(module, name)]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise WeightsOnlyUnpicklingError(f"{self._name} names {module}.{name}, which a checkpoint of this package "
                                         "never holds")


def dcp_reader(directory: str | os.PathLike[str]) -> Any:
    """A DCP storage reader of ``directory`` whose metadata is read weights-only."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class WeightsOnlyReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            path = self._get_metadata_path(kwargs.get("rank"))
            with self.fs.create_stream(path, "rb") as file:
                metadata = _RestrictedUnpickler(file, _dcp_globals(), str(path)).load()
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return WeightsOnlyReader(os.fspath(directory))


def dcp_planner() -> Any:
    """A DCP load planner that reads non-tensor items (optimizer hyper-parameters) weights-only."""
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint._traverse import set_element

    class WeightsOnlyPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            loaded = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
            else:
                self.state_dict[read_item.dest_index.fqn] = loaded

    return WeightsOnlyPlanner()


def dcp_group(group: dist.ProcessGroup | None, group_size: int) -> dict[str, Any]:
    """DCP's collective arguments for a role's group (a group of one rank needs none)."""
    return {"process_group": group} if group_size > 1 else {"no_dist": True}


def save_dcp(module: nn.Module, optimizer: torch.optim.Optimizer | None, directory: str | os.PathLike[str],
             group: dist.ProcessGroup | None, group_size: int) -> None:
    """Write ``module``'s weights (and ``optimizer``'s state) with DCP: each rank its own shard (FSDP2's DTensors),
    one copy of replicated tensors. Collective over ``group``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    state: dict[str, Any] = {"model": get_model_state_dict(module)}
    if optimizer is not None:
        state["optimizer"] = get_optimizer_state_dict(module, optimizer)
    dcp.save(state, checkpoint_id=os.fspath(directory), **dcp_group(group, group_size))


def load_dcp(module: nn.Module, optimizer: torch.optim.Optimizer | None, directory: str | os.PathLike[str],
             group: dist.ProcessGroup | None, group_size: int) -> None:
    """Read what :func:`save_dcp` wrote into ``module`` (and ``optimizer``) as they are sharded now, whatever the
    sharding and number of ranks they were saved with. Collective over ``group``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    state: dict[str, Any] = {"model": get_model_state_dict(module)}
    if optimizer is not None:
        state["optimizer"] = get_optimizer_state_dict(module, optimizer)
    dcp.load(state, checkpoint_id=os.fspath(directory), storage_reader=dcp_reader(directory), planner=dcp_planner(),
             **dcp_group(group, group_size))
    set_model_state_dict(module, state["model"])
    if optimizer is not None:
        set_optimizer_state_dict(module, optimizer, state["optimizer"])


def _deepspeed_classes() -> list[Any]:
    classes: list[Any] = [torch.Size, collections.OrderedDict, collections.defaultdict, set, frozenset]
    with contextlib.suppress(ImportError):
        from deepspeed.runtime.zero.config import ZeroStageEnum

        classes.append(ZeroStageEnum)
    with contextlib.suppress(ImportError):
        from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler

        classes += [LossScaler, DynamicLossScaler]
    with contextlib.suppress(ImportError):
        from deepspeed.utils.tensor_fragment import fragment_address

        classes.append(fragment_address)
    return classes


def deepspeed_load(path: str, map_location: Any = None) -> Any:
    """DeepSpeed's ``checkpoint_engine.load``, weights-only."""
    with open(path, "rb") as file, torch.serialization.safe_globals(_deepspeed_classes()):
        try:
            return torch.load(file, map_location=map_location, weights_only=True)
        except pickle.UnpicklingError as err:
            raise WeightsOnlyUnpicklingError(f"{path}: {err}") from err


@contextlib.contextmanager
def weights_only_deepspeed(engine: Any) -> Iterator[None]:
    """Make ``engine`` read its checkpoint files weights-only inside the block."""
    checkpoint_engine = engine.checkpoint_engine
    original = checkpoint_engine.load
    checkpoint_engine.load = deepspeed_load
    try:
        yield
    finally:
        checkpoint_engine.load = original


def load_full(module: nn.Module, optimizer: torch.optim.Optimizer | None, state_dict: dict[str, torch.Tensor],
              optimizer_state: dict[str, Any] | None) -> None:
    """Load a whole role (its full weights, and its ``torch.optim`` state dict keyed by parameter index) into
    ``module`` and ``optimizer`` as they are sharded now (FSDP2: each rank keeps its shard of every tensor)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(module, state_dict, options=options)
    if optimizer is None or optimizer_state is None:
        return
    names = {id(p): name for name, p in module.named_parameters()}
    by_index = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    saved_order = [i for group in optimizer_state["param_groups"] for i in group["params"]]
    fqn = dict(zip(saved_order, by_index, strict=True))
    converted = {
        "state": {fqn[i]: state for i, state in optimizer_state["state"].items()},
        "param_groups": [{**group, "params": [fqn[i] for i in group["params"]]}
                         for group in optimizer_state["param_groups"]],
    }
    set_optimizer_state_dict(module, optimizer, converted, options=options)
