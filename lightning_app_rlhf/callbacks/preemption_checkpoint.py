"""``PreemptionCheckpoint``: on SIGTERM (or SLURM's requeue signal), finish the iteration, save, and stop."""

from __future__ import annotations

import collections
import contextlib
import os
import re
import signal
import subprocess
import threading
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.fabric.utilities.imports import _IS_WINDOWS
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_app_rlhf.parallel.heartbeat import waiting

_TERM, _REQUEUE = 0, 1


class PreemptionCheckpoint(Callback):
    """Stop a preempted run cleanly, with a checkpoint to resume from exactly.

    :class:`~lightning_app_rlhf.RLHFModule` adds one to every Trainer run (its ``configure_callbacks``) unless the
    Trainer already has one or the module was built with ``preemption_checkpoint=False``
    (``--model.preemption_checkpoint false``): give your own to set ``dirpath``.

    On SIGTERM, sent to the launcher (rank 0's process, which forwards it to the other ranks) or to every rank (as
    SLURM and Kubernetes do), the run finishes its current iteration; at its end (``on_train_batch_end``) every
    rank agrees to stop (an all-reduce of the flag over the world group, the same collective at the same point on
    every rank), saves one checkpoint (``trainer.save_checkpoint``, a collective under the placement strategies) to
    ``last.ckpt`` and stops: the process exits with code 0 after the message
    ``SIGTERM received at iteration N: saved PATH; resume with --ckpt_path last`` (or ``--ckpt_path PATH`` where
    ``last`` would not find it). Resuming so continues as the uninterrupted run would have.

    ``last.ckpt`` goes where ``--ckpt_path last`` finds it: the ``ModelCheckpoint`` with ``save_last`` writes it
    (its own last checkpoint, in its ``dirpath``); else it goes to ``dirpath`` if given, or to the first
    ``ModelCheckpoint``'s directory, or to ``trainer.default_root_dir``. ``--ckpt_path last`` looks in the
    directories of the resumed run's ``ModelCheckpoint`` callbacks: one configured with a ``dirpath`` looks in the
    same place again, one without looks in the new run's logger directory (the next ``version_N``), so the message
    names the file itself then.

    The signal handler only sets a flag. It replaces Lightning's own SIGTERM handler from the sanity check or the
    start of training, whichever comes first (Lightning's runs a collective inside the handler and stops with
    ``SIGTERMException``, no checkpoint); Lightning restores the handlers from before the fit when the fit ends.

    Under SLURM with ``SLURMEnvironment(auto_requeue=True)`` (Lightning's default there), the checkpoint is
    Lightning's ``hpc_ckpt_N.ckpt`` in ``default_root_dir``, which a requeued job resumes from by itself (no
    ``--ckpt_path``), and Lightning's requeue signal (``requeue_signal``, SIGUSR1 by default) is handled the
    same way as SIGTERM, then ``scontrol requeue`` from rank 0 (as Lightning's handler does; that handler would
    save, a collective, from inside the signal handler, wherever each rank happens to be).

    Args:
        dirpath: Where ``last.ckpt`` goes when no ``ModelCheckpoint`` with ``save_last`` is configured.
    """

    def __init__(self, dirpath: str | os.PathLike[str] | None = None) -> None:
        self.dirpath = dirpath
        self._flags = [False, False]  # SIGTERM, requeue signal
        self._requeue_signal: int | None = None
        self._forwarded = False
        self._trainer: pl.Trainer | None = None
        self._fixed_directories: set[Path] = set()
        self._agreements: collections.deque[tuple[dist.Work, torch.Tensor]] = collections.deque()
        """Free-running plans: the flags' all-reduces posted and not yet waited for (:meth:`_agree`)."""

    # ---- signals ----

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        """Note the signal; forward it once to the other ranks when this process launched them."""
        self._flags[_TERM] = True
        if not self._forwarded and self._trainer is not None:
            self._forwarded = True
            launcher = self._trainer.strategy.launcher
            if launcher is not None:
                with contextlib.suppress(Exception):
                    launcher.kill(signum)

    def _on_requeue_signal(self, signum: int, frame: Any) -> None:
        self._flags[_REQUEUE] = True

    def _install(self) -> None:
        """Replace the handlers Lightning's ``_SignalConnector`` registered for this fit; it restores the ones from
        before the fit when the fit ends (or fails)."""
        if threading.current_thread() is not threading.main_thread():
            return  # signals can only be handled on the main thread
        signal.signal(signal.SIGTERM, self._on_sigterm)
        if self._requeue_signal is not None:
            signal.signal(self._requeue_signal, self._on_requeue_signal)

    # ---- hooks ----

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # Before the ModelCheckpoint callbacks resolve their directories (Lightning runs them last): the ones
        # configured with a dirpath are where a resumed run's `--ckpt_path last` looks again.
        self._fixed_directories = {Path(c.dirpath).resolve() for c in trainer.checkpoint_callbacks
                                   if isinstance(c, ModelCheckpoint) and c.dirpath is not None}

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._trainer, self._flags, self._forwarded = trainer, [False, False], False
        self._agreements.clear()
        environment = trainer._accelerator_connector.cluster_environment
        auto_requeue = isinstance(environment, SLURMEnvironment) and environment.auto_requeue and not _IS_WINDOWS
        self._requeue_signal = environment.requeue_signal if auto_requeue else None

    @override
    def on_sanity_check_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._install()  # Lightning registered its handlers just before (after on_fit_start)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._install()  # again when there was no sanity check; a signal noted during it is kept

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        term, requeue = self._agree(trainer)
        if not (term or requeue):
            return
        self._flags = [False, False]
        self._finish_agreements()  # every rank posted the same ones: none is left in flight past the fit
        path = self._save(trainer)
        trainer.should_stop = True
        what = "SIGTERM" if term else f"SLURM requeue signal {signal.Signals(self._requeue_signal).name}"
        if self._requeue_signal is not None:  # SLURM auto-requeue: Lightning resumes from the hpc checkpoint
            if requeue and trainer.is_global_zero:
                _requeue_slurm_job()
            then = "the requeued job resumes from it (no --ckpt_path)" if requeue else \
                "a requeued job resumes from it (no --ckpt_path)"
            rank_zero_info(f"{what} received at iteration {trainer.global_step}: saved {path}; {then}")
            return
        resume = "--ckpt_path last" if self._found_by_last(path) else f"--ckpt_path {path}"
        rank_zero_info(f"{what} received at iteration {trainer.global_step}: saved {path}; resume with {resume}")

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._finish_agreements()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._trainer = None  # (Lightning has restored the signal handlers by now)

    # ---- helpers ----

    def _agree(self, trainer: pl.Trainer) -> tuple[bool, bool]:
        """Every rank's flags, reduced with MAX over the world group: the same answer on every rank.

        Under a free-running plan (``plan.run_ahead`` iterations of lead for the generation side) the all-reduce of
        iteration ``i`` is posted without waiting and waited for at iteration ``i + run_ahead + 1``, which every
        rank has reached by then without waiting: the answer is the same on every rank, that many iterations late
        (the generation side is never held back to the training side's pace)."""
        flags = torch.tensor([int(f) for f in self._flags], dtype=torch.int32)
        lag = getattr(getattr(trainer.strategy, "placement_plan", None), "run_ahead", 0)
        if dist.is_available() and dist.is_initialized() and trainer.world_size > 1:
            flags = flags.to(trainer.strategy.root_device)
            try:
                if lag:
                    self._agreements.append((dist.all_reduce(flags, op=dist.ReduceOp.MAX, async_op=True), flags))
                    if len(self._agreements) <= lag + 1:
                        return False, False
                    work, flags = self._agreements.popleft()
                    with waiting():  # the heartbeat counts it as a wait for other ranks, not as a stuck rank
                        work.wait()
                else:
                    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
            except (RuntimeError, dist.DistError):
                # Another rank is gone (it died, or did not answer within the timeout), and no checkpoint can be
                # saved without it. Not this check's to report: training goes on into the next iteration, whose
                # first collective with that rank fails with the error that names the call and the rank that
                # stopped (under a placement strategy; Lightning's own per-iteration SIGTERM check also ignores a
                # failed broadcast).
                return False, False
        term, requeue = (bool(v) for v in flags.tolist())
        return term, requeue

    def _finish_agreements(self) -> None:
        """Wait for the lagged all-reduces still in flight (free-running plans; every rank posted the same ones)."""
        while self._agreements:
            work, _ = self._agreements.popleft()
            with contextlib.suppress(RuntimeError, dist.DistError), waiting():  # a rank gone: the fit's error says so
                work.wait()

    def _save(self, trainer: pl.Trainer) -> str:
        """Save ``last.ckpt``, or under SLURM auto-requeue the next ``hpc_ckpt_N.ckpt`` (collective: every rank
        calls it) and return its path."""
        if self._requeue_signal is not None:
            # Lightning's name, chosen on rank 0 (another rank could see the file rank 0 is writing).
            path = trainer.strategy.broadcast(trainer._checkpoint_connector.hpc_save_path(trainer.default_root_dir))
            trainer.save_checkpoint(path)
            return str(path)
        checkpoints = [c for c in trainer.checkpoint_callbacks if isinstance(c, ModelCheckpoint)]
        keeper = next((c for c in checkpoints if c.save_last and c.dirpath is not None), None)
        if keeper is not None and self.dirpath is None:
            # ModelCheckpoint's own last checkpoint: its bookkeeping (last_model_path, the step it saved at, so
            # it does not save again at this step) stays right.
            keeper._save_last_checkpoint(trainer, keeper._monitor_candidates(trainer))
            return str(keeper.last_model_path)
        if self.dirpath is not None:
            directory = str(self.dirpath)
        elif checkpoints and checkpoints[0].dirpath is not None:
            directory = str(checkpoints[0].dirpath)
        else:
            directory = str(trainer.default_root_dir)
        path = os.path.join(directory, ModelCheckpoint.CHECKPOINT_NAME_LAST + ModelCheckpoint.FILE_EXTENSION)
        trainer.save_checkpoint(path)
        for callback in checkpoints:  # nothing more to save at this step
            callback._last_global_step_saved = trainer.global_step
        return path

    def _found_by_last(self, path: str) -> bool:
        """Whether a resumed run's ``--ckpt_path last`` looks in ``path``'s directory: a ModelCheckpoint's configured
        ``dirpath`` (one resolved from the logger moves to the next run's ``version_N``)."""
        return Path(path).resolve().parent in self._fixed_directories


def _requeue_slurm_job() -> None:
    """``scontrol requeue`` this job, as Lightning's SLURM handler does."""
    array_job_id = os.getenv("SLURM_ARRAY_JOB_ID")
    job_id = f"{array_job_id}_{os.environ['SLURM_ARRAY_TASK_ID']}" if array_job_id else os.environ["SLURM_JOB_ID"]
    if not re.fullmatch(r"[0-9_-]+", job_id):
        raise ValueError(f"Unexpected SLURM job id {job_id!r}: not requeued.")
    try:
        result = subprocess.call(["scontrol", "requeue", job_id])
    except FileNotFoundError:
        result = subprocess.call(f"scontrol requeue {job_id}", shell=True)
    if result == 0:
        rank_zero_info(f"Requeued SLURM job {job_id}.")
    else:
        rank_zero_warn(f"Requeuing SLURM job {job_id} failed with exit code {result}.")


__all__ = ["PreemptionCheckpoint"]
