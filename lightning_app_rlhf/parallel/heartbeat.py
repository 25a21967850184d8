"""The heartbeat: a thread per rank that writes its wall-clock time to the job's store, so that when a collective
fails the surviving ranks can name the rank that stopped. Plain torch.distributed.
"""

from __future__ import annotations

import atexit
import datetime
import threading
import time

import torch.distributed as dist

EXIT_POLL = 0.1
"""Seconds between the heartbeat thread's checks that the main thread still runs."""
HEARTBEAT_KEY = "rlhf_heartbeat/"
"""Store key prefix of the heartbeats: ``rlhf_heartbeat/{rank}`` holds that rank's wall-clock time of its last beat."""


class Heartbeat:
    """A daemon thread that writes this rank's wall-clock time to the job's store every ``interval`` seconds, so
    that when a collective fails the surviving ranks can name the rank that stopped (gloo names only the dead
    peer's address). It writes through its own connection to the store, with a timeout of ``store_timeout``.

    The store lives in rank 0's process: when rank 0 dies the heartbeats go with it, and :meth:`stopped_ranks`
    says so. Ranks compare each other's clocks, which across nodes are only as close as their clock sync; a rank
    that hangs but lives keeps beating (its collectives' timeout names it, not this).
    """

    def __init__(self, store: dist.Store, rank: int, world_size: int, interval: float = 1.0,
                 store_timeout: float = 5.0) -> None:
        self.store, self.rank, self.world_size, self.interval = store, rank, world_size, interval
        self._writer, self._reader = store.clone(), store.clone()  # own connections: thread-safe, own timeout
        for connection in (self._writer, self._reader):
            connection.set_timeout(datetime.timedelta(seconds=store_timeout))
        self._stopped = threading.Event()
        self._join_timeout = interval + store_timeout
        self._beat()
        # Not a daemon: the interpreter waits for it at exit, so it is never inside a store call when Python
        # finalizes (a daemon thread there is stopped mid-C++ call: "terminate called without an active exception").
        self._thread = threading.Thread(target=self._run, name=f"rlhf-heartbeat-rank{rank}", daemon=False)
        self._thread.start()

    def _beat(self) -> None:
        self._writer.set(f"{HEARTBEAT_KEY}{self.rank}", repr(time.time()))

    def _run(self) -> None:
        """Beat every ``interval`` until stopped or until the main thread has finished (the interpreter is exiting
        and waits for this thread: it notices within ``EXIT_POLL`` seconds)."""
        next_beat = time.monotonic() + self.interval
        while not self._stopped.wait(min(EXIT_POLL, max(0.0, next_beat - time.monotonic()))):
            if not threading.main_thread().is_alive():
                return
            if time.monotonic() < next_beat:
                continue
            next_beat += self.interval
            try:
                self._beat()
            except RuntimeError:  # the store is gone (rank 0 ended): nothing left to tell (DistError)
                return

    def stop(self) -> None:
        """Stop beating, wait for the thread (at most one store timeout), and close the store connections."""
        self._stopped.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=self._join_timeout)
        if not self._thread.is_alive():  # close the store connections now, not during interpreter teardown
            self._writer = self._reader = None

    def last_beats(self) -> dict[int, float]:
        """Each other rank's time of its last beat (ranks that never beat are left out). Raises if the store is
        unreachable."""
        if self._reader is None:
            raise RuntimeError("the heartbeat was stopped")
        beats = {}
        for rank in range(self.world_size):
            key = f"{HEARTBEAT_KEY}{rank}"
            if rank != self.rank and self._reader.check([key]):
                beats[rank] = float(self._reader.get(key))
        return beats

    def stopped_ranks(self) -> str:
        """Which ranks stopped beating, for an error message: reads the beats, waits two intervals (a rank that
        just died beat less than one interval ago), reads again."""
        try:
            before = self.last_beats()
            time.sleep(2 * self.interval + 0.5)
            after = self.last_beats()
        except RuntimeError as err:  # DistNetworkError, DistStoreError
            return (f"The store that carries the heartbeats is unreachable ({type(err).__name__}): rank 0 hosts it, "
                    "so rank 0 has died, or exited after an error of its own (its log says which).")
        now = time.time()
        silent = [r for r in range(self.world_size) if r != self.rank and (r not in after or after[r] == before[r])]
        if not silent:
            return "Every other rank is still alive (heartbeats): one raised an error or hangs."
        # The first to stop first (the others may have followed it); ranks that never beat last.
        silent.sort(key=lambda r: (r not in after, after.get(r, 0.0)))
        ages = [f"{now - after[r]:.1f}s ago" if r in after else "none ever" for r in silent]
        later = ", ".join(f"rank {r} ({age})" for r, age in zip(silent[1:], ages[1:]))
        return (f"Heartbeats: rank {silent[0]} stopped responding (last heartbeat {ages[0]})"
                + (f"; later: {later}." if later else "."))

    def keep_store_up(self, max_wait: float) -> None:
        """On the rank that hosts the store (rank 0), after its own error: wait, at most ``max_wait`` seconds,
        until every other rank stopped beating, so that the ranks that fail after it can still read who died."""
        deadline = time.monotonic() + max_wait
        while time.monotonic() < deadline:
            try:
                beats = self.last_beats()
            except RuntimeError:
                return
            if all(time.time() - beat > 2 * self.interval + 0.5 for beat in beats.values()):
                return
            time.sleep(self.interval / 2)


_heartbeat: Heartbeat | None = None


def start_heartbeat(rank: int, world_size: int, interval: float = 1.0) -> Heartbeat | None:
    """Start this process's :class:`Heartbeat` through the default process group's store (once per process; None
    for a single process). Placement errors then name the ranks that stopped beating."""
    global _heartbeat
    if world_size < 2 or not dist.is_initialized():
        return None
    from torch.distributed.distributed_c10d import _get_default_store

    store = _get_default_store()
    if _heartbeat is None or (_heartbeat.store, _heartbeat.rank, _heartbeat.world_size) != (store, rank, world_size):
        if _heartbeat is not None:  # a new process group in this process (a later fit): beat through its store
            _heartbeat.stop()
        _heartbeat = Heartbeat(store, rank, world_size, interval)
        atexit.register(_heartbeat.stop)
    return _heartbeat


def stopped_ranks() -> str:
    """What the heartbeats say about the other ranks ("" without a heartbeat)."""
    return _heartbeat.stopped_ranks() if _heartbeat is not None else ""


def keep_store_up(timeout: datetime.timedelta, max_wait: float = 10.0) -> None:
    """On rank 0, which hosts the store: give the other ranks time to read the heartbeats before this one exits."""
    if _heartbeat is not None and _heartbeat.rank == 0:
        _heartbeat.keep_store_up(min(max_wait, timeout.total_seconds()))
