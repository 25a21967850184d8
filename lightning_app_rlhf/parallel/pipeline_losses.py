"""The engine's train-call losses, run on a pipeline's last stage. Plain PyTorch, no Lightning.

A pipelined train call hands torch's schedule a loss function ``(head output, batch rows) -> loss`` that runs on the
last stage for each micro-batch (:meth:`~lightning_app_rlhf.parallel.pipeline.PipelinedRole.backward`). These build
it from the same pieces :meth:`~lightning_app_rlhf.engine.update_loop.UpdateLoop.accumulate_gradients` uses: the
actor's log-probabilities and entropies from its logits
(:func:`~lightning_app_rlhf.algorithms.functional.token_logprobs_and_entropy`, as
:func:`~lightning_app_rlhf.models.calls.policy_logprobs` computes them), or the critic's values (as
:func:`~lightning_app_rlhf.models.calls.critic_values` slices them), and the algorithm's loss on the micro-batch's rows
of the minibatch, scaled by the whole minibatch's sizes. Each records its statistics, summed over micro-batches.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lightning_app_rlhf.algorithms import Algorithm, LossScale
from lightning_app_rlhf.algorithms.functional import token_logprobs_and_entropy
from lightning_app_rlhf.models.calls import Experience


@dataclass
class _RecordedLoss:
    """A loss function for the last stage that sums ``[loss, *stats]`` (``names`` order) over its micro-batches."""

    algorithm: Algorithm
    batch: Experience
    """The minibatch the schedule's rows index (this replica's share of it)."""
    scale: LossScale
    """The whole minibatch's sizes."""
    names: tuple[str, ...]
    sums: torch.Tensor | None = field(default=None, init=False)

    def record(self, loss: torch.Tensor, stats: dict[str, torch.Tensor]) -> torch.Tensor:
        zero = loss.new_zeros(())
        row = torch.stack([loss.detach().float(), *(stats.get(n, zero).detach().float() for n in self.names)])
        self.sums = row if self.sums is None else self.sums + row
        return loss

    def totals(self) -> torch.Tensor:
        """``[loss, *stats]`` summed over the micro-batches run so far (zeros before any: a stage other than the
        last receives them by broadcast)."""
        return self.sums if self.sums is not None else torch.zeros(1 + len(self.names))


@dataclass
class PolicyLoss(_RecordedLoss):
    """The actor's loss on a micro-batch's logits (``logits_to_keep`` = response length + 1), as the engine runs it.

    Args:
        temperature: The sampling temperature the log-probabilities are taken at.
        entropy_grad: Whether the entropy enters the loss (``ppo.entropy_coef != 0``); otherwise it is a statistic.
    """

    temperature: float = 1.0
    entropy_grad: bool = True

    def __call__(self, logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        batch = self.batch.minibatch(rows)
        responses = batch.sequences[:, batch.prompt_length :]
        logprobs, entropy = token_logprobs_and_entropy(logits, responses, self.temperature, self.entropy_grad)
        return self.record(*self.algorithm.policy_loss(logprobs, entropy, batch, self.scale))


@dataclass
class ValueLoss(_RecordedLoss):
    """The critic's loss on a micro-batch's values ``[B, S]`` (the last stage's value head), as the engine runs it."""

    def __call__(self, values: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        batch = self.batch.minibatch(rows)
        return self.record(*self.algorithm.value_loss(values[:, batch.prompt_length - 1 : -1], batch, self.scale))


def minibatch_scale(batch: Experience, max_new_tokens: int) -> LossScale:
    """The sizes a minibatch's loss divides by: its valid response tokens and sequences, and the generation budget
    (the :class:`LossScale` :meth:`~lightning_app_rlhf.engine.update_loop.UpdateLoop.accumulate_gradients` builds)."""
    return LossScale(batch.response_mask.sum().float(), len(batch.sequences), max_new_tokens)


def policy_loss_fn(algorithm: Algorithm, batch: Experience, scale: LossScale, temperature: float,
                   entropy_grad: bool) -> PolicyLoss:
    """The actor's train-call loss for a pipeline's last stage.

    Args:
        algorithm: Its ``policy_loss`` runs on each micro-batch.
        batch: The rows the pipeline trains on (the schedule's targets index them).
        scale: The whole minibatch's sizes (:func:`minibatch_scale`).
        temperature: The sampling temperature.
        entropy_grad: ``ppo.entropy_coef != 0``.
    """
    return PolicyLoss(algorithm, batch, scale, algorithm.stat_names("actor"), temperature=temperature,
                      entropy_grad=entropy_grad)


def value_loss_fn(algorithm: Algorithm, batch: Experience, scale: LossScale) -> ValueLoss:
    """The critic's train-call loss for a pipeline's last stage (see :func:`policy_loss_fn`)."""
    return ValueLoss(algorithm, batch, scale, algorithm.stat_names("critic"))
