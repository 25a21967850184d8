"""GSPO-token (Zheng et al. 2025, arXiv 2507.18071, section 4.3): GSPO with a per-token handle on the advantage."""

from __future__ import annotations

from lightning_app_rlhf.algorithms.base import register_algorithm
from lightning_app_rlhf.algorithms.gspo import GSPO


@register_algorithm
class GSPOToken(GSPO):
    """GSPO with the token ratio ``s_i_t = sg(s_i) * p_t / sg(p_t)``: the value of every token's ratio is its
    response's ``s_i``, and the gradient is the token's own. With one advantage per response (every estimator here)
    it gives GSPO's loss and gradient exactly; it exists for per-token advantages. GSPO's defaults otherwise."""

    name = "gspo_token"
    policy_loss_mode = "gspo_token"
