"""Model presets and the run settings every measurement shares. Plain Python: no Lightning, no torch."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

MODEL_PRESETS: dict[str, dict[str, Any]] = {
    # The demo's model.
    "tiny": {"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 512},
    # About 7M parameters, 2M of them in the tied embedding.
    "small": {"model_type": "gpt2", "n_layer": 6, "n_embd": 256, "n_head": 8, "vocab_size": 8192},
    # About 100M parameters: GPT-2 base's body with a 16k vocabulary.
    "medium": {"model_type": "gpt2", "n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 16384},
}
SPECIAL_TOKENS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
TOKENIZER_VOCAB = 512
"""The demo's BPE vocabulary; larger presets keep it (prompts read the same) and leave the rest of their
embedding rows to sampled tokens, which is all a throughput benchmark needs."""


@dataclass
class RunSettings:
    """One measured configuration. Both frameworks get exactly these."""

    preset: str = "tiny"
    """Model preset for all four roles: ``tiny``, ``small`` or ``medium``."""
    algorithm: str = "ppo"
    """``ppo`` (actor, critic, reference, reward model; the peer is TRL 1.12's PPOTrainer) or ``grpo`` (the actor,
    a reference only with ``beta > 0``, the demo's reward function; the peer is TRL 1.16's GRPOTrainer)."""
    batch_size: int = 32
    """Prompts per iteration (the global rollout batch holds ``batch_size x num_samples`` completions)."""
    num_samples: int = 1
    """Completions per prompt: GRPO's group size G (TRL's ``num_generations``); 1 for PPO."""
    beta: float = 0.0
    """GRPO's KL coefficient, a k3 term in the loss (TRL's ``beta``; ours ``ppo.kl_loss_coef``). 0: no reference
    model on either side."""
    new_tokens: int = 32
    """Response length: tokens generated per prompt."""
    ppo_epochs: int = 1
    """Passes over each rollout."""
    num_minibatches: int = 1
    """Minibatches per PPO epoch."""
    threads: int = 1
    """Torch threads per process."""
    precision: str = "32-true"
    """``32-true`` or ``bf16-mixed`` (autocast; TRL's ``bf16=True``, its default for PPO)."""
    processes: int = 1
    """Processes (ranks). Ours only: the peer runs single-process here."""
    placement: str = "flattening"
    """``flattening``, ``interleaving``, ``separation``, ``separation_overlap`` (max_staleness 1),
    ``separation_k2``, ``separation_k4``, free-running ``separation_free_k{0,1,2,4}``, and with partial rollouts
    ``separation_partial`` (max_staleness 1) and ``separation_free_k{1,2}_partial`` (:data:`PLACEMENTS`)."""
    decoder: str = "eager"
    """Our generation backend (:data:`DECODERS`): ``eager`` (the default), ``static``, or ``static_compiled`` (the
    static decode step through ``torch.compile``; its compilation falls in the warm-up). Ours only."""
    mean_length: int | None = None
    """Responses of uneven length: a random-init model's rows stop after about this many tokens (geometric lengths,
    cut at ``new_tokens``; :func:`stop_ids`). None: every row runs to
    ``new_tokens``. Ours only."""
    padding_free: bool = False
    """Ours only: ``ppo.padding_free`` (the actor's training forward and the reference's scoring forward on packed
    real tokens; the same numbers within float rounding). False: the default padded forwards."""
    warmup: int = 2
    """Iterations run before measuring (allocator, caches)."""
    iterations: int = 6
    """Measured iterations; the median is reported with min and max."""

    def __post_init__(self) -> None:
        if self.preset not in MODEL_PRESETS:
            raise ValueError(f"Unknown preset {self.preset!r}: choose one of {sorted(MODEL_PRESETS)}.")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"Unknown placement {self.placement!r}: choose one of {sorted(PLACEMENTS)}.")
        if self.batch_size % (self.num_minibatches * self.processes):
            raise ValueError(
                f"batch_size {self.batch_size} must divide into {self.num_minibatches} minibatches on "
                f"{self.processes} processes: pick a multiple of {self.num_minibatches * self.processes}."
            )
        if self.placement != "flattening" and self.processes < 2:
            raise ValueError(f"Placement {self.placement!r} needs at least 2 processes; got {self.processes}.")
        if self.precision not in ("32-true", "bf16-mixed"):
            raise ValueError(f"precision must be '32-true' or 'bf16-mixed', got {self.precision!r}.")
        if self.decoder not in DECODERS:
            raise ValueError(f"Unknown decoder {self.decoder!r}: choose one of {sorted(DECODERS)}.")
        if self.algorithm not in ("ppo", "grpo"):
            raise ValueError(f"algorithm must be 'ppo' or 'grpo', got {self.algorithm!r}.")
        if self.algorithm == "grpo" and self.num_samples < 2:
            raise ValueError(f"GRPO compares a prompt's completions: num_samples must be >= 2, got {self.num_samples}.")
        if self.algorithm == "ppo" and (self.num_samples != 1 or self.beta):
            raise ValueError("num_samples and beta are GRPO's: leave them at 1 and 0 for algorithm 'ppo'.")
        if self.warmup < 0 or self.iterations < 1:
            raise ValueError(f"Need warmup >= 0 and iterations >= 1; got {self.warmup} and {self.iterations}.")

    @property
    def completions(self) -> int:
        """Completions generated and trained on per iteration."""
        return self.batch_size * self.num_samples

    def model_config(self) -> dict[str, Any]:
        return {**MODEL_PRESETS[self.preset], "n_positions": 128 + self.new_tokens, **SPECIAL_TOKENS}

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def variant(self) -> str:
        """Our side's options in a name: the decoder, then ``+padding_free`` where it is on."""
        return self.decoder + ("+padding_free" if self.padding_free else "")


DECODERS: dict[str, dict[str, Any]] = {
    "eager": {},
    "static": {"backend": "static"},
    "static_compiled": {"backend": "static", "compile": True},
}
"""Decoder name -> our ``generation`` settings (see docs/api.md, "Generation backends")."""

PLACEMENTS: dict[str, tuple[str, dict[str, Any]]] = {
    "flattening": ("lightning_app_rlhf.strategies.FlatteningStrategy", {}),
    "interleaving": ("lightning_app_rlhf.strategies.InterleavingStrategy", {}),
    "separation": ("lightning_app_rlhf.strategies.SeparationStrategy", {}),
    "separation_overlap": ("lightning_app_rlhf.strategies.SeparationStrategy", {"overlap": True}),
    "separation_k2": ("lightning_app_rlhf.strategies.SeparationStrategy", {"max_staleness": 2}),
    "separation_k4": ("lightning_app_rlhf.strategies.SeparationStrategy", {"max_staleness": 4}),
    **{f"separation_free_k{k}": ("lightning_app_rlhf.strategies.SeparationStrategy",
                                 {"max_staleness": k, "free_running": True}) for k in (0, 1, 2, 4)},
    **{f"separation_free_k{k}_partial": ("lightning_app_rlhf.strategies.SeparationStrategy",
                                         {"max_staleness": k, "free_running": True, "partial_rollout": True})
       for k in (1, 2)},
    "separation_partial": ("lightning_app_rlhf.strategies.SeparationStrategy",
                           {"max_staleness": 1, "partial_rollout": True}),
}
"""Placement name -> (strategy class path, extra strategy arguments)."""


def stop_ids(vocab: int, mean_length: int | None) -> list[int]:
    """Stop ids that end a random-init model's rows after about ``mean_length`` tokens: such a model's next token is
    close to uniform over the vocabulary, so ``vocab / mean_length`` stop ids stop a row at each step with
    probability ``1 / mean_length``: geometric lengths, most far below the longest (None: no stop id, every row
    runs to ``new_tokens``)."""
    if mean_length is None:
        return []
    return list(range(3, 3 + max(1, vocab // mean_length)))  # past pad, bos and eos (0, 1, 2)
