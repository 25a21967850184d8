"""``RoleSpecs``: the model of each role, from the module's arguments to built modules. Plain PyTorch, no Lightning.

Validates the combination once (LoRA, a reference that copies the actor, critic arguments of a critic-free
algorithm), builds the roles a rank holds, and resolves each role's precision.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from torch import nn

from lightning_app_rlhf.core.role_table import ACTOR, CRITIC, REFERENCE, REWARD
from lightning_app_rlhf.models.roles import (
    AdapterDisabledReference,
    ModelSpec,
    as_model_spec,
    build_causal_lm,
    build_critic,
    build_reference,
    build_reward_model,
    check_no_lora,
    freeze,
    hold_in,
    reference_source,
    role_precisions,
)

ModelSource = ModelSpec | dict[str, Any] | str
"""A model spec, its fields as a dict, or a local model directory."""


@dataclasses.dataclass
class RoleSpecs:
    """The model spec of each role that is a model.

    Args:
        actor: The policy.
        critic: The value model's backbone; None for a critic-free algorithm.
        reference: The reference's own spec; None for a copy of the initial actor (or, for a LoRA actor, its base
            with the adapters off).
        reference_precision: The precision of that copy (``{"precision": ...}`` without a path or config).
        reward: The reward model; None for a reward function.
    """

    actor: ModelSpec
    critic: ModelSpec | None
    reference: ModelSpec | None
    reference_precision: str | None
    reward: ModelSpec | None

    @classmethod
    def from_arguments(
        cls, actor: ModelSource, critic: ModelSource | None, reference: ModelSource | None,
        reward_model: ModelSource | None, reward_fn: Any, algorithm: str, has_critic: bool, *critic_builders: Any,
    ) -> RoleSpecs:
        """The specs of ``RLHFModule``'s model arguments: the critic defaults to the actor's spec (a fresh copy with a
        value head and the actor's LoRA settings). Raises a ``ValueError`` naming the fix for arguments that cannot
        hold together: not exactly one reward, critic arguments (``critic``, then ``critic_builders``: its optimizer
        and scheduler) for a critic-free ``algorithm``, a LoRA combination."""
        if (reward_model is None) == (reward_fn is None):
            raise ValueError(
                "Give exactly one reward: `reward_model` (a sequence classifier) or `reward_fn` (a function "
                f"`(prompts, responses) -> scores`). Got reward_model={reward_model!r}, reward_fn={reward_fn!r}. "
                "Checkpoints keep a reward function only as its import path: with "
                "`RLHFModule.load_from_checkpoint(path, reward_fn=...)` pass a function object again."
            )
        names = ("critic", "critic_optimizer", "critic_scheduler")
        given = [name for name, value in zip(names, (critic, *critic_builders), strict=True) if value is not None]
        if given and not has_critic:
            raise ValueError(f"Algorithm {algorithm!r} has no critic, but {given} were given. Remove them "
                             "(from the config's model section too), or use algorithm='ppo'.")
        actor_spec = as_model_spec(actor, "actor")
        critic_spec = (as_model_spec(critic, "critic") if critic is not None else actor_spec) if has_critic else None
        reference_spec, reference_precision = reference_source(reference)
        reward_spec = as_model_spec(reward_model, "reward model") if reward_model is not None else None
        specs = cls(actor_spec, critic_spec, reference_spec, reference_precision, reward_spec)
        specs._check_lora()
        return specs

    @property
    def reference_shares_actor(self) -> bool:
        """Whether the reference is the LoRA actor's base with adapters disabled, rather than a model of its own."""
        return self.reference is None and self.actor.lora is not None

    def _check_lora(self) -> None:
        if self.reference_shares_actor and self.reference_precision is not None:
            raise ValueError("A LoRA actor's reference is its own base model with the adapters off, so it computes at "
                             "the actor's precision: remove the reference's `precision`, or give a `reference` model "
                             "spec of its own.")
        check_no_lora("reference", self.reference)
        check_no_lora("reward_model", self.reward)
        if self.reference_shares_actor and self.actor.lora.get("bias", "none") != "none":
            raise ValueError(f"actor.lora.bias={self.actor.lora['bias']!r} trains the base model's biases, so the "
                             "base with adapters disabled would drift from the initial actor and could not serve as "
                             "the reference. Use bias='none', or give a separate `reference` model.")

    def build(
        self, holds: Callable[[str], bool], trains: Callable[[str], bool], pad_token_id: int
    ) -> dict[str, nn.Module]:
        """The roles this rank holds, by role. Random init is seeded per role, so every copy of a role (its trained
        weights or a shadow) starts identical on every rank.

        Args:
            holds: Whether this rank holds a role.
            trains: Whether this rank runs a role's train call; a trained role built elsewhere is a Separation shadow,
                held at its spec's ``shadow_precision``.
            pad_token_id: The tokenizer's pad id, which a reward model reads to find each sequence's last token.
        """
        built: dict[str, nn.Module] = {}
        if holds(ACTOR.name):
            actor = build_causal_lm(self.actor)
            built[ACTOR.name] = actor if trains(ACTOR.name) else hold_in(actor, self.actor.shadow_precision)
        if holds(REFERENCE.name):
            built[REFERENCE.name] = self._build_reference(built.get(ACTOR.name))
        if self.critic is not None and holds(CRITIC.name):
            critic = build_critic(self.critic)
            built[CRITIC.name] = critic if trains(CRITIC.name) else hold_in(critic, self.critic.shadow_precision)
        if self.reward is not None and holds(REWARD.name):
            built[REWARD.name] = build_reward_model(self.reward, pad_token_id)
        return built

    def _build_reference(self, actor: nn.Module | None) -> nn.Module:
        if self.reference_shares_actor:
            return AdapterDisabledReference(actor)  # type: ignore[return-value]
        if self.reference is None:
            # A copy of the initial actor: the actor here unless it is a shadow cast to bf16, else built from its spec
            # (the same seeded weights).
            if actor is not None and next(actor.parameters()).dtype == self.actor.param_dtype:
                return hold_in(build_reference(actor, None), self.reference_precision)
            spec = dataclasses.replace(self.actor, precision=self.reference_precision, shadow_precision=None)
            return freeze(build_causal_lm(spec))
        return freeze(build_causal_lm(self.reference))

    def precisions(self, trainable_roles: tuple[str, ...], run_precision: Any) -> dict[str, str]:
        """Each model role's precision (``32-true``, ``bf16-mixed`` or ``bf16-true``): its spec's, else the run's
        (the ``Trainer``'s or Fabric's ``precision``). Raises a ``ValueError`` naming the fix for a combination that
        cannot hold."""
        explicit: dict[str, str | None] = {ACTOR.name: self.actor.precision}
        if self.critic is not None:
            explicit[CRITIC.name] = self.critic.precision
        explicit[REFERENCE.name] = self.reference.precision if self.reference is not None else self.reference_precision
        if self.reward is not None:
            explicit[REWARD.name] = self.reward.precision
        resolved = role_precisions(explicit, trainable_roles, run_precision)
        if self.reference_shares_actor:
            resolved[REFERENCE.name] = resolved[ACTOR.name]
        return resolved

    def shadow_precisions(self) -> dict[str, str]:
        """Trained role -> the precision its copies that do not train are held at, where it is ``bf16-true``."""
        specs = {ACTOR.name: self.actor, CRITIC.name: self.critic}
        return {role: "bf16-true" for role, spec in specs.items()
                if spec is not None and spec.shadow_precision == "bf16-true"}
