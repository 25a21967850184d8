"""Test helper: make one rank stuck mid-run while its process lives (loaded through the CLI by test_faults.py).

- :class:`StopRank`: the rank sends itself SIGSTOP (its whole process freezes, heartbeat thread included), as a node
  that stops answering would;
- :func:`deadlocking_reward`: the demo's reward, except that on one rank one call never returns (its main thread
  waits on a lock it holds; its heartbeat thread goes on beating), as a deadlocked reward function or a read from
  a stalled file system would.

Each writes ``{"pid": ..., "time": ...}`` to the file ``RLHF_STUCK_FILE`` just before it gets stuck.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

from agent_task import LetterCount

from lightning_app_rlhf.demo import topic_reward


def _note_stuck() -> None:
    with open(os.environ["RLHF_STUCK_FILE"], "w") as file:
        json.dump({"pid": os.getpid(), "time": time.time()}, file)


class StopRank(Callback):
    """SIGSTOP rank ``rank`` at the start of global step ``step``."""

    def __init__(self, rank: int = 1, step: int = 2) -> None:
        self.rank, self.step = rank, step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            _note_stuck()
            os.kill(os.getpid(), signal.SIGSTOP)


_calls = 0


def deadlocking_reward(prompts: list[str], responses: list[str]) -> list[float]:
    """:func:`~lightning_app_rlhf.demo.topic_reward`; on rank ``RLHF_STUCK_RANK`` its call number
    ``RLHF_STUCK_CALL`` (from 1) never returns."""
    _hang_on_the_chosen_call()
    return topic_reward(prompts, responses)


def _hang_on_the_chosen_call() -> None:
    """Count a call; on rank ``RLHF_STUCK_RANK``, call number ``RLHF_STUCK_CALL`` (from 1) never returns."""
    global _calls
    _calls += 1
    if dist.get_rank() == int(os.environ["RLHF_STUCK_RANK"]) and _calls == int(os.environ["RLHF_STUCK_CALL"]):
        _note_stuck()
        lock = threading.Lock()
        lock.acquire()
        lock.acquire()  # never returns: the lock is held by this very thread


class HangingEnvironment(LetterCount):
    """:class:`agent_task.LetterCount`, except that on rank ``RLHF_STUCK_RANK`` its step number ``RLHF_STUCK_CALL``
    (from 1, counted over the process) never returns, as an environment waiting on a dead sandbox would."""

    def step(self, assistant_text: str):
        _hang_on_the_chosen_call()
        return super().step(assistant_text)
