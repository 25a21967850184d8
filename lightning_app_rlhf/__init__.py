"""lightning-app-rlhf: RLHF with PPO for PyTorch Lightning, with placement of the four roles."""

from lightning_app_rlhf.agents import Environment, StepResult, ToolEnvironment
from lightning_app_rlhf.callbacks import default_callbacks
from lightning_app_rlhf.core.config import AgentConfig, GenerationConfig, PPOConfig
from lightning_app_rlhf.data import PromptDataModule
from lightning_app_rlhf.engine.update_guard import DivergenceError
from lightning_app_rlhf.models.calls import RewardFunctionError
from lightning_app_rlhf.models.reward_args import RewardSignatureError
from lightning_app_rlhf.models.roles import ModelSpec, ValueModel
from lightning_app_rlhf.module import RLHFModule
from lightning_app_rlhf.parallel.plan import PlacementPlan
from lightning_app_rlhf.strategies import (
    FlatteningStrategy,
    InterleavingStrategy,
    PlacementStrategy,
    SeparationStrategy,
)

__all__ = [
    "AgentConfig",
    "DivergenceError",
    "Environment",
    "FlatteningStrategy",
    "GenerationConfig",
    "InterleavingStrategy",
    "ModelSpec",
    "PPOConfig",
    "PlacementPlan",
    "PlacementStrategy",
    "PromptDataModule",
    "RLHFModule",
    "RewardFunctionError",
    "RewardSignatureError",
    "SeparationStrategy",
    "StepResult",
    "ToolEnvironment",
    "ValueModel",
    "default_callbacks",
]
