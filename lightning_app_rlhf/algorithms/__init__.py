"""RL algorithms as plug-ins: each file registers one :class:`Algorithm` by name."""

from lightning_app_rlhf.algorithms.base import (
    ALGORITHMS,
    Algorithm,
    ScoredRollout,
    build_algorithm,
    register_algorithm,
)
from lightning_app_rlhf.algorithms.dr_grpo import DrGRPO
from lightning_app_rlhf.algorithms.grpo import GRPO
from lightning_app_rlhf.algorithms.ppo import PPO
from lightning_app_rlhf.algorithms.reinforce_pp import ReinforcePlusPlus
from lightning_app_rlhf.algorithms.reinforce_pp_baseline import ReinforcePlusPlusBaseline
from lightning_app_rlhf.algorithms.rloo import RLOO

__all__ = [
    "ALGORITHMS",
    "GRPO",
    "PPO",
    "RLOO",
    "Algorithm",
    "DrGRPO",
    "ReinforcePlusPlus",
    "ReinforcePlusPlusBaseline",
    "ScoredRollout",
    "build_algorithm",
    "register_algorithm",
]
