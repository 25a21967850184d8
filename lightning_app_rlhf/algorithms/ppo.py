"""PPO with a critic (Schulman et al. 2017; Ouyang et al. 2022): per-token KL-shaped rewards and GAE advantages."""

from __future__ import annotations

import torch
from torch import nn

from lightning_app_rlhf import ppo
from lightning_app_rlhf.algorithms.base import Algorithm, ScoredRollout, register_algorithm
from lightning_app_rlhf.calls import Experience, critic_loss
from lightning_app_rlhf.role_table import CRITIC, ROLE_NAMES


@register_algorithm
class PPO(Algorithm):
    """``r_t = -beta * KL_t`` on every response token plus the score on the last one; GAE(gamma, lambda) with the
    critic's values; advantages whitened over the batch (``ppo.whiten_advantages``); the critic regresses the
    GAE returns with a clipped value loss."""

    name = "ppo"
    roles = ROLE_NAMES

    def advantages(self, rollout: ScoredRollout) -> tuple[torch.Tensor, torch.Tensor | None]:
        assert rollout.values is not None, "PPO needs the critic's values"
        mask = rollout.response_mask
        rewards = ppo.token_rewards(rollout.scores, rollout.kl, rollout.kl_coef, mask)
        advantages, returns = ppo.gae_advantages(rewards, rollout.values, mask, self.config.gamma, self.config.lam)
        if self.config.whiten_advantages and mask.sum() > 1:  # every score skipped: nothing to whiten or learn
            advantages = ppo.masked_whiten(advantages, mask)
        return advantages, returns

    def stat_names(self, role: str) -> tuple[str, ...]:
        return ("value/loss", "value/clipfrac") if role == CRITIC.name else super().stat_names(role)

    def loss(
        self, role: str, model: nn.Module, batch: Experience, scale: ppo.LossScale
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if role == CRITIC.name:
            return critic_loss(model, batch, self.config, scale.tokens)
        return super().loss(role, model, batch, scale)
