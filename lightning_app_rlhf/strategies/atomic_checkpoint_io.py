"""``AtomicCheckpointIO``: the placement strategies' checkpoint writer."""

from __future__ import annotations

from typing import Any

from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.io import TorchCheckpointIO
from typing_extensions import override

from lightning_app_rlhf.checkpoint import save_checkpoint_file


class AtomicCheckpointIO(TorchCheckpointIO):
    """Writes local checkpoints with :func:`~lightning_app_rlhf.checkpoint.save_checkpoint_file`: streamed to a
    temporary file in the checkpoint's directory, then renamed over the target. Lightning's own writer first
    serialises the whole file into memory and stages it in the system's temporary directory, where an interrupted
    save leaves it. Remote paths (``s3://`` and the like) go through Lightning's writer."""

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        if "://" in str(path):
            super().save_checkpoint(checkpoint, path, storage_options=storage_options)
            return
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint takes no storage_options for local files; got "
                            f"{storage_options!r}. Drop them, or pass your own checkpoint_io to the strategy.")
        save_checkpoint_file(checkpoint, path)
