"""Multi-turn agentic rollouts: environments and tools inside the rollout (docs/agents.md)."""

from lightning_app_rlhf.agents.chat import ChatRenderer
from lightning_app_rlhf.agents.environment import (
    Environment,
    EnvironmentFactory,
    EnvironmentTypeError,
    Messages,
    StepResult,
    as_environment,
    environment_rewards_only,
)
from lightning_app_rlhf.agents.episodes import EPISODE_STATS, EpisodeRollout, run_episodes
from lightning_app_rlhf.agents.tools import ToolCall, ToolEnvironment, parse_tool_calls, tool_schemas

__all__ = [
    "EPISODE_STATS",
    "ChatRenderer",
    "Environment",
    "EnvironmentFactory",
    "EnvironmentTypeError",
    "EpisodeRollout",
    "Messages",
    "StepResult",
    "ToolCall",
    "ToolEnvironment",
    "as_environment",
    "environment_rewards_only",
    "parse_tool_calls",
    "run_episodes",
    "tool_schemas",
]
