"""Batched sampling with a KV cache: the ``actor.generate`` call. Plain PyTorch, no Lightning.

Every random draw is keyed by a per-sample integer (derived from the seed, the iteration and the sample's
global index), never by the batch it happens to sit in. A prompt therefore gets the same response whether
it is generated alone, in a batch of 32, or on any rank of a placement.

A row ends at the first of its stop tokens (EOS, the actor's other end ids, ``generation.stop_token_ids``) or at
the token that completes one of ``generation.stop_strings``; that token is kept, with mask 1. With
``generation.do_sample=False`` the most likely token is taken instead of a keyed draw (greedy decoding).

The modules, each importing only those above it:

- :mod:`.hf_cache`: the KV-cache keyword of the installed transformers;
- :mod:`.rollout`: :class:`Rollout`, the per-sample keys, repeated samples, row chunks;
- :mod:`.sampling`: positions, keyed noise, top-k/top-p filtering, the exponential-race draw, the next token;
- :mod:`.stopping`: the stop condition, the model's end ids, the context-length check;
- :mod:`.backend`: the :class:`GenerationBackend` interface, its registry and :func:`generate`;
- :mod:`.eager`, :mod:`.static` and :mod:`.continuous`: the built-in decoding loops ``generation.backend`` chooses
  between, ``eager`` (a dynamic cache, a host sync per token), ``static`` (a preallocated cache, CUDA-graph friendly)
  or ``continuous`` (continuous batching: a finished row's slot takes the next prompt). All draw the same keyed
  noise, so they give the same tokens for the same keys;
- :mod:`.vllm`: the ``vllm`` backend, a vLLM engine per generating rank with the model's weights synced to it (its
  own kernels and sampler: other tokens for the same keys). Each backend registers itself when imported, and
  importing this package imports all four; a backend of your own is one module that subclasses :class:`GenerationBackend` and
  calls :func:`register_backend` (``generation.backend: <its name>`` then selects it).
"""

from lightning_app_rlhf.generation.backend import (
    DecodeRequest,
    GenerationBackend,
    close_backends,
    generate,
    get_backend,
    register_backend,
    registered_backends,
)
from lightning_app_rlhf.generation.eager import EagerBackend
from lightning_app_rlhf.generation.rollout import (
    Rollout,
    concat_rollouts,
    repeat_samples,
    row_chunks,
    sample_keys,
)
from lightning_app_rlhf.generation.sampling import (
    exponential_race,
    filter_log_probs,
    hash32,
    keyed_seeds,
    keyed_uniforms,
    next_token,
    position_ids_from_mask,
)
from lightning_app_rlhf.generation.static import OneDtypeStaticCache, StaticBackend

# isort: split
# Imported (so registered) after eager and static: `--help` lists the backends in registration order, the default
# first.
from lightning_app_rlhf.generation.continuous import ContinuousBackend, SlotCache
from lightning_app_rlhf.generation.vllm import VllmBackend, vllm_available, vllm_weights
from lightning_app_rlhf.generation.stopping import (
    StopCondition,
    all_done,
    check_context_length,
    config_context_length,
    context_length,
    context_length_error,
    model_eos_token_ids,
    stop_condition,
    stop_string_criteria,
)

__all__ = [
    "ContinuousBackend",
    "DecodeRequest",
    "EagerBackend",
    "GenerationBackend",
    "OneDtypeStaticCache",
    "Rollout",
    "SlotCache",
    "StaticBackend",
    "StopCondition",
    "VllmBackend",
    "all_done",
    "close_backends",
    "check_context_length",
    "concat_rollouts",
    "config_context_length",
    "context_length",
    "context_length_error",
    "exponential_race",
    "filter_log_probs",
    "generate",
    "get_backend",
    "hash32",
    "keyed_seeds",
    "keyed_uniforms",
    "model_eos_token_ids",
    "next_token",
    "position_ids_from_mask",
    "register_backend",
    "registered_backends",
    "repeat_samples",
    "row_chunks",
    "sample_keys",
    "stop_condition",
    "stop_string_criteria",
    "vllm_available",
    "vllm_weights",
]
