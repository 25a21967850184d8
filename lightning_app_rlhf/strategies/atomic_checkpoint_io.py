"""``AtomicCheckpointIO``: the placement strategies' checkpoint writer."""

from __future__ import annotations

from typing import Any

import torch
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.io import TorchCheckpointIO
from typing_extensions import override

from lightning_app_rlhf.checkpoint.format import check_checkpoint_file
from lightning_app_rlhf.core.files import remove_path, write_atomically


class AtomicCheckpointIO(TorchCheckpointIO):
    """Writes local checkpoints with :func:`~lightning_app_rlhf.core.files.write_atomically`: ``torch.save`` streams to
    a temporary file in the checkpoint's directory (no copy of the whole file in memory), renamed over the target. Lightning's own writer first
    serialises the whole file into memory and stages it in the system's temporary directory, where an interrupted
    save leaves it. Remote paths (``s3://`` and the like) go through Lightning's writer.

    Removing a checkpoint removes a file, a link (``ModelCheckpoint(save_last="link")``) or a checkpoint directory
    (sharded roles), the directory renamed away first so that no partial one is left under its name.

    A save killed mid-write (SIGKILL, out of memory, a lost node) leaves the previous checkpoint as it was, and its
    hidden temporary file ``.<name>.<pid>.<random>.tmp`` beside it, which no loader takes for a checkpoint (it does
    not end in ``.ckpt``): the next successful save in that directory removes it."""

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        if "://" in str(path):
            super().save_checkpoint(checkpoint, path, storage_options=storage_options)
            return
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint takes no storage_options for local files; got "
                            f"{storage_options!r}. Drop them, or pass your own checkpoint_io to the strategy.")
        write_atomically(path, lambda file: torch.save(checkpoint, file), remove_stale=True)

    @override
    def load_checkpoint(self, path: _PATH, map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """Lightning's reader, after :func:`~lightning_app_rlhf.checkpoint.format.check_checkpoint_file` for a local file:
        an empty, truncated or missing file fails with a :class:`~lightning_app_rlhf.checkpoint.format.CheckpointError`
        that names it and the fix, not with a ``PytorchStreamReader`` error that names no file."""
        if "://" not in str(path):
            check_checkpoint_file(path)
        if map_location is None:
            return super().load_checkpoint(path, weights_only=weights_only)
        return super().load_checkpoint(path, map_location=map_location, weights_only=weights_only)

    @override
    def remove_checkpoint(self, path: _PATH) -> None:
        if "://" in str(path):
            super().remove_checkpoint(path)
            return
        remove_path(path)
