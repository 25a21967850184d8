"""``ppo.reuse_critic_forward``: the critic's scoring forward is also its training forward. Plain PyTorch.

With one epoch and one minibatch, the critic's train call sees the weights its scoring forward saw: the scoring
forward keeps its graph (:class:`KeptValues`) and the train call takes its loss on those values, saving a forward
over the rollout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lightning_app_rlhf.core.config import GenerationConfig, PPOConfig
from lightning_app_rlhf.core.role_table import CRITIC
from lightning_app_rlhf.engine.batch_split import micro_batch_count
from lightning_app_rlhf.parallel.plan import PlacementPlan


@dataclass
class KeptValues:
    """The critic's scoring forward on this rank's rows, with its graph, for its train call."""

    iteration: int
    rows: slice
    """This rank's rows of the rollout (its ``critic.forward`` shard)."""
    values: torch.Tensor
    """[rows, T] unmasked values, with gradients."""


def reuses_critic_forward(plan: PlacementPlan, config: PPOConfig, generation: GenerationConfig, rows: int) -> bool:
    """Whether the critic's scoring forward is also its training forward: asked for (``ppo.reuse_critic_forward``),
    one epoch and one minibatch (the train call's only forward sees the weights the scoring forward saw), the same
    ranks for both calls and one plain forward per rank (``ddp``, no chunks, no micro-batches, no tensor- or
    pipeline-parallel degree), and no one-step overlap (which trains on the previous rollout). The same answer on every rank.

    Args:
        plan: The placement.
        config: The train calls' settings.
        generation: Gives the forwards' chunk size.
        rows: Rows of the rollout being scored (0 before the first rollout).
    """
    critic = CRITIC.name
    if not (config.reuse_critic_forward and f"{critic}.train" in plan.calls and config.ppo_epochs == 1
            and config.num_minibatches == 1 and not plan.overlap):
        return False
    forward, train = critic + ".forward", critic + ".train"
    ranks = plan.ranks(train)
    if list(plan.ranks(forward)) != list(ranks) or plan.wrappers.get(critic, "ddp") != "ddp":
        return False
    if any(plan.tp.get(call, 1) > 1 or plan.pp_degree(call) > 1 for call in (forward, train)):
        return False  # a copy or a pipeline: the scoring forward is not the train call's own forward
    largest_shard = -(-rows // len(ranks)) if rows else 0
    one_chunk = generation.batch_size is None or generation.batch_size >= largest_shard
    return one_chunk and micro_batch_count(rows, len(ranks), config.micro_batch_size) == 1
