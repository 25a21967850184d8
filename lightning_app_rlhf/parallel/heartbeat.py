"""The heartbeat: a thread per rank that writes its state to the job's store every second, so that a failed collective
names the rank that died, and a rank that is alive but stuck is named within ``heartbeat_timeout`` instead of
stalling the job for the collective timeout. Plain torch.distributed.

A rank is *stuck* when its process is frozen (SIGSTOP, a node that stopped answering: its beats stop), or when its
main thread has stood still outside any collective (a deadlocked reward function, a read from a stalled file system:
its beats go on, but its main thread's frame does not move and it uses no CPU, nor do its helper processes: the
child processes that are not ranks, such as a vLLM engine's, which work while its main thread waits for them). A rank waiting in a collective (one
of the placement's, which it marks, or any frame of torch.distributed, DDP or DeepSpeed) for longer than
``heartbeat_timeout`` reads the others' beats; if one of them is stuck it posts the verdict to the store, and every
rank (the stuck one too, where it can, with its main thread's stack) prints it and ends its process, as NCCL's own
watchdog does: a thread cannot raise into a main thread blocked inside a C++ collective.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import datetime
import json
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from types import FrameType

import psutil
import torch.distributed as dist

EXIT_POLL = 0.1
"""Seconds between the heartbeat thread's checks that the main thread still runs."""
HEARTBEAT_KEY = "rlhf_heartbeat/"
"""Store key prefix of the heartbeats: ``rlhf_heartbeat/{rank}`` holds that rank's :class:`Beat` as JSON."""
STUCK_KEY = "rlhf_stuck"
"""Store key of the verdict: the message naming the stuck ranks, posted by the first rank that found them."""
STUCK_EXIT_CODE = 75
"""Exit status of every rank that ends on a stuck-rank verdict (EX_TEMPFAIL: a restart may succeed)."""
DEFAULT_HEARTBEAT_TIMEOUT = 60.0
"""Seconds a rank may wait in a collective for a stuck rank before the job stops naming it."""
FLUSH_TIMEOUT = 5.0
"""Seconds a flush before a stuck-rank exit may take (:meth:`Heartbeat.before_exit`)."""
CALL_KEY = "rlhf_call/"
"""Store key prefix of the step each rank's main thread entered last: ``rlhf_call/{rank}``, written by the main
thread itself as it enters the step (a store ``set`` does not wait for an answer: a few microseconds), so that a rank
frozen right after is named with it."""
STILL_CPU_SHARE = 0.01
"""A main thread that used less than this share of a CPU since the last beat, in the same frame, stands still."""
WAITING_CODE = (f"{os.sep}torch{os.sep}distributed{os.sep}", f"{os.sep}torch{os.sep}nn{os.sep}parallel{os.sep}",
                f"{os.sep}deepspeed{os.sep}", f"{os.sep}torch{os.sep}autograd{os.sep}")
"""Source directories whose frames on the main thread's stack mean "waiting for other ranks": torch.distributed's
collectives (ours and FSDP's), DDP, DeepSpeed's communication, and the backward pass in which DDP and ZeRO reduce
gradients."""


@dataclass(frozen=True)
class Beat:
    """One rank's state, as it writes it to the store every beat.

    Args:
        time: Wall-clock time of the beat.
        host: The rank's host name.
        pid: Its process id.
        ppid: Its parent's process id (rank 0 of a Lightning launch is the parent of the other local ranks).
        call: The last step of the iteration it entered (``"call actor.generate"``), or ``""`` before the first.
        where: Its main thread's innermost Python frame, ``file:line in function``.
        still_s: Seconds its main thread's frame has not moved.
        waiting: Whether its main thread is inside a collective (or the backward pass): waiting for other ranks.
        waited_s: Seconds it has waited so far: since it entered the placement's collective it is in (which counts
            where NCCL waits on the GPU, the main thread spinning, not standing still), else as long as it has
            stood still inside a collective.
    """

    time: float
    host: str
    pid: int
    ppid: int
    call: str
    where: str
    still_s: float
    waiting: bool
    waited_s: float = 0.0

    def age(self, now: float) -> float:
        return now - self.time


class Heartbeat:
    """A thread that writes this rank's :class:`Beat` to the job's store every ``interval`` seconds, through its own
    connection to the store (timeout ``store_timeout``), and that stops the job when a rank is stuck.

    The store lives in rank 0's process: when rank 0 dies the heartbeats go with it, and :meth:`stopped_ranks`
    says so. Ranks compare each other's clocks, which across nodes are only as close as their clock sync.

    Args:
        store: The job's store (the default process group's).
        rank: This rank.
        world_size: The job's ranks.
        interval: Seconds between beats.
        store_timeout: Limit of one store call.
        heartbeat_timeout: Seconds this rank waits in a collective before it looks for a stuck rank; also how long a
            rank's beats must have stopped, or its main thread stood still outside a collective, to count as
            stuck. None: never stop the job (a failed collective still names the rank that died).
    """

    def __init__(self, store: dist.Store, rank: int, world_size: int, interval: float = 1.0,
                 store_timeout: float = 5.0, heartbeat_timeout: float | None = DEFAULT_HEARTBEAT_TIMEOUT) -> None:
        self.store, self.rank, self.world_size, self.interval = store, rank, world_size, interval
        self.heartbeat_timeout = heartbeat_timeout
        # Own connections (a store client is not thread-safe), each with its own timeout: the thread's writer and
        # reader, and the main thread's writer of the step it enters.
        self._writer, self._reader, self._call_writer = store.clone(), store.clone(), store.clone()
        for connection in (self._writer, self._reader, self._call_writer):
            connection.set_timeout(datetime.timedelta(seconds=store_timeout))
        self._host, self._main = socket.gethostname(), threading.main_thread()
        self._call = ""
        self._collective_since: float | None = None
        self._before_exit: dict[str, Callable[[], object]] = {}
        self._frame_seen: tuple[int, int] | None = None
        self._still_since = self._observed_at = time.monotonic()
        self._main_cpu_clock = _thread_cpu_clock(self._main)
        self._main_cpu = self._main_cpu_time()
        self._rank_pids: set[int] = set()
        self._helpers_cpu = self._helpers_cpu_time()
        self._stopped = threading.Event()
        self._join_timeout = interval + store_timeout
        self._beat()
        # Not a daemon: the interpreter waits for it at exit, so it is never inside a store call when Python
        # finalizes (a daemon thread there is stopped mid-C++ call: "terminate called without an active exception").
        self._thread = threading.Thread(target=self._run, name=f"rlhf-heartbeat-rank{rank}", daemon=False)
        self._thread.start()
        # A store call to a frozen rank 0 never returns (its timeout covers the wait for a key, not a silent
        # server), so a second thread, which makes no store calls (a daemon: nothing to interrupt at exit), watches
        # the first one's store calls.
        self._in_store_call_since: float | None = None
        if heartbeat_timeout is not None:
            threading.Thread(target=self._guard_store, name=f"rlhf-heartbeat-guard-rank{rank}", daemon=True).start()

    # ---- the main thread's side ----

    def enter(self, call: str) -> None:
        """Note that the main thread starts ``call`` (named in a stuck-rank verdict as the call it was last in)."""
        self._call = call
        if self._call_writer is not None:
            with contextlib.suppress(RuntimeError):  # the store is gone: the job is ending
                self._call_writer.set(f"{CALL_KEY}{self.rank}", call)

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """Around a collective of the placement: the main thread waits for other ranks (nested: the outermost)."""
        outermost = self._collective_since is None
        if outermost:
            self._collective_since = time.monotonic()
        try:
            yield
        finally:
            if outermost:
                self._collective_since = None

    def before_exit(self, name: str, flush: Callable[[], object]) -> None:
        """Run ``flush`` (e.g. the loggers' save; ``name`` replaces an earlier one of that name) before this process
        exits on a stuck-rank verdict: in a thread of its own, for at most :data:`FLUSH_TIMEOUT` seconds (a stalled
        file system must not keep the job up)."""
        self._before_exit[name] = flush

    # ---- the thread ----

    def _main_frame(self) -> FrameType | None:
        return sys._current_frames().get(self._main.ident)  # documented in sys; what faulthandler and py-spy read

    def _main_cpu_time(self) -> float:
        return time.clock_gettime(self._main_cpu_clock) if self._main_cpu_clock is not None else 0.0

    def _helpers_cpu_time(self) -> float:
        """CPU seconds of this rank's helper processes: its child processes (and theirs) that are not ranks (a vLLM
        engine's core process, a reward server), which work while the main thread waits for them. A child that is a
        rank (Lightning's fork launcher starts ranks 1.. from rank 0) is left out with its own children."""
        if len(self._rank_pids) < self.world_size - 1 and self._reader is not None:
            with contextlib.suppress(RuntimeError):  # the store unreachable: the verdict logic reports that
                self._rank_pids = {beat.pid for beat in self.beats().values()}
        total = 0.0
        with contextlib.suppress(psutil.Error):
            for child in psutil.Process().children():
                if child.pid in self._rank_pids:
                    continue
                with contextlib.suppress(psutil.Error):  # a process that ended since the listing
                    for process in (child, *child.children(recursive=True)):
                        times = process.cpu_times()
                        total += times.user + times.system
        return total

    def _observe(self) -> Beat:
        """This rank's state now: how long its main thread has stood still (its frame did not move and neither it
        nor the rank's helper processes used CPU: a long C++ call such as a big matmul or a checkpoint load computes,
        a wait on a vLLM engine that generates computes in the engine's process, a blocked one waits), and whether it
        waits in a collective."""
        frame, now, cpu, helpers = self._main_frame(), time.monotonic(), self._main_cpu_time(), self._helpers_cpu_time()
        seen = (id(frame), frame.f_lasti) if frame is not None else None
        used = STILL_CPU_SHARE * (now - self._observed_at)
        computed = cpu - self._main_cpu > used or helpers - self._helpers_cpu > used
        if seen != self._frame_seen or computed:
            self._frame_seen, self._still_since = seen, now
        self._observed_at, self._main_cpu, self._helpers_cpu = now, cpu, helpers
        where = f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}" if frame is not None else ""
        since, still = self._collective_since, now - self._still_since
        in_stack = _in_collective(frame)
        waited = now - since if since is not None else (still if in_stack else 0.0)
        return Beat(time.time(), self._host, os.getpid(), os.getppid(), self._call, where, round(still, 3),
                    in_stack or since is not None, round(waited, 3))

    def _beat(self) -> Beat:
        beat = self._observe()
        self._writer.set(f"{HEARTBEAT_KEY}{self.rank}", json.dumps(asdict(beat)))
        return beat

    def _run(self) -> None:
        """Beat every ``interval`` until stopped or until the main thread has finished (the interpreter is exiting
        and waits for this thread: it notices within ``EXIT_POLL`` seconds); watch for stuck ranks."""
        next_beat = time.monotonic() + self.interval
        while not self._stopped.wait(min(EXIT_POLL, max(0.0, next_beat - time.monotonic()))):
            if not self._main.is_alive():
                return
            if time.monotonic() < next_beat:
                continue
            next_beat += self.interval
            self._in_store_call_since = time.monotonic()
            try:
                self._watch(self._beat())
            except RuntimeError:  # the store fails (DistError): rank 0 ended or died; try again at the next beat
                pass
            finally:
                self._in_store_call_since = None

    def _guard_store(self) -> None:
        """Stop the job when a store call has not returned for ``heartbeat_timeout`` seconds while the main thread
        waits in a collective: rank 0, which hosts the store, is frozen or gone, and the collective would wait for it
        until its own timeout."""
        assert self.heartbeat_timeout is not None
        while not self._stopped.wait(self.interval) and self._main.is_alive():
            since = self._in_store_call_since
            silent = time.monotonic() - since if since is not None else 0.0
            if silent > self.heartbeat_timeout and (self._collective_since is not None
                                                    or _in_collective(self._main_frame())):
                self._stop_job(f"this rank (host {self._host}) waits in a collective, last in {self._call!r}, and "
                               f"the store that carries the heartbeats has not answered for {silent:.0f} s: rank 0, "
                               "which hosts it, is frozen (SIGSTOP, a stalled node) or died. Look at rank 0's host "
                               "and log.", stuck=[])

    def _waiting_too_long(self, beat: Beat) -> bool:
        return self.heartbeat_timeout is not None and beat.waiting and beat.waited_s > self.heartbeat_timeout

    def _watch(self, beat: Beat) -> None:
        """Stop this process on a posted verdict; post one when this rank has waited too long for a stuck rank."""
        if self._reader.check([STUCK_KEY]):
            verdict = json.loads(self._reader.get(STUCK_KEY))
            self._stop_job(verdict["message"], verdict["stuck"])
        if not self._waiting_too_long(beat):
            return
        now, beats = time.time(), self.beats()
        stuck = {rank: other for rank, other in beats.items() if self._is_stuck(other, now)}
        if not stuck:
            return  # every other rank moves or waits too: a mismatch of collectives, which their timeout ends
        verdict = json.dumps({"message": self._verdict(beat, stuck, now), "stuck": sorted(stuck)})
        self._reader.compare_set(STUCK_KEY, "", verdict)  # the first rank's verdict stands
        verdict = json.loads(self._reader.get(STUCK_KEY))
        self._stop_job(verdict["message"], verdict["stuck"])

    def _is_stuck(self, beat: Beat, now: float) -> bool:
        assert self.heartbeat_timeout is not None
        return beat.age(now) > self.heartbeat_timeout or (not beat.waiting and beat.still_s > self.heartbeat_timeout)

    def _verdict(self, beat: Beat, stuck: dict[int, Beat], now: float) -> str:
        lines = []
        for rank, other in sorted(stuck.items()):
            how = (f"its heartbeats stopped {other.age(now):.0f} s ago: the process is frozen (SIGSTOP, a stalled "
                   "node) or gone" if other.age(now) > (self.heartbeat_timeout or 0) else
                   f"its main thread has not moved for {other.still_s:.0f} s outside any collective, at {other.where}")
            last = f"last in {other.call!r}" if other.call else "before its first call"
            lines.append(f"rank {rank} (host {other.host}, pid {other.pid}) is stuck, {last}: {how}")
        return (f"Stuck rank: {'; '.join(lines)}. Rank {self.rank} (host {self._host}) waited {beat.waited_s:.0f} s "
                f"for it in a collective, last in {beat.call!r}, longer than heartbeat_timeout={self.heartbeat_timeout}"
                " s, so every rank stops now. A living stuck rank prints its main thread's stack in its log. If one "
                "step of a rank legitimately runs longer without a collective, raise PlacementStrategy("
                "heartbeat_timeout=...).")

    def _stop_job(self, message: str, stuck: list[int]) -> None:
        """Print the verdict (a stuck rank adds its main thread's stack) and end this process; rank 0, which hosts
        the store, first lets the others read it and kills the stuck ranks it launched."""
        text = f"HungRankError: Rank {self.rank}: {message}\n"
        frame = self._main_frame()
        if self.rank in stuck and frame is not None:
            text += "This is the stuck rank. Its main thread:\n" + "".join(traceback.format_stack(frame))
        sys.stderr.write(text)
        sys.stderr.flush()
        for flush in self._before_exit.values():
            thread = threading.Thread(target=flush, name="rlhf-heartbeat-flush", daemon=True)
            thread.start()
            thread.join(timeout=FLUSH_TIMEOUT)
        if self.rank == 0:
            self.keep_store_up(max_wait=3 * self.interval + 2)
            self._kill_stuck_children(stuck)
        os._exit(STUCK_EXIT_CODE)

    def _kill_stuck_children(self, stuck: list[int]) -> None:
        """SIGKILL the stuck ranks that this process launched (a SIGSTOPped child would outlive the job: only
        SIGKILL ends a stopped process); a launcher such as torchrun kills its own."""
        with contextlib.suppress(RuntimeError):
            beats = self.beats()
            for rank in stuck:
                other = beats.get(rank)
                if other is not None and other.host == self._host and other.ppid == os.getpid():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(other.pid, signal.SIGKILL)

    def stop(self) -> None:
        """Stop beating, wait for the thread (at most one store timeout), and close the store connections."""
        self._stopped.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=self._join_timeout)
        self._call_writer = None  # the main thread's own: it calls stop, so nothing else uses it now
        if not self._thread.is_alive():  # close the store connections now, not during interpreter teardown
            self._writer = self._reader = None

    # ---- reading the others ----

    def beats(self) -> dict[int, Beat]:
        """Each other rank's last beat (ranks that never beat are left out). Raises if the store is unreachable."""
        if self._reader is None:
            raise RuntimeError("the heartbeat was stopped")
        beats = {}
        for rank in range(self.world_size):
            key = f"{HEARTBEAT_KEY}{rank}"
            if rank != self.rank and self._reader.check([key]):
                beat = Beat(**json.loads(self._reader.get(key)))
                call = f"{CALL_KEY}{rank}"
                if self._reader.check([call]):  # the main thread's own word: newer than its last beat
                    beat = dataclasses.replace(beat, call=self._reader.get(call).decode())
                beats[rank] = beat
        return beats

    def last_beats(self) -> dict[int, float]:
        """Each other rank's time of its last beat (ranks that never beat are left out). Raises if the store is
        unreachable."""
        return {rank: beat.time for rank, beat in self.beats().items()}

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


def _in_collective(frame: FrameType | None) -> bool:
    """Whether a thread whose innermost frame is ``frame`` waits for other ranks (:data:`WAITING_CODE`)."""
    while frame is not None:
        if any(part in frame.f_code.co_filename for part in WAITING_CODE):
            return True
        frame = frame.f_back
    return False


def _thread_cpu_clock(thread: threading.Thread) -> int | None:
    """The clock of ``thread``'s CPU time (None where the platform has none: then only its frames tell progress)."""
    try:
        return time.pthread_getcpuclockid(thread.ident)  # type: ignore[arg-type]
    except (AttributeError, OSError):
        return None


_heartbeat: Heartbeat | None = None


def job_store() -> dist.Store:
    """The job's key-value store: the default process group's (rank 0 hosts it), which the heartbeats and a
    free-running plan's version announcements use. torch has no public accessor for it; this is the one place that
    reaches for the private one."""
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


def start_heartbeat(rank: int, world_size: int, interval: float = 1.0,
                    heartbeat_timeout: float | None = DEFAULT_HEARTBEAT_TIMEOUT) -> Heartbeat | None:
    """Start this process's :class:`Heartbeat` through the default process group's store (once per process; None
    for a single process). Placement errors then name the ranks that stopped beating, and a stuck rank stops the
    job after ``heartbeat_timeout`` seconds."""
    global _heartbeat
    if world_size < 2 or not dist.is_initialized():
        return None
    store = job_store()
    wanted = (store, rank, world_size, heartbeat_timeout)
    if _heartbeat is None or (_heartbeat.store, _heartbeat.rank, _heartbeat.world_size,
                              _heartbeat.heartbeat_timeout) != wanted:
        if _heartbeat is not None:  # a new process group in this process (a later fit): beat through its store
            _heartbeat.stop()
        _heartbeat = Heartbeat(store, rank, world_size, interval, heartbeat_timeout=heartbeat_timeout)
        atexit.register(_heartbeat.stop)
    return _heartbeat


@contextlib.contextmanager
def waiting() -> Iterator[None]:
    """Around a collective of the placement: this rank waits for others (:meth:`Heartbeat.waiting`)."""
    with _heartbeat.waiting() if _heartbeat is not None else contextlib.nullcontext():
        yield


def before_exit(name: str, flush: Callable[[], object]) -> None:
    """Run ``flush`` before this process exits on a stuck-rank verdict (:meth:`Heartbeat.before_exit`)."""
    if _heartbeat is not None:
        _heartbeat.before_exit(name, flush)


def entering(call: str) -> None:
    """Note the step of the iteration this rank's main thread starts (a stuck-rank verdict names it)."""
    if _heartbeat is not None:
        _heartbeat.enter(call)


def stopped_ranks() -> str:
    """What the heartbeats say about the other ranks ("" without a heartbeat)."""
    return _heartbeat.stopped_ranks() if _heartbeat is not None else ""


def keep_store_up(timeout: datetime.timedelta, max_wait: float = 10.0) -> None:
    """On rank 0, which hosts the store: give the other ranks time to read the heartbeats before this one exits."""
    if _heartbeat is not None and _heartbeat.rank == 0:
        _heartbeat.keep_store_up(min(max_wait, timeout.total_seconds()))
