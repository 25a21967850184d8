"""When a response ends, and whether it fits: stop ids and stop strings (:class:`StopCondition`), the model's own
end ids, the context-length check, and the all-rows-done check of a lockstep group. Plain PyTorch.

A row ends at the first of its stop tokens (EOS, the actor's other end ids, ``generation.stop_token_ids``) or at the
token that completes one of ``generation.stop_strings``; that token is kept, with mask 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from lightning_app_rlhf.core.config import GenerationConfig

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase
    from transformers.generation.stopping_criteria import StopStringCriteria


def context_length(model: torch.nn.Module) -> int | None:
    """The model's maximum sequence length from its Hugging Face config, if it declares one."""
    return config_context_length(getattr(model, "config", None))


def config_context_length(config: object | None) -> int | None:
    """The maximum sequence length a Hugging Face config declares (``max_position_embeddings``, ``n_positions``,
    ...), if any: read before the model is built, to check the prompts at setup."""
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def context_length_error(prompt_length: int, max_new_tokens: int, limit: int, prompts: str | None = None) -> str:
    """The message of a prompt that does not fit the actor's context, naming the three fixes.

    Args:
        prompt_length: The longest prompt's tokens.
        max_new_tokens: ``generation.max_new_tokens``.
        limit: The actor's context length.
        prompts: Which prompt is the longest (e.g. ``"Prompt #17 of data.prompts ('What is...')"``); None: the batch's.
    """
    subject = f"{prompts} has {prompt_length} tokens:" if prompts else f"Prompts of up to {prompt_length} tokens"
    return (f"{subject} plus generation.max_new_tokens={max_new_tokens} need {prompt_length + max_new_tokens} "
            f"positions, but the actor's context holds {limit}. Lower generation.max_new_tokens, cap prompts with "
            f"data.max_prompt_length (<= {max(limit - max_new_tokens, 0)}), or use a model with a longer context.")


def check_context_length(model: torch.nn.Module, prompt_length: int, max_new_tokens: int) -> None:
    """Raise a clear error when prompts plus the requested new tokens do not fit the model's context."""
    limit = context_length(model)
    if limit is not None and prompt_length + max_new_tokens > limit:
        raise ValueError(context_length_error(prompt_length, max_new_tokens, limit))


def model_eos_token_ids(model: torch.nn.Module) -> list[int]:
    """The ids in the model's ``generation_config.eos_token_id`` (an int or a list: chat models such as Llama 3
    and Qwen list several end tokens); none when the model has no generation config."""
    ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    return [] if ids is None else [int(i) for i in torch.as_tensor(ids).reshape(-1).tolist()]


@dataclass
class StopCondition:
    """What ends a row: one of ``token_ids``, or a token that completes one of the stop strings."""

    token_ids: torch.Tensor
    """[S] int64 stop ids, on the tokens' device."""
    strings: StopStringCriteria | None = None
    """transformers' matcher of ``generation.stop_strings`` (strings that span tokens too); None: no strings."""

    @property
    def window(self) -> int:
        """How many of the latest response columns :meth:`ended_window` needs (a stop string spans at most one token
        per byte, so the longest string's byte count is enough)."""
        return 1 if self.strings is None else self.strings.maximum_token_len

    def ended(self, tokens: list[torch.Tensor]) -> torch.Tensor:
        """[B] whether each row's latest token (``tokens[-1]``; ``tokens`` are the response's columns so far) ends
        it. Stop strings are matched within the response only, never reaching back into the prompt."""
        hit = torch.isin(tokens[-1], self.token_ids)
        if self.strings is not None:
            recent = torch.stack(tokens[-self.window :], dim=1)
            hit = hit | self.strings(recent, None).to(hit.device)
        return hit

    def ended_window(self, recent: torch.Tensor) -> torch.Tensor:
        """:meth:`ended` for a preallocated response buffer: ``recent`` [B, W] holds the latest response columns
        (at most :attr:`window` of them are read), the last one being the newest token."""
        hit = torch.isin(recent[:, -1], self.token_ids)
        if self.strings is not None:
            hit = hit | self.strings(recent[:, -self.window :], None).to(hit.device)
        return hit


def stop_string_criteria(
    tokenizer: PreTrainedTokenizerBase | None, stop_strings: Sequence[str]
) -> StopStringCriteria:
    """transformers' ``StopStringCriteria`` for ``stop_strings``, with a clear error when it cannot be built."""
    if tokenizer is None:
        raise ValueError(
            f"generation.stop_strings={list(stop_strings)!r} needs the tokenizer to match text: pass "
            "generate(..., tokenizer=tokenizer), or set generation.stop_strings=None."
        )
    from transformers.generation.stopping_criteria import StopStringCriteria

    try:
        return StopStringCriteria(tokenizer, list(stop_strings))
    except ValueError as error:  # e.g. characters no token of the vocabulary can produce
        raise ValueError(
            f"generation.stop_strings={list(stop_strings)!r} cannot be matched with this tokenizer: {error} "
            "Change or remove the strings it cannot produce."
        ) from error


def stop_condition(
    config: GenerationConfig,
    eos_token_id: int | Sequence[int],
    tokenizer: PreTrainedTokenizerBase | None = None,
    device: torch.device | str | None = None,
) -> StopCondition:
    """The stop ids (``eos_token_id`` plus ``config.stop_token_ids``) and ``config.stop_strings``'s matcher."""
    ids = list(eos_token_id) if isinstance(eos_token_id, Sequence) else [eos_token_id]
    ids = list(dict.fromkeys([*map(int, ids), *(config.stop_token_ids or [])]))
    strings = stop_string_criteria(tokenizer, config.stop_strings) if config.stop_strings else None
    return StopCondition(torch.tensor(ids, dtype=torch.int64, device=device), strings)


def all_done(done: torch.Tensor, lockstep_group: dist.ProcessGroup | None) -> bool:
    """Whether every row has ended: this rank's rows, or, with a lockstep group, the rows of every rank of it.

    Args:
        done: [B] True for rows that ended.
        lockstep_group: Ranks whose model is sharded: they must stop decoding at the same step, so the answer is one
            all-reduce over the group (every rank must call this at the same steps); None: this rank alone.
    """
    if lockstep_group is None:
        return bool(done.all())
    running = (~done.all()).to(torch.int32).reshape(1)
    dist.all_reduce(running, op=dist.ReduceOp.MAX, group=lockstep_group)
    return not bool(running.item())
