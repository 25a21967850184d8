"""``PlacementSignalConnector``: Lightning's signal handling without a collective inside the SIGTERM handler."""

from __future__ import annotations

import logging
from types import FrameType
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.trainer.connectors.signal_connector import _SignalConnector
from lightning.pytorch.utilities.rank_zero import rank_prefixed_message
from typing_extensions import override

log = logging.getLogger(__name__)


class PlacementSignalConnector(_SignalConnector):
    """The Trainer's signal connector under a placement strategy: SIGTERM only sets Lightning's flag.

    Lightning's SIGTERM handler (``_SignalConnector._sigterm_notifier_fn``, Lightning 2.6) runs ``dist.broadcast``
    inside the handler, on whatever line each rank was interrupted. Under a placement the other ranks are then in a
    different collective (a gather of a scoring call, a weight reallocation), so the broadcast pairs with the wrong
    one: the job hangs, or a rank fails with "Connection closed by peer". This handler forwards the signal once to
    the processes this one launched (as Lightning's does) and sets ``trainer.received_sigterm``, nothing else; the
    ranks agree at a safe point: :class:`~lightning_app_rlhf.callbacks.PreemptionCheckpoint` (installed by
    :class:`~lightning_app_rlhf.RLHFModule` unless ``preemption_checkpoint=False``) replaces this handler for the
    fit, saves and stops cleanly; without it, Lightning's loops stop with their ``SIGTERMException`` (no checkpoint)
    at their next check: the end of the iteration, or the start of the next one, where Lightning broadcasts rank 0's
    flag on every rank at the same point.

    The connector is private Lightning API (``Trainer._signal_connector``): the only place where the handler is
    chosen. ``tests/test_preemption.py`` checks both that Lightning's own handler still broadcasts (so this class is
    still needed) and that this one does not.
    """

    @override
    def _sigterm_notifier_fn(self, signum: Any, _: FrameType | None) -> None:
        log.info(rank_prefixed_message(f"Received SIGTERM: {signum}", self.trainer.local_rank))
        if not self.received_sigterm:
            launcher = self.trainer.strategy.launcher
            if launcher is not None:
                launcher.kill(signum)
        self.received_sigterm = True


def use_placement_signal_connector(trainer: pl.Trainer) -> None:
    """Give ``trainer`` a :class:`PlacementSignalConnector` where it has Lightning's own (a strategy's ``setup`` runs
    before the Trainer registers its handlers, so the run's handlers are this connector's from the start).

    Args:
        trainer: The Trainer about to run.
    """
    if type(trainer._signal_connector) is _SignalConnector:  # not a user's own connector
        trainer._signal_connector = PlacementSignalConnector(trainer)


__all__ = ["PlacementSignalConnector", "use_placement_signal_connector"]
