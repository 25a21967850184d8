"""``RoleLearningRateMonitor``: Lightning's ``LearningRateMonitor`` for roles whose optimizers live on other ranks."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import LearningRateMonitor
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from typing_extensions import override


class RoleLearningRateMonitor(LearningRateMonitor):
    """Logs ``lr-actor`` and ``lr-critic`` (and their ``-momentum`` / ``-weight_decay`` when asked) from the ranks
    that hold each role's optimizer, whichever those are.

    The stock monitor reads the optimizers of the rank that logs (global rank 0), which under Separation holds none,
    and names them by class (``lr-AdamW``, ``lr-AdamW-1``). :class:`~lightning_app_rlhf.RLHFModule` replaces a
    ``LearningRateMonitor`` given to the Trainer with this one (keeping its settings), so adding the usual callback
    is all a user does. The values come from the module's ``learning_rates``: each trained role's first parameter
    group, as in effect for the coming iteration.
    """

    @classmethod
    def like(cls, monitor: LearningRateMonitor) -> RoleLearningRateMonitor:
        """A role monitor with ``monitor``'s settings."""
        return cls(logging_interval=monitor.logging_interval, log_momentum=monitor.log_momentum,
                   log_weight_decay=monitor.log_weight_decay)

    @override
    def on_train_start(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        if not trainer.loggers:
            raise MisconfigurationException("Cannot use `LearningRateMonitor` callback with `Trainer` that has no "
                                            "logger. Add a logger (e.g. `--trainer.logger CSVLogger`) or remove it.")
        self.lrs = {name: [] for name in self._role_rates(trainer) if "-momentum" not in name
                    and "-weight_decay" not in name}

    @override
    def _extract_stats(self, trainer: pl.Trainer, interval: str) -> dict[str, float]:
        if interval == "epoch":  # every role's scheduler is stepped per iteration, as the module does
            return {}
        stats = self._role_rates(trainer)
        for name in list(stats):
            unwanted = (name.endswith("-momentum") and not self.log_momentum) or (
                name.endswith("-weight_decay") and not self.log_weight_decay)
            if unwanted:
                del stats[name]
            elif name in self.lrs:
                self.lrs[name].append(stats[name])
        trainer.callback_metrics.update({name: torch.tensor(value, device=trainer.strategy.root_device)
                                         for name, value in stats.items()})
        return stats

    @staticmethod
    def _role_rates(trainer: pl.Trainer) -> dict[str, float]:
        return dict(getattr(trainer.lightning_module, "learning_rates", {}))
