"""RL algorithms as plug-ins, veRL ``core_algos`` style: advantage estimators (``advantages.py``) and losses
(``losses.py``) are tensor functions registered by name; an :class:`Algorithm` (one file each) names its roles, its
estimator and its losses, and is registered by name too. The shared masked math is in ``functional.py``, the reward
shaping's state (KL controllers, running moments) in ``shaping.py``."""

from lightning_app_rlhf.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    ScoredRollout,
    get_advantage_estimator,
    register_advantage_estimator,
)
from lightning_app_rlhf.algorithms.base import ALGORITHMS, Algorithm, build_algorithm, register_algorithm
from lightning_app_rlhf.algorithms.cispo import CISPO
from lightning_app_rlhf.algorithms.dapo import DAPO
from lightning_app_rlhf.algorithms.dr_grpo import DrGRPO
from lightning_app_rlhf.algorithms.functional import LossScale
from lightning_app_rlhf.algorithms.grpo import GRPO
from lightning_app_rlhf.algorithms.gspo import GSPO
from lightning_app_rlhf.algorithms.gspo_token import GSPOToken
from lightning_app_rlhf.algorithms.losses import (
    POLICY_LOSSES,
    VALUE_LOSSES,
    get_policy_loss,
    get_value_loss,
    register_policy_loss,
    register_surrogate,
    register_value_loss,
)
from lightning_app_rlhf.algorithms.ppo import PPO
from lightning_app_rlhf.algorithms.reinforce_pp import ReinforcePlusPlus
from lightning_app_rlhf.algorithms.reinforce_pp_baseline import ReinforcePlusPlusBaseline
from lightning_app_rlhf.algorithms.rloo import RLOO

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "ALGORITHMS",
    "CISPO",
    "DAPO",
    "GRPO",
    "GSPO",
    "POLICY_LOSSES",
    "PPO",
    "RLOO",
    "VALUE_LOSSES",
    "Algorithm",
    "DrGRPO",
    "GSPOToken",
    "LossScale",
    "ReinforcePlusPlus",
    "ReinforcePlusPlusBaseline",
    "ScoredRollout",
    "build_algorithm",
    "get_advantage_estimator",
    "get_policy_loss",
    "get_value_loss",
    "register_advantage_estimator",
    "register_algorithm",
    "register_policy_loss",
    "register_surrogate",
    "register_value_loss",
]
