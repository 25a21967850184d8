"""PPO with a critic (Schulman et al. 2017; Ouyang et al. 2022): per-token KL-shaped rewards and GAE advantages."""

from __future__ import annotations

from typing import Any, ClassVar

from lightning_app_rlhf.algorithms.base import Algorithm, register_algorithm
from lightning_app_rlhf.core.role_table import ROLE_NAMES


@register_algorithm
class PPO(Algorithm):
    """``r_t = -beta * KL_t`` on every response token plus the score on the last one; GAE(gamma, lambda) with the
    critic's values; advantages whitened over the batch (``ppo.whiten_advantages``); the critic regresses the
    GAE returns with a clipped value loss."""

    name = "ppo"
    roles = ROLE_NAMES
    advantage_estimator = "gae"
    value_loss_mode = "clipped_mse"
    own_settings: ClassVar[dict[str, Any]] = {"whiten_advantages": True}
