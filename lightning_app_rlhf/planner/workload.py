"""What one RLHF iteration computes: the shape of each role's model and the batch it runs. Plain Python.

A role's shape comes from a named size (``llama-7b``, ``gpt2-tiny``...) or a Hugging Face config (a dict with
``model_type`` or a ``PretrainedConfig``); :func:`workload_from_module` reads an ``RLHFModule``'s specs. A workload
places the roles of its algorithm: PPO's four, or a critic-free algorithm's three (``critic=None``).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, replace
from typing import Any

from lightning_app_rlhf.core.role_table import (
    CRITIC,
    REFERENCE,
    REQUIRED_ROLES,
    ROLE_NAMES,
    TRAINABLE_ROLES,
    calls_of,
)
from lightning_app_rlhf.generation import get_backend
from lightning_app_rlhf.parallel.wrappers import available_wrappers, wrapper_class

ROLE_KINDS = ("causal_lm", "value", "classifier")

Shape = tuple[int, ...]
"""One parameter's shape."""


@dataclass(frozen=True)
class RoleShape:
    """The model of one role, as the cost model needs it."""

    name: str
    """A label, e.g. ``llama-7b``."""
    kind: str
    """``causal_lm`` (actor, reference), ``value`` (critic: backbone + value head) or ``classifier`` (reward)."""
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    """Key/value heads (grouped-query attention); equal to ``heads`` for plain multi-head attention."""
    intermediate: int
    """Width of the MLP."""
    vocab: int
    params: int
    """Parameters of the built model (tied weights counted once), as ``module.parameters()`` sees them."""
    matmul_params: int
    """Parameters multiplied once per token in a forward pass (all but embedding lookups and norms; an output
    head counts once even when tied to the input embedding)."""
    dtype_bytes: int = 4
    """Bytes per parameter: 4 for float32, 2 for bfloat16."""
    tied_head: bool = False
    """Whether a causal LM's output head shares the input embedding (GPT-2)."""
    config: dict[str, Any] | None = field(default=None, compare=False, repr=False)
    """The Hugging Face config fields it was read from (the profiler builds the model from them)."""
    param_shapes: tuple[Shape, ...] = field(default=(), repr=False)
    """Every parameter's shape, in the built module's ``parameters()`` order (tied weights once): what the wrappers
    shard, parameter by parameter (:meth:`~lightning_app_rlhf.parallel.wrappers.RoleWrapper.predicted_bytes`). Empty: only
    the count is known, and the memory model reads the body as one flat parameter (see :attr:`shapes`)."""

    @property
    def key(self) -> str:
        """Identifies the shape for profile caches: kind, sizes and dtype."""
        return (
            f"{self.kind}-L{self.layers}-h{self.hidden}-a{self.heads}-kv{self.kv_heads}-ff{self.intermediate}"
            f"-v{self.vocab}-p{self.params}-b{self.dtype_bytes}"
        )

    def __post_init__(self) -> None:
        if self.kind not in ROLE_KINDS:
            raise ValueError(f"Role kind {self.kind!r} is not one of {ROLE_KINDS}.")
        if min(self.layers, self.hidden, self.heads, self.vocab, self.params) < 1:
            raise ValueError(f"Role shape {self.name!r} has a non-positive size: {self}.")
        if self.param_shapes and sum(map(numel, self.param_shapes)) != self.params:
            raise ValueError(f"Role shape {self.name!r}: its parameter shapes hold "
                             f"{sum(map(numel, self.param_shapes))} elements, not params={self.params}.")

    @property
    def shapes(self) -> tuple[Shape, ...]:
        """:attr:`param_shapes`, or where they are unknown the body as one flat parameter followed by the head's."""
        if self.param_shapes:
            return self.param_shapes
        head = _head_shapes(self)
        return ((self.params - sum(map(numel, head)),), *head)

    @property
    def param_bytes(self) -> int:
        return self.params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """KV cache of one token over all layers (keys and values)."""
        return 2 * self.layers * self.hidden * self.kv_heads // self.heads * self.dtype_bytes

    @property
    def head_outputs(self) -> int:
        return self.vocab if self.kind == "causal_lm" else 1

    def as_kind(self, kind: str) -> RoleShape:
        """The same backbone with another head: a critic or a reward model built from a causal LM's config."""
        if kind == self.kind:
            return self
        base_params = self.params - _head_params(self)
        base_matmul = self.matmul_params - self.hidden * self.head_outputs
        head = _head_shapes(self)
        # The head's parameters come last (the LM head of a causal LM, the critic's value head, the reward's score).
        body = self.param_shapes[: len(self.param_shapes) - len(head)]
        known = bool(self.param_shapes) and self.param_shapes[len(body):] == head
        shaped = replace(self, kind=kind, params=base_params, matmul_params=base_matmul, param_shapes=())
        return replace(
            shaped,
            params=base_params + _head_params(shaped),
            matmul_params=base_matmul + self.hidden * shaped.head_outputs,
            param_shapes=(*body, *_head_shapes(shaped)) if known else (),
        )


def _head_shapes(shape: RoleShape) -> tuple[Shape, ...]:
    """Parameters of the head on top of the backbone, last in ``parameters()``: an untied LM head (vocab x hidden), a
    value head with bias (``ValueModel``) or a one-label score without bias (``...ForSequenceClassification``)."""
    if shape.kind == "value":
        return (1, shape.hidden), (1,)
    if shape.kind == "classifier":
        return ((1, shape.hidden),)
    return () if shape.tied_head else ((shape.vocab, shape.hidden),)


def _head_params(shape: RoleShape) -> int:
    """Parameters of the head on top of the backbone: an untied LM head, a value head (with bias) or a score."""
    return sum(map(numel, _head_shapes(shape)))


def numel(shape: Shape) -> int:
    """Elements of a parameter of this shape."""
    return math.prod(shape)


NAMED_SIZES: dict[str, dict[str, Any]] = {
    # LLaMA-1 sizes (APP's and ReaLHF's experiments), 2k context.
    "llama-7b": {
        "model_type": "llama",
        "num_hidden_layers": 32,
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "intermediate_size": 11008,
        "vocab_size": 32000,
    },
    "llama-13b": {
        "model_type": "llama",
        "num_hidden_layers": 40,
        "hidden_size": 5120,
        "num_attention_heads": 40,
        "intermediate_size": 13824,
        "vocab_size": 32000,
    },
    "llama-33b": {
        "model_type": "llama",
        "num_hidden_layers": 60,
        "hidden_size": 6656,
        "num_attention_heads": 52,
        "intermediate_size": 17920,
        "vocab_size": 32000,
    },
    "llama-65b": {
        "model_type": "llama",
        "num_hidden_layers": 80,
        "hidden_size": 8192,
        "num_attention_heads": 64,
        "intermediate_size": 22016,
        "vocab_size": 32000,
    },
    # LLaMA-2 sizes (ReaLHF's experiments), 4k context; 7B and 13B have LLaMA-1's shapes (set below), 34B (Code
    # Llama's shape) and 70B use grouped-query attention with 8 key/value heads.
    "llama2-34b": {
        "model_type": "llama",
        "num_hidden_layers": 48,
        "hidden_size": 8192,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "intermediate_size": 22016,
        "vocab_size": 32000,
    },
    "llama2-70b": {
        "model_type": "llama",
        "num_hidden_layers": 80,
        "hidden_size": 8192,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "intermediate_size": 28672,
        "vocab_size": 32000,
    },
    # Our demo model (examples/configs/demo_cpu.yaml) and GPT-2 small.
    "gpt2-tiny": {
        "model_type": "gpt2",
        "n_layer": 2,
        "n_embd": 64,
        "n_head": 4,
        "vocab_size": 512,
        "n_positions": 64,
    },
    "gpt2-small": {
        "model_type": "gpt2",
        "n_layer": 12,
        "n_embd": 768,
        "n_head": 12,
        "vocab_size": 50257,
        "n_positions": 1024,
    },
}
"""Named model sizes, as Hugging Face config fields."""
NAMED_SIZES["llama2-7b"] = dict(NAMED_SIZES["llama-7b"])
NAMED_SIZES["llama2-13b"] = dict(NAMED_SIZES["llama-13b"])


def role_shape(
    source: str | dict[str, Any] | Any, kind: str = "causal_lm", dtype_bytes: int = 4
) -> RoleShape:
    """The shape of a model from a named size, a config dict with ``model_type``, a ``PretrainedConfig``, a local
    model directory or a ``config.json`` path.

    Args:
        source: ``llama-7b``, ``gpt2-tiny``... (see :data:`NAMED_SIZES`), a config, or a path.
        kind: ``causal_lm``, ``value`` (critic) or ``classifier`` (reward model).
        dtype_bytes: Bytes per parameter (4 float32, 2 bfloat16).
    """
    name = "custom"
    if isinstance(source, str):
        if source.lower() in NAMED_SIZES:
            name, source = source.lower(), NAMED_SIZES[source.lower()]
        elif os.path.exists(source):
            path = os.path.join(source, "config.json") if os.path.isdir(source) else source
            with open(path) as f:
                name, source = os.path.basename(os.path.dirname(os.path.abspath(path))), json.load(f)
        else:
            raise ValueError(
                f"Unknown model size {source!r}: use one of {sorted(NAMED_SIZES)}, a local model "
                "directory, a config.json path, or a config dict with 'model_type'."
            )
    fields = source if isinstance(source, dict) else source.to_dict()
    model_type = fields.get("model_type")
    if model_type is None:
        raise ValueError(f"A model config needs 'model_type' (e.g. 'gpt2' or 'llama'); got {sorted(fields)}.")
    if model_type == "gpt2":
        shape = _gpt2_shape(fields, name)
    elif model_type in ("llama", "mistral", "qwen2"):
        shape = _llama_shape(fields, name)
    else:
        try:  # built on the meta device: exact shapes of any architecture transformers knows
            shape = _counted_shape(fields, name)
        except (ValueError, KeyError):
            if "intermediate_size" not in fields:
                raise
            shape = _llama_shape(fields, name)  # a model type transformers lacks: read as a LLaMA-like model
    return replace(shape, dtype_bytes=dtype_bytes, config=dict(fields)).as_kind(kind)


def _gpt2_shape(f: dict[str, Any], name: str) -> RoleShape:
    layers, h = f.get("n_layer", 12), f.get("n_embd", 768)
    heads, vocab, positions = f.get("n_head", 12), f.get("vocab_size", 50257), f.get("n_positions", 1024)
    inner = f.get("n_inner") or 4 * h
    # GPT2LMHeadModel.parameters(): wte, wpe; per block ln_1, c_attn (Conv1D: in x out), attn c_proj, ln_2, c_fc,
    # mlp c_proj, each weight then bias; ln_f. The LM head is tied to wte (listed once).
    block = ((h,), (h,), (h, 3 * h), (3 * h,), (h, h), (h,), (h,), (h,), (h, inner), (inner,), (inner, h), (h,))
    shapes = ((vocab, h), (positions, h), *block * layers, (h,), (h,))
    matmul = layers * (4 * h * h + 2 * h * inner) + h * vocab
    label = name if name != "custom" else f"gpt2-{layers}x{h}"
    return RoleShape(
        label, "causal_lm", layers, h, heads, heads, inner, vocab, sum(map(numel, shapes)), matmul, tied_head=True,
        param_shapes=shapes,
    )


def _llama_shape(f: dict[str, Any], name: str) -> RoleShape:
    layers, h = f.get("num_hidden_layers", 32), f.get("hidden_size", 4096)
    heads, vocab, inner = (
        f.get("num_attention_heads", 32),
        f.get("vocab_size", 32000),
        f.get("intermediate_size"),
    )
    kv_heads = f.get("num_key_value_heads") or heads
    kv = h * kv_heads // heads
    tied = bool(f.get("tie_word_embeddings", False))
    head_dim = f.get("head_dim") or h // heads
    q_out, kv_out = heads * head_dim, kv_heads * head_dim
    # LlamaForCausalLM.parameters(): embed_tokens; per layer q, k, v, o (nn.Linear: out x in, biases with
    # attention_bias; Qwen2 always biases q, k, v), gate, up, down (biases with mlp_bias), two RMSNorms; the final
    # norm; the LM head unless tied.
    qkv_bias = bool(f.get("attention_bias")) or f["model_type"] == "qwen2"
    o_bias, mlp_bias = bool(f.get("attention_bias")), bool(f.get("mlp_bias"))
    attention = ((q_out, h), *[(q_out,)] * qkv_bias, (kv_out, h), *[(kv_out,)] * qkv_bias, (kv_out, h),
                 *[(kv_out,)] * qkv_bias, (h, q_out), *[(h,)] * o_bias)
    mlp = ((inner, h), *[(inner,)] * mlp_bias, (inner, h), *[(inner,)] * mlp_bias, (h, inner), *[(h,)] * mlp_bias)
    shapes = ((vocab, h), *(*attention, *mlp, (h,), (h,)) * layers, (h,), *[(vocab, h)] * (not tied))
    matmul = layers * (2 * h * h + 2 * h * kv + 3 * h * inner) + h * vocab
    label = name if name != "custom" else f"{f['model_type']}-{layers}x{h}"
    return RoleShape(
        label, "causal_lm", layers, h, heads, kv_heads, inner, vocab, sum(map(numel, shapes)), matmul, tied_head=tied,
        param_shapes=shapes,
    )


def _counted_shape(f: dict[str, Any], name: str) -> RoleShape:
    """Other architectures: count parameters on the meta device (no memory), read sizes from the config."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(f)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    shapes = tuple(tuple(p.shape) for p in model.parameters())  # tied weights once, as the wrappers see them
    params = sum(map(numel, shapes))
    embeddings = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Embedding))
    h, vocab = config.hidden_size, config.vocab_size
    tied = model.get_output_embeddings() is not None and getattr(config, "tie_word_embeddings", False)
    matmul = params - embeddings + (h * vocab if tied else 0)
    heads = config.num_attention_heads
    inner = getattr(config, "intermediate_size", None) or 4 * h
    return RoleShape(
        name if name != "custom" else config.model_type,
        "causal_lm",
        config.num_hidden_layers,
        h,
        heads,
        getattr(config, "num_key_value_heads", None) or heads,
        inner,
        vocab,
        params,
        matmul,
        tied_head=bool(tied),
        param_shapes=shapes,
    )


@dataclass(frozen=True)
class Workload:
    """One RLHF iteration: the shapes of the algorithm's roles and the batch they run.

    The roles are those of :data:`~lightning_app_rlhf.core.role_table.REQUIRED_ROLES` (actor, reward), the reference
    when ``reference`` is given (every algorithm with a KL), and the critic when ``critic`` is given (PPO);
    ``critic=None`` is a critic-free algorithm (GRPO, RLOO, ...), whose plans have no ``critic.*`` calls.
    """

    actor: RoleShape
    """The policy: generates, and trains."""
    critic: RoleShape | None
    """The value model (PPO); None: a critic-free algorithm (no critic calls, weights or optimizer state)."""
    reference: RoleShape | None
    """The frozen reference policy; None: the algorithm uses no KL (both coefficients 0), so there is no reference
    role (no calls, weights or memory)."""
    reward: RoleShape | None
    """None: the reward is a Python function (no model, no memory)."""
    batch_size: int
    """Prompts per iteration (``data.batch_size``); each is sampled ``num_samples`` times (see :attr:`samples`)."""
    prompt_length: int
    """Padded prompt tokens."""
    generation_length: int
    """Generated tokens per response (``generation.max_new_tokens``), or per turn of a multi-turn episode
    (:attr:`turns`): the most a response runs to, and, without :attr:`mean_response_length`, what every response
    (every turn) runs to."""
    ppo_epochs: int = 1
    """Passes of the train calls over the rollout."""
    num_minibatches: int = 1
    """Optimizer steps per epoch: the rollout's ``samples`` are split into this many minibatches."""
    num_samples: int = 1
    """Responses sampled per prompt (``generation.num_samples``, the group size G of GRPO and RLOO). Generation,
    the forwards and the train calls all run on the ``batch_size x num_samples`` sequences of the rollout."""
    algorithm: str = "ppo"
    """The algorithm's registered name (``RLHFModule(algorithm=...)``), for labels and the profiler's loss. Its roles
    are :attr:`roles`: give ``critic`` exactly when it has a critic."""
    wrappers: tuple[str, ...] = ("ddp", "fsdp2")
    """Wrappers the search may give the trainable roles (and, those of
    :data:`~lightning_app_rlhf.parallel.wrappers.FROZEN_WRAPPERS`, the frozen ones): names of the registry,
    :data:`~lightning_app_rlhf.parallel.wrappers.WRAPPERS`, whose packages are installed (DeepSpeed's ``zero1``-``zero3``
    need deepspeed; see :func:`installed_wrappers`). Another name fails with the choices or the install command."""
    optimizer_bytes_per_param: float = 8.0
    """Optimizer work per trainable parameter, for the analytic time of a step: AdamW's two slots in the parameter
    dtype (8 at float32); 12 for mixed precision (fp32 master weights + two fp32 moments). Memory counts
    :attr:`optimizer_slots` instead, as each wrapper keeps them."""
    optimizer_slots: int = 2
    """Optimizer state tensors per trainable element (AdamW: 2, SGD with momentum: 1): the wrappers' ``slots``.
    DDP and FSDP2 keep them in the parameter's dtype; DeepSpeed's ZeRO keeps them in fp32 next to an fp32 master
    copy (:meth:`~lightning_app_rlhf.parallel.wrappers.RoleWrapper.predicted_bytes`)."""
    recompute_old_logprobs: bool = False
    """``ppo.recompute_old_logprobs``: the actor's train call first runs one forward (no gradients) over its share of
    the whole rollout, and sums the log-probabilities over its group."""
    generation_backend: str = "eager"
    """``generation.backend``: the decoder ``actor.generate`` runs, a registered name. ``vllm`` is priced from its own
    measured points and pays the sync of the actor's weights to its engine once per iteration (docs/planner.md,
    "Generation on vLLM"); the others are priced from the points measured with ``eager``."""
    generation_rounds: int = 1
    """Generation rounds per update: with dynamic sampling (``ppo.dynamic_sampling``) an update generates and scores
    a batch of prompts this many times on average (a run logs it as ``train/generation_rounds``) before it trains
    once; 1 without."""
    gradient_checkpointing: bool = False
    """Train calls keep only each layer's input and recompute the rest in backward (one more forward)."""
    flash_attention: bool = False
    """Attention never stores the [heads, seq, seq] score matrix (fused kernels on GPUs)."""
    reward_fn_s_per_sample: float = 50e-6
    """Time of a Python reward function per sample (decoding and scoring)."""
    turns: int = 1
    """Assistant turns per episode (multi-turn rollouts: ``agent.max_turns``). Each turn is one ``generate`` call over
    the episodes' whole context so far (a full prefill of the prompt, the earlier turns and their observations: no KV
    cache is kept across turns), then ``generation_length`` decode steps; the environment steps between turns. The
    train and forward calls read the whole episode (:attr:`episode_length`). 1: single-turn."""
    observation_length: int = 0
    """Tokens of each observation appended after a turn that does not end the episode (the environment's answer
    rendered by the chat template): ``turns - 1`` of them per episode."""
    environment_s_per_turn: float = 0.0
    """Python time per episode and turn between the generate calls, on the generating ranks: the environment's
    ``step`` and its share of ``reset`` (a run logs their sum as ``episode/environment_seconds``), and the chat
    template's rendering of the observation."""
    max_episode_tokens: int | None = None
    """``agent.max_episode_tokens``: the most tokens of an episode after its prompt (it bounds
    :attr:`response_length`); None: no bound."""
    lora_rank: int | None = None
    """LoRA: the trainable roles train rank-``r`` adapters on every attention and MLP projection (plus the critic's
    value head) and keep their base weights frozen; the reference is the actor's base with the adapters disabled, so
    it costs no weights where the actor is held. None: full fine-tuning."""
    mean_response_length: float | None = None
    """Responses of uneven length: each response stops after a geometric number of tokens of this mean (a stop at
    every token with probability ``1 / mean``), cut at :attr:`generation_length`, as the bench's ``uneven`` workload
    makes them (``bench/presets.py``, ``stop_ids``). The generate call is then priced until its longest row
    (or, with partial rollouts, until a batch of groups is complete: docs/planner.md, "Partial rollouts and uneven
    lengths"); the gathers, forwards and train calls keep the padded width :attr:`response_length`. None: every
    response runs to :attr:`generation_length` (single-turn only)."""
    segment_tokens: int | None = None
    """``generation.segment_tokens``: tokens a partial rollout's round decodes at most (``PlacementPlan.
    partial_rollout``); None: a quarter of :attr:`generation_length` (``GenerationConfig.partial_segment``)."""
    name: str = "workload"
    """A label for tables and errors."""

    def __post_init__(self) -> None:
        for what in ("batch_size", "prompt_length", "generation_length", "ppo_epochs", "num_minibatches",
                     "num_samples", "generation_rounds", "turns"):
            if getattr(self, what) < 1:
                raise ValueError(f"Workload {what} must be >= 1, got {getattr(self, what)}.")
        if self.samples % self.num_minibatches:
            raise ValueError(
                f"The rollout of {self.batch_size} prompts x {self.num_samples} samples = {self.samples} sequences "
                f"is not divisible by num_minibatches {self.num_minibatches}: pick a batch_size (or num_samples) "
                f"that makes it a multiple, or a num_minibatches that divides {self.samples}."
            )
        if not self.wrappers:
            raise ValueError(f"Workload wrappers must name at least one of {list(available_wrappers())}.")
        for name in self.wrappers:
            wrapper_class(name)  # unknown, or its package missing: the error names the choices or the install
        if self.observation_length < 0 or self.environment_s_per_turn < 0:
            raise ValueError(f"Workload observation_length and environment_s_per_turn must be >= 0, got "
                             f"{self.observation_length} and {self.environment_s_per_turn}.")
        if self.max_episode_tokens is not None and self.max_episode_tokens < 1:
            raise ValueError(f"Workload max_episode_tokens must be >= 1 (or None), got {self.max_episode_tokens}.")
        if self.optimizer_slots < 0:
            raise ValueError(f"optimizer_slots must be >= 0, got {self.optimizer_slots}.")
        get_backend(self.generation_backend)  # unknown: the registered names, and how to register another

        if self.lora_rank is not None and self.lora_rank < 1:
            raise ValueError(f"lora_rank must be >= 1 (or None for full fine-tuning), got {self.lora_rank}.")
        self._check_lengths()

    def _check_lengths(self) -> None:
        """:attr:`mean_response_length` and :attr:`segment_tokens` in range, each error naming the fix."""
        mean = self.mean_response_length
        if mean is not None:
            if isinstance(mean, bool) or not isinstance(mean, (int, float)) or not 0 < mean <= self.generation_length:
                raise ValueError(f"Workload mean_response_length must lie in (0, generation_length="
                                 f"{self.generation_length}], got {mean!r}: give the mean of the uneven responses' "
                                 "lengths (plan --mean_response_length), or None where every response runs to "
                                 "generation_length.")
            if self.turns > 1:
                raise ValueError(f"Workload mean_response_length prices single-turn responses of uneven length, and "
                                 f"this workload runs episodes of {self.turns} turns: set mean_response_length None "
                                 "(every turn runs to generation_length), or turns 1.")
        segment = self.segment_tokens
        if segment is not None and (isinstance(segment, bool) or not isinstance(segment, int) or segment < 1):
            raise ValueError(f"Workload segment_tokens must be an integer >= 1 (generation.segment_tokens: tokens per "
                             f"round of a partial rollout), or None for a quarter of generation_length, got "
                             f"{segment!r}.")

    @property
    def partial_segment(self) -> int:
        """Tokens a partial rollout's round decodes at most: :attr:`segment_tokens`, or a quarter of
        :attr:`generation_length` (as ``GenerationConfig.partial_segment``)."""
        return self.segment_tokens if self.segment_tokens is not None else max(1, self.generation_length // 4)

    @property
    def roles(self) -> tuple[str, ...]:
        """The roles the algorithm places, in role-table order: the required ones, plus the critic when given."""
        return tuple(r for r in ROLE_NAMES if r in REQUIRED_ROLES or getattr(self, r) is not None)

    @property
    def trainable(self) -> tuple[str, ...]:
        """The roles with a train call (actor, and the critic where there is one)."""
        return tuple(r for r in self.roles if r in TRAINABLE_ROLES)

    @property
    def calls(self) -> tuple[str, ...]:
        """The model calls of one iteration, phase by phase (:func:`~lightning_app_rlhf.core.role_table.calls_of`)."""
        return calls_of(self.roles)

    @property
    def has_critic(self) -> bool:
        return self.critic is not None

    @property
    def samples(self) -> int:
        """Sequences per iteration: ``batch_size`` prompts x ``num_samples`` responses each."""
        return self.batch_size * self.num_samples

    def turn_context(self, turn: int) -> int:
        """Tokens turn ``turn`` (from 0) prefills: the prompt, then the earlier turns' ``generation_length`` sampled
        tokens and ``observation_length`` observation tokens each (at most ``max_episode_tokens`` of them). Turn 0
        prefills the prompt alone, as single-turn generation does."""
        earlier = turn * (self.generation_length + self.observation_length)
        if self.max_episode_tokens is not None:
            earlier = min(earlier, self.max_episode_tokens)
        return self.prompt_length + earlier

    @property
    def response_length(self) -> int:
        """Tokens of an episode after its prompt, as the rollout's right-padded width: ``turns x generation_length``
        sampled plus ``(turns - 1) x observation_length`` observed (at most ``max_episode_tokens``); single-turn, the
        ``generation_length``. The one place that knows it: every call price reads it through here or
        :attr:`episode_length`."""
        tokens = self.turns * self.generation_length + (self.turns - 1) * self.observation_length
        return tokens if self.max_episode_tokens is None else min(tokens, self.max_episode_tokens)

    @property
    def episode_length(self) -> int:
        """Tokens of a whole sequence that the train and forward calls read: the prompt and :attr:`response_length`."""
        return self.prompt_length + self.response_length

    @property
    def sequence_length(self) -> int:
        """:attr:`episode_length` (the prompt and the response, or the whole episode)."""
        return self.episode_length

    def trainable_params(self, role: str) -> int:
        """Parameters the optimizer updates: all of them, or with LoRA the adapters (and the critic's value head)."""
        shape = self.shape(role)
        if shape is None or role not in self.trainable:
            return 0
        if self.lora_rank is None:
            return shape.params
        head = shape.hidden + 1 if shape.kind == "value" else 0
        return lora_params(shape, self.lora_rank) + head

    def held_params(self, role: str) -> int:
        """Parameters of one whole copy of the role: with LoRA a trainable role's base plus its adapters."""
        shape = self.shape(role)
        if shape is None:
            return 0
        if self.lora_rank is not None and role in self.trainable:
            return shape.params + lora_params(shape, self.lora_rank)
        return shape.params

    def parameters(self, role: str) -> tuple[tuple[Shape, ...], tuple[bool, ...]]:
        """The shapes of the role's parameters in ``module.parameters()`` order, and whether each trains: what a
        wrapper's ``predicted_bytes`` takes. A trainable role trains all of them; a frozen role none. With LoRA a
        trainable role's base is frozen and its adapters (counted as one flat parameter after the base, an
        approximation of PEFT's per-projection A and B matrices) train, with the critic's value head."""
        shape = self.shape(role)
        if shape is None:
            return (), ()
        shapes, trains = shape.shapes, role in self.trainable
        if self.lora_rank is None or not trains:
            return shapes, (trains,) * len(shapes)
        head = len(_head_shapes(shape)) if shape.kind == "value" else 0
        flags = (False,) * (len(shapes) - head) + (True,) * head
        return (*shapes, (lora_params(shape, self.lora_rank),)), (*flags, True)

    @property
    def reference_is_actor_base(self) -> bool:
        """With LoRA the reference is the actor's base (adapters disabled) where the actor is held."""
        return self.lora_rank is not None and self.reference == self.actor

    def shape(self, role: str) -> RoleShape | None:
        """The shape of ``role`` (a role-table name); None for a reward function or a role the algorithm lacks."""
        if role not in ROLE_NAMES:
            raise KeyError(f"Unknown role {role!r}; the roles are {list(ROLE_NAMES)}.")
        return getattr(self, role)


def llama_workload(
    actor: str = "llama-7b",
    critic: str | None = None,
    batch_size: int = 512,
    prompt_length: int = 480,
    generation_length: int = 480,
    ppo_epochs: int = 1,
    num_minibatches: int = 8,
    *,
    has_critic: bool = True,
    **kwargs: Any,
) -> Workload:
    """APP's / ReaLHF's setting: bf16 models, reference = actor size, reward = critic size, mixed-precision AdamW,
    gradient checkpointing and fused attention.

    Args:
        actor: Named size of the actor (and the reference).
        critic: Named size of the critic and the reward model (default: the actor's).
        batch_size: Prompts per iteration.
        prompt_length: Padded prompt tokens.
        generation_length: Generated tokens per response.
        ppo_epochs: Passes over the rollout.
        num_minibatches: Optimizer steps per epoch.
        has_critic: False for a critic-free algorithm (pass ``algorithm=`` and ``num_samples=`` too): no critic,
            and the reward model takes ``critic``'s size.
        **kwargs: Other :class:`Workload` fields.
    """
    size = critic or actor
    return Workload(
        actor=role_shape(actor, "causal_lm", 2),
        critic=role_shape(size, "value", 2) if has_critic else None,
        reference=role_shape(actor, "causal_lm", 2),
        reward=role_shape(size, "classifier", 2),
        batch_size=batch_size,
        prompt_length=prompt_length,
        generation_length=generation_length,
        ppo_epochs=ppo_epochs,
        num_minibatches=num_minibatches,
        optimizer_bytes_per_param=12.0,
        gradient_checkpointing=True,
        flash_attention=True,
        name=f"{actor}+{size}" if has_critic else f"{actor} {kwargs.get('algorithm', 'critic-free')}",
        **{"wrappers": installed_wrappers(), **kwargs},
    )


def workload_from_module(
    module: Any, batch_size: int, prompt_length: int, optimizer_slots: int = 2
) -> Workload:
    """The workload of an ``RLHFModule`` (its algorithm's roles, model specs, generation and PPO configs) at
    ``batch_size`` prompts, each sampled ``generation.num_samples`` times. A module with an ``environment`` runs
    episodes of ``agent.max_turns`` turns (the most it runs: every episode is priced at every turn) within
    ``agent.max_episode_tokens``; their observations' tokens and the environment's time are not known before a run
    (0 here: give them with ``dataclasses.replace``, or ``plan --observation_tokens``).

    Args:
        module: An ``RLHFModule`` (models need not be built).
        batch_size: Prompts per iteration (``data.batch_size``).
        prompt_length: Padded prompt tokens of a batch.
        optimizer_slots: State tensors per parameter of the optimizer (AdamW: 2, SGD with momentum: 1).
    """

    def shape(spec: Any, kind: str) -> RoleShape:
        dtype_bytes = 2 if spec.dtype == "bfloat16" else 4
        return role_shape(spec.load_config().to_dict(), kind, dtype_bytes)

    roles = module.algorithm.roles
    actor = shape(module.specs.actor, "causal_lm")
    reference = shape(module.specs.reference, "causal_lm") if module.specs.reference is not None else actor
    reference = reference if REFERENCE.name in roles else None
    reward = shape(module.specs.reward, "classifier") if module.specs.reward is not None else None
    critic = shape(module.specs.critic, "value") if CRITIC.name in roles else None
    agent = getattr(module, "agent", None) if getattr(module, "environment", None) is not None else None
    return Workload(
        actor=actor,
        critic=critic,
        reference=reference,
        reward=reward,
        batch_size=batch_size,
        prompt_length=prompt_length,
        generation_length=module.generation.max_new_tokens,
        ppo_epochs=module.ppo.ppo_epochs,
        num_minibatches=module.ppo.num_minibatches,
        recompute_old_logprobs=module.ppo.recompute_old_logprobs,
        generation_backend=module.generation.backend,
        num_samples=module.generation.num_samples,
        algorithm=module.algorithm.name,
        optimizer_bytes_per_param=float(optimizer_slots * actor.dtype_bytes),
        optimizer_slots=optimizer_slots,
        name=f"module ({module.algorithm.name})",
        wrappers=installed_wrappers(),
        # LoRA: adapters of this rank train (peft's default r is 8); the reference then shares the actor's base.
        lora_rank=int(module.specs.actor.lora.get("r", 8)) if module.specs.actor.lora is not None else None,
        turns=agent.max_turns if agent is not None else 1,
        max_episode_tokens=agent.max_episode_tokens if agent is not None else None,
        segment_tokens=getattr(module.generation, "segment_tokens", None),
    )


def workload_from_data(module: Any, datamodule: Any, optimizer_slots: int = 2) -> Workload:
    """The workload ``fit`` runs: :func:`workload_from_module` at the datamodule's batch size and the
    :func:`padded_prompt_length` of its prompts.

    Args:
        module: An ``RLHFModule`` (models need not be built).
        datamodule: A ``PromptDataModule`` after ``setup("fit")`` (its prompts tokenised).
        optimizer_slots: State tensors per parameter of the optimizer (AdamW: 2, SGD with momentum: 1).
    """
    lengths = [len(ids) for ids in datamodule.dataset.input_ids]
    return workload_from_module(module, datamodule.batch_size, padded_prompt_length(lengths, datamodule.batch_size),
                                optimizer_slots)


def padded_prompt_length(lengths: list[int], batch_size: int) -> int:
    """Batches are left-padded to their longest prompt: the mean of per-batch maxima, in dataset order."""
    maxima = [max(lengths[i : i + batch_size]) for i in range(0, len(lengths) - batch_size + 1, batch_size)]
    return round(sum(maxima) / len(maxima)) if maxima else max(lengths)


def installed_wrappers() -> tuple[str, ...]:
    """Wrappers this machine can run, in registry order: :func:`lightning_app_rlhf.parallel.wrappers.available_wrappers`
    (those whose package is installed; ``PlacementPlan`` refuses the others)."""
    return available_wrappers()


def lora_params(shape: RoleShape, rank: int) -> int:
    """LoRA adapter parameters (A: in x r, B: r x out) on every attention and MLP projection of every layer."""
    h, kv, inner = shape.hidden, shape.hidden * shape.kv_heads // shape.heads, shape.intermediate
    if (shape.config or {}).get(
        "model_type"
    ) == "gpt2":  # c_attn h->3h, attn c_proj h->h, c_fc h->4h, c_proj 4h->h
        per_layer = (h + 3 * h) + 2 * h + 2 * (h + inner)
    else:  # q, o: h->h; k, v: h->kv; gate, up: h->inner; down: inner->h
        per_layer = 2 * (2 * h) + 2 * (h + kv) + 3 * (h + inner)
    return shape.layers * rank * per_layer


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def log2_ceil(n: int) -> int:
    return max(0, math.ceil(math.log2(n))) if n > 0 else 0
