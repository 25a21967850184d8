"""How a failed collective becomes an error that names the fix: the default timeout every process group is created
with, :class:`PlacementError`, and :func:`named_failure`, which turns a collective's failure into one. Below both the
placement and the pipelines, which name their failures with it. Plain torch.distributed."""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Iterator

import torch.distributed as dist

from lightning_app_rlhf.parallel.heartbeat import keep_store_up, stopped_ranks, waiting

DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)


class PlacementError(RuntimeError):
    """A collective of a call failed: another rank died, failed, or did not answer within the timeout."""


@contextlib.contextmanager
def named_failure(where: str, timeout: datetime.timedelta) -> Iterator[None]:
    """Turn a failed collective into a :class:`PlacementError` that starts with ``where`` (this rank and what it was
    doing) and names the rank that stopped, from the heartbeats; the heartbeat counts the time inside it as waiting
    (a stuck peer is named after ``heartbeat_timeout``). On rank 0, which hosts the store, the store stays up a little
    (at most ``timeout``) so that the other ranks can still read who died."""
    try:
        with waiting():
            yield
    except (RuntimeError, dist.DistError) as err:
        heard = stopped_ranks()  # which rank stopped, from the heartbeats ("" without them)
        message = (f"{where} failed: another rank died, raised, or did not answer within the timeout of {timeout}. "
                   f"{heard + ' ' if heard else ''}Look for the first error in the other ranks' logs. Cause: {err}")
        keep_store_up(timeout)
        raise PlacementError(message) from err
