"""Batched sampling with a KV cache: the ``actor.generate`` call. Plain PyTorch, no Lightning.

Every random draw is keyed by a per-sample integer (derived from the seed, the iteration and the sample's
global index), never by the batch it happens to sit in. A prompt therefore gets the same response whether
it is generated alone, in a batch of 32, or on any rank of a placement.

A row ends at the first of its stop tokens (EOS, the actor's other end ids, ``generation.stop_token_ids``) or at
the token that completes one of ``generation.stop_strings``; that token is kept, with mask 1. With
``generation.do_sample=False`` the most likely token is taken instead of a keyed draw (greedy decoding).

The decoding loop itself is a :class:`GenerationBackend`, chosen by ``generation.backend``: ``eager`` (this module:
a dynamic cache, a host sync per token) or ``static`` (:mod:`lightning_app_rlhf.static_decoder`: a preallocated
cache, CUDA-graph friendly). Both draw the same keyed uniforms, so they give the same tokens for the same keys.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_app_rlhf.config import GenerationConfig
from lightning_app_rlhf.hf_cache import cache_kwargs, returned_cache

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase
    from transformers.generation.stopping_criteria import StopStringCriteria

_MASK64 = (1 << 63) - 1


@dataclass
class Rollout:
    """What ``actor.generate`` produces for one batch of left-padded prompts."""

    sequences: torch.Tensor
    """[B, P + T] prompt tokens (left-padded) followed by response tokens (pad after EOS)."""
    attention_mask: torch.Tensor
    """[B, P + T] 1 for real prompt tokens and for response tokens up to and including EOS."""
    response_mask: torch.Tensor
    """[B, T] 1 for response tokens up to and including EOS."""
    logprobs: torch.Tensor
    """[B, T] behaviour log-probabilities of the sampled tokens at the sampling temperature (no top-k/top-p)."""
    prompt_length: int
    """P, the padded prompt length."""
    stopped: torch.Tensor | None = None
    """[B] True where the response ended at a stop token or stop string (its last masked token), False where it
    was cut at ``max_new_tokens``. None when unknown, e.g. a rollout rebuilt from gathered tensors."""

    @property
    def responses(self) -> torch.Tensor:
        return self.sequences[:, self.prompt_length :]

    def select(self, rows: slice) -> Rollout:
        """The rollout of a subset of rows."""
        return Rollout(self.sequences[rows], self.attention_mask[rows], self.response_mask[rows],
                       self.logprobs[rows], self.prompt_length,
                       self.stopped[rows] if self.stopped is not None else None)


def sample_keys(
    seed: int, iteration: int, sample_indices: torch.Tensor, repeat_indices: torch.Tensor | None = None
) -> torch.Tensor:
    """One 63-bit key per sample from (seed, iteration, prompt index, sample index), by a splitmix64-style mix.

    ``sample_indices`` are the prompts' global indices; ``repeat_indices`` which of the ``generation.num_samples``
    responses of its prompt a row is (None: all 0, the first response, whose key does not depend on the group size).
    """
    repeats = repeat_indices.tolist() if repeat_indices is not None else [0] * len(sample_indices)
    keys = []
    for index, repeat in zip(sample_indices.tolist(), repeats):
        z = (seed * 0x9E3779B97F4A7C15 + iteration * 0xBF58476D1CE4E5B9 + index * 0x94D049BB133111EB
             + repeat * 0xD1B54A32D192ED03) & _MASK64
        z = ((z ^ (z >> 31)) * 0xD6E8FEAC8F3A5A1D) & _MASK64
        keys.append(z ^ (z >> 29))
    return torch.tensor(keys, dtype=torch.int64)


def repeat_samples(batch: dict[str, Any], num_samples: int) -> dict[str, Any]:
    """Each prompt row repeated ``num_samples`` times, consecutively (a prompt's group is contiguous), with
    ``sample``: which repeat a row is. Row fields (lists) are repeated alike."""
    repeat = lambda t: t.repeat_interleave(num_samples, dim=0)
    out = {key: repeat(batch[key]) for key in ("input_ids", "attention_mask", "index")}
    out["sample"] = torch.arange(num_samples, device=batch["index"].device).repeat(len(batch["index"]))
    fields = batch.get("fields") or {}
    out["fields"] = {name: [v for v in values for _ in range(num_samples)] for name, values in fields.items()}
    return out


def keyed_uniforms(keys: torch.Tensor, num: int) -> torch.Tensor:
    """[B, num] uniforms in [0, 1); row b depends only on ``keys[b]``."""
    rows = []
    for key in keys.tolist():
        generator = torch.Generator().manual_seed(key)
        rows.append(torch.rand(num, generator=generator, dtype=torch.float64))
    return torch.stack(rows)


def filter_probs(probs: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Zero out tokens outside the top-k and outside the top-p nucleus (the most likely token always stays)."""
    if top_k > 0 and top_k < probs.shape[-1]:
        kth = torch.topk(probs, top_k, dim=-1).values[..., -1:]
        probs = probs.masked_fill(probs < kth, 0.0)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(mass_before >= top_p * sorted_probs.sum(-1, keepdim=True), 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return probs


def inverse_cdf_sample(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Sample one token per row of (unnormalised) ``probs`` [B, V] with the given uniforms [B]."""
    cdf = probs.double().cumsum(-1)
    targets = (uniforms.to(cdf.device) * cdf[:, -1]).unsqueeze(-1)
    tokens = torch.searchsorted(cdf, targets, right=True).squeeze(-1)
    return tokens.clamp(max=probs.shape[-1] - 1)


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding, so a padded prompt sees the same positions as an unpadded one."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def context_length(model: torch.nn.Module) -> int | None:
    """The model's maximum sequence length from its Hugging Face config, if it declares one."""
    config = getattr(model, "config", None)
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def check_context_length(model: torch.nn.Module, prompt_length: int, max_new_tokens: int) -> None:
    """Raise a clear error when prompts plus the requested new tokens do not fit the model's context."""
    limit = context_length(model)
    if limit is not None and prompt_length + max_new_tokens > limit:
        raise ValueError(
            f"Prompts of up to {prompt_length} tokens plus generation.max_new_tokens={max_new_tokens} need "
            f"{prompt_length + max_new_tokens} positions, but the actor's context holds {limit}. Lower "
            f"generation.max_new_tokens, cap prompts with data.max_prompt_length "
            f"(<= {max(limit - max_new_tokens, 0)}), or use a model with a longer context."
        )


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


def _all_done(done: torch.Tensor, group: dist.ProcessGroup | None) -> bool:
    if group is None:
        return bool(done.all())
    running = (~done.all()).to(torch.int32).reshape(1)
    dist.all_reduce(running, op=dist.ReduceOp.MAX, group=group)
    return not bool(running.item())


def row_chunks(
    num_rows: int,
    batch_size: int | None,
    lockstep_group: dist.ProcessGroup | None = None,
    device: torch.device | str | None = None,
) -> list[slice]:
    """Consecutive row chunks of a rank's ``num_rows`` rows, each of at most ``batch_size`` rows.

    ``ceil(num_rows / batch_size)`` chunks of near-equal size (sizes differ by at most one), covering the rows in
    order; ``batch_size=None``: one chunk of every row. With ``lockstep_group`` (ranks whose model is sharded and
    must run the same number of forwards), the count is ``ceil(max rows over the group / batch_size)`` on every
    rank, from one all-reduce on ``device``: a rank's chunks are then non-empty when it has at least as many rows as
    chunks, and a rank with fewer rows gets empty chunks, which its caller runs on a stand-in row so that the
    group's collectives stay paired. Without a group, zero rows give no chunks.
    """
    if batch_size is None:
        num_chunks = 1 if num_rows > 0 or lockstep_group is not None else 0
    else:
        most = num_rows
        if lockstep_group is not None:
            count = torch.tensor([num_rows], dtype=torch.int64, device=device)
            dist.all_reduce(count, op=dist.ReduceOp.MAX, group=lockstep_group)
            most = int(count.item())
        num_chunks = -(-most // batch_size)
    bounds = [i * num_rows // num_chunks for i in range(num_chunks + 1)] if num_chunks else []
    return [slice(start, stop) for start, stop in itertools.pairwise(bounds)]


def _pad_columns(tensor: torch.Tensor, width: int, value: float) -> torch.Tensor:
    return F.pad(tensor, (0, width - tensor.shape[1]), value=value)


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    config: GenerationConfig,
    keys: torch.Tensor,
    eos_token_id: int | Sequence[int],
    pad_token_id: int,
    lockstep_group: dist.ProcessGroup | None = None,
    *,
    tokenizer: PreTrainedTokenizerBase | None = None,
) -> Rollout:
    """Sample responses for left-padded prompts with a KV cache, stopping each row at its first stop.

    A row stops at a token of ``eos_token_id`` or ``config.stop_token_ids``, or at the token that completes one of
    ``config.stop_strings`` (matched within the response); the stopping token is kept, with mask 1, and pad follows.
    ``config.do_sample=False`` takes the most likely token at every step instead of a keyed draw.

    With ``config.batch_size`` set, the rows run in consecutive chunks of at most that many rows (see
    :func:`row_chunks`), each a separate prefill and decode loop that stops when its rows are done; the chunks'
    responses are padded (``pad_token_id``; mask and log-probs 0) to the longest and concatenated. Every draw is
    keyed per row, so the tokens are those of one call on all rows, and the log-probabilities equal within float
    tolerance.

    Args:
        model: A Hugging Face causal LM (or anything with the same call signature and output), or a PEFT model
            wrapping one; its adapters run unmerged.
        input_ids: [B, P] left-padded prompt tokens.
        attention_mask: [B, P] 1 for real prompt tokens.
        config: Sampling settings, with the extra stop ids and stop strings.
        keys: [B] per-sample keys from :func:`sample_keys`; they fix every random draw of that row.
        eos_token_id: Token id, or ids, that end a response besides ``config.stop_token_ids``: the tokenizer's
            EOS, plus the actor's other end ids (:func:`model_eos_token_ids`).
        pad_token_id: Token written after a row's stop.
        lockstep_group: Ranks whose model is sharded (FSDP2): they must run the same number of forwards, so every
            rank of the group runs the same number of chunks (from the group's largest shard), and a chunk's
            generation stops only when every rank of the group is done with it. A rank without rows in a chunk
            runs its forwards on a stand-in row that is done from the start.
        tokenizer: Needed only for ``config.stop_strings``, to match text.

    The loop is ``config.backend``'s :class:`GenerationBackend` (``eager`` or ``static``); both give the same tokens
    for the same keys.
    """
    return get_backend(config.backend).generate(model, input_ids, attention_mask, config, keys, eos_token_id,
                                                pad_token_id, lockstep_group, tokenizer=tokenizer)


class GenerationBackend(ABC):
    """A decoder for ``actor.generate``, chosen by name (``generation.backend``).

    It takes left-padded prompts, the sampling settings and one key per row, and returns the rollout: tokens,
    masks, behaviour log-probabilities and stop flags (:class:`Rollout`). The chunking of rows
    (``generation.batch_size``), the stop condition and the lockstep rules of sharded models are shared
    (:meth:`generate`); a backend implements one prefill-and-decode loop (:meth:`decode`), and takes new weights
    through :meth:`update_weights`. Every backend must give, for the same keys, the tokens of ``eager``.
    """

    name: ClassVar[str]
    """The value of ``generation.backend`` that selects it."""

    @torch.no_grad()
    def generate(
        self,
        model: torch.nn.Module,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        config: GenerationConfig,
        keys: torch.Tensor,
        eos_token_id: int | Sequence[int],
        pad_token_id: int,
        lockstep_group: dist.ProcessGroup | None = None,
        *,
        tokenizer: PreTrainedTokenizerBase | None = None,
    ) -> Rollout:
        """Sample responses for left-padded prompts; the arguments are those of :func:`generate`."""
        num_rows, prompt_length = input_ids.shape
        check_context_length(model, prompt_length, config.max_new_tokens)
        stops = stop_condition(config, eos_token_id, tokenizer, input_ids.device)
        chunks = row_chunks(num_rows, config.batch_size, lockstep_group, input_ids.device)
        if len(chunks) == 1 and chunks[0].stop - chunks[0].start == num_rows > 0:
            return self.decode(model, input_ids, attention_mask, config, keys, stops, pad_token_id, lockstep_group)
        parts = []
        for rows in chunks:
            if rows.stop > rows.start:
                parts.append(self.decode(model, input_ids[rows], attention_mask[rows], config, keys[rows], stops,
                                         pad_token_id, lockstep_group))
            else:  # only with a lockstep group: take part in the group's forwards, keep nothing
                if num_rows:
                    stand_in, stand_in_mask = input_ids[:1], attention_mask[:1]
                else:
                    stand_in = torch.full((1, prompt_length), pad_token_id, dtype=input_ids.dtype,
                                          device=input_ids.device)
                    stand_in_mask = torch.ones_like(stand_in, dtype=attention_mask.dtype)
                self.decode(model, stand_in, stand_in_mask, config, torch.zeros(1, dtype=torch.int64), stops,
                            pad_token_id, lockstep_group, active=False)
        return _concat_chunks(parts, input_ids, attention_mask, pad_token_id)

    @abstractmethod
    def decode(
        self,
        model: torch.nn.Module,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        config: GenerationConfig,
        keys: torch.Tensor,
        stops: StopCondition,
        pad_token_id: int,
        lockstep_group: dist.ProcessGroup | None,
        active: bool = True,
    ) -> Rollout:
        """One prefill and decode loop over all of its (non-empty) rows.

        Args:
            model: The causal LM (or PEFT model) to sample from.
            input_ids: [B, P] left-padded prompt tokens.
            attention_mask: [B, P] 1 for real prompt tokens.
            config: Sampling settings.
            keys: [B] per-row keys; row b's draws are ``keyed_uniforms(keys[b:b+1], config.max_new_tokens)``.
            stops: What ends a row.
            pad_token_id: Token written after a row's stop.
            lockstep_group: Ranks that must run the same number of forwards (a sharded model), or None.
            active: False: the rows are done from the start (a stand-in that only keeps a lockstep group's
                forwards paired).

        Returns:
            The rollout, with as many response columns as the longest response of the lockstep group (of the
            rows, without a group): the width ``eager`` returns.
        """

    def update_weights(
        self, model: torch.nn.Module, weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]
    ) -> int:
        """Copy new weights into the model this backend decodes with, in place; return the bytes copied.

        In-place copies keep every parameter's storage, so a compiled decode step (and its CUDA graph, which
        captured those addresses) stays valid. A backend that holds its own copy of the model (a vLLM engine) would
        load the weights into that copy instead.

        Args:
            model: The model passed to :meth:`generate` (a Separation shadow, for instance).
            weights: Parameter or buffer name -> new value (the names of ``model.state_dict()``), e.g. the trained
                actor's ``named_parameters()``.
        """
        targets = dict(model.state_dict(keep_vars=True))
        copied = 0
        for name, value in dict(weights).items():
            if name not in targets:
                raise KeyError(f"update_weights: the model has no parameter or buffer {name!r}. Pass the names of "
                               f"its state_dict(), e.g. {next(iter(targets), '<none>')!r}.")
            target = targets[name]
            if target.shape != value.shape:
                raise ValueError(f"update_weights: {name!r} has shape {tuple(target.shape)} in the model but "
                                 f"{tuple(value.shape)} in the new weights: were they taken from another model?")
            with torch.no_grad():
                target.copy_(value)
            copied += value.numel() * value.element_size()
        return copied


class EagerBackend(GenerationBackend):
    """Today's decoder: a dynamic Hugging Face cache, the mask grown per token, a host sync per token to stop as
    soon as every row is done, the keyed uniforms drawn on the CPU in float64. Works with any model on any device
    (also stand-ins that only share a Hugging Face causal LM's call signature)."""

    name = "eager"

    def decode(
        self,
        model: torch.nn.Module,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        config: GenerationConfig,
        keys: torch.Tensor,
        stops: StopCondition,
        pad_token_id: int,
        lockstep_group: dist.ProcessGroup | None,
        active: bool = True,
    ) -> Rollout:
        return _generate_chunk(model, input_ids, attention_mask, config, keys, stops, pad_token_id, lockstep_group,
                               active)


_BACKENDS: dict[str, GenerationBackend] = {}


def register_backend(backend: GenerationBackend) -> GenerationBackend:
    """Make ``backend`` the one ``generation.backend: <backend.name>`` selects (replacing any of that name)."""
    _BACKENDS[backend.name] = backend
    return backend


def get_backend(name: str) -> GenerationBackend:
    """The backend registered as ``name`` (``static`` is imported on first use)."""
    if name == "static" and name not in _BACKENDS:
        import lightning_app_rlhf.static_decoder  # noqa: F401 - registers itself

    if name not in _BACKENDS:
        raise ValueError(f"Unknown generation.backend {name!r}: choose from {sorted({*_BACKENDS, 'static'})}.")
    return _BACKENDS[name]


register_backend(EagerBackend())


def _concat_chunks(
    parts: list[Rollout], input_ids: torch.Tensor, attention_mask: torch.Tensor, pad_token_id: int
) -> Rollout:
    """The chunks' rollouts as one, responses padded to the longest chunk's (pad token; mask and log-probs 0)."""
    width = max((part.response_mask.shape[1] for part in parts), default=0)
    if parts:
        responses = torch.cat([_pad_columns(part.responses, width, pad_token_id) for part in parts])
        response_mask = torch.cat([_pad_columns(part.response_mask, width, 0) for part in parts])
        logprobs = torch.cat([_pad_columns(part.logprobs, width, 0.0) for part in parts])
        stopped = torch.cat([part.stopped for part in parts])
    else:
        responses, response_mask = input_ids.new_zeros(0, 0), attention_mask.new_zeros(0, 0)
        logprobs = torch.zeros(0, 0, device=input_ids.device)
        stopped = torch.zeros(0, dtype=torch.bool, device=input_ids.device)
    return Rollout(
        sequences=torch.cat([input_ids, responses], dim=1),
        attention_mask=torch.cat([attention_mask, response_mask], dim=1),
        response_mask=response_mask,
        logprobs=logprobs,
        prompt_length=input_ids.shape[1],
        stopped=stopped,
    )


def _next_token(
    log_probs: torch.Tensor, config: GenerationConfig, uniforms: torch.Tensor | None, step: int
) -> torch.Tensor:
    """[B] each row's next token: the most likely one (greedy), or a keyed draw from the filtered distribution."""
    if not config.do_sample:
        return log_probs.argmax(-1)
    probs = filter_probs(log_probs.exp(), config.top_k, config.top_p)
    return inverse_cdf_sample(probs, uniforms[:, step])


def _generate_chunk(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    config: GenerationConfig,
    keys: torch.Tensor,
    stops: StopCondition,
    pad_token_id: int,
    lockstep_group: dist.ProcessGroup | None,
    active: bool = True,
) -> Rollout:
    """One prefill and decode loop over all of its (non-empty) rows; ``active=False``: the rows are done from the
    start (a stand-in that only keeps a lockstep group's forwards paired)."""
    batch_size, prompt_length = input_ids.shape
    uniforms = keyed_uniforms(keys, config.max_new_tokens) if config.do_sample else None  # greedy draws nothing
    position_ids = position_ids_from_mask(attention_mask)
    # Only the last prompt position's logits are needed: with a large vocabulary the LM head dominates a prefill.
    out = model(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=True, logits_to_keep=1
    )
    done = torch.full((batch_size,), not active, dtype=torch.bool, device=input_ids.device)
    tokens, logprobs, masks = [], [], []
    mask = attention_mask
    for step in range(config.max_new_tokens):
        logits = out.logits[:, -1, :].float() / config.temperature
        log_probs = F.log_softmax(logits, dim=-1)
        token = _next_token(log_probs, config, uniforms, step)
        token = torch.where(done, torch.full_like(token, pad_token_id), token)
        masks.append(~done)
        logprobs.append(log_probs.gather(-1, token.unsqueeze(-1)).squeeze(-1) * (~done))
        tokens.append(token)
        # Each rank detects its own stops (ids and strings) before the group's all-done check, so ranks stay paired.
        done = done | stops.ended(tokens)
        if _all_done(done, lockstep_group) or step == config.max_new_tokens - 1:  # no forward for unsampled tokens
            break
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        position_ids = position_ids[:, -1:] + 1
        out = model(
            input_ids=token.unsqueeze(-1),
            attention_mask=mask,
            position_ids=position_ids,
            use_cache=True,
            **cache_kwargs(returned_cache(out)),
        )
    response_mask = torch.stack(masks, dim=1).to(attention_mask.dtype)
    return Rollout(
        sequences=torch.cat([input_ids, torch.stack(tokens, dim=1)], dim=1),
        attention_mask=torch.cat([attention_mask, response_mask], dim=1),
        response_mask=response_mask,
        logprobs=torch.stack(logprobs, dim=1),
        prompt_length=prompt_length,
        stopped=done,
    )
