"""Cut a role's Hugging Face model at its decoder layers into pipeline stages. Plain PyTorch + transformers.

Stage 0 keeps the embeddings and the first layers, the last stage the last layers, the final norm and the role's head
(the LM head of an actor or reference, the value head of a critic, the score head of a reward model); a stage in
between keeps its layers only. A stage is the role's own module with the parts other stages run removed in place, so
its ``state_dict`` names are the unpipelined model's names (what reallocation and checkpoints match on). The family's
own modules run unchanged (no attention is rewritten): :class:`PipelineStageModule` calls them as the family's
``forward`` does, with the position ids, the rotary embeddings and the causal mask each stage builds from the
batch's 2-D attention mask.

Supported: the Llama, Qwen2 and GPT-2 families (transformers 5.x module layout). Any other model is refused with a
``ValueError`` naming the fix.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from lightning_app_rlhf.models.roles import ValueModel, is_lora

_MASK_CACHE_ARGUMENT = "cache" if "cache" in inspect.signature(create_causal_mask).parameters else "past_key_values"
"""The keyword the mask builders take the KV cache by, which they require: ``past_key_values`` in transformers 5.19 (the
release vLLM's CPU build needs), ``cache`` in 5.24. Read from the installed signature, so each release gets its own
keyword."""

CAUSAL_LM, VALUE, SCORE = "causal_lm", "value", "score"
"""The heads a last stage can hold: an LM head (actor, reference), a value head (critic), a score head (reward)."""


@dataclass(frozen=True)
class Family:
    """Where a model family keeps its parts, by attribute name on its base model (``LlamaModel``, ``GPT2Model``)."""

    name: str
    model_types: tuple[str, ...]
    """``config.model_type`` values of the family."""
    embeddings: tuple[str, ...]
    """The first stage's embedding modules."""
    layers: str
    """The ``nn.ModuleList`` of decoder layers."""
    norm: str
    """The final norm (last stage)."""
    rotary: str | None
    """The rotary-embedding module every stage runs (it holds no parameters, only ``inv_freq`` buffers)."""


LLAMA = Family("llama", ("llama",), ("embed_tokens",), "layers", "norm", "rotary_emb")
QWEN2 = Family("qwen2", ("qwen2",), ("embed_tokens",), "layers", "norm", "rotary_emb")
GPT2 = Family("gpt2", ("gpt2",), ("wte", "wpe", "drop"), "h", "ln_f", None)
FAMILIES = (LLAMA, QWEN2, GPT2)
"""The families a role may be pipelined in."""


def family_of(config_model_type: str, what: str) -> Family:
    """The supported family of ``config_model_type``, or a ``ValueError`` naming the fix.

    Args:
        config_model_type: The model's ``config.model_type``.
        what: The role or call being pipelined, for the message.
    """
    for family in FAMILIES:
        if config_model_type in family.model_types:
            return family
    supported = ", ".join(t for f in FAMILIES for t in f.model_types)
    raise ValueError(
        f"{what}: pipeline parallelism splits a model at its decoder layers, and knows the families {supported}; this "
        f"model's model_type is {config_model_type!r}. Use pp=1 for this call (data or tensor parallelism instead), "
        f"or a model of a supported family.")


@dataclass
class RoleParts:
    """A role's model taken apart: its base model (embeddings, layers, norm), its head, and the head's kind."""

    base: nn.Module
    head_owner: nn.Module
    """The module whose attribute ``head_name`` is the head."""
    head_name: str
    head_kind: str
    family: Family


def role_parts(role_module: nn.Module, what: str) -> RoleParts:
    """Find the base model and the head of a role's module: a causal LM (``lm_head``), a :class:`ValueModel`
    (``value_head``) or a sequence classifier (``score``), of a supported family.

    Args:
        role_module: The role's module, unwrapped (no DDP, FSDP2 or LoRA).
        what: The role or call, for the messages.
    """
    if is_lora(role_module):
        raise ValueError(f"{what}: a LoRA (PEFT) role cannot be pipelined yet. Use pp=1 for its calls, or train it "
                         "without `lora`.")
    if isinstance(role_module, ValueModel):
        base, owner, head, kind = role_module.backbone, role_module, "value_head", VALUE
    else:
        prefix = getattr(role_module, "base_model_prefix", None)
        base = getattr(role_module, prefix, None) if prefix else None
        if hasattr(role_module, "lm_head"):
            owner, head, kind = role_module, "lm_head", CAUSAL_LM
        elif hasattr(role_module, "score"):
            owner, head, kind = role_module, "score", SCORE
        else:
            base = None
        if base is None:
            raise ValueError(
                f"{what}: {type(role_module).__name__} is neither a causal LM, a critic (ValueModel) nor a sequence "
                "classifier of a Hugging Face family, so it cannot be split into pipeline stages. Use pp=1 for this "
                "call.")
    family = family_of(getattr(base.config, "model_type", type(base).__name__), what)
    return RoleParts(base, owner, head, kind, family)


def stage_layers(num_layers: int, num_stages: int, what: str) -> list[range]:
    """The contiguous decoder layers of each stage: as even as possible, the first stages taking one more when they
    do not divide (the last stage also runs the head)."""
    if num_stages > num_layers:
        raise ValueError(f"{what}: pp={num_stages} needs at least one decoder layer per stage, and the model has "
                         f"{num_layers}. Lower pp to at most {num_layers}.")
    cuts = torch.arange(num_layers).tensor_split(num_stages)
    return [range(int(c[0]), int(c[-1]) + 1) for c in cuts]


class PipelineStageModule(nn.Module):
    """One pipeline stage of a role: the role's module with the other stages' parts removed, run as its family runs.

    ``forward(x, attention_mask, position_ids, token_ids=None)``: ``x`` is the token ids on the first stage and the
    previous stage's hidden states elsewhere; the other arguments are the whole micro-batch's, given to every stage.
    The last stage returns the head's output: logits of the last :attr:`logits_to_keep` positions (a causal LM; all
    with 0), values ``[B, S]`` in float32 (a critic), or the score of each row's last non-pad token ``[B, labels]``
    (a reward model, which needs ``token_ids``); other stages return hidden states.

    Args:
        role_module: The role's module, whole and unwrapped. It is cut in place: keep no other use of it.
        stage_index: This stage, from 0.
        num_stages: The pipeline degree.
        what: The role or call, for the messages.
    """

    def __init__(self, role_module: nn.Module, stage_index: int, num_stages: int, what: str) -> None:
        super().__init__()
        parts = role_parts(role_module, what)
        self.family = parts.family
        self.head_kind = parts.head_kind
        self.stage_index, self.num_stages = stage_index, num_stages
        self.is_first, self.is_last = stage_index == 0, stage_index == num_stages - 1
        layers: nn.ModuleList = getattr(parts.base, parts.family.layers)
        self.layer_indices = stage_layers(len(layers), num_stages, what)[stage_index]
        self.logits_to_keep = 0
        # The role's module itself, registered under one name: stage_state_dict strips the prefix again.
        self.role = role_module
        self._base = [parts.base]  # a list: not registered twice
        # A ModuleDict keyed by the original indices keeps the names "layers.5...." of the whole model.
        kept = nn.ModuleDict({str(i): layers[i] for i in self.layer_indices})
        setattr(parts.base, parts.family.layers, kept)
        if not self.is_first:
            for name in parts.family.embeddings:
                setattr(parts.base, name, None)
        if not self.is_last:
            setattr(parts.base, parts.family.norm, None)
            setattr(parts.head_owner, parts.head_name, None)
        self._head = [getattr(parts.head_owner, parts.head_name)]

    @property
    def base(self) -> nn.Module:
        return self._base[0]

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                token_ids: torch.Tensor | None = None) -> torch.Tensor:
        base, family = self.base, self.family
        hidden = self._embed(x, position_ids) if self.is_first else x
        masks = self._masks(hidden, attention_mask, position_ids)
        run_layer = self._layer_runner(hidden, position_ids)
        for i in self.layer_indices:
            hidden = run_layer(getattr(base, family.layers)[str(i)], hidden, masks(i))
        if not self.is_last:
            return hidden
        return self._head_output(getattr(base, family.norm)(hidden), token_ids)

    def _embed(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        base = self.base
        if self.family is GPT2:
            return base.drop(base.wte(input_ids) + base.wpe(position_ids))
        return base.embed_tokens(input_ids)

    def _masks(self, hidden: torch.Tensor, attention_mask: torch.Tensor,
               position_ids: torch.Tensor) -> Callable[[int], torch.Tensor | None]:
        """Layer index -> its attention mask, built as the family's forward builds it (each stage builds its own from
        the 2-D mask: a few comparisons, where sending a 4-D mask would cost far more)."""
        config = self.base.config
        kwargs = {"config": config, "inputs_embeds": hidden, "attention_mask": attention_mask,
                  _MASK_CACHE_ARGUMENT: None, "position_ids": position_ids}
        full = create_causal_mask(**kwargs)
        layer_types = getattr(config, "layer_types", None)
        if self.family is QWEN2 and layer_types and "sliding_attention" in layer_types:
            by_type = {"full_attention": full, "sliding_attention": create_sliding_window_causal_mask(**kwargs)}
            return lambda i: by_type[layer_types[i]]
        return lambda i: full

    def _layer_runner(self, hidden: torch.Tensor, position_ids: torch.Tensor
                      ) -> Callable[[nn.Module, torch.Tensor, torch.Tensor | None], torch.Tensor]:
        if self.family is GPT2:
            return lambda layer, h, mask: layer(h, None, mask, None, use_cache=False, position_ids=position_ids)
        rotary = getattr(self.base, self.family.rotary)(hidden, position_ids)
        # No cache keyword: a layer's cache argument defaults to None under either of its names (``past_key_values``,
        # ``cache``), where naming one a release lacks would slip it into the layer's **kwargs unnoticed.
        return lambda layer, h, mask: layer(h, attention_mask=mask, position_embeddings=rotary,
                                            position_ids=position_ids, use_cache=False)

    def _head_output(self, hidden: torch.Tensor, token_ids: torch.Tensor | None) -> torch.Tensor:
        head = self._head[0]
        if self.head_kind == CAUSAL_LM:
            if self.logits_to_keep:
                hidden = hidden[:, -self.logits_to_keep :]
            return head(hidden)
        if self.head_kind == VALUE:
            with torch.autocast(hidden.device.type, enabled=False):  # as ValueModel: values in float32
                return head(hidden.to(head.weight.dtype)).squeeze(-1).float()
        if token_ids is None:
            raise ValueError("A reward model's last pipeline stage needs token_ids: it reads the score at each row's "
                             "last non-pad token.")
        logits = head(hidden)
        pad = self.base.config.pad_token_id
        if pad is None:
            return logits[:, -1]
        # The sequence classifier's own rule: the rightmost token that is not the pad token.
        non_pad = (token_ids != pad).to(logits.device, torch.int32)
        last = (torch.arange(token_ids.shape[-1], device=logits.device, dtype=torch.int32) * non_pad).argmax(-1)
        return logits[torch.arange(len(logits), device=logits.device), last]
