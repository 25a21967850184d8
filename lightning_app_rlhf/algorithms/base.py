"""What an RL algorithm is to the engine, and the registry that finds one by name. Plain PyTorch, no Lightning.

An algorithm is a set of names: the roles it needs, its advantage estimator (``advantages.py``), its policy loss and,
with a critic, its value loss (``losses.py``), plus its defaults. It runs no model: the engine generates, scores,
computes the actor's log-probabilities and the critic's values, and hands them to the algorithm's losses. A new
algorithm is a subclass of :class:`Algorithm` decorated with :func:`register_algorithm` (and, for a new estimator or
loss, a function decorated with ``register_advantage_estimator`` / ``register_policy_loss``).
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import torch

from lightning_app_rlhf.algorithms.advantages import ScoredRollout, get_advantage_estimator
from lightning_app_rlhf.algorithms.functional import MISMATCH_STATS, LossScale
from lightning_app_rlhf.algorithms.losses import get_policy_loss, get_value_loss
from lightning_app_rlhf.algorithms.registry import Registry
from lightning_app_rlhf.core.config import GENERATION_BACKENDS, GenerationConfig, PPOConfig
from lightning_app_rlhf.core.role_table import (
    ACTOR,
    CRITIC,
    REFERENCE,
    REQUIRED_ROLES,
    REWARD,
    ROLE_NAMES,
    TRAINABLE_ROLES,
)

if TYPE_CHECKING:  # calls.py imports the functional math from this package: no import back at runtime
    from lightning_app_rlhf.models.calls import Experience

__all__ = ["ALGORITHMS", "FAMILY_SETTINGS", "Algorithm", "ScoredRollout", "build_algorithm", "register_algorithm"]

FAMILY_SETTINGS = ("scale_rewards", "whiten_advantages")
"""The ``ppo`` settings only some algorithms have (:attr:`Algorithm.own_settings`). Their default, None, is the
running algorithm's own value; a value given to an algorithm without the setting is refused, unless it is given in
``ppo.per_algorithm`` for the algorithms that have it."""


class Algorithm:
    """An RLHF algorithm: the roles it needs and the names of its advantage estimator and losses.

    Args:
        config: Hyper-parameters of the update.
        generation: Sampling settings (the group size, and the generation budget of Dr. GRPO's normaliser).
    """

    name: ClassVar[str]
    """The name the registry and ``RLHFModule(algorithm=...)`` know it by."""
    roles: tuple[str, ...] = (ACTOR.name, REFERENCE.name, REWARD.name)
    """The roles it needs; the plan gives ranks to their calls only. A class lists the reference; an instance whose
    KL coefficients (``ppo.kl_coef``, ``ppo.kl_loss_coef``) are both 0 drops it: no reference is built, placed,
    planned or run (as TRL at beta 0)."""
    advantage_estimator: ClassVar[str]
    """A registered advantage estimator's name (``register_advantage_estimator``)."""
    policy_loss_mode: ClassVar[str] = "ppo_clip"
    """A registered policy loss's name (``register_policy_loss``): the actor's loss."""
    value_loss_mode: ClassVar[str | None] = None
    """A registered value loss's name (``register_value_loss``): the critic's loss; None without a critic."""
    min_group_size: ClassVar[int] = 1
    """Fewest samples per prompt its estimator works with."""
    default_loss_agg_mode: ClassVar[str] = "token_mean"
    """Its paper's loss aggregation, used when ``ppo.loss_agg_mode`` is None."""
    default_clip_ratio: ClassVar[tuple[float, float] | None] = None
    """Its paper's ``(clip_ratio_low, clip_ratio_high)``, used where ``ppo`` leaves them None; None: ``clip_range``
    on both sides."""
    default_kl: ClassVar[tuple[float, float]] = (0.05, 0.0)
    """Its ``(kl_coef, kl_loss_coef)``, used where ``ppo`` leaves them None: the KL in the reward and in the loss."""
    default_overlong_buffer_fraction: ClassVar[float] = 0.0
    """Its paper's ``ppo.overlong_buffer`` as a fraction of ``generation.max_new_tokens``, used when it is None."""
    default_dynamic_sampling: ClassVar[bool] = False
    """Its paper's ``ppo.dynamic_sampling``, used when it is None."""
    default_num_samples: ClassVar[int | None] = None
    """Its ``generation.num_samples``, used when that is None. None: 1, or ``max(4, min_group_size)`` when it compares
    a prompt's responses (``min_group_size`` above 1; GRPO's paper uses more, 4 keeps a CPU demo fast)."""
    own_settings: ClassVar[dict[str, Any]] = {}
    """The family settings (:data:`FAMILY_SETTINGS`) it has, each with its own value, used where ``ppo`` leaves it
    None; a family setting it does not list is refused when given."""
    policy_stats: ClassVar[tuple[str, ...]] = ("policy/loss", "policy/clipfrac", "policy/approx_kl", "policy/entropy")
    """The statistics its policy loss reports, besides ``policy/kl_loss`` (with a KL loss term), in a fixed order."""
    value_stats: ClassVar[tuple[str, ...]] = ("value/loss", "value/clipfrac")
    """The statistics its value loss reports, in a fixed order."""

    def __init__(self, config: PPOConfig, generation: GenerationConfig) -> None:
        self.config = config
        self.generation = generation
        config.apply_per_algorithm(self.name)
        self.loss_agg_mode = config.loss_agg_mode or self.default_loss_agg_mode
        self._resolve_defaults(config, generation)
        if not self.uses_kl:
            self.roles = tuple(r for r in type(self).roles if r != REFERENCE.name)
        self.resolve_num_samples(generation)
        # Looked up once: a name unregistered since the class was registered fails here, not mid-iteration.
        self._estimator = get_advantage_estimator(self.advantage_estimator)
        self._policy_loss = get_policy_loss(self.policy_loss_mode)
        self._value_loss = get_value_loss(self.value_loss_mode) if self.value_loss_mode is not None else None


    def resolve_num_samples(self, generation: GenerationConfig) -> None:
        """Fill ``generation.num_samples`` with the algorithm's own when it is None (1, or a group of at least 4 for an
        algorithm that compares a prompt's responses), and refuse a group smaller than the algorithm needs. Called at
        construction, and again by the engine for a config set on the module afterwards.

        Raises:
            ValueError: ``generation.num_samples`` is below :attr:`min_group_size`, naming the fix.
        """
        if generation.num_samples is None:
            own = 1 if self.min_group_size < 2 else max(4, self.min_group_size)
            generation.num_samples = own if self.default_num_samples is None else self.default_num_samples
        if generation.num_samples < self.min_group_size:
            raise ValueError(
                f"Algorithm {self.name!r} compares the responses of one prompt with each other and needs at least "
                f"{self.min_group_size} per prompt; generation.num_samples is {generation.num_samples}. Set "
                f"generation.num_samples to {max(self.min_group_size, 4)} or more (e.g. --model.generation.num_samples "
                f"{max(self.min_group_size, 4)}), or leave it unset for the algorithm's own, or use algorithm 'ppo' or "
                "'reinforce_pp'."
            )

    def _resolve_defaults(self, config: PPOConfig, generation: GenerationConfig) -> None:
        """Write this algorithm's defaults into the settings ``config`` leaves None (the KL coefficients, the clip
        range, the overlong buffer), so that the losses and the reward shaping read one config."""
        kl_coef, kl_loss_coef = self.default_kl
        config.kl_coef = kl_coef if config.kl_coef is None else config.kl_coef
        config.kl_loss_coef = kl_loss_coef if config.kl_loss_coef is None else config.kl_loss_coef
        if config.kl_estimator == "k3" and config.kl_coef > 0:
            warnings.warn("ppo.kl_estimator='k3' puts the k3 estimate in the reward, where its policy gradient is not "
                          "the gradient of KL(policy || reference). Use kl_estimator='k1' in the reward, or move the "
                          "penalty into the loss: kl_coef=0, kl_loss_coef>0, kl_loss_estimator='k3'.", stacklevel=4)
        low, high = self.default_clip_ratio or (config.clip_range, config.clip_range)
        config.clip_ratio_low = low if config.clip_ratio_low is None else config.clip_ratio_low
        config.clip_ratio_high = high if config.clip_ratio_high is None else config.clip_ratio_high
        self._resolve_family_settings(config)
        # An inference engine's numerics (vLLM's kernels) are not the trainer's: measure and correct by default.
        separate = GENERATION_BACKENDS.get(generation.backend).separate_numerics
        if config.recompute_old_logprobs is None:
            config.recompute_old_logprobs = separate or config.rollout_is not in (None, "none") \
                or config.partial_rollout_loss == "decoupled"
        if config.rollout_is is None:
            decoupled = config.partial_rollout_loss == "decoupled"  # its own weights
            config.rollout_is = "tis" if separate and config.recompute_old_logprobs and not decoupled else "none"
        if config.dynamic_sampling is None:
            config.dynamic_sampling = self.default_dynamic_sampling
        if config.dynamic_sampling and self.min_group_size < 2:
            raise ValueError(f"ppo.dynamic_sampling drops the groups of a prompt whose responses all score alike; "
                             f"algorithm {self.name!r} does not compare a prompt's responses. Set "
                             "ppo.dynamic_sampling false, or use a group algorithm (dapo, grpo, gspo, cispo, rloo).")
        if config.overlong_buffer is None:
            config.overlong_buffer = int(generation.max_new_tokens * self.default_overlong_buffer_fraction)
        if config.overlong_buffer >= generation.max_new_tokens:
            raise ValueError(f"ppo.overlong_buffer ({config.overlong_buffer}) must be below generation.max_new_tokens "
                             f"({generation.max_new_tokens}): the penalty starts that many tokens before the limit. "
                             f"Lower it, e.g. to {generation.max_new_tokens // 5}.")

    def _resolve_family_settings(self, config: PPOConfig) -> None:
        """Its own value of each family setting ``config`` leaves None; a ``ValueError`` naming the fix for one it
        does not have."""
        for setting in FAMILY_SETTINGS:
            value = getattr(config, setting)
            if setting in self.own_settings:
                setattr(config, setting, self.own_settings[setting] if value is None else value)
                continue
            if value is None:
                continue
            owners = sorted(name for name, cls in ALGORITHMS.items() if setting in cls.own_settings)
            example = ", ".join(f"{name}: {{{setting}: {value}}}" for name in owners[:2])
            raise ValueError(
                f"ppo.{setting}={value!r} is a setting of {owners}, not of algorithm {self.name!r}. Remove it (each "
                f"algorithm then uses its own), or, in a config meant for several algorithms, give it for those that "
                f"have it only: ppo.per_algorithm: {{{example}, ...}}.")

    @property
    def uses_kl(self) -> bool:
        """Whether a KL to the reference enters the reward or the loss; without, there is no reference role."""
        return self.config.kl_coef > 0 or self.config.kl_loss_coef > 0

    @property
    def trainable_roles(self) -> tuple[str, ...]:
        return tuple(r for r in self.roles if r in TRAINABLE_ROLES)

    @property
    def keeps_ref_logprobs(self) -> bool:
        """Whether the actor's loss needs the reference log-probabilities (a KL loss term)."""
        return self.config.kl_loss_coef > 0

    def stat_names(self, role: str) -> tuple[str, ...]:
        """The statistics the loss of ``role``'s train call reports, in a fixed order (every rank must agree).

        Args:
            role: A trainable role of this algorithm.
        """
        if role == CRITIC.name:
            return self.value_stats
        stats = self.policy_stats + ("policy/kl_loss",) if self.keeps_ref_logprobs else self.policy_stats
        stats = stats + MISMATCH_STATS if self.config.recompute_old_logprobs else stats
        return stats + ("rollout/superseded_masked_frac",) if self.config.partial_rollout_loss == "mask_superseded" \
            else stats

    def advantages(self, rollout: ScoredRollout) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per-token advantages [B, T] and, with a critic, the critic's returns [B, T] (else None), from the
        registered ``advantage_estimator``. Both are 0 outside the response mask.

        Args:
            rollout: The whole gathered batch, scored.
        """
        return self._estimator(rollout, self.config)

    def policy_loss(
        self, logprobs: torch.Tensor, entropy: torch.Tensor | None, batch: Experience, scale: LossScale
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The actor's loss (the registered ``policy_loss_mode``) on one minibatch (or one data-parallel shard of
        it), and its statistics.

        Args:
            logprobs: [B, T] the actor's log-probabilities of ``batch``'s response tokens, with gradients.
            entropy: [B, T] the actor's entropies there, or None.
            batch: The minibatch's rollout-time tensors (behaviour log-probs, advantages, mask, reference log-probs).
            scale: The whole minibatch's sizes.
        """
        return self._policy_loss(logprobs, batch.logprobs, batch.advantages, batch.response_mask, scale, self.config,
                                 self.loss_agg_mode, ref_logprobs=batch.ref_logprobs, entropy=entropy,
                                 is_weights=batch.is_weights)

    def value_loss(
        self, values: torch.Tensor, batch: Experience, scale: LossScale
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The critic's loss (the registered ``value_loss_mode``) on one minibatch (or shard), and its statistics.

        Args:
            values: [B, T] the critic's values of ``batch``'s rows, with gradients.
            batch: The minibatch's rollout-time values, returns and mask.
            scale: The whole minibatch's sizes.
        """
        if self._value_loss is None or batch.values is None or batch.returns is None:
            raise ValueError(f"Algorithm {self.name!r} has no critic: it trains {list(self.trainable_roles)}. Give it "
                             "the 'critic' role and a value_loss_mode (e.g. 'clipped_mse') to train one.")
        return self._value_loss(values, batch.values, batch.returns, batch.response_mask, scale, self.config)


A = TypeVar("A", bound=type[Algorithm])

ALGORITHMS: Registry[type[Algorithm]] = Registry("algorithm", "@register_algorithm",
                                                 "RLHFModule(algorithm=...), e.g. --model.algorithm grpo")
"""Name -> algorithm class; filled by :func:`register_algorithm`."""


def register_algorithm(cls: A) -> A:
    """Class decorator: make ``cls`` available as ``RLHFModule(algorithm=cls.name)``, once its roles, estimator and
    losses check out (each error names the fix).

    Args:
        cls: A subclass of :class:`Algorithm` that sets ``name`` and ``advantage_estimator``.
    """
    unknown = [r for r in cls.roles if r not in ROLE_NAMES]
    missing = [r for r in REQUIRED_ROLES if r not in cls.roles]
    if unknown or missing:
        raise ValueError(f"Algorithm {cls.name!r} lists roles {list(cls.roles)}: it must include "
                         f"{list(REQUIRED_ROLES)} and may add {[r for r in ROLE_NAMES if r not in REQUIRED_ROLES]}.")
    if not hasattr(cls, "advantage_estimator"):
        raise ValueError(f"Algorithm {cls.name!r} names no advantage estimator: set advantage_estimator to a "
                         "registered one, or register yours with @register_advantage_estimator(name).")
    get_advantage_estimator(cls.advantage_estimator)
    get_policy_loss(cls.policy_loss_mode)
    has_critic = CRITIC.name in cls.roles
    if has_critic and cls.value_loss_mode is None:
        raise ValueError(f"Algorithm {cls.name!r} has a critic but no value loss: set value_loss_mode "
                         "(e.g. 'clipped_mse').")
    if not has_critic and cls.value_loss_mode is not None:
        raise ValueError(f"Algorithm {cls.name!r} names value loss {cls.value_loss_mode!r} but no critic: add "
                         f"{CRITIC.name!r} to its roles, or set value_loss_mode = None.")
    if has_critic:
        get_value_loss(cls.value_loss_mode)
    return ALGORITHMS.add(cls.name, cls)


def build_algorithm(name: str, config: PPOConfig, generation: GenerationConfig) -> Algorithm:
    """The registered algorithm ``name`` with these settings; the error lists the registered names.

    Args:
        name: A registered algorithm's name.
        config: Hyper-parameters of the update.
        generation: Sampling settings.
    """
    cls = ALGORITHMS.lookup(name)
    unknown = sorted(set(config.per_algorithm or {}) - set(ALGORITHMS))
    if unknown:  # a typo there would leave its settings unused without a word
        raise ValueError(f"ppo.per_algorithm names {unknown}, which are no registered algorithms: use names of "
                         f"{sorted(ALGORITHMS)}.")
    return cls(config, generation)
