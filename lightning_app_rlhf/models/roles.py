"""The four RLHF roles built from Hugging Face models. Plain PyTorch + transformers, no Lightning.

- actor, reference: ``AutoModelForCausalLM``;
- critic: :class:`ValueModel`, a causal-LM backbone with a scalar value head per token;
- reward: ``AutoModelForSequenceClassification`` with one label, or a Python function
  ``(prompts, responses) -> scores``.

A model (or tokenizer) comes from a local directory, from a Hugging Face hub name such as ``Qwen/Qwen2.5-0.5B-Instruct``
(loaded as transformers loads it: downloaded when online, read from the cache, ``HF_HUB_OFFLINE=1`` respected), or,
for a model, from an import path ``"package.module:function"`` that returns a local directory (docs/models.md).

Actor and critic may carry PEFT LoRA adapters (``ModelSpec.lora``): their base weights freeze and only the
adapters train (plus the critic's value head). A LoRA actor's reference is then its own base model with the
adapters switched off (:class:`AdapterDisabledReference`), not a second copy.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import importlib.util
import os
import re
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import constants as hub_constants
from torch import nn
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.activations import GELUTanh, NewGELUActivation

PRECISIONS = ("32-true", "bf16-mixed", "bf16-true")
"""The precisions a role takes (``ModelSpec.precision``), spelled as Lightning's ``precision`` argument."""
_LIGHTNING_PRECISIONS = {"32": "32-true", "32-true": "32-true", "bf16": "bf16-mixed", "bf16-mixed": "bf16-mixed",
                         "bf16-true": "bf16-true"}
"""Lightning's spellings of the precisions a run can take, to ours."""

RewardFunction = Callable[[list[str], list[str]], "Sequence[float] | torch.Tensor"]
"""``(prompts, responses) -> one score per sample``, on decoded text."""


@dataclass
class ModelSpec:
    """Where a role's weights come from: a local Hugging Face directory, a hub name, or a config with random weights."""

    path: str | None = None
    """Where the pretrained weights are: a local directory with ``config.json`` and weights; a Hugging Face hub name
    (``Qwen/Qwen2.5-0.5B-Instruct``), loaded as ``from_pretrained`` loads it (downloaded when online, then read from
    the cache; ``HF_HUB_OFFLINE=1`` reads the cache only); or an import path ``"package.module:function"`` whose
    function returns a local directory (``lightning_app_rlhf.models.smollm2:model_dir``). See docs/models.md."""
    config: dict[str, Any] = field(default_factory=dict)
    """With ``path``: config fields to override. Without: the full config for random init, with
    ``model_type`` (e.g. ``{"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 4}``)."""
    init_seed: int = 0
    """Seed for random initialisation, so every rank and every placement builds the same weights."""
    dtype: str = "float32"
    """Parameter dtype: ``float32`` or ``bfloat16``."""
    precision: str | None = None
    """How this role computes (docs/api.md, "Precision"): ``32-true`` (float32), ``bf16-mixed`` (float32 weights,
    forwards under bf16 autocast; a trained role keeps float32 master weights and optimizer state) or ``bf16-true``
    (weights held in bfloat16: frozen roles only, the reference and the reward model). Log-probabilities, values and
    scores come out in float32 whatever it is. None: the ``Trainer``'s (or Fabric's) ``precision``."""
    shadow_precision: str | None = None
    """A trained role's copies that never train: Separation's shadows (generation and scoring on other ranks) and the
    tensor-parallel copies of its generate / forward calls. ``bf16-true`` holds them in bfloat16, rounded from the
    trained float32 weights at every reallocation (half the bytes move); None or ``32-true``: the trained weights'
    dtype."""
    gguf_file: str | None = None
    """A GGUF file inside ``path`` to load instead of ``config.json`` + weights; it is dequantized to ``dtype``.
    Needs the ``gguf`` package."""
    lora: dict[str, Any] | None = None
    """PEFT LoRA adapters for a trainable role (actor or critic): ``peft.LoraConfig`` fields, e.g.
    ``{"r": 8, "lora_alpha": 16, "target_modules": ["c_attn"]}``. The base weights freeze; only the adapters
    train (plus the critic's value head). ``task_type`` is set per role and ``lora_dropout`` is turned off like
    every dropout (PPO ratios need the same function at rollout and update). Needs ``peft``."""

    def __post_init__(self) -> None:
        if self.path is None and "model_type" not in self.config and not (self.copies_actor and self.precision):
            raise ValueError(
                "A model spec needs either `path` (a local Hugging Face model directory) or `config` with a "
                "`model_type` for random init, e.g. {'model_type': 'gpt2', 'n_layer': 2, 'n_embd': 64, "
                f"'n_head': 4, 'vocab_size': 512}}. Got config={self.config}. (A reference may give only "
                "`precision`: the actor's copy at that precision.)"
            )
        if self.path is not None and "model_type" in self.config:
            raise ValueError(
                f"The model spec has both `path` ({self.path!r}) and a random-init `config` (model_type="
                f"{self.config['model_type']!r}); with a path, `config` only overrides fields of the pretrained config. "
                "Drop `config`. On the command line over a config file whose model is random-init, replace the role's "
                f"whole spec, e.g. for the actor --model.actor '{{path: \"{self.path}\", config: {{}}}}' (or add "
                "--model.actor.config '{}')."
            )
        source = self.source  # a path that is neither a directory, a hub name nor an import path fails here
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {self.dtype!r}.")
        self._check_precision()
        if source is not None and os.path.isdir(source):
            _check_model_directory(source, self.gguf_file)
        if self.gguf_file is not None:
            if source is None:
                raise FileNotFoundError(f"gguf_file={self.gguf_file!r} needs `path`: the directory or hub model "
                                        "that holds the file.")
            if importlib.util.find_spec("gguf") is None:
                raise ImportError("Loading a GGUF file needs the gguf package: `pip install gguf`.")
        if self.lora is not None:
            lora_config(self.lora, task_type=None)  # bad fields fail here, before any model is built

    def _check_precision(self) -> None:
        if self.precision not in (None, *PRECISIONS):
            raise ValueError(f"precision must be one of {list(PRECISIONS)} or None (the Trainer's), got "
                             f"{self.precision!r}.")
        if self.shadow_precision not in (None, "32-true", "bf16-true"):
            raise ValueError(f"shadow_precision must be '32-true', 'bf16-true' or None (the trained weights' dtype), "
                             f"got {self.shadow_precision!r}.")
        if self.dtype == "bfloat16" and self.precision in ("32-true", "bf16-mixed"):
            raise ValueError(f"dtype='bfloat16' holds the weights in bfloat16, but precision={self.precision!r} "
                             "keeps them in float32: drop `dtype` (bf16-mixed keeps float32 weights and computes "
                             "in bf16), or set precision='bf16-true'.")

    @property
    def source(self) -> str | None:
        """What ``from_pretrained`` reads: ``path`` itself (a local directory or a hub name), or the directory that an
        import-path ``path`` returns; None for random init. See :func:`resolve_model_path`."""
        return None if self.path is None else resolve_model_path(self.path)

    @property
    def copies_actor(self) -> bool:
        """Neither ``path`` nor ``config``: the actor's weights (a reference spec that sets only its precision)."""
        return self.path is None and not self.config

    @property
    def param_dtype(self) -> torch.dtype:
        """The dtype the role's weights are built in: bfloat16 for ``dtype='bfloat16'`` or ``precision='bf16-true'``."""
        return torch.bfloat16 if self.precision == "bf16-true" else getattr(torch, self.dtype)

    @property
    def trusts_remote_code(self) -> bool:
        """Whether the code a model directory declares (``auto_map``) may run: only when ``config`` sets
        ``trust_remote_code: true`` explicitly."""
        return self.config.get("trust_remote_code", False) is True

    def load_config(self, **overrides: Any) -> PretrainedConfig:
        """The role's config: the pretrained one (from ``path``) with ``config`` and ``overrides`` applied, or for random
        init ``config`` itself. A hub name that cannot be fetched raises an ``OSError`` naming the fixes."""
        fields = {**self.config, **overrides}
        source = self.source
        if source is not None:
            fields["trust_remote_code"] = self.trusts_remote_code  # False, not None: transformers would prompt
            with _hub_fetch(source, "model"), _no_remote_code(f"Model {source!r}", _TRUST_MODEL,
                                                               self.trusts_remote_code):
                return AutoConfig.from_pretrained(source, gguf_file=self.gguf_file, **fields)
        fields.pop("trust_remote_code", None)  # random init: there is no directory whose code could run
        return AutoConfig.for_model(fields.pop("model_type"), **fields)


_HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")
"""A Hugging Face hub id: ``name`` or ``org/name``, of letters, digits, ``-``, ``_`` and ``.``."""


def is_hub_name(name: str) -> bool:
    """Whether ``name`` reads as a Hugging Face hub id (``org/name``, or a bare ``name`` such as ``gpt2``) and is not an
    existing local directory, which ``from_pretrained`` would read first."""
    return (not os.path.isdir(name) and _HUB_NAME.fullmatch(name) is not None and ".." not in name
            and "--" not in name)


def resolve_model_path(path: str) -> str:
    """What ``from_pretrained`` reads for ``ModelSpec.path``: a local directory or a hub name as given, or the directory
    that an import path ``"package.module:function"`` (or ``"package.module:DIRECTORY"``) gives.

    Raises:
        FileNotFoundError: ``path`` is none of these (a local path that does not exist), or its import path does not
            give an existing directory; the message names the fix.
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        return path
    if ":" in path and not os.path.isabs(path):  # hub names never hold ':'
        target = resolve_import(path)
        directory = target() if callable(target) else target
        if not isinstance(directory, str | os.PathLike) or not os.path.isdir(directory):
            raise FileNotFoundError(f"Model path {path!r} is an import path, but it gave {directory!r}, not a local "
                                    "directory: make it return the directory that holds the model.")
        return os.fspath(directory)
    if is_hub_name(path):
        return path
    raise FileNotFoundError(
        f"Model path {path!r} is not a local directory ({os.path.abspath(path)!r} does not exist) nor a Hugging Face "
        "hub name ('org/name'). Pass an existing directory, a hub name such as 'Qwen/Qwen2.5-0.5B-Instruct', or "
        "download a model into a directory first (`hf download NAME --local-dir DIR`) and pass that directory."
    )


def _check_model_directory(directory: str, gguf_file: str | None) -> None:
    """A local model directory holds what will be loaded: ``gguf_file`` when given, else ``config.json`` (a directory
    with only GGUF files names them)."""
    if gguf_file is not None:
        if not os.path.isfile(os.path.join(directory, gguf_file)):
            raise FileNotFoundError(f"gguf_file={gguf_file!r} must name a file inside `path` ({directory!r}).")
        return
    ggufs = sorted(name for name in os.listdir(directory) if name.endswith(".gguf"))
    if ggufs and not os.path.isfile(os.path.join(directory, "config.json")):
        raise FileNotFoundError(f"Model directory {directory!r} has no config.json but GGUF files: name one with "
                                f"gguf_file={ggufs[0]!r} (`--model.actor.gguf_file {ggufs[0]}` on the command line).")


@contextlib.contextmanager
def _hub_fetch(name: str, what: str) -> Iterator[None]:
    """Turn transformers' failure to fetch the hub name ``name`` (offline and not cached, unknown, gated, no network)
    into one ``OSError`` that names the fixes. A local directory's errors pass through as transformers raised them."""
    if os.path.isdir(name):
        yield
        return
    try:
        yield
    except OSError as err:
        raise hub_fetch_error(name, what, err) from None


def hub_fetch_error(name: str, what: str, err: BaseException) -> OSError:
    """The error for a ``what`` (``"model"``, ``"tokenizer"``) named ``name`` that transformers could not load from the
    hub or its cache: ``FileNotFoundError`` offline (``HF_HUB_OFFLINE``), ``OSError`` online, each naming the fixes."""
    reason = " ".join(str(err).split())[:300]
    local = f" (Read as a local path, {os.path.abspath(name)!r} does not exist either.)"
    if hub_constants.HF_HUB_OFFLINE:
        return FileNotFoundError(
            f"Cannot load the {what} {name!r}: HF_HUB_OFFLINE is set and it is not in the Hugging Face cache "
            f"({hub_constants.HF_HUB_CACHE}). Fix: download it first where there is network access (`hf download "
            f"{name}`, with the same HF_HOME), or unset HF_HUB_OFFLINE so transformers downloads it, or pass a local "
            f"directory (`hf download {name} --local-dir DIR`, then DIR as the path).{local} [transformers: {reason}]")
    return OSError(
        f"Cannot load the {what} {name!r} from the Hugging Face hub: {reason} Fix: check the name "
        f"(https://huggingface.co/{name}); a private or gated model needs `hf auth login` or HF_TOKEN; without "
        f"network access, download it first (`hf download {name}`) and set HF_HUB_OFFLINE=1, or pass a local "
        f"directory (`hf download {name} --local-dir DIR`).{local}")


_TRUST_MODEL = ("set trust_remote_code: true in this role's config (ModelSpec(config={'trust_remote_code': True})), "
                "or use a model whose model_type transformers implements")
_TRUST_TOKENIZER = "give the tokenizer as an import path 'package.module:function' that builds it, or as an object"


@contextlib.contextmanager
def _no_remote_code(source: str, fix: str, trusted: bool) -> Iterator[None]:
    """Turn transformers' refusal of a directory's custom code into an error naming this package's setting."""
    try:
        yield
    except ValueError as err:
        if trusted or "trust_remote_code" not in str(err):
            raise
        raise ValueError(f"{source} declares custom code (`auto_map`), which is not run: trust_remote_code is off, "
                         f"since that code would run with your permissions. If you trust it like your own code, "
                         f"{fix}.") from err


def reference_source(reference: ModelSpec | dict[str, Any] | str | None) -> tuple[ModelSpec | None, str | None]:
    """The reference's own spec, or None for a copy of the initial actor; and that copy's precision.

    ``{"precision": "bf16-true"}`` (no ``path`` nor ``config``) asks for the actor's copy held in bfloat16."""
    if isinstance(reference, dict) and not {"path", "config"} & reference.keys():
        unknown = sorted(reference.keys() - {"precision"})
        if unknown:
            raise ValueError(f"reference={reference!r}: without `path` or `config` the reference is a copy of the "
                             f"actor and takes only `precision`, not {unknown}. Give a full model spec for a "
                             "reference of its own.")
        precision = reference.get("precision")
        if precision not in (None, *PRECISIONS):
            raise ValueError(f"reference precision must be one of {list(PRECISIONS)} or None, got {precision!r}.")
        return None, precision
    spec = as_model_spec(reference) if reference is not None else None
    if spec is not None and spec.copies_actor:  # also the saved hyperparameters of such a reference
        return None, spec.precision
    return spec, None


def role_precisions(explicit: dict[str, str | None], trained: Sequence[str], run_precision: Any) -> dict[str, str]:
    """Each role's precision: its own setting, else the run's (the ``Trainer``'s or Fabric's ``precision``).

    Args:
        explicit: Role -> its ``ModelSpec.precision`` (None where unset), for the roles that are models.
        trained: The roles that train.
        run_precision: The ``Trainer``'s (or Fabric's) ``precision``.

    Raises:
        ValueError: A combination that cannot hold, with the fix: a trained role in ``bf16-true`` (no float32 master
            weights), or a role set to another precision under ``precision='bf16-true'`` (which casts every role).
    """
    run = _LIGHTNING_PRECISIONS.get(str(run_precision))
    if run is None:
        raise ValueError(f"precision={run_precision!r} is not supported: use '32-true', 'bf16-mixed' or 'bf16-true' "
                         "(fp16 needs a gradient scaler, which the update does not use).")
    resolved = {}
    for role, chosen in explicit.items():
        if run == "bf16-true" and chosen not in (None, "bf16-true"):
            raise ValueError(f"precision='bf16-true' casts every role to bfloat16, so the {role}'s "
                             f"precision={chosen!r} cannot hold. Use precision='bf16-mixed' or '32-true' for the run "
                             "and set precision='bf16-true' on the frozen roles' specs, or remove the "
                             f"{role}'s precision.")
        if role in trained and chosen == "bf16-true":
            raise ValueError(f"The {role} trains, and precision='bf16-true' would leave it without float32 master "
                             "weights (AdamW updates below bfloat16's resolution are lost): use precision="
                             "'bf16-mixed' (float32 weights, bf16 compute). For generation in bfloat16, set "
                             "shadow_precision='bf16-true'.")
        resolved[role] = chosen or run
    return resolved


def precision_context(precision: str, device: torch.device) -> contextlib.AbstractContextManager[None]:
    """The autocast a role's call runs under: bf16 for ``bf16-mixed``, none otherwise (also inside a ``Trainer``'s
    bf16 autocast, which a ``32-true`` role turns off for its calls; ``bf16-true`` weights are bf16 already)."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16-mixed")


def hold_in(module: nn.Module, precision: str | None) -> nn.Module:
    """``module`` cast to bfloat16 for ``bf16-true`` (in place); unchanged otherwise."""
    return module.to(torch.bfloat16) if precision == "bf16-true" else module


def as_model_spec(spec: ModelSpec | dict[str, Any] | str, role: str | None = None) -> ModelSpec:
    """Accept a :class:`ModelSpec`, its fields as a dict, or a local path. With ``role``: refuse a spec without
    weights (only a reference may be the actor's copy)."""
    if isinstance(spec, str):
        spec = ModelSpec(path=spec)
    elif not isinstance(spec, ModelSpec):
        spec = ModelSpec(**spec)
    if role is not None and spec.copies_actor:
        raise ValueError(f"The {role}'s spec gives only a precision, but only the reference can be a copy of the "
                         f"actor: give the {role} a `path` or a `config`.")
    return spec


def disable_dropout(model: nn.Module) -> None:
    """PPO ratios assume the same function at rollout and update time: dropout must be off, in the ``nn.Dropout``
    modules and in the attention kernels' own dropout (Llama-style attention modules pass ``attention_dropout`` to
    the kernel while training), so that a model trained in train mode computes what it computed at rollout."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0
    config = getattr(model, "config", None)
    if isinstance(getattr(config, "attention_dropout", None), float):
        config.attention_dropout = 0.0


def _build(auto_class: Any, spec: ModelSpec, lora_task_type: str | None = None, **config_overrides: Any) -> nn.Module:
    config = spec.load_config(**config_overrides)
    dtype = spec.param_dtype
    # Seeded even when loading: weights missing from a checkpoint (a new classification head) and LoRA's A
    # matrices are random, and every rank must build the same ones.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.init_seed)
        source = spec.source
        if source is not None:
            with _hub_fetch(source, "model"), _no_remote_code(f"Model {source!r}", _TRUST_MODEL,
                                                               spec.trusts_remote_code):
                model = auto_class.from_pretrained(source, config=config, dtype=dtype, gguf_file=spec.gguf_file,
                                                   trust_remote_code=spec.trusts_remote_code)
        else:
            model = auto_class.from_config(config, dtype=dtype)
        if spec.lora is not None:
            model = _import_peft().get_peft_model(model, lora_config(spec.lora, lora_task_type))
    disable_dropout(model)
    fuse_activations(model)
    return model


def fuse_activations(model: nn.Module) -> None:
    """Run GPT-2's ``gelu_new`` through torch's fused tanh-GELU kernel.

    ``gelu_new`` is the tanh approximation of GELU written as five elementwise ops, each a pass over the MLP's
    widest activation, forward and backward; ``gelu(x, approximate="tanh")`` is the same function in one pass
    (outputs agree to ~1e-7) and trains 2-3x faster. On CPU this is a sizeable share of every forward.
    """
    for module in model.modules():
        for name, child in module.named_children():
            if isinstance(child, NewGELUActivation):
                setattr(module, name, GELUTanh())


def _import_peft() -> Any:
    try:
        import peft
    except ImportError as err:
        raise ImportError(
            "LoRA roles (`lora` in a model spec) need peft: install it with `pip install 'lightning-app-rlhf[peft]'`."
        ) from err
    return peft


def lora_config(fields: dict[str, Any], task_type: str | None) -> Any:
    """A ``peft.LoraConfig`` from its fields, with the role's ``task_type`` (``CAUSAL_LM`` or None)."""
    peft = _import_peft()
    if not isinstance(fields, dict):
        raise TypeError(f"`lora` takes peft.LoraConfig fields as a dict, e.g. {{'r': 8, 'target_modules': "
                        f"['c_attn']}}; got {type(fields).__name__}.")
    try:
        return peft.LoraConfig(**{**fields, "task_type": task_type})
    except (TypeError, ValueError) as err:
        raise ValueError(f"Invalid LoRA settings {fields}: {err}. Use peft.LoraConfig fields such as r, lora_alpha, "
                         "target_modules, bias.") from err


def is_lora(model: nn.Module | None) -> bool:
    """Whether ``model`` (or a critic's backbone) carries PEFT adapters."""
    if isinstance(model, ValueModel):
        model = model.backbone
    return model is not None and hasattr(model, "peft_config") and hasattr(model, "disable_adapter")


def build_causal_lm(spec: ModelSpec) -> PreTrainedModel:
    """The actor (or a separately given reference); with ``spec.lora`` a ``PeftModelForCausalLM``."""
    return _build(AutoModelForCausalLM, spec, lora_task_type="CAUSAL_LM")


def build_reference(actor: nn.Module, spec: ModelSpec | None) -> PreTrainedModel:
    """A frozen reference: an exact copy of the initial actor unless a spec is given."""
    check_no_lora("reference", spec)
    reference = copy.deepcopy(actor) if spec is None else build_causal_lm(spec)
    return freeze(reference)


class AdapterDisabledReference:
    """The reference policy of a LoRA actor: the actor's own frozen base model with its adapters switched off.

    No second copy of the weights exists (TRL's memory saving). It is deliberately not an ``nn.Module``, so the
    actor's parameters are neither registered twice, counted twice, nor saved twice in checkpoints.

    Args:
        actor: The actor as a PEFT model (trained copy or shadow). Its base weights never train, so with adapters
            off it computes the initial actor exactly (LoRA starts as the identity).
    """

    def __init__(self, actor: nn.Module) -> None:
        if not is_lora(actor):
            raise TypeError(f"AdapterDisabledReference needs a PEFT (LoRA) actor, got {type(actor).__name__}.")
        self.actor = actor

    def __call__(self, **kwargs: Any) -> Any:
        with self.actor.disable_adapter():
            return self.actor(**kwargs)

    @property
    def config(self) -> PretrainedConfig:
        return self.actor.config

    def get_input_embeddings(self) -> nn.Module:
        return self.actor.get_input_embeddings()


def check_no_lora(role: str, spec: ModelSpec | None) -> None:
    """Frozen roles (reference, reward model) take no LoRA adapters."""
    if spec is not None and spec.lora is not None:
        raise ValueError(f"`{role}` is frozen, so LoRA adapters on it would never train: remove `lora` from its "
                         "spec. LoRA belongs on the trainable roles, `actor` and `critic`.")


def freeze(model: nn.Module) -> nn.Module:
    """No gradients. Its mode is set where the roles are built (RLHFModule.configure_model: frozen roles in eval
    mode); dropout is off in every role anyway (:func:`disable_dropout`)."""
    return model.requires_grad_(False)


def default_optimizer(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """A trained role's optimizer unless the user gives one: AdamW, lr 1e-5, with torch's fused kernel (one kernel
    updates every tensor: on this CPU 4-5x faster than ``foreach=True``, and Hugging Face's Trainer, so TRL too,
    defaults to it). The same updates as the other implementations within float rounding."""
    return torch.optim.AdamW(params, lr=1e-5, fused=True)


class ValueModel(nn.Module):
    """A causal-LM backbone with a linear value head: one scalar per token."""

    def __init__(self, backbone: PreTrainedModel) -> None:
        super().__init__()
        self.backbone = backbone
        hidden = backbone.config.hidden_size
        self.value_head = nn.Linear(hidden, 1, dtype=backbone.dtype)
        # A zero head starts every value at 0: deterministic and independent of the init RNG.
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    @property
    def config(self) -> PretrainedConfig:
        return self.backbone.config

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor
    ) -> torch.Tensor:
        hidden = self.backbone(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        ).last_hidden_state
        # The head outside autocast, in its own dtype: values in float32 under bf16-mixed. A fresh tensor, not a view
        # of the head's output: FSDP2 warns on a view (an in-place op on it would drop its pre-backward hook).
        with torch.autocast(hidden.device.type, enabled=False):
            return self.value_head(hidden.to(self.value_head.weight.dtype)).squeeze(-1).float().clone()


def build_critic(spec: ModelSpec) -> ValueModel:
    """The critic: the spec's backbone (a causal LM's weights load without their LM head) plus a value head.

    With ``spec.lora`` the backbone carries LoRA adapters and the value head stays fully trainable.
    """
    return ValueModel(_build(AutoModel, spec))


def build_reward_model(spec: ModelSpec, pad_token_id: int) -> PreTrainedModel:
    """A frozen sequence classifier with one label; the score is read at the last non-pad token."""
    check_no_lora("reward_model", spec)
    return freeze(_build(AutoModelForSequenceClassification, spec, num_labels=1, pad_token_id=pad_token_id))


def resolve_import(target: str) -> Any:
    """Import ``"package.module:attr"`` or ``"package.module.attr"``.

    A module in the current folder imports under the console script (``lightning-app-rlhf fit ...``, whose
    ``sys.path[0]`` is the script's folder) as under ``python -m lightning_app_rlhf`` (whose ``sys.path[0]`` is the
    current folder): when the top-level module is found nowhere on ``sys.path`` but ``<module>.py`` or a
    ``<module>/`` package is in the current folder, that folder is added to the end of ``sys.path`` and the import
    retried.

    Raises:
        ValueError: ``target`` is not an import path, its module is not found (the message lists the folders
            searched), importing it failed, or it has no such attribute.
    """
    module_name, sep, attr = target.partition(":")
    if not sep:
        module_name, _, attr = target.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"{target!r} is not an import path: write it as 'package.module:name'.")
    module = _import_module(target, module_name)
    try:
        return getattr(module, attr)
    except AttributeError:
        where = getattr(module, "__file__", None) or module_name
        own = sorted(name for name, value in vars(module).items() if not name.startswith("_") and callable(value)
                     and getattr(value, "__module__", None) == module.__name__)
        shown = ("the module defines: " + ", ".join(own[:20]) + (", ..." if len(own) > 20 else "") if own else
                 "the module defines no public function or class")
        raise ValueError(f"Cannot import {target!r}: module {module_name!r} ({where}) has no attribute {attr!r}. "
                         f"The path's syntax ('package.module:name') is right; {shown}.") from None


def _import_module(target: str, module_name: str) -> Any:
    """``importlib.import_module(module_name)``, retried with the current folder on ``sys.path`` (see
    :func:`resolve_import`); a ``ValueError`` naming the folders searched when the module is not found."""
    top = module_name.partition(".")[0]
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name not in (top, module_name) and not module_name.startswith(f"{err.name}."):
            raise ValueError(f"Cannot import {target!r}: importing module {module_name!r} failed with {err} (an "
                             "import inside it). Install the missing package.") from err
        if err.name == top and _in_cwd(top) and not _cwd_on_path():
            sys.path.append(os.getcwd())  # as `python -m` has it, but last: installed packages keep precedence
            importlib.invalidate_caches()
            return _import_module(target, module_name)
        raise ValueError(_not_found(target, module_name, err)) from err
    except ImportError as err:
        raise ValueError(f"Cannot import {target!r}: importing module {module_name!r} failed with {err}. The path's "
                         "syntax ('package.module:name') is right: fix the module.") from err


def _in_cwd(top: str) -> bool:
    """Whether the current folder holds ``<top>.py`` or a ``<top>/`` package."""
    return Path(f"{top}.py").is_file() or Path(top).is_dir()


def _cwd_on_path() -> bool:
    """Whether the current folder is on ``sys.path`` (``""`` stands for it too)."""
    cwd = os.path.realpath(os.getcwd())
    return any(os.path.realpath(entry or os.curdir) == cwd for entry in sys.path)


def _not_found(target: str, module_name: str, err: ModuleNotFoundError) -> str:
    """The message for a module found nowhere: the folders searched, and that the path's syntax is right."""
    top = module_name.partition(".")[0]
    if err.name == top:
        folders = [entry or os.getcwd() for entry in sys.path]
        shown = ", ".join(folders[:6]) + (f", and {len(folders) - 6} more" if len(folders) > 6 else "")
        where = (f"the current folder ({os.getcwd()}) and sys.path ({shown})" if not _cwd_on_path() else
                 f"sys.path ({shown}), which includes the current folder")
        return (f"Cannot import {target!r}: no module {top!r} in {where}. The path's syntax ('package.module:name') is "
                f"right: put {top}.py in the current folder, run from the folder that holds it, add that folder to "
                "PYTHONPATH, or install its package.")
    parent = err.name.rpartition(".")[0] if err.name else top
    return (f"Cannot import {target!r}: {err}. The path's syntax ('package.module:name') is right: check the "
            f"submodule's name in package {parent!r}.")


def load_tokenizer(spec: str | PreTrainedTokenizerBase | dict[str, str]) -> PreTrainedTokenizerBase:
    """A tokenizer from a local directory, a Hugging Face hub name, ``"package.module:function"`` that builds one, or
    the files of :func:`tokenizer_files` (how a checkpoint embeds a tokenizer that was passed as an object).

    A string is a directory if one exists; else an import path if it holds ``:``; else a hub name if it reads as one
    and holds ``/`` or no ``.`` (``Qwen/Qwen2.5-0.5B-Instruct``, ``gpt2``), loaded as transformers does (downloaded
    when online, cached, ``HF_HUB_OFFLINE=1`` respected); else a dotted import path (``package.module.function``).
    """
    if isinstance(spec, PreTrainedTokenizerBase):
        tokenizer = spec
    elif isinstance(spec, dict):
        tokenizer = _tokenizer_from_files(spec)
    elif os.path.isdir(spec) or (":" not in spec and is_hub_name(spec) and ("/" in spec or "." not in spec)):
        with _hub_fetch(spec, "tokenizer"), _no_remote_code(f"Tokenizer {spec!r}", _TRUST_TOKENIZER, False):
            tokenizer = AutoTokenizer.from_pretrained(spec, trust_remote_code=False)
    else:
        target = resolve_import(spec)
        tokenizer = target() if callable(target) and not isinstance(target, PreTrainedTokenizerBase) else target
        if not isinstance(tokenizer, PreTrainedTokenizerBase):
            raise TypeError(f"{spec!r} gave a {type(tokenizer).__name__}, not a Hugging Face tokenizer.")
    check_tokenizer(tokenizer)
    return tokenizer


def tokenizer_files(tokenizer: PreTrainedTokenizerBase) -> dict[str, str]:
    """The text files ``tokenizer.save_pretrained`` writes, by name: plain strings, so a weights-only checkpoint can
    hold them and :func:`load_tokenizer` can rebuild the tokenizer."""
    with tempfile.TemporaryDirectory() as directory:
        tokenizer.save_pretrained(directory)
        return {path.name: path.read_text(encoding="utf-8") for path in sorted(Path(directory).iterdir())
                if path.is_file()}


def _tokenizer_from_files(files: dict[str, str]) -> PreTrainedTokenizerBase:
    if not files or not all(isinstance(k, str) and isinstance(v, str) for k, v in files.items()):
        raise ValueError("A tokenizer given as a dict must map file names to their text (as `tokenizer_files` "
                         "returns); give a tokenizer, a local directory or 'package.module:function' instead.")
    with tempfile.TemporaryDirectory() as directory:
        for name, text in files.items():
            (Path(directory) / Path(name).name).write_text(text, encoding="utf-8")  # names only: no path escapes
        with _no_remote_code("The tokenizer saved in the checkpoint", _TRUST_TOKENIZER, False):  # a crafted one may
            return AutoTokenizer.from_pretrained(directory, local_files_only=True, trust_remote_code=False)


def check_tokenizer(tokenizer: PreTrainedTokenizerBase) -> None:
    """Batched rollouts need a pad token and an EOS token."""
    if tokenizer.pad_token_id is None:
        raise ValueError(
            f"The tokenizer ({type(tokenizer).__name__}) has no pad token, which batched generation needs. "
            "Set one before training, e.g. `tokenizer.pad_token = tokenizer.eos_token`, or add a new one with "
            "`tokenizer.add_special_tokens({'pad_token': '<pad>'})` and resize the models' embeddings."
        )
    if tokenizer.eos_token_id is None:
        raise ValueError(
            f"The tokenizer ({type(tokenizer).__name__}) has no EOS token, so responses could never end. "
            "Set `tokenizer.eos_token` to the token your model emits at the end of a response."
        )


def vocab_size(model: nn.Module) -> int:
    """Rows of the input embedding table."""
    backbone = model.backbone if isinstance(model, ValueModel) else model
    return backbone.get_input_embeddings().num_embeddings


def check_vocabularies(
    tokenizer: PreTrainedTokenizerBase,
    actor: nn.Module | None,
    reference: nn.Module | None,
    critic: nn.Module | None,
    reward_model: nn.Module | None,
) -> None:
    """Every role reads the actor's tokens: the reference must share its vocabulary, the rest must cover it; a reward
    model must find each sequence's end.

    Roles this rank does not hold are None and skipped.
    """
    if reward_model is not None and tokenizer.pad_token_id == tokenizer.eos_token_id:
        warnings.warn("The tokenizer's pad token is its EOS token: Hugging Face sequence classifiers skip trailing "
                      "pad ids, so the reward model scores the token before EOS. Add a distinct pad token if "
                      "the reward model was trained to read EOS.")
    policy = actor if actor is not None else reference
    if policy is None:
        return
    actor_vocab = vocab_size(policy)
    reference_vocab = vocab_size(reference) if reference is not None else actor_vocab
    if actor_vocab != reference_vocab:
        raise ValueError(
            f"The actor has a vocabulary of {actor_vocab} tokens but the reference has {reference_vocab}. "
            "KL needs both on the same tokens: build the reference from the actor's checkpoint (leave "
            "`reference` unset to copy the actor) or resize its embeddings to match."
        )
    if len(tokenizer) > actor_vocab:
        raise ValueError(
            f"The tokenizer has {len(tokenizer)} tokens but the actor's embedding has {actor_vocab} rows. "
            "Resize the model (`model.resize_token_embeddings(len(tokenizer))`) or use the model's tokenizer."
        )
    for name, model in (("critic", critic), ("reward model", reward_model)):
        if model is not None and vocab_size(model) < len(tokenizer):
            raise ValueError(
                f"The {name} has a vocabulary of {vocab_size(model)} tokens, fewer than the tokenizer's "
                f"{len(tokenizer)}: it cannot read the actor's tokens. Build it from a model with the actor's "
                "vocabulary."
            )
