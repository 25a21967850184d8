"""Pipeline parallelism per model call, through ``torch.distributed.pipelining``. Plain PyTorch, no Lightning.

A role pipelined over ``pp`` ranks holds one stage per rank (:class:`~.pipeline_split.PipelineStageModule`: stage 0
the embeddings and first decoder layers, the last stage the last layers and the head). Its calls run torch's own
schedules over micro-batches: :class:`ScheduleGPipe` or :class:`Schedule1F1B` for a training call, the forward-only
pass of the same schedule (``schedule.eval``) for a scoring call. Nothing here hand-writes a schedule.

- Scoring (reference log-probabilities, critic values, reward scores): the last stage computes the result, which is
  then broadcast to every stage of the pipeline, so each rank of the call holds it, as in an unpipelined call.
- Training: the loss runs on the last stage, on each micro-batch's output, with the rows of the batch it covers as
  the schedule's ``target`` (:func:`~.pipeline_losses.policy_loss_fn` runs the engine's actor loss there). Gradients
  are summed over micro-batches (``scale_grads=False``): the engine's micro-batch losses are already shares of the
  whole minibatch, as in :meth:`~lightning_app_rlhf.engine.update_loop.UpdateLoop.accumulate_gradients`. Weights
  tied between the first and the last stage (GPT-2's embedding and LM head) get their gradients summed over the two.

Every communication runs on process groups created with a timeout, and is wrapped so that a dead or stuck rank
becomes a :class:`~lightning_app_rlhf.parallel.failures.PlacementError` naming the stage and the call, not a hang.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.pipelining.schedules import PipelineScheduleSingle

from lightning_app_rlhf.algorithms import functional
from lightning_app_rlhf.parallel.failures import DEFAULT_TIMEOUT, named_failure
from lightning_app_rlhf.parallel.pipeline_split import CAUSAL_LM, SCORE, VALUE, PipelineStageModule

SCHEDULES: dict[str, type[PipelineScheduleSingle]] = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}
"""The schedule names a plan takes (:data:`~lightning_app_rlhf.parallel.plan.PIPELINE_SCHEDULES`) -> torch's
schedule classes (one stage per rank)."""

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""``(last stage's output for a micro-batch, the batch rows it covers) -> loss``: what a training call runs."""


def check_schedule(name: str) -> type[PipelineScheduleSingle]:
    """The torch schedule class of ``name``, or a ``ValueError`` naming the choices."""
    if name not in SCHEDULES:
        raise ValueError(f"Unknown pipeline schedule {name!r}: use one of {sorted(SCHEDULES)} (1f1b keeps fewer "
                         "micro-batches' activations alive than gpipe).")
    return SCHEDULES[name]


@dataclass(frozen=True)
class PipelineGroup:
    """This rank's pipeline: its ranks in stage order and their process group (created with a timeout).

    ``tied_group``: the first and last stages' ranks, over which tied weights' gradients are summed; the pipeline's
    own group when it has two stages, None with one stage.
    """

    ranks: tuple[int, ...]
    group: dist.ProcessGroup | None
    tied_group: dist.ProcessGroup | None
    timeout: datetime.timedelta

    @property
    def num_stages(self) -> int:
        return len(self.ranks)


def create_pipeline_groups(pipelines: Sequence[Sequence[int]], rank: int,
                           timeout: datetime.timedelta = DEFAULT_TIMEOUT) -> PipelineGroup | None:
    """Create the process group of every pipeline (and of its first and last stages), on every rank in the same order
    (``new_group`` is collective over the world); return this rank's pipeline, or None when it is in none.

    Args:
        pipelines: Each pipeline's global ranks, in stage order (stage ``i`` on ``pipeline[i]``).
        rank: This process's global rank.
        timeout: Every collective and send on these groups fails after it instead of waiting forever.
    """
    mine = None
    for ranks in pipelines:
        ranks = tuple(ranks)
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"A pipeline's stages need one rank each; got ranks {list(ranks)}.")
        group = dist.new_group(list(ranks), timeout=timeout) if len(ranks) > 1 else None
        tied = group if len(ranks) == 2 else (
            dist.new_group([ranks[0], ranks[-1]], timeout=timeout) if len(ranks) > 2 else None)
        if rank in ranks:
            mine = PipelineGroup(ranks, group, tied, timeout)
    return mine


def tied_parameter_names(module: nn.Module) -> list[list[str]]:
    """Groups of parameter names that share one tensor (a tie), each in ``named_parameters`` order."""
    by_tensor: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        by_tensor.setdefault(id(p), []).append(name)
    return [names for names in by_tensor.values() if len(names) > 1]


@dataclass
class PipelineInputs:
    """A batch as every stage of a pipeline takes it: the token ids (the first stage embeds them; a reward model's
    last stage reads its score position from them), the 2-D attention mask and the position ids."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor

    @classmethod
    def from_mask(cls, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> PipelineInputs:
        """Position ids that skip left padding, as every call of the engine computes them."""
        return cls(input_ids, attention_mask, (attention_mask.long().cumsum(-1) - 1).clamp(min=0))

    def __len__(self) -> int:
        return len(self.input_ids)

    def padded_to(self, multiple: int) -> PipelineInputs:
        """Rows appended (copies of the last row) up to a multiple of ``multiple``: torch's schedules need
        micro-batches of one shape. Their outputs are dropped."""
        missing = -len(self) % multiple
        if not missing:
            return self

        def pad(t: torch.Tensor) -> torch.Tensor:
            return torch.cat([t, t[-1:].expand(missing, *t.shape[1:])])

        return PipelineInputs(pad(self.input_ids), pad(self.attention_mask), pad(self.position_ids))


class PipelinedRole:
    """One rank's stage of a role pipelined over a :class:`PipelineGroup`, and the calls it runs.

    Args:
        role_module: The role's whole, unwrapped module (built identically on every rank). It is cut in place to
            this rank's stage: keep no other use of it.
        pipeline: This rank's pipeline.
        rank: This process's global rank.
        device: Where the stage computes.
        what: The role or call, named by errors.
        schedule: ``"1f1b"`` or ``"gpipe"`` for training calls.
    """

    def __init__(self, role_module: nn.Module, pipeline: PipelineGroup, rank: int, device: torch.device,
                 what: str, schedule: str = "1f1b") -> None:
        self.schedule_class = check_schedule(schedule)
        if rank not in pipeline.ranks:
            raise ValueError(f"Rank {rank} is not in the pipeline of {what} (ranks {list(pipeline.ranks)}).")
        self.pipeline, self.rank, self.device, self.what = pipeline, rank, device, what
        self.stage_index = pipeline.ranks.index(rank)
        ties = tied_parameter_names(role_module)
        self.module = PipelineStageModule(role_module, self.stage_index, pipeline.num_stages, what)
        kept = dict(self.module.role.named_parameters(remove_duplicate=False))
        # A tie cut across stages: each side keeps its copy, and their gradients are summed after every backward.
        self.tied: list[nn.Parameter] = []
        for names in ties:
            here = [name for name in names if name in kept]
            if here and len(here) < len(names):
                if not (self.module.is_first or self.module.is_last):
                    raise ValueError(f"{what}: parameters {names} are tied across middle pipeline stages; only ties "
                                     "between the embeddings and the head are supported. Use pp=1 or pp=2.")
                self.tied.append(kept[here[0]])

    @property
    def is_first(self) -> bool:
        return self.module.is_first

    @property
    def is_last(self) -> bool:
        return self.module.is_last

    @property
    def last_rank(self) -> int:
        return self.pipeline.ranks[-1]

    def parameters(self) -> list[nn.Parameter]:
        """This stage's parameters (what its optimizer takes)."""
        return list(self.module.role.parameters())

    # ---- running the schedule ----

    def _schedule(self, n_microbatches: int, loss_fn: LossFn | None) -> PipelineScheduleSingle:
        # Forward only, every schedule is GPipe's fill of forwards (1F1B would refuse fewer micro-batches than stages).
        schedule_class = self.schedule_class if loss_fn is not None else ScheduleGPipe
        # A fresh stage per call: torch sizes its receive buffers from the first micro-batch it sees, and a call's
        # batch shape (rows, sequence length) changes from one iteration to the next.
        stage = PipelineStage(self.module, self.stage_index, self.pipeline.num_stages, self.device,
                              group=self.pipeline.group)
        # scale_grads=False: the micro-batch losses are shares of the whole batch already; their gradients add up.
        return schedule_class(stage, n_microbatches, loss_fn=loss_fn, scale_grads=False)

    def _step_kwargs(self, inputs: PipelineInputs) -> tuple[tuple[torch.Tensor, ...], dict[str, torch.Tensor]]:
        args = (inputs.input_ids,) if self.is_first else ()
        kwargs = {"attention_mask": inputs.attention_mask, "position_ids": inputs.position_ids}
        if self.is_last and self.module.head_kind == SCORE:
            kwargs["token_ids"] = inputs.input_ids
        return args, kwargs

    def _failure(self, doing: str) -> object:
        return named_failure(f"Rank {self.rank}: stage {self.stage_index} of {self.pipeline.num_stages} of the "
                             f"pipeline of {self.what} (ranks {list(self.pipeline.ranks)}), {doing},",
                             self.pipeline.timeout)

    @torch.no_grad()
    def forward(self, inputs: PipelineInputs, n_microbatches: int, logits_to_keep: int = 0) -> torch.Tensor | None:
        """The head's output for the whole batch on the last stage (None on the others), forward only.

        Args:
            inputs: The batch, the same on every stage.
            n_microbatches: Micro-batches the batch is cut into (rows are padded to a multiple and dropped after).
            logits_to_keep: A causal LM's last positions to compute logits for (0: all).
        """
        rows = len(inputs)
        n_microbatches = max(1, min(n_microbatches, rows))
        padded = inputs.padded_to(n_microbatches)
        self.module.logits_to_keep = logits_to_keep
        args, kwargs = self._step_kwargs(padded)
        if self.pipeline.num_stages == 1:
            return self.module(*args, **kwargs)[:rows]
        schedule = self._schedule(n_microbatches, None)
        with self._failure("forward"):
            out = schedule.eval(*args, **kwargs)
        return out[:rows] if self.is_last else None

    def backward(self, inputs: PipelineInputs, loss_fn: LossFn, n_microbatches: int,
                 logits_to_keep: int = 0) -> torch.Tensor:
        """Forward and backward of the whole batch through the training schedule; gradients accumulate into this
        stage's parameters (tied ones summed with their other stage's). Returns the sum of the micro-batch losses,
        on every stage.

        Args:
            inputs: The batch, the same on every stage.
            loss_fn: Run on the last stage for each micro-batch: ``(head output, batch row indices) -> loss``.
            n_microbatches: Micro-batches; must divide the rows (gradients of padded rows would count).
            logits_to_keep: A causal LM's last positions to compute logits for (0: all).
        """
        rows = len(inputs)
        if n_microbatches < 1 or rows % n_microbatches:
            raise ValueError(f"{self.what}: a pipelined training call cuts its {rows} rows into {n_microbatches} "
                             "micro-batches of one size: choose a micro-batch count that divides the rows (e.g. "
                             f"{_divisor_near(rows, n_microbatches)}).")
        if self.schedule_class is Schedule1F1B and n_microbatches < self.pipeline.num_stages:
            raise ValueError(f"{self.what}: the 1f1b schedule needs at least as many micro-batches as stages "
                             f"({self.pipeline.num_stages}), got {n_microbatches}. Use more micro-batches, or the "
                             "gpipe schedule.")
        self.module.logits_to_keep = logits_to_keep
        args, kwargs = self._step_kwargs(inputs)
        target = torch.arange(rows, device=inputs.input_ids.device)
        if self.pipeline.num_stages == 1:
            total = sum(loss_fn(self.module(*a, **k), t).float() for a, k, t in
                        _chunks(args, kwargs, target, n_microbatches))
            return self._backward_one(total)
        losses: list[torch.Tensor] = []
        counted = _MicroBatchLoss(loss_fn)
        schedule = self._schedule(n_microbatches, counted)
        with self._failure("training forward and backward"):
            schedule.step(*args, target=target if self.is_last else None, losses=losses if self.is_last else None,
                          **kwargs)
            self._sum_tied_gradients()
        if self.is_last and counted.calls != n_microbatches:
            raise RuntimeError(f"{self.what}: torch's schedule ran the loss on {counted.calls} micro-batches of "
                               f"{n_microbatches}: this torch version's pipelining differs from the one this engine "
                               "was written for (torch 2.13). Use pp=1 for this call.")
        total = torch.stack([loss.detach().float() for loss in losses]).sum() if self.is_last else torch.zeros(())
        return self.broadcast_from_last(total.reshape(1), "the summed loss")[0]

    def _backward_one(self, total: torch.Tensor) -> torch.Tensor:
        total.backward()
        return total.detach()

    def _sum_tied_gradients(self) -> None:
        group = self.pipeline.tied_group
        for p in self.tied:
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            work = dist.all_reduce(grad, group=group, async_op=True)
            work.wait(self.pipeline.timeout)
            p.grad = grad

    def broadcast_from_last(self, tensor: torch.Tensor, what: str) -> torch.Tensor:
        """``tensor`` from the last stage to every stage (the others pass one of the same shape and dtype)."""
        if self.pipeline.num_stages == 1:
            return tensor
        tensor = tensor.contiguous()
        with self._failure(f"broadcast of {what} from the last stage"):
            work = dist.broadcast(tensor, src=self.last_rank, group=self.pipeline.group, async_op=True)
            work.wait(self.pipeline.timeout)
        return tensor

    def grad_norm(self) -> torch.Tensor:
        """The L2 norm of the whole role's gradient, on every stage (a tied weight counted once, on the first
        stage), as ``clip_grad_norm_`` over the unpipelined model computes it."""
        first_copy = {id(p) for p in self.tied} if not self.is_first else set()
        squares = torch.zeros(1, dtype=torch.float64)
        for p in self.parameters():
            if p.grad is not None and id(p) not in first_copy:
                squares += p.grad.detach().double().pow(2).sum()
        if self.pipeline.num_stages > 1:
            with self._failure("all-reduce of the gradient norm"):
                dist.all_reduce(squares, group=self.pipeline.group, async_op=True).wait(self.pipeline.timeout)
        return squares.sqrt().float()[0]

    def clip_and_step(self, optimizer: torch.optim.Optimizer, max_grad_norm: float | None = None) -> torch.Tensor:
        """Clip the whole role's gradient to ``max_grad_norm`` (None: no clipping) and step this stage's optimizer;
        returns the norm before clipping. Every stage of the pipeline must call it (the norm is a collective)."""
        norm = self.grad_norm()
        if max_grad_norm is not None and torch.isfinite(norm):
            factor = max_grad_norm / (norm + 1e-6)
            if factor < 1:
                for p in self.parameters():
                    if p.grad is not None:
                        p.grad.mul_(factor)
        optimizer.step()
        return norm

    # ---- the scoring calls ----

    def logprobs(self, sequences: torch.Tensor, attention_mask: torch.Tensor, response_mask: torch.Tensor,
                 prompt_length: int, temperature: float, n_microbatches: int) -> torch.Tensor:
        """Log-probabilities ``[B, T]`` of the response tokens, masked, on every stage: the pipelined
        ``reference.forward`` (the numbers of :func:`~lightning_app_rlhf.models.calls.reference_forward`)."""
        self._expect(CAUSAL_LM, "log-probabilities")
        responses = sequences[:, prompt_length:]
        logits = self.forward(PipelineInputs.from_mask(sequences, attention_mask), n_microbatches,
                              logits_to_keep=responses.shape[1] + 1)
        out = torch.empty(responses.shape, dtype=torch.float32, device=sequences.device)
        if logits is not None:
            out = functional.logprobs_from_logits(logits[:, :-1], responses, temperature).float() * response_mask
        return self.broadcast_from_last(out, "log-probabilities")

    def values(self, sequences: torch.Tensor, attention_mask: torch.Tensor, response_mask: torch.Tensor,
               prompt_length: int, n_microbatches: int) -> torch.Tensor:
        """Critic values ``[B, T]`` of the states before each response token, masked, on every stage: the pipelined
        ``critic.forward`` (:func:`~lightning_app_rlhf.models.calls.critic_forward`)."""
        self._expect(VALUE, "values")
        values = self.forward(PipelineInputs.from_mask(sequences, attention_mask), n_microbatches)
        out = torch.empty(response_mask.shape, dtype=torch.float32, device=sequences.device)
        if values is not None:
            out = values[:, prompt_length - 1 : -1] * response_mask
        return self.broadcast_from_last(out, "values")

    def scores(self, sequences: torch.Tensor, attention_mask: torch.Tensor, n_microbatches: int) -> torch.Tensor:
        """Reward-model scores ``[B]`` in float32, on every stage: the pipelined ``reward.forward`` of a reward model
        (:func:`~lightning_app_rlhf.models.calls.reward_forward`, before any environment reward)."""
        self._expect(SCORE, "scores")
        logits = self.forward(PipelineInputs.from_mask(sequences, attention_mask), n_microbatches)
        out = torch.empty(len(sequences), dtype=torch.float32, device=sequences.device)
        if logits is not None:
            out = logits[:, 0].float()
        return self.broadcast_from_last(out, "scores")

    def _expect(self, kind: str, what: str) -> None:
        if self.module.head_kind != kind:
            raise ValueError(f"{self.what} has a {self.module.head_kind} head; {what} need a {kind} head.")


class _MicroBatchLoss:
    """The training loss as torch's schedule calls it, ``loss_fn`` run on micro-batches only.

    A fresh :class:`PipelineStage` without example inputs infers its tensors' metadata on its first step: the last
    stage then runs the loss once on an inferred output (received buffers, not a micro-batch's activations) against
    a detached copy of the first micro-batch's target, only for the shapes of the gradients it sends back. That call
    gets a stand-in loss with the same graph (no statistics recorded, no NaN from uninitialised buffers): it is the
    first call, and its target is no view (the micro-batches' targets are views of the whole target).
    :attr:`calls` counts the micro-batches the loss really ran on; :meth:`PipelinedRole.backward` checks it.
    """

    def __init__(self, loss_fn: LossFn) -> None:
        self.loss_fn, self.calls, self.first = loss_fn, 0, True

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        first, self.first = self.first, False
        if first and target._base is None:
            return (output.float() * 0).sum()  # metadata inference: input gradients of the right shapes
        self.calls += 1
        return self.loss_fn(output, target)


def _chunks(args: tuple[torch.Tensor, ...], kwargs: dict[str, torch.Tensor], target: torch.Tensor,
            n: int) -> list[tuple[tuple[torch.Tensor, ...], dict[str, torch.Tensor], torch.Tensor]]:
    """The micro-batches of a one-stage pipeline, cut as torch's schedules cut them (dim 0, equal parts)."""
    parts_args = [a.tensor_split(n) for a in args]
    parts_kwargs = {k: v.tensor_split(n) for k, v in kwargs.items()}
    return [(tuple(p[i] for p in parts_args), {k: v[i] for k, v in parts_kwargs.items()}, t)
            for i, t in enumerate(target.tensor_split(n))]


def _divisor_near(rows: int, wanted: int) -> int:
    return min((d for d in range(1, rows + 1) if rows % d == 0), key=lambda d: (abs(d - wanted), d))
