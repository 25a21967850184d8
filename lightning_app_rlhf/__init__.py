"""lightning-app-rlhf: RLHF with PPO for PyTorch Lightning, with placement of the four roles."""

from lightning_app_rlhf.config import GenerationConfig, PPOConfig
from lightning_app_rlhf.data import PromptDataModule
from lightning_app_rlhf.module import RLHFModule
from lightning_app_rlhf.roles import ModelSpec, ValueModel

__all__ = ["GenerationConfig", "ModelSpec", "PPOConfig", "PromptDataModule", "RLHFModule", "ValueModel"]
