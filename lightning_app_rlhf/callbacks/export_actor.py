"""``ExportActor``: save the trained actor in Hugging Face format when fit ends (merged weights or LoRA adapter)."""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override


class ExportActor(Callback):
    """Writes the trained actor and its tokenizer to ``dirpath`` at the end of ``fit``, ready for plain
    ``transformers`` (``merge=True``) or ``peft`` (``merge=False``, the LoRA adapter alone).

    The rank that trains the actor writes (under Separation that is not rank 0). On the command line::

        --trainer.callbacks+=lightning_app_rlhf.callbacks.ExportActor --trainer.callbacks.dirpath=runs/actor

    Args:
        dirpath: Output directory.
        merge: ``True``: full weights with any LoRA adapter merged in. ``False``: the LoRA adapter only (needs a
            LoRA actor); load it with ``PeftModel.from_pretrained(base_model, dirpath)``.
    """

    def __init__(self, dirpath: str, merge: bool = True) -> None:
        self.dirpath = dirpath
        self.merge = merge

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if not hasattr(pl_module, "export_actor"):
            raise TypeError(f"ExportActor exports an RLHFModule's actor; got {type(pl_module).__name__}.")
        if not self.merge and pl_module.specs.actor.lora is None:  # fail before training, not after
            raise ValueError(
                "ExportActor(merge=False) saves a LoRA adapter, but the actor has no `lora` settings. "
                "Use merge=True to save its full weights, or give the actor a `lora` config."
            )

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        path = pl_module.export_actor(self.dirpath, merge=self.merge)
        if path is not None:
            what = "merged weights" if self.merge else "LoRA adapter"
            print(f"Exported the actor ({what}) and tokenizer to {path}")
        trainer.strategy.barrier("export_actor")
