"""A callback that measures each checkpoint save: resident memory just before it, the peak during it, and its time.

Linux only: it reads ``/proc/self/status``. The peak comes from ``VmHWM`` after resetting it through
``/proc/self/clear_refs``; where that file cannot be written (some containers), a thread samples ``VmRSS``.
"""

from __future__ import annotations

import functools
import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from typing_extensions import Self, override

STATUS = "/proc/self/status"
CLEAR_REFS = "/proc/self/clear_refs"
SAMPLE_INTERVAL_S = 0.002
RESET_SLACK_BYTES = 8 * 2**20
"""How far ``VmHWM`` may sit above ``VmRSS`` right after a reset before we call the reset ineffective (the two
fields are read together, so only pages touched between the write and the read count)."""


def read_status(*fields: str) -> dict[str, int]:
    """The named ``/proc/self/status`` fields (``VmRSS``, ``VmHWM``, ...) in bytes.

    Args:
        fields: Field names as the kernel spells them.

    Returns:
        Field name -> bytes.
    """
    values: dict[str, int] = {}
    with open(STATUS) as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name in fields:
                values[name] = int(rest.split()[0]) * 1024  # the kernel reports kB
    missing = set(fields) - set(values)
    if missing:
        raise RuntimeError(f"{STATUS} has no {', '.join(sorted(missing))}: checkpoint memory needs Linux.")
    return values


def reset_peak() -> bool:
    """Reset this process's ``VmHWM`` to its current RSS.

    Returns:
        Whether the reset took effect; ``False`` where ``clear_refs`` is not writable or ignored.
    """
    try:
        with open(CLEAR_REFS, "w") as f:
            f.write("5")  # 5: reset the peak RSS (proc(5), since Linux 4.0)
    except OSError:
        return False
    now = read_status("VmRSS", "VmHWM")
    return now["VmHWM"] <= now["VmRSS"] + RESET_SLACK_BYTES


class _RssSampler:
    """Polls ``VmRSS`` from a daemon thread; the fallback where ``VmHWM`` cannot be reset.

    It misses peaks shorter than the interval and any stretch in which the saving thread holds the GIL (a long
    C-level pickle), so it reads low where the peak is brief.
    """

    def __init__(self, interval_s: float = SAMPLE_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, read_status("VmRSS")["VmRSS"])
            self._stop.wait(self.interval_s)

    def __enter__(self) -> Self:
        self.peak = read_status("VmRSS")["VmRSS"]
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, read_status("VmRSS")["VmRSS"])


def measure(call: Callable[[], Any], method: str) -> tuple[Any, dict[str, Any]]:
    """Run ``call`` and measure it.

    Args:
        call: What to measure (a whole checkpoint save).
        method: ``clear_refs`` (reset ``VmHWM``, read it after) or ``sampling`` (poll ``VmRSS`` every 2 ms).

    Returns:
        ``call``'s result, and a record with ``steady_rss_bytes`` (RSS just before), ``peak_rss_bytes`` (the peak
        during the call; not clamped to the steady value, so memory freed between the two reads shows) and
        ``seconds`` (wall time).
    """
    steady = read_status("VmRSS")["VmRSS"]
    if method == "clear_refs":
        reset_peak()
        start = time.perf_counter()
        result = call()
        seconds = time.perf_counter() - start
        peak = read_status("VmHWM")["VmHWM"]
    elif method == "sampling":
        with _RssSampler() as sampler:
            start = time.perf_counter()
            result = call()
            seconds = time.perf_counter() - start
        peak = sampler.peak
    else:
        raise ValueError(f"Unknown method {method!r}: 'clear_refs' or 'sampling'.")
    record = {"method": method, "steady_rss_bytes": steady, "peak_rss_bytes": peak, "seconds": seconds}
    return result, record


class CheckpointMemory(pl.Callback):
    """Writes ``{path}/rank{r}.json``: for every checkpoint save on this rank, the resident memory just before it,
    the peak during it, and its wall time (rank 0 adds the size of the file written).

    From the start of training it wraps ``trainer.save_checkpoint`` on every rank, so the measured span is the
    whole save: the Trainer's dump of the state, the strategy's gather and write, and the closing barrier
    (``ModelCheckpoint`` calls it on all ranks). The file is rewritten after each save, so a run that dies later
    keeps the saves it made.

    Args:
        path: Folder for the per-rank JSON files.
        force_sampling: Poll ``VmRSS`` even where ``VmHWM`` can be reset (to test the fallback).
    """

    def __init__(self, path: str, force_sampling: bool = False) -> None:
        self.path = Path(path)
        self.force_sampling = force_sampling
        self.method = "sampling"
        self.saves: list[dict[str, Any]] = []
        self._rank = 0

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._rank = trainer.global_rank
        self.method = "sampling" if self.force_sampling or not reset_peak() else "clear_refs"
        original = trainer.save_checkpoint

        @functools.wraps(original)
        def save_checkpoint(filepath: Any, *args: Any, **kwargs: Any) -> None:
            self._measured_save(trainer, lambda: original(filepath, *args, **kwargs), filepath)

        # An instance attribute shadows the method for every caller (ModelCheckpoint calls trainer.save_checkpoint).
        trainer.save_checkpoint = save_checkpoint  # type: ignore[method-assign]

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        trainer.__dict__.pop("save_checkpoint", None)  # back to the class's method

    def _measured_save(self, trainer: pl.Trainer, save: Callable[[], None], filepath: Any) -> None:
        step = trainer.global_step
        _, record = measure(save, self.method)
        record = {"rank": self._rank, "step": step, "path": str(filepath), **record}
        if self._rank == 0:
            # Rank 0 writes the job's one file before the save's closing barrier, so it is complete here.
            record["file_bytes"] = os.path.getsize(filepath) if os.path.exists(filepath) else None
        self.saves.append(record)
        self._write()

    def _write(self) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        record = {"rank": self._rank, "method": self.method, "pid": os.getpid(), "saves": self.saves}
        target = self.path / f"rank{self._rank}.json"
        tmp = target.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(record, indent=1))
        tmp.replace(target)  # a reader never sees half a file


def read_records(path: Path) -> list[dict[str, Any]]:
    """The per-rank records a :class:`CheckpointMemory` wrote into ``path``, by rank.

    Args:
        path: The callback's folder.

    Returns:
        One record per rank, rank 0 first.
    """
    records = [json.loads(p.read_text()) for p in path.glob("rank*.json")]
    return sorted(records, key=lambda record: record["rank"])
