"""The guard against non-finite updates: a role's optimizer step is skipped when a loss term or the gradient norm
is NaN or infinite, and the role stops with a :class:`DivergenceError` after ``ppo.max_consecutive_skipped_updates``
skips in a row. Plain Python; the engine applies it to every update (``RLHFEngine._guarded_step``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from lightning_app_rlhf.parallel.wrappers.base import SkippedUpdates

LOSS_TERMS = {"policy/loss": "policy loss", "policy/kl_loss": "kl loss", "value/loss": "value loss",
              "loss": "total loss"}
"""Loss statistics the guard checks, in this order, and their names in messages (``loss``: what backward ran on)."""
GRAD_NORM = "gradient norm"
"""The gradient norm's name among the guard's values and in its messages."""


class DivergenceError(RuntimeError):
    """A role's updates were skipped ``ppo.max_consecutive_skipped_updates`` times in a row because its loss or
    gradient norm was NaN or infinite, or a wrapper applied such an update that it could not skip."""



def first_nonfinite(values: Mapping[str, float]) -> str | None:
    """The name of the first of ``values`` that is NaN or infinite, in order; None when all are finite (the update
    may step)."""
    return next((name for name, value in values.items() if not math.isfinite(value)), None)


def record_update(
    record: SkippedUpdates, values: Mapping[str, float], where: str, reason: str | None, stepped: bool, limit: int
) -> bool:
    """Count one update of a role in ``record``; True when the role must stop.

    Args:
        record: The role's skipped updates in a row and last finite values, updated in place.
        values: The update's loss terms and gradient norm, by name.
        where: Where the update was (iteration, epoch, minibatch).
        reason: The name of the value that was not finite; None for a clean update.
        stepped: Whether the optimizer stepped.
        limit: ``ppo.max_consecutive_skipped_updates``.

    Returns:
        True after ``limit`` skips in a row, or when a non-finite update was applied (it could not be skipped).
    """
    record.last_finite.update({name: value for name, value in values.items() if math.isfinite(value)})
    if reason is None:
        record.in_a_row, record.last_step = 0, where
        return False
    if stepped:
        return True
    record.in_a_row += 1
    return record.in_a_row >= limit


def skip_message(role: str, reason: str, value: float, where: str, in_a_row: int, limit: int) -> str:
    """The warning of one skipped update."""
    return (f"Skipped the {role}'s update at {where}: its {reason} is {value:g}. Its gradients were zeroed; its "
            f"weights and optimizer state are unchanged. Skip {in_a_row} in a row of "
            f"ppo.max_consecutive_skipped_updates={limit}, after which the run stops.")


def divergence_message(
    role: str, reason: str, value: float, where: str, record: SkippedUpdates, limit: int, applied_by: str | None
) -> str:
    """The :class:`DivergenceError`'s message: what diverged, where, the last finite values and the fixes."""
    if applied_by is None:
        what = (f"The {role} diverged: {record.in_a_row} updates in a row were skipped "
                f"(ppo.max_consecutive_skipped_updates={limit}), the last at {where}, where its {reason} was "
                f"{value:g}.")
    else:
        what = (f"The {role} diverged: its {reason} was {value:g} at {where}, and its wrapper {applied_by!r} applied "
                "that update (DeepSpeed decides inside its step), so its weights may hold NaN: resume from the last "
                "checkpoint.")
    finite = ", ".join(f"{name} {v:.6g}" for name, v in record.last_finite.items()) or "none"
    last = f"the last update that stepped was at {record.last_step}" if record.last_step else "no update stepped yet"
    return (f"{what} Last finite values: {finite}; {last}. Lower the {role}'s learning rate ({role}_optimizer), "
            f"clip harder (a smaller ppo.max_grad_norm), or check the rewards for huge or non-finite scores "
            f"(ppo.reward_clip, ppo.reward_norm).")
