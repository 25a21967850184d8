"""The ``static`` generation backend: a preallocated KV cache, a CUDA-graph friendly decode step. Plain PyTorch.

The approach of gpt-fast and litgpt, on the model family's own Hugging Face modules (no model is rewritten):

- the KV cache is transformers' ``StaticCache``, allocated once for ``prompt + max_new_tokens`` positions (and reused
  by later calls of the same shape, so its addresses stay fixed);
- the attention mask is allocated once at that length: the prompt's padding followed by ones. Slots not written yet
  need no masking: the causal mask (from the cache's own write offset) already hides them;
- the keyed draw (top-k/top-p filter, exponential race) runs on the device from the rows' seeds and a column counter
  kept there; the tokens, masks and log-probs go into preallocated buffers;
- the host learns whether every row has stopped only every ``generation.sync_every`` tokens;
- the decode step can run through ``torch.compile`` (``generation.compile``; ``reduce-overhead``, i.e. CUDA graphs,
  on CUDA; on the CPU, Dynamo's guards are checked on a decode's first step only, and in float32 the attention takes
  the math backend that Inductor fuses).

The sampling arithmetic is eager's (:func:`~lightning_app_rlhf.generation.sampling.next_token`: integer-hash noise
from the row's seed and column, no device generator, whose stream would depend on the device and the batch), so
tokens are equal and log-probs equal within float tolerance (the attention runs over the preallocated length, which
changes the float rounding only). Compiled, the forward and the draw are one graph per step.

Supported: every model whose attention writes through transformers' ``Cache`` API, which in transformers 5 includes
GPT-2, Llama, Qwen2/Qwen3 and SmolLM2 (Llama). A model that ignores the static cache is detected after the prefill and
refused with an error that names the fix (``generation.backend: eager``). The backend registers itself on import.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import StaticCache

from lightning_app_rlhf.core.config import GenerationConfig
from lightning_app_rlhf.generation.backend import (
    DecodeRequest,
    GenerationBackend,
    register_backend,
    transformers_config,
)
from lightning_app_rlhf.generation.hf_cache import cache_kwargs, returned_cache
from lightning_app_rlhf.generation.rollout import Rollout
from lightning_app_rlhf.generation.sampling import keyed_seeds, next_token, position_ids_from_mask
from lightning_app_rlhf.generation.stopping import all_done

COMPILED_LENGTH_MULTIPLE = 64
"""With a compiled step, the cache length is rounded up to a multiple of this, so that prompts of a few different
lengths share one compiled graph (every new shape compiles again)."""


class OneDtypeStaticCache(StaticCache):
    """transformers' ``StaticCache``, storing keys and values in one dtype when they arrive in two.

    Under autocast, RoPE models (Llama, Qwen) produce float32 keys (the rotation runs in float32) and bfloat16 values;
    some transformers releases allocate both buffers in the keys' dtype and then refuse the values. Here every update
    casts both to the wider of the two dtypes, which is the same on every call of a decode (prefill and steps run
    under the same autocast), so the buffers' dtype never changes. The upcast is exact, and the attention
    (autocast) casts them back down, so the numbers are those of the dynamic cache. Only the public ``update`` is
    overridden: no layer internals are read, which keeps this working across transformers releases.
    """

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        dtype = torch.promote_types(key_states.dtype, value_states.dtype)
        return super().update(key_states.to(dtype), value_states.to(dtype), layer_idx, *args, **kwargs)


@dataclass
class _ModelState:
    """What the backend keeps per model between calls: the last cache (reused when the shape matches) and the
    compiled step."""

    cache: Any = None
    cache_shape: tuple[Any, ...] | None = None
    step: Callable[..., torch.Tensor] | None = None
    step_function: Callable[..., Any] | None = None
    """The function ``step`` runs (compiled or not): :func:`_decode_step` or its math-attention form."""
    compiled: bool = False


def _decode_step(
    model: torch.nn.Module,
    cache: Any,
    token: torch.Tensor,
    position_ids: torch.Tensor,
    mask: torch.Tensor,
    config: GenerationConfig,
    seeds: torch.Tensor | None,
    column: torch.Tensor | None,
    done: torch.Tensor,
    pad_token_id: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row through the model with the static cache, and the next token drawn from its logits
    (:func:`~lightning_app_rlhf.generation.sampling.next_token`; ``column`` [1] the response column, a device tensor
    so that one graph serves every step): the next tokens [B] and their log-probabilities [B]. Compiled, the draw is
    part of the graph (fused with the LM head's log-softmax instead of a dozen small eager ops per token)."""
    out = model(input_ids=token, attention_mask=mask, position_ids=position_ids, use_cache=True, **cache_kwargs(cache))
    return next_token(out.logits[:, -1, :], config, seeds, column, done, pad_token_id)


def _decode_step_with_math_attention(model: torch.nn.Module, *args: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_decode_step` with scaled dot-product attention on its math backend: the compiled step's form on the
    CPU in float32 (:func:`_step_function`).

    There, SDPA's default is the CPU flash-attention kernel, which Inductor can only call as an opaque op, once per
    layer and token (py-spy put it at about 40% of a compiled ``tiny`` decode step of 128 rows). The math backend is
    written in matmuls and a softmax, which Inductor fuses with the rest of the step. A compiled decode of 32 rows
    then takes 0.94x (``tiny``) and 0.96x (``small``) of the flash kernel's time, the medians of several runs, and
    1.01x at ``llama-small``, whose GEMMs dominate; the same tokens (``benchmarks/decode_attention.py``,
    docs/benchmarks.md). The context is entered inside the compiled function, so Dynamo traces it, and the prefill
    (outside) keeps the default kernels."""
    with sdpa_kernel(SDPBackend.MATH):
        return _decode_step(model, *args)


def _step_function(model: torch.nn.Module, compiled: bool, device: torch.device) -> Callable[..., Any]:
    """The decode step to run: :func:`_decode_step_with_math_attention` when compiled on the CPU in float32, else
    :func:`_decode_step`. Uncompiled, the math backend's separate ops are slower than the flash kernel (1.05-1.12x
    on the CPU); in bfloat16 (parameters or autocast) its rounding is not the flash kernel's float32 accumulation,
    so its tokens could differ from eager's; on CUDA it is unmeasured."""
    autocast = torch.is_autocast_enabled(device.type)
    dtype = torch.get_autocast_dtype(device.type) if autocast else next(model.parameters()).dtype
    if compiled and device.type == "cpu" and dtype == torch.float32:
        return _decode_step_with_math_attention
    return _decode_step


def _guards_checked_by_the_first_step() -> contextlib.AbstractContextManager[None]:
    """Dynamo's guards, evaluated only where they tell cached graphs apart, for a decode's steps after its first.

    Every step of a decode calls the compiled step with the same model, cache, mask and config and with inputs of the
    same shapes, dtypes and devices; only tensor values change. The first step ran every guard (and compiled, or
    chose among the graphs of earlier batch sizes), so the later steps' guards pass again, and evaluating them costs
    7-19% of a ``tiny`` decode on the CPU (``benchmarks/decode_guards.py``). ``torch.compiler.set_stance``'s
    ``skip_guard_eval_unsafe`` is the public switch for that case; it still runs the guards that tell cached graphs
    apart, and the previous stance comes back on exit. The one model it cannot serve is one whose forward breaks the
    graph and then depends on a Python value that changes per token (it would recompile at every token): Dynamo
    raises instead of running a wrong graph, and :meth:`StaticBackend.decode` turns that into an error naming the fix.
    Unmeasured on CUDA (no GPU where this was added), so the decode uses it on the CPU only.
    """
    return torch.compiler.set_stance("default", skip_guard_eval_unsafe=True)


def _compile_on(config: GenerationConfig, device: torch.device) -> bool:
    return config.compile if config.compile is not None else device.type == "cuda"


def _check_transformers() -> None:
    """transformers 5 is where the static cache keeps its own write offset on the device (no ``cache_position`` to
    pass, no per-step count of filled slots): the design this decoder is written and tested for."""
    import transformers
    from packaging.version import Version

    if Version(transformers.__version__).major < 5:
        raise RuntimeError(
            f"generation.backend='static' needs transformers >= 5 (found {transformers.__version__}): "
            "`pip install -U 'transformers>=5'`, or use generation.backend='eager'."
        )


class StaticBackend(GenerationBackend):
    """``generation.backend: static``: preallocated cache and buffers, keyed sampling on the device, a host sync
    every ``generation.sync_every`` tokens, an optional compiled decode step. Same tokens as ``eager``."""

    name = "static"

    def __init__(self) -> None:
        self._states: weakref.WeakKeyDictionary[torch.nn.Module, _ModelState] = weakref.WeakKeyDictionary()

    def _state(self, model: torch.nn.Module, config: GenerationConfig, device: torch.device) -> _ModelState:
        state = self._states.setdefault(model, _ModelState())
        compiled = _compile_on(config, device)
        function = _step_function(model, compiled, device)
        if state.step is None or state.compiled != compiled or state.step_function is not function:
            state.compiled, state.step_function, state.step = compiled, function, function
            if compiled:
                mode = "reduce-overhead" if device.type == "cuda" else None
                state.step = torch.compile(function, mode=mode, dynamic=False)
        return state

    def _cache(self, model: torch.nn.Module, state: _ModelState, batch: int, length: int, device: torch.device) -> Any:
        """An empty static cache of ``length`` positions for ``batch`` rows: the previous one, reset, when the shape
        matches (fixed addresses for a CUDA graph), else a new one."""
        config = transformers_config(model, self.name)
        # The cache takes the dtype of the keys it first sees: the parameters', or autocast's.
        autocast = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None
        # A cache made under inference mode holds inference tensors, which a reset outside it may not write.
        inference = torch.is_inference_mode_enabled()
        shape = (id(config), batch, length, next(model.parameters()).dtype, autocast, device, inference)
        if state.cache is not None and state.cache_shape == shape:
            state.cache.reset()
        else:
            state.cache, state.cache_shape = None, None  # free the old one first
            state.cache, state.cache_shape = OneDtypeStaticCache(config=config, max_cache_len=length), shape
        return state.cache

    def decode(self, model: torch.nn.Module, request: DecodeRequest) -> Rollout:
        input_ids, attention_mask, config = request.input_ids, request.attention_mask, request.config
        batch, prompt_length = input_ids.shape
        steps, device, pad_token_id = config.max_new_tokens, input_ids.device, request.pad_token_id
        _check_transformers()
        transformers_config(model, self.name)
        state = self._state(model, config, device)
        length = prompt_length + steps
        if state.compiled:
            length = -(-length // COMPILED_LENGTH_MULTIPLE) * COMPILED_LENGTH_MULTIPLE
        cache = self._cache(model, state, batch, length, device)
        seeds = keyed_seeds(request.keys).to(device, non_blocking=True) if config.do_sample else None
        column = torch.zeros(1, dtype=torch.int64, device=device)  # the response column; advanced in place
        mask = attention_mask.new_ones(batch, length)
        mask[:, :prompt_length] = attention_mask
        position_ids = position_ids_from_mask(attention_mask)
        out = model(input_ids=input_ids, attention_mask=mask, position_ids=position_ids, use_cache=True,
                    logits_to_keep=1, **cache_kwargs(cache))
        if returned_cache(out) is not cache:
            raise NotImplementedError(
                f"{type(model).__name__} does not decode with transformers' StaticCache (it returned its own cache), "
                "so generation.backend='static' cannot run it. Use generation.backend='eager'."
            )
        position = position_ids[:, -1:].clone()
        tokens = torch.full((batch, steps), pad_token_id, dtype=input_ids.dtype, device=device)
        logprobs = torch.zeros(batch, steps, device=device)
        masks = torch.zeros(batch, steps, dtype=torch.bool, device=device)
        done = torch.full((batch,), not request.active, dtype=torch.bool, device=device)
        stops, lockstep_group = request.stops, request.lockstep_group
        token, logprob = next_token(out.logits[:, -1, :], config, seeds, column, done, pad_token_id)
        with contextlib.ExitStack() as later_steps:
            for step in range(steps):
                if step > 0:
                    position.add_(1)
                    column.add_(1)
                    if state.compiled and device.type == "cuda":
                        torch.compiler.cudagraph_mark_step_begin()  # the previous step's outputs are consumed
                    inputs = (model, cache, token.unsqueeze(-1), position, mask, config, seeds, column, done,
                              pad_token_id)
                    try:
                        token, logprob = state.step(*inputs)
                    except RuntimeError as error:
                        # torch raises a plain RuntimeError that names the stance; if its wording changes, the
                        # user sees torch's own error instead of this one (still an error, never a wrong graph).
                        if "skip_guard_eval_unsafe" not in str(error):
                            raise
                        # Part of the step may have run (a graph break before the failing guard): not retried.
                        raise RuntimeError(
                            f"The compiled decode step of {type(model).__name__} needs a new graph at every token: "
                            "its forward breaks the graph and then depends on a value that changes per token, so "
                            "each token would recompile. Use generation.compile: false (the static backend "
                            "uncompiled) or generation.backend: eager, or remove the graph break from the forward."
                        ) from error
                    token = token.clone()  # a CUDA graph's output is overwritten by its next replay; it is that input
                    if step == 1 and state.compiled and device.type == "cpu":
                        later_steps.enter_context(_guards_checked_by_the_first_step())
                logprobs[:, step] = logprob
                masks[:, step] = ~done
                tokens[:, step] = token
                done = done | stops.ended_window(tokens[:, max(0, step + 1 - stops.window) : step + 1])
                if step == steps - 1 or ((step + 1) % config.sync_every == 0 and all_done(done, lockstep_group)):
                    break
        width = self._width(masks, lockstep_group)
        response_mask = masks[:, :width].to(attention_mask.dtype)
        return Rollout.from_responses(input_ids, attention_mask, tokens[:, :width], response_mask,
                                      logprobs[:, :width], done)

    @staticmethod
    def _width(masks: torch.Tensor, lockstep_group: dist.ProcessGroup | None) -> int:
        """Eager's response width: the longest response (of the lockstep group, when there is one); at least 1."""
        longest = masks.sum(1).max().reshape(1).to(torch.int64)
        if lockstep_group is not None:
            dist.all_reduce(longest, op=dist.ReduceOp.MAX, group=lockstep_group)
        return max(int(longest.item()), 1)


register_backend(StaticBackend())
