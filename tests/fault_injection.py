"""Test helper: SIGKILL one rank at a chosen phase of an RLHF iteration (loaded through the CLI by test_faults.py).

Which rank, phase and step come from the environment, so one command line serves every rank:

``RLHF_KILL_RANK``
    The global rank that dies.
``RLHF_KILL_PHASE``
    ``generate``: inside ``actor.generate`` (its rank's sampling, before the rollout's gather);
    ``score_gather``: inside the gather of the first forward call (``reference.forward``), after its shapes went out;
    ``train``: inside ``actor.train``, after the first minibatch's backward, before its loss all-reduce;
    ``reallocate``: inside Separation's weight reallocation of the actor, before its broadcast.
``RLHF_KILL_STEP``
    The ``trainer.global_step`` of the iteration in which it dies (default 2).

The callback patches the engine and placement methods in its own process only, in ``setup``; the dying rank sends
itself SIGKILL (no cleanup, no exception: as the OOM killer or a lost node would).
"""

from __future__ import annotations

import os
import signal
import sys

from lightning.pytorch.callbacks import Callback

from lightning_app_rlhf.engine.role_calls import RoleCalls
from lightning_app_rlhf.engine.update_loop import UpdateLoop
from lightning_app_rlhf.parallel.placement import Placement

PHASES = ("generate", "score_gather", "train", "reallocate")


class KillAtPhase(Callback):
    """SIGKILL rank ``RLHF_KILL_RANK`` inside phase ``RLHF_KILL_PHASE`` of global step ``RLHF_KILL_STEP``."""

    def __init__(self) -> None:
        self.rank = int(os.environ["RLHF_KILL_RANK"])
        self.phase = os.environ["RLHF_KILL_PHASE"]
        self.step = int(os.environ.get("RLHF_KILL_STEP", "2"))
        if self.phase not in PHASES:
            raise ValueError(f"RLHF_KILL_PHASE must be one of {PHASES}, not {self.phase!r}")
        self.global_step = -1

    def setup(self, trainer, pl_module, stage) -> None:
        if trainer.global_rank == self.rank:
            _PATCHES[self.phase](self)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.global_step = trainer.global_step

    def die_now(self) -> None:
        if self.global_step == self.step:
            print(f"fault_injection: SIGKILL rank {self.rank} in phase {self.phase!r} at step {self.step}",
                  file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


def _patch_generate(killer: KillAtPhase) -> None:
    original = RoleCalls.generate_rows

    def generate_rows(self, *args, **kwargs):
        killer.die_now()
        return original(self, *args, **kwargs)

    RoleCalls.generate_rows = generate_rows


def _patch_score_gather(killer: KillAtPhase) -> None:
    original = Placement._all_gather_shapes

    def _all_gather_shapes(self, *args, **kwargs):
        shapes = original(self, *args, **kwargs)  # the first collective of a gather: inside it, die
        if self._gathering.endswith(".forward"):
            killer.die_now()
        return shapes

    original_gather = Placement.gather_to_world

    def gather_to_world(self, call, *args, **kwargs):
        self._gathering = call
        return original_gather(self, call, *args, **kwargs)

    Placement._all_gather_shapes = _all_gather_shapes
    Placement.gather_to_world = gather_to_world


def _patch_train(killer: KillAtPhase) -> None:
    original = UpdateLoop.accumulate_gradients

    def _accumulate_gradients(self, role, *args, **kwargs):
        sums = original(self, role, *args, **kwargs)  # forward and backward of the first minibatch done
        if role == "actor":
            killer.die_now()
        return sums

    UpdateLoop.accumulate_gradients = _accumulate_gradients


def _patch_reallocate(killer: KillAtPhase) -> None:
    original = Placement.reallocate_weights

    def reallocate_weights(self, role, *args, **kwargs):
        if role == "actor":
            killer.die_now()
        return original(self, role, *args, **kwargs)

    Placement.reallocate_weights = reallocate_weights


_PATCHES = {"generate": _patch_generate, "score_gather": _patch_score_gather, "train": _patch_train,
            "reallocate": _patch_reallocate}
