"""``PlacementSignalConnector``: Lightning's signal handling without a collective inside the SIGTERM handler."""

from __future__ import annotations

import collections
import contextlib
import logging
from types import FrameType
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.trainer.connectors.signal_connector import _SignalConnector
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_prefixed_message
from typing_extensions import override

from lightning_app_rlhf.parallel.heartbeat import waiting

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


class LaggedSigtermCheck:
    """Lightning's per-iteration SIGTERM check, a lagged collective, for a free-running plan.

    Before every iteration Lightning's epoch loop broadcasts rank 0's SIGTERM flag on every rank and waits for it
    (``_TrainingEpochLoop._broadcast_sigterm_tensor``, Lightning 2.6): a collective of the whole world per iteration,
    which would hold a free-running plan's generation side to the training side's pace. This check posts the same
    broadcast without waiting and reads it ``lag`` iterations later, when every rank has posted it without waiting
    (``plan.run_ahead + 1``): every rank stops with Lightning's ``SIGTERMException`` at the same iteration, ``lag``
    iterations after the flag. (With :class:`~lightning_app_rlhf.callbacks.PreemptionCheckpoint`, the default, the
    flag is never set: that callback saves and stops instead, with the same lag.)

    Args:
        trainer: The Trainer whose epoch loop it replaces the check of.
        lag: Iterations between a broadcast and its reading.
    """

    def __init__(self, trainer: pl.Trainer, lag: int) -> None:
        self.trainer, self.lag = trainer, lag
        self.pending: collections.deque[tuple[dist.Work, torch.Tensor]] = collections.deque()

    def __call__(self) -> None:
        flag = torch.tensor([int(getattr(self.trainer, "received_sigterm", False))],
                            device=self.trainer.strategy.root_device)
        try:
            self.pending.append((dist.broadcast(flag, src=0, async_op=True), flag))
            if len(self.pending) <= self.lag:
                return
            work, flag = self.pending.popleft()
            with waiting():  # the heartbeat counts it as a wait for other ranks, not as a stuck rank
                work.wait()
        except (RuntimeError, dist.DistError):  # as Lightning's check: a rank is gone, and the next collective says so
            return
        if flag.item() == 1:
            self.finish()
            with contextlib.suppress(RuntimeError, dist.DistError):
                dist.barrier()
            raise SIGTERMException()

    def finish(self) -> None:
        """Wait for the broadcasts still in flight (every rank posted the same ones)."""
        while self.pending:
            work, _ = self.pending.popleft()
            with contextlib.suppress(RuntimeError, dist.DistError), waiting():
                work.wait()


def lag_sigterm_check(trainer: pl.Trainer, lag: int) -> LaggedSigtermCheck:
    """Replace the Trainer's per-iteration SIGTERM broadcast with a :class:`LaggedSigtermCheck` of ``lag`` iterations.

    Raises:
        RuntimeError: Naming the Lightning version this runs with, where its epoch loop has no such check (a
            Lightning other than the 2.6 series pinned in ``requirements.txt``).
    """
    loop = trainer.fit_loop.epoch_loop
    if not callable(getattr(loop, "_broadcast_sigterm_tensor", None)):
        raise RuntimeError("free_running needs Lightning's per-iteration SIGTERM check "
                           "(_TrainingEpochLoop._broadcast_sigterm_tensor) to take its place, and Lightning "
                           f"{pl.__version__} has none: install the version pinned in requirements.txt, or use the "
                           "fixed schedule (free_running=False).")
    check = LaggedSigtermCheck(trainer, lag)
    loop._broadcast_sigterm_tensor = check
    return check


__all__ = ["LaggedSigtermCheck", "PlacementSignalConnector", "lag_sigterm_check", "use_placement_signal_connector"]
