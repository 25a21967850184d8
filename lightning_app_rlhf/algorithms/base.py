"""What an RL algorithm is to the engine, and the registry that finds one by name. Plain PyTorch, no Lightning.

An algorithm states the roles it needs, turns a scored rollout into advantages (and returns, where it has a
critic), and gives the loss of each role it trains. The engine does the rest: generation, scoring, placement,
minibatches and optimizer steps. A new algorithm is one file with a subclass of :class:`Algorithm` decorated with
:func:`register_algorithm`, imported in ``algorithms/__init__.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, TypeVar

import torch
from torch import nn

from lightning_app_rlhf import ppo
from lightning_app_rlhf.calls import Experience, policy_logprobs
from lightning_app_rlhf.config import GenerationConfig, PPOConfig
from lightning_app_rlhf.role_table import ACTOR, REQUIRED_ROLES, TRAINABLE_ROLES


@dataclass
class ScoredRollout:
    """What every algorithm's advantage estimator reads, for the whole (gathered) rollout batch of ``B = prompts x G``
    samples; the ``G`` samples of a prompt are consecutive rows."""

    scores: torch.Tensor
    """[B] sequence scores after shaping (normalisation, clipping, EOS penalty); 0 for skipped samples."""
    kl: torch.Tensor
    """[B, T] per-token KL(policy || reference) in ``ppo.kl_estimator``, 0 outside the response."""
    kl_coef: float
    """The current coefficient of the KL in the reward (0: none)."""
    response_mask: torch.Tensor
    """[B, T] 1 on response tokens up to EOS; all 0 for skipped samples."""
    valid: torch.Tensor
    """[B] False for samples whose score was skipped (non-finite): they count in no statistic."""
    group_size: int
    """Samples per prompt (``generation.num_samples``)."""
    values: torch.Tensor | None = None
    """[B, T] critic values, for algorithms with a critic."""


class Algorithm:
    """An RLHF algorithm: the roles it needs, its advantage estimator and its losses.

    Args:
        config: Hyper-parameters of the update.
        generation: Sampling settings (the group size, and the generation budget of Dr. GRPO's normaliser).
    """

    name: ClassVar[str]
    """The name the registry and ``RLHFModule(algorithm=...)`` know it by."""
    roles: ClassVar[tuple[str, ...]] = REQUIRED_ROLES
    """The roles it needs; the plan gives ranks to their calls only."""
    min_group_size: ClassVar[int] = 1
    """Fewest samples per prompt its estimator works with."""
    default_loss_agg_mode: ClassVar[str] = "token_mean"
    """Its paper's loss aggregation, used when ``ppo.loss_agg_mode`` is None."""

    def __init__(self, config: PPOConfig, generation: GenerationConfig) -> None:
        self.config = config
        self.generation = generation
        self.loss_agg_mode = config.loss_agg_mode or self.default_loss_agg_mode
        if generation.num_samples < self.min_group_size:
            raise ValueError(
                f"Algorithm {self.name!r} compares the responses of one prompt with each other and needs at least "
                f"{self.min_group_size} per prompt; generation.num_samples is {generation.num_samples}. Set "
                f"generation.num_samples to {max(self.min_group_size, 4)} or more (e.g. --model.generation.num_samples "
                f"{max(self.min_group_size, 4)}), or use algorithm 'ppo' or 'reinforce_pp'."
            )

    @property
    def trainable_roles(self) -> tuple[str, ...]:
        return tuple(r for r in self.roles if r in TRAINABLE_ROLES)

    @property
    def keeps_ref_logprobs(self) -> bool:
        """Whether the actor's loss needs the reference log-probabilities (a KL loss term)."""
        return self.config.kl_loss_coef > 0

    def advantages(self, rollout: ScoredRollout) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per-token advantages [B, T] and, for an algorithm with a critic, the critic's returns [B, T] (else None).
        Both are 0 outside the response mask."""
        raise NotImplementedError

    def stat_names(self, role: str) -> tuple[str, ...]:
        """The statistics :meth:`loss` reports for ``role``, in a fixed order (every rank must agree)."""
        names = ("policy/loss", "policy/clipfrac", "policy/approx_kl", "policy/entropy")
        return names + ("policy/kl_loss",) if self.keeps_ref_logprobs else names

    def loss(
        self, role: str, model: nn.Module, batch: Experience, scale: ppo.LossScale
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The loss of ``role``'s train call on one minibatch (or one data-parallel shard of it, with the whole
        minibatch's ``scale``), and its statistics."""
        if role != ACTOR.name:
            raise ValueError(f"Algorithm {self.name!r} trains {list(self.trainable_roles)}, not {role!r}.")
        # No entropy term in the loss: the entropy is only logged, so no graph for it (backward skips a vocab pass).
        logprobs, entropy = policy_logprobs(model, batch, self.generation.temperature,
                                            entropy_grad=self.config.entropy_coef != 0)
        return self.policy_loss(logprobs, entropy, batch, scale)

    def policy_loss(
        self, logprobs: torch.Tensor, entropy: torch.Tensor, batch: Experience, scale: ppo.LossScale
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """PPO's clipped surrogate, aggregated by ``loss_agg_mode``, minus the entropy bonus, plus the KL loss term
        when ``kl_loss_coef > 0``."""
        mask, mode = batch.response_mask, self.loss_agg_mode
        per_token, clipped, approx_kl = ppo.clipped_surrogate(
            logprobs, batch.logprobs, batch.advantages, self.config.clip_range
        )
        loss = ppo.aggregate_loss(per_token, mask, mode, scale)
        entropy_mean = ppo.aggregate_loss(entropy, mask, "token_mean", scale)
        total = loss - self.config.entropy_coef * entropy_mean
        stats = {
            "policy/loss": loss.detach(),
            "policy/clipfrac": ppo.aggregate_loss(clipped, mask, "token_mean", scale),
            "policy/approx_kl": ppo.aggregate_loss(approx_kl, mask, "token_mean", scale),
            "policy/entropy": entropy_mean.detach(),
        }
        if self.keeps_ref_logprobs:
            assert batch.ref_logprobs is not None
            kl = ppo.kl_penalty(logprobs, batch.ref_logprobs, self.config.kl_loss_estimator)
            kl_loss = ppo.aggregate_loss(kl, mask, mode, scale)
            total = total + self.config.kl_loss_coef * kl_loss
            stats["policy/kl_loss"] = kl_loss.detach()
        return total, stats


ALGORITHMS: dict[str, type[Algorithm]] = {}
"""Name -> algorithm class; filled by :func:`register_algorithm`."""

A = TypeVar("A", bound=type[Algorithm])


def register_algorithm(cls: A) -> A:
    """Class decorator: make ``cls`` available as ``RLHFModule(algorithm=cls.name)``."""
    if cls.name in ALGORITHMS and ALGORITHMS[cls.name] is not cls:
        raise ValueError(f"An algorithm named {cls.name!r} is registered already ({ALGORITHMS[cls.name].__name__}).")
    unknown = [r for r in cls.roles if r not in (*REQUIRED_ROLES, *TRAINABLE_ROLES)]
    missing = [r for r in REQUIRED_ROLES if r not in cls.roles]
    if unknown or missing:
        raise ValueError(f"Algorithm {cls.name!r} lists roles {list(cls.roles)}: it must include {list(REQUIRED_ROLES)} "
                         f"and may add {[r for r in TRAINABLE_ROLES if r not in REQUIRED_ROLES]}.")
    ALGORITHMS[cls.name] = cls
    return cls


def build_algorithm(name: str, config: PPOConfig, generation: GenerationConfig) -> Algorithm:
    """The registered algorithm ``name`` with these settings; the error lists the registered names."""
    if name not in ALGORITHMS:
        raise ValueError(f"Unknown algorithm {name!r}: choose one of {sorted(ALGORITHMS)} (e.g. "
                         "--model.algorithm grpo), or register your own with @register_algorithm.")
    return ALGORITHMS[name](config, generation)


def sequence_rewards(rollout: ScoredRollout) -> torch.Tensor:
    """[B] score minus ``kl_coef`` times the response's summed KL: the one reward of a sequence-level estimator."""
    return rollout.scores - rollout.kl_coef * (rollout.kl * rollout.response_mask).sum(1)


def per_token(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B] sequence advantages -> [B, T], the same on every response token (outcome supervision)."""
    return advantages.unsqueeze(1).to(torch.float32) * mask.to(torch.float32)


