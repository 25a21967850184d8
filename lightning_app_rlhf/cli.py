"""The command line, built on LightningCLI: ``python -m lightning_app_rlhf fit --config CONFIG.yaml``.

``python -m lightning_app_rlhf plan ...`` is a dry run of the placement planner (see ``planner/command.py``); it
never reaches LightningCLI.
"""

from __future__ import annotations

import pickle
import sys

from jsonargparse import set_parsing_settings
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from typing_extensions import override

from lightning_app_rlhf.callbacks.placement_tuner import PlacementTuner
from lightning_app_rlhf.checkpoint import (
    CheckpointError,
    check_checkpoint_file,
    checkpoint_file,
    is_sharded_checkpoint,
    not_weights_only,
)
from lightning_app_rlhf.data import PromptDataModule
from lightning_app_rlhf.module import RLHFModule
from lightning_app_rlhf.strategies.placement_strategy import PlacementStrategy


class RLHFCLI(LightningCLI):
    """LightningCLI for :class:`RLHFModule` and :class:`PromptDataModule`; the model's tokenizer feeds the data."""

    @override
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.link_arguments("model.tokenizer", "data.tokenizer")

    @override
    def _parse_ckpt_path(self) -> None:
        # LightningCLI reads --ckpt_path (weights-only) for saved hyper-parameters before anything else runs; an
        # empty, truncated or crafted file must fail there with its name, not with a bare torch error.
        ckpt_path = self.config.get(self.config.get("subcommand") or "", {}).get("ckpt_path")
        if not ckpt_path or "://" in str(ckpt_path):
            super()._parse_ckpt_path()
            return
        check_checkpoint_file(ckpt_path)
        file = checkpoint_file(ckpt_path)  # a checkpoint directory (sharded roles): its meta file
        section = self.config[self.config["subcommand"]]
        section["ckpt_path"] = str(file)
        try:
            super()._parse_ckpt_path()
        except pickle.UnpicklingError as err:
            raise not_weights_only(file, err) from err
        finally:
            section["ckpt_path"] = ckpt_path

    def before_fit(self) -> None:
        """A PlacementTuner must see ``--ckpt_path`` before the models are built, to reuse the saved plan."""
        ckpt_path = self.config_init[self.subcommand].get("ckpt_path")
        if ckpt_path and is_sharded_checkpoint(ckpt_path) and not isinstance(self.trainer.strategy, PlacementStrategy):
            raise CheckpointError(f"Checkpoint {ckpt_path} is a directory with sharded roles, which only a placement "
                                  f"strategy reads; this run uses {type(self.trainer.strategy).__name__}. Resume with "
                                  "--trainer.strategy rlhf_flattening (or the strategy it was saved with).")
        for callback in self.trainer.callbacks:
            if isinstance(callback, PlacementTuner) and callback.ckpt_path is None:
                callback.ckpt_path = ckpt_path


def main(args: list[str] | None = None) -> RLHFCLI | None:
    """Entry point of ``python -m lightning_app_rlhf`` and the ``lightning-app-rlhf`` console script."""
    argv = sys.argv[1:] if args is None else args
    if argv[:1] == ["plan"]:
        from lightning_app_rlhf.planner.command import main as plan_main

        sys.exit(plan_main(argv[1:]))
    set_parsing_settings(docstring_parse_attribute_docstrings=True)  # dataclass field docstrings in --help
    return RLHFCLI(
        RLHFModule,
        PromptDataModule,
        args=args,
        save_config_kwargs={"overwrite": True},
        auto_configure_optimizers=False,  # the module builds its own two optimizers
    )
