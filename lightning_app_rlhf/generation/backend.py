"""The decoder interface and the ``actor.generate`` entry point. Plain PyTorch.

:func:`generate` checks the context length, builds the stop condition, splits the rows into chunks
(``generation.batch_size``) and keeps a lockstep group's forwards paired; each chunk's prefill and decode loop is
the :meth:`GenerationBackend.decode` of the backend that ``generation.backend`` names in the registry
(:func:`register_backend`, :func:`get_backend`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import torch
import torch.distributed as dist

from lightning_app_rlhf.core.config import GENERATION_BACKENDS, GenerationConfig
from lightning_app_rlhf.generation.rollout import Rollout, concat_rollouts, row_chunks
from lightning_app_rlhf.generation.stopping import StopCondition, check_context_length, stop_condition

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class DecodeRequest:
    """What one prefill and decode loop (:meth:`GenerationBackend.decode`) runs on: rows and the call's settings."""

    input_ids: torch.Tensor
    """[B, P] left-padded prompt tokens (B >= 1)."""
    attention_mask: torch.Tensor
    """[B, P] 1 for real prompt tokens."""
    config: GenerationConfig
    """Sampling settings."""
    keys: torch.Tensor
    """[B] per-row keys; row b's noise at response column c is ``keyed_uniforms(keyed_seeds(keys[b:b+1]), c, V)``."""
    stops: StopCondition
    """What ends a row."""
    pad_token_id: int
    """Token written after a row's stop."""
    lockstep_group: dist.ProcessGroup | None = None
    """Ranks that must run the same number of forwards (a sharded model), or None."""
    active: bool = True
    """False: the rows are done from the start (a stand-in that only keeps a lockstep group's forwards paired)."""
    weights_version: int | None = None
    """The policy version of the model's weights (the updates it has had): a backend that keeps its own copy of the
    weights (``vllm``) reloads them when this changes; None: unknown, reload on every call."""

    def select(self, rows: slice) -> DecodeRequest:
        """The same request for a subset of the rows."""
        return replace(self, input_ids=self.input_ids[rows], attention_mask=self.attention_mask[rows],
                       keys=self.keys[rows])

    def stand_in(self) -> DecodeRequest:
        """One row, done from the start, for a rank without rows in a chunk of a lockstep group: its first row, or a
        row of pad tokens when it has none. Decoding it only takes part in the group's forwards."""
        if len(self.input_ids):
            input_ids, attention_mask = self.input_ids[:1], self.attention_mask[:1]
        else:
            input_ids = torch.full((1, self.input_ids.shape[1]), self.pad_token_id, dtype=self.input_ids.dtype,
                                   device=self.input_ids.device)
            attention_mask = torch.ones_like(input_ids, dtype=self.attention_mask.dtype)
        return replace(self, input_ids=input_ids, attention_mask=attention_mask,
                       keys=torch.zeros(1, dtype=torch.int64), active=False)


class GenerationBackend(ABC):
    """A decoder for ``actor.generate``, chosen by name (``generation.backend``).

    It implements one prefill and decode loop (:meth:`decode`) over left-padded prompts with one key per row, and
    returns the rollout: tokens, masks, behaviour log-probabilities and stop flags (:class:`Rollout`). The chunking
    of rows (``generation.batch_size``), the stop condition and the lockstep rules of sharded models are shared
    (:func:`generate`). Every backend must give, for the same keys, the tokens of ``eager``.
    """

    name: ClassVar[str]
    """The value of ``generation.backend`` that selects it."""
    schedules_rows: ClassVar[bool] = False
    """True: :meth:`decode` gets all of a rank's rows in one request and runs at most ``generation.batch_size`` of
    them at a time itself (continuous batching); False: :func:`generate` splits the rows into chunks of that many,
    one :meth:`decode` each."""
    separate_numerics: ClassVar[bool] = False
    """True: its tokens and log-probabilities come from kernels other than the trainer's (an inference engine), so
    ``ppo.recompute_old_logprobs`` and ``ppo.rollout_is: tis`` default to on with it."""

    def check_usable(self) -> None:
        """Raise a ``ValueError`` naming the fix when this backend cannot run here (e.g. its engine is not
        installed): called when a config selects it, before any model is built. Usable by default."""

    def close(self) -> None:
        """Release what the backend keeps between calls (an inference engine's processes): at the end of a run
        (:func:`close_backends`). Nothing by default."""

    @abstractmethod
    def decode(self, model: torch.nn.Module, request: DecodeRequest) -> Rollout:
        """One prefill and decode loop over all of the request's (non-empty) rows.

        Args:
            model: The causal LM (or PEFT model) to sample from.
            request: The rows, their keys and the call's settings.

        Returns:
            The rollout, with as many response columns as the longest response of the lockstep group (of the
            rows, without a group): the width ``eager`` returns.
        """


def transformers_config(model: torch.nn.Module, backend: str) -> Any:
    """The model's transformers config, which a backend that builds transformers cache objects needs; refuses a model
    without one (a stand-in with only a causal LM's call signature), naming ``eager``, which serves it.

    Args:
        model: The causal LM (or a PEFT model wrapping one).
        backend: The refusing backend's name, for the message.
    """
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "get_text_config"):
        raise TypeError(
            f"generation.backend={backend!r} needs a Hugging Face causal LM (a transformers model, or a PEFT model "
            f"wrapping one) to build its KV cache; got {type(model).__name__} without a transformers config. Use "
            "generation.backend='eager', which only needs the call signature of a causal LM."
        )
    return config


BackendOrClass = TypeVar("BackendOrClass", GenerationBackend, type[GenerationBackend])


def register_backend(backend: BackendOrClass) -> BackendOrClass:
    """Make ``backend`` the one ``generation.backend: <backend.name>`` selects (replacing any of that name): from then
    on :class:`~lightning_app_rlhf.core.config.GenerationConfig` accepts the name, :func:`generate` decodes with it,
    and the command line's ``--help`` lists it. A backend's module calls it at import, once.

    Args:
        backend: The backend, or its class (instantiated without arguments), so that it decorates the class:
            ``@register_backend`` above ``class MyBackend(GenerationBackend)``.

    Returns:
        ``backend`` as given (the class, when it decorates one).
    """
    instance = backend() if isinstance(backend, type) and issubclass(backend, GenerationBackend) else backend
    if not isinstance(instance, GenerationBackend):
        raise TypeError(f"register_backend takes a GenerationBackend subclass or instance, got {backend!r}: subclass "
                        "lightning_app_rlhf.generation.GenerationBackend (a `name` and `decode(model, request)`).")
    name = getattr(instance, "name", None)
    if not isinstance(name, str) or not name:
        raise ValueError(f"{type(instance).__name__} has no name: set the class attribute `name = \"...\"`, the "
                         "value of generation.backend that selects it.")
    GENERATION_BACKENDS.register(name, instance)
    return backend


def get_backend(name: str) -> GenerationBackend:
    """The backend registered as ``name`` (the built-in ``eager`` and ``static`` register on import of the
    :mod:`lightning_app_rlhf.generation` package).

    Raises:
        ValueError: No backend of that name is registered; the message lists those that are.
    """
    return GENERATION_BACKENDS.get(name)


def close_backends() -> None:
    """:meth:`GenerationBackend.close` of every registered backend: the end of a run (``RLHFModule.teardown``). An
    engine's child processes must stop before the run's process ends: a rank that Lightning's ``fork`` launcher
    started exits without ``atexit`` handlers, and would wait on the engine's threads forever."""
    for name in GENERATION_BACKENDS.names():
        GENERATION_BACKENDS.get(name).close()


def registered_backends() -> list[str]:
    """The names ``generation.backend`` takes now, in registration order (the built-in ``eager`` and ``static``
    first)."""
    return GENERATION_BACKENDS.names()


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
    inference_mode: bool = False,
    weights_version: int | None = None,
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
        inference_mode: Decode under ``torch.inference_mode`` instead of ``torch.no_grad``: less bookkeeping per
            op (a tenth of the ``tiny`` preset's CPU decode, nothing at ``small``), the same tokens; the rollout is
            cloned out of it, so that a loss may save its tensors for backward. Only for a model that keeps no
            state past its forward: not FSDP2 or ZeRO-3, whose gathered parameters would become inference tensors
            that their next training step may not write.
        weights_version: The policy version of ``model``'s weights (see :attr:`DecodeRequest.weights_version`).

    The loop is ``config.backend``'s :class:`GenerationBackend` (the built-in ``eager`` or ``static``, or any other
    registered with :func:`register_backend`); all give the same tokens for the same keys.
    """
    backend = get_backend(config.backend)
    num_rows, prompt_length = input_ids.shape
    check_context_length(model, prompt_length, config.max_new_tokens)
    stops = stop_condition(config, eos_token_id, tokenizer, input_ids.device)
    request = DecodeRequest(input_ids, attention_mask, config, keys, stops, pad_token_id, lockstep_group,
                            weights_version=weights_version)
    if not inference_mode:
        return _decode_in_chunks(backend, model, request)
    with torch.inference_mode():
        rollout = _decode_in_chunks(backend, model, request)
    return Rollout(*(t.clone() for t in (rollout.sequences, rollout.attention_mask, rollout.response_mask,
                                         rollout.logprobs)),
                   prompt_length=rollout.prompt_length,
                   stopped=rollout.stopped.clone() if rollout.stopped is not None else None)


def _decode_in_chunks(backend: GenerationBackend, model: torch.nn.Module, request: DecodeRequest) -> Rollout:
    """``backend``'s decode of the request's rows, in the chunks of ``config.batch_size`` (see :func:`generate`)."""
    input_ids, attention_mask, config = request.input_ids, request.attention_mask, request.config
    num_rows, lockstep_group = input_ids.shape[0], request.lockstep_group
    if backend.schedules_rows and num_rows > 0:
        return backend.decode(model, request)
    chunks = row_chunks(num_rows, config.batch_size, lockstep_group, input_ids.device)
    if len(chunks) == 1 and chunks[0].stop - chunks[0].start == num_rows > 0:
        return backend.decode(model, request)
    parts = []
    for rows in chunks:
        if rows.stop > rows.start:
            parts.append(backend.decode(model, request.select(rows)))
        else:  # only with a lockstep group: take part in the group's forwards, keep nothing
            backend.decode(model, request.stand_in())
    if not parts:  # no row here (a lockstep rank with none): an empty rollout
        empty = input_ids.new_zeros(0, 0)
        return Rollout.from_responses(input_ids, attention_mask, empty, attention_mask.new_zeros(0, 0),
                                      torch.zeros(0, 0, device=input_ids.device),
                                      torch.zeros(0, dtype=torch.bool, device=input_ids.device))
    return concat_rollouts(parts, request.pad_token_id)
