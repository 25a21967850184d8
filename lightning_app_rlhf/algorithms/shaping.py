"""Reward-shaping state carried from iteration to iteration (and checkpointed): the KL coefficient's controllers and
the running moments of the scores. Plain PyTorch, no Lightning.

Not part of the stateless math in ``functional.py``: :class:`~lightning_app_rlhf.engine.experience.RewardShaping` owns one
of each and the module saves their ``state_dict`` with its checkpoint.
"""

from __future__ import annotations

import math
from typing import Any

import torch


class FixedKLController:
    """A constant KL coefficient."""

    def __init__(self, kl_coef: float) -> None:
        self.value = kl_coef

    def update(self, current_kl: float, n_samples: int) -> None:
        """A fixed controller ignores the measured KL."""

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = state["value"]


class AdaptiveKLController:
    """Proportional KL controller of Ziegler et al. (2019), "Fine-Tuning Language Models from Human Preferences".

    ``error = clip(kl / target - 1, -0.2, 0.2)`` and ``value *= 1 + error * n_samples / horizon``.
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: int) -> None:
        self.value = init_kl_coef
        self.target = target
        self.horizon = horizon

    def update(self, current_kl: float, n_samples: int) -> None:
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_samples / self.horizon

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = state["value"]


class RunningMoments:
    """Running mean and std over every score seen so far (Chan et al. parallel update)."""

    def __init__(self) -> None:
        self.mean, self.var, self.count = 0.0, 1.0, 0

    def update(self, values: torch.Tensor) -> None:
        n = values.numel()
        if n == 0:
            return
        batch_mean = values.double().mean().item()
        batch_var = values.double().var(unbiased=False).item() if n > 1 else 0.0
        total = self.count + n
        delta = batch_mean - self.mean
        m2 = self.var * self.count + batch_var * n + delta**2 * self.count * n / total
        self.mean += delta * n / total
        self.var = m2 / total
        self.count = total

    @property
    def std(self) -> float:
        return math.sqrt(self.var) if self.count > 1 else 1.0

    def state_dict(self) -> dict[str, Any]:
        return {"mean": self.mean, "var": self.var, "count": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.mean, self.var, self.count = state["mean"], state["var"], state["count"]
