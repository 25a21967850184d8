"""The model calls of one iteration, besides ``actor.generate`` (see ``generation/``).

``reference.forward``, ``critic.forward`` and ``reward.forward`` score a rollout; the train calls are built from
:func:`policy_logprobs` and :func:`critic_values` (the algorithm's losses on top). Each call takes only the
tensors it needs, so a placement can run it on any group of ranks. Plain PyTorch, no Lightning.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from transformers import PreTrainedTokenizerBase

from lightning_app_rlhf.algorithms import functional
from lightning_app_rlhf.generation import Rollout, position_ids_from_mask, row_chunks
from lightning_app_rlhf.models.packing import (
    pack_rows,
    padding_free_logprobs,
    padding_free_logprobs_and_entropy,
)
from lightning_app_rlhf.models.reward_args import RewardSignature
from lightning_app_rlhf.models.roles import RewardFunction


def response_logits(
    model: nn.Module, sequences: torch.Tensor, attention_mask: torch.Tensor, prompt_length: int
) -> torch.Tensor:
    """Logits [B, T + 1, V] of the last T + 1 positions: the LM head runs on those only. Positions 0..T-1 predict
    the T response tokens; the last predicts the token after the response, and only pads the shape (slicing it
    off would cost a logits-sized copy, and in backward a logits-sized zero fill)."""
    response_length = sequences.shape[1] - prompt_length
    return model(
        input_ids=sequences,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        use_cache=False,
        logits_to_keep=response_length + 1,
    ).logits


def _in_chunks(
    forward: Callable[[Rollout], torch.Tensor],
    rollout: Rollout,
    batch_size: int | None,
    lockstep_group: dist.ProcessGroup | None,
    inference_mode: bool = False,
) -> torch.Tensor:
    """``forward`` on consecutive row chunks of ``rollout`` (see :func:`~lightning_app_rlhf.generation.row_chunks`),
    its outputs concatenated along dim 0. With a lockstep group, a rank without rows in a chunk runs ``forward`` on a
    stand-in row and drops the output, so that a sharded model's forwards stay paired across the group.

    ``inference_mode``: the forwards run under ``torch.inference_mode`` (less per-op bookkeeping than ``no_grad``),
    and the output is cloned out of it, so that a loss may save it for backward."""
    if not inference_mode:
        return _chunked(forward, rollout, batch_size, lockstep_group)
    with torch.inference_mode():
        out = _chunked(forward, rollout, batch_size, lockstep_group)
    return out.clone()


def _chunked(
    forward: Callable[[Rollout], torch.Tensor],
    rollout: Rollout,
    batch_size: int | None,
    lockstep_group: dist.ProcessGroup | None,
) -> torch.Tensor:
    if batch_size is None and lockstep_group is None:
        return forward(rollout)
    num_rows = len(rollout.sequences)
    chunks = row_chunks(num_rows, batch_size, lockstep_group, rollout.sequences.device)
    if not chunks:  # no rows and no group: the one call on the empty rollout, as without chunks
        return forward(rollout)
    outs, stand_in_out = [], None
    for rows in chunks:
        if rows.stop > rows.start:
            outs.append(forward(rollout if rows.stop - rows.start == num_rows else rollout.select(rows)))
        else:
            stand_in_out = forward(_stand_in(rollout))
    if not outs:
        return stand_in_out[:0]
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)


def _stand_in(rollout: Rollout) -> Rollout:
    """One row to run a forward on when a rank has none left in a chunk: its first row, or token 0 attended."""
    if len(rollout.sequences):
        return rollout.select(slice(0, 1))
    sequences = rollout.sequences.new_zeros(1, rollout.sequences.shape[1])
    response_mask = rollout.response_mask.new_zeros(1, rollout.response_mask.shape[1])
    return Rollout(sequences, rollout.attention_mask.new_ones(sequences.shape), response_mask,
                   rollout.logprobs.new_zeros(response_mask.shape), rollout.prompt_length)


@torch.no_grad()
def reference_forward(
    reference: nn.Module,
    rollout: Rollout,
    temperature: float,
    batch_size: int | None = None,
    lockstep_group: dist.ProcessGroup | None = None,
    padding_free: bool = False,
    inference_mode: bool = False,
) -> torch.Tensor:
    """Reference log-probabilities [B, T] of the sampled response tokens.

    ``batch_size``: rows per forward (``generation.batch_size``; None: all at once). ``lockstep_group``: the ranks
    over which ``reference`` is sharded (FSDP2 / ZeRO-3), which must then run the same number of chunks; None when it
    is not sharded. ``padding_free``: each forward on the chunk's real tokens only (:mod:`.packing`).
    ``inference_mode``: the forwards under ``torch.inference_mode`` instead of ``torch.no_grad``, the same numbers
    (only for a module that keeps no state past its forward: not FSDP2 or ZeRO-3, whose gathered parameters would
    become inference tensors).
    """

    def forward(part: Rollout) -> torch.Tensor:
        packed = pack_rows(part.sequences, part.attention_mask, part.prompt_length) if padding_free else None
        if packed is not None:
            return padding_free_logprobs(reference, packed, temperature) * part.response_mask
        logits = response_logits(reference, part.sequences, part.attention_mask, part.prompt_length)
        return functional.logprobs_from_logits(logits[:, :-1], part.responses, temperature) * part.response_mask

    return _in_chunks(forward, rollout, batch_size, lockstep_group, inference_mode)


@torch.no_grad()
def critic_forward(
    critic: nn.Module,
    rollout: Rollout,
    batch_size: int | None = None,
    lockstep_group: dist.ProcessGroup | None = None,
    inference_mode: bool = False,
) -> torch.Tensor:
    """Critic values [B, T] of the states before each response token, ``batch_size`` rows per forward (see
    :func:`reference_forward`, also for ``lockstep_group`` and ``inference_mode``)."""

    def forward(part: Rollout) -> torch.Tensor:
        return critic_values(critic, part) * part.response_mask

    return _in_chunks(forward, rollout, batch_size, lockstep_group, inference_mode)


class RewardFunctionError(RuntimeError):
    """A reward function raised: the message names the function, the iteration and the batch's first prompt; the
    function's own exception is the ``__cause__``, with its traceback."""


@torch.no_grad()
def reward_forward(
    reward: nn.Module | RewardFunction,
    rollout: Rollout,
    tokenizer: PreTrainedTokenizerBase,
    row_fields: dict[str, list[Any]] | None = None,
    batch_size: int | None = None,
    lockstep_group: dist.ProcessGroup | None = None,
    iteration: int | None = None,
    inference_mode: bool = False,
) -> torch.Tensor:
    """Scores [B] in float32: a reward model's output, or a reward function's on decoded text.

    A reward model runs ``batch_size`` rows per forward (see :func:`reference_forward`, also for ``inference_mode``,
    which a reward function ignores: it runs the user's code as it is). A reward function is
    called once on the whole rollout whatever ``batch_size``: decoded text is small, and the function sees every
    response of the shard (and its row fields) at once, as without chunks.

    A multi-turn episode's score is the reward's plus the environment's rewards (the sum over its turns); a reward
    function gets the episode's final turn as its response (the answer), and the prompt as rendered.

    A reward function is called ``(prompts, responses, **fields)``, or by name as TRL's ``GRPOTrainer`` calls it
    (``prompts=``, ``completions=``, the fields, ``completion_ids=`` and ``trainer_state=`` when taken) when its
    signature names ``completions`` (see :class:`~lightning_app_rlhf.models.reward_args.RewardSignature`). The
    dataset rows' other fields (e.g. ``answer=[...]``, one entry per response) come as keyword arguments when its
    signature names them or takes ``**kwargs``. It may return a list (or tuple) of numbers (floats, ints, bools), a
    1-D tensor or a numpy array (a ``[B, 1]`` column too), one score per response.

    Args:
        iteration: The iteration being scored, named by the errors below (None: not named).

    Raises:
        RewardFunctionError: The reward function raised; its exception is chained as the cause.
        RewardSignatureError: The reward function's parameters cannot take the call (checked before calling it).
        ValueError: The reward function returned something else than one number per response.
    """
    if isinstance(reward, nn.Module):

        def forward(part: Rollout) -> torch.Tensor:
            logits = reward(
                input_ids=part.sequences,
                attention_mask=part.attention_mask,
                position_ids=position_ids_from_mask(part.attention_mask),
            ).logits
            return logits[:, 0].float()

        return with_environment_rewards(_in_chunks(forward, rollout, batch_size, lockstep_group, inference_mode),
                                        rollout)
    prompts = tokenizer.batch_decode(rollout.sequences[:, : rollout.prompt_length], skip_special_tokens=True)
    if rollout.turn_rewards is None:
        responses = tokenizer.batch_decode(rollout.responses, skip_special_tokens=True)
    else:  # a multi-turn episode: the function scores its final turn, the answer
        responses = [tokenizer.decode(ids[mask.bool()], skip_special_tokens=True)
                     for ids, mask in zip(rollout.responses, rollout.final_turns())]
    signature = RewardSignature.of(reward)
    signature.check(reward, (row_fields or {}).keys(), "this batch's rows")  # not a TypeError from inside the call
    args, kwargs = signature.arguments(prompts, responses, row_fields or {}, lambda: _completion_ids(rollout),
                                       iteration)
    try:
        returned = reward(*args, **kwargs)
    except Exception as err:  # user code: say which call failed; the cause keeps its traceback
        raised = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
        raise RewardFunctionError(
            f"The reward function {_name_of(reward)} raised {raised} ({_batch_of(prompts, iteration)}). Fix the "
            "function: its traceback is shown above."
        ) from err
    return with_environment_rewards(_scores_from(returned, reward, prompts, iteration).to(rollout.sequences.device),
                                    rollout)


def with_environment_rewards(scores: torch.Tensor, rollout: Rollout) -> torch.Tensor:
    """``scores`` plus each multi-turn episode's environment rewards (the sum over its turns)."""
    return scores if rollout.turn_rewards is None else scores + rollout.turn_rewards.sum(1).to(scores.dtype)


def _scores_from(returned: Any, reward: RewardFunction, prompts: list[str], iteration: int | None) -> torch.Tensor:
    """A reward function's return value as float32 scores [B], or a ``ValueError`` saying what came back."""
    expected = len(prompts)

    def refuse(what: str) -> ValueError:
        return ValueError(
            f"The reward function {_name_of(reward)} ({_batch_of(prompts, iteration)}) returned {what}. It must "
            f"return one float per (prompt, response) pair: {expected} of them, as a list of numbers, a 1-D tensor "
            "or a numpy array."
        )

    kind = _a(type(returned).__name__)
    if _is_array(returned):
        if not _numeric_dtype(returned):
            items = list(returned.flatten()) if returned.ndim else [returned.item()]
            first = next(((i, item) for i, item in enumerate(items) if not _is_number(item)), None)
            shown = f", whose item #{first[0]} is {_describe_item(first[1])}" if first is not None else ""
            raise refuse(f"{kind} of dtype {returned.dtype}{shown}")
        scores = torch.as_tensor(returned)
        if scores.ndim == 2 and scores.shape[1] == 1:  # a [B, 1] column, as a one-label head gives
            scores = scores[:, 0]
        if scores.ndim != 1:
            raise refuse(f"{kind} of shape {tuple(scores.shape)}")
    elif isinstance(returned, (list, tuple)):
        for i, item in enumerate(returned):
            if not _is_number(item):
                raise refuse(f"{kind} whose item #{i} is {_describe_item(item)}")
        scores = torch.tensor([float(item) for item in returned], dtype=torch.float32)
    elif returned is None:
        raise refuse("None (is a `return` missing?)")
    else:
        raise refuse(f"{kind} ({_short(returned)})")
    if len(scores) != expected:
        raise refuse(f"{kind} of {len(scores)} score{'s' if len(scores) != 1 else ''}")
    return scores.to(torch.float32)


def _is_array(value: Any) -> bool:
    """A tensor, or a numpy array or scalar (duck-typed: numpy is not imported here)."""
    return torch.is_tensor(value) or all(hasattr(value, name) for name in ("__array__", "dtype", "shape"))


def _numeric_dtype(array: Any) -> bool:
    if torch.is_tensor(array):
        return not array.is_complex()
    return array.dtype.kind in "biuf"  # numpy: bool, signed and unsigned integers, floats


def _is_number(item: Any) -> bool:
    if isinstance(item, numbers.Real):  # bools, and numpy's integer and floating scalars
        return True
    return _is_array(item) and tuple(item.shape) == () and _numeric_dtype(item)  # a 0-d tensor, numpy's bool_


def _describe_item(item: Any) -> str:
    return "None" if item is None else f"{_short(item)} ({_a(type(item).__name__)}, not a number)"


def _a(noun: str) -> str:
    return f"{'an' if noun[:1].lower() in 'aeiou' else 'a'} {noun}"


def _name_of(function: Any) -> str:
    name = getattr(function, "__qualname__", None) or type(function).__qualname__
    module = getattr(function, "__module__", None)
    return f"'{module}.{name}'" if module else f"'{name}'"


def _batch_of(prompts: list[str], iteration: int | None) -> str:
    """Where a reward call failed: the iteration and the batch's first prompt, to find the batch in the data."""
    where = f"at iteration {iteration}, " if iteration is not None else ""
    if not prompts:
        return f"{where}on an empty batch"
    return f"{where}on a batch of {len(prompts)} responses whose first prompt is {_short(prompts[0])}"


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _completion_ids(rollout: Rollout) -> list[list[int]]:
    """Each response's token ids without padding (TRL's ``completion_ids``)."""
    return [row[mask.bool()].tolist() for row, mask in zip(rollout.responses, rollout.response_mask)]


@dataclass
class Experience:
    """A scored rollout, ready for the policy update. Every tensor has the batch as its first dimension."""

    sequences: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor
    logprobs: torch.Tensor
    values: torch.Tensor | None
    """Critic values at rollout time; None for a critic-free algorithm."""
    advantages: torch.Tensor
    returns: torch.Tensor | None
    """Targets of the critic; None for a critic-free algorithm."""
    prompt_length: int
    iteration: int
    """The iteration whose rollout this is; keys the minibatch order of every update on it."""
    ref_logprobs: torch.Tensor | None = None
    """Reference log-probabilities, kept when the actor's loss has a KL term (``ppo.kl_loss_coef > 0``)."""
    is_weights: torch.Tensor | None = None
    """Per-token loss weights of ``ppo.rollout_is: tis`` (the truncated trainer-over-behaviour ratio); None
    otherwise."""
    policy_version: int = 0
    """The policy version that generated the rollout: how many updates its weights had had. An update on it is
    ``current version - policy_version`` versions stale (``PlacementPlan.max_staleness`` bounds it). With partial
    rollouts, the oldest version of any of its tokens."""
    token_versions: torch.Tensor | None = None
    """[B, T] with partial rollouts: the policy version that sampled each response token (0 off the response mask);
    the staleness bound holds per token. None: every token is ``policy_version``'s."""

    def minibatch(self, indices: torch.Tensor) -> Experience:
        parts = {f.name: getattr(self, f.name) for f in fields(self)}
        return Experience(**{k: v[indices] if torch.is_tensor(v) else v for k, v in parts.items()})

    def to(self, device: torch.device) -> Experience:
        parts = {f.name: getattr(self, f.name) for f in fields(self)}
        return Experience(**{k: v.to(device) if torch.is_tensor(v) else v for k, v in parts.items()})


def policy_logprobs(
    actor: nn.Module, batch: Experience, temperature: float, entropy_grad: bool = True, padding_free: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """The actor's log-probabilities [B, T] of the sampled response tokens (with gradients) and its entropies
    [B, T], at the sampling temperature: the forward of the ``actor.train`` call.

    One float32 ``log_softmax`` over the vocabulary serves both, with a closed-form backward
    (:func:`~lightning_app_rlhf.algorithms.functional.token_logprobs_and_entropy`: the numbers of
    ``logprobs_from_logits`` and ``entropy_from_logits``). ``entropy_grad=False`` (no entropy term in the loss):
    the entropy is a statistic, computed without a graph, so backward skips it. ``padding_free``: the forward runs on
    the batch's real tokens only (:mod:`.packing`; 0 at positions without a response token)."""
    packed = pack_rows(batch.sequences, batch.attention_mask, batch.prompt_length) if padding_free else None
    if packed is not None:
        return padding_free_logprobs_and_entropy(actor, packed, temperature, entropy_grad)
    logits = response_logits(actor, batch.sequences, batch.attention_mask, batch.prompt_length)
    responses = batch.sequences[:, batch.prompt_length :]
    return functional.token_logprobs_and_entropy(logits, responses, temperature, entropy_grad)


def critic_values(critic: nn.Module, batch: Experience | Rollout) -> torch.Tensor:
    """The critic's values [B, T] of the states before each response token, unmasked, with gradients when enabled:
    the forward of ``critic.train`` (and of ``critic.forward``, masked)."""
    values = critic(batch.sequences, batch.attention_mask, position_ids_from_mask(batch.attention_mask))
    return values[:, batch.prompt_length - 1 : -1]


def describe_nonfinite(scores: torch.Tensor) -> str:
    bad = (~torch.isfinite(scores)).nonzero().flatten().tolist()
    shown = ", ".join(f"#{i}={scores[i].item()}" for i in bad[:5])
    return f"{len(bad)} of {len(scores)} scores are NaN or inf ({shown}{', ...' if len(bad) > 5 else ''})"


def minibatch_permutation(batch_size: int, seed: int, iteration: int, epoch: int) -> torch.Tensor:
    """The order of samples in one PPO epoch, keyed by (seed, iteration, epoch) only."""
    generator = torch.Generator().manual_seed((seed * 1_000_003 + iteration) * 1_009 + epoch)
    return torch.randperm(batch_size, generator=generator)


def split_minibatches(permutation: torch.Tensor, num_minibatches: int) -> list[torch.Tensor]:
    size = math.ceil(len(permutation) / num_minibatches)
    return [permutation[i : i + size] for i in range(0, len(permutation), size)]
