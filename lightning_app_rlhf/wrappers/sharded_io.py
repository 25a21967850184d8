"""Reading and writing a role's shards: ``torch.distributed.checkpoint`` (DCP) and DeepSpeed's checkpoint files,
both read weights-only. Plain PyTorch, no Lightning.

Neither format reads weights-only by itself: DCP unpickles its ``.metadata`` file and ``torch.load``\\ s its
non-tensor items with ``weights_only=False``, and DeepSpeed's checkpoint engine loads every file with
``weights_only=False``. A crafted shard could then run code, which this package's checkpoints never allow. The
readers here use torch's weights-only unpickler instead, with the few plain classes each format stores allowed
by name.
"""

from __future__ import annotations

import collections
import contextlib
import io
import os
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

DEEPSPEED_TAG = "zero"
"""The tag (subdirectory) of a role's DeepSpeed checkpoint."""


def _dcp_classes() -> list[Any]:
    from torch.distributed.checkpoint import metadata
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    return [metadata.Metadata, metadata.TensorStorageMetadata, metadata.BytesStorageMetadata,
            metadata.ChunkStorageMetadata, metadata.TensorProperties, metadata.MetadataIndex, metadata.StorageMeta,
            _StorageInfo, torch.Size, collections.OrderedDict]


class WeightsOnlyUnpicklingError(pickle.UnpicklingError):
    """A shard file holds objects outside the weights-only allow-list."""


def _weights_only_load(file: Any, classes: list[Any], name: str) -> Any:
    from torch import _weights_only_unpickler

    with torch.serialization.safe_globals(classes):
        try:
            return _weights_only_unpickler.load(file, encoding="utf-8")
        except pickle.UnpicklingError as err:
            raise WeightsOnlyUnpicklingError(f"{name}: {err}") from err


def dcp_reader(directory: str | os.PathLike[str]) -> Any:
    """A DCP storage reader of ``directory`` whose metadata is read weights-only."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class WeightsOnlyReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            path = self._get_metadata_path(kwargs.get("rank"))
            with self.fs.create_stream(path, "rb") as file:
                metadata = _weights_only_load(file, _dcp_classes(), str(path))
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


def dcp_keys(directory: str | os.PathLike[str]) -> set[str]:
    """The top-level entries a DCP checkpoint holds (``model``, and ``optimizer`` when it was saved)."""
    metadata = dcp_reader(directory).read_metadata()
    return {key.split(".")[0] for key in metadata.state_dict_metadata}


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
    with open(path, "rb") as file:
        with torch.serialization.safe_globals(_deepspeed_classes()):
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


def deepspeed_files(directory: str | os.PathLike[str]) -> list[Path]:
    """The files of a role's DeepSpeed checkpoint."""
    return sorted(p for p in (Path(directory) / DEEPSPEED_TAG).glob("*.pt"))
