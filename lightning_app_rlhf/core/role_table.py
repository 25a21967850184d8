"""The role table: every model role of the engine, defined once. Plain Python, no torch.

Plans, placements, strategies, memory rows, reallocation, checkpoints, the planner and the summary all iterate over
:data:`ROLES`; an algorithm names the subset it needs (PPO all four, the critic-free algorithms no ``critic``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Role:
    """One model of the RLHF dataflow graph."""

    name: str
    """Role name, the prefix of its calls (``actor`` -> ``actor.generate``, ``actor.train``)."""
    attribute: str
    """Attribute of :class:`~lightning_app_rlhf.RLHFModule` that holds the role's module on ranks that hold it."""
    calls: tuple[str, ...]
    """The role's model calls, without the role prefix: ``generate``, ``forward``, ``train``."""
    trainable: bool
    """Whether the role has a train call (its weights live on that call's ranks and change every iteration)."""

    def call(self, kind: str) -> str:
        """The full call name: ``ACTOR.call("train") == "actor.train"``."""
        if kind not in self.calls:
            raise KeyError(f"Role {self.name!r} has no {kind!r} call; its calls are {list(self.calls)}.")
        return f"{self.name}.{kind}"


ROLES: tuple[Role, ...] = (
    Role("actor", "actor", ("generate", "train"), trainable=True),
    Role("reference", "reference", ("forward",), trainable=False),
    Role("reward", "reward_model", ("forward",), trainable=False),
    Role("critic", "critic", ("forward", "train"), trainable=True),
)
"""Every role the engine knows, in the order their calls run within a phase."""

ROLE_NAMES: tuple[str, ...] = tuple(role.name for role in ROLES)
TRAINABLE_ROLES: tuple[str, ...] = tuple(role.name for role in ROLES if role.trainable)
FROZEN_ROLES: tuple[str, ...] = tuple(role.name for role in ROLES if not role.trainable)
REQUIRED_ROLES: tuple[str, ...] = ("actor", "reward")
"""Roles every plan has: the policy and the scorer. The reference (the KL's anchor) is an algorithm's role too, but
a run whose KL coefficients are both 0 leaves it out (:attr:`Algorithm.roles`)."""

PHASES = ("generate", "forward", "train")
"""Call kinds in the order one iteration runs them."""


def role(name: str) -> Role:
    """The table entry of role ``name``."""
    for entry in ROLES:
        if entry.name == name:
            return entry
    raise KeyError(f"Unknown role {name!r}; the roles are {list(ROLE_NAMES)}.")


def role_of(call: str) -> str:
    """``actor.train`` -> ``actor``."""
    return call.split(".")[0]


def calls_of(roles: Iterable[str]) -> tuple[str, ...]:
    """The calls of ``roles``, phase by phase in table order (the order every rank creates their groups in)."""
    wanted = set(roles)
    return tuple(
        f"{entry.name}.{kind}" for kind in PHASES for entry in ROLES if entry.name in wanted and kind in entry.calls
    )


CALLS: tuple[str, ...] = calls_of(ROLE_NAMES)
"""Every call of every role: ``actor.generate``, ``reference.forward``, ``reward.forward``, ``critic.forward``,
``actor.train``, ``critic.train``."""

ACTOR, REFERENCE, REWARD, CRITIC = ROLES
"""The table's entries by name, for code that means one particular role."""
