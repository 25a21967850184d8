"""DAPO's dynamic sampling (``ppo.dynamic_sampling``): the scored groups one update collects over generation
rounds. Plain PyTorch.

A group whose raw scores are all equal (every response right, or every one wrong) has zero advantage under a
group-relative estimator: it adds no gradient, only dilutes the batch. Each generation round (a batch of prompts)
is generated and scored as usual; its informative groups join the collection, and the update runs once it holds
``target`` of them, or after ``max_rounds`` rounds, on exactly ``target`` groups (the rest of a short batch left
out of the loss). Every rank holds the same gathered scores, so every rank decides alike without a collective.
"""

from __future__ import annotations

import dataclasses

import torch

from lightning_app_rlhf.generation import Rollout, concat_rollouts
from lightning_app_rlhf.parallel.plan import PlacementPlan


def informative_groups(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """[B / group_size] True for the groups whose finite scores differ: at least two, not all equal.

    Args:
        scores: [B] raw scores, a prompt's ``group_size`` responses contiguous.
        group_size: Responses per prompt (``generation.num_samples``).
    """
    grouped = scores.float().view(-1, group_size)
    finite = torch.isfinite(grouped)
    high = torch.where(finite, grouped, -torch.inf).amax(1)
    low = torch.where(finite, grouped, torch.inf).amin(1)
    return (finite.sum(1) >= 2) & (high > low)


def check_dynamic_sampling_plan(plan: PlacementPlan) -> None:
    """Raise naming the fix if ``plan`` cannot run dynamic sampling: its rounds come before each update, which a
    plan with a staleness bound runs beside later generations."""
    if plan.free_running:
        raise ValueError("ppo.dynamic_sampling collects groups over generation rounds before each update; a "
                         "free-running plan generates ahead of the updates. Use the fixed schedule with "
                         "max_staleness 0 (free_running false), or set ppo.dynamic_sampling false.")
    if plan.overlap:
        raise ValueError("ppo.dynamic_sampling collects groups over generation rounds before each update; the plan "
                         f"{plan.name!r} trains on earlier rollouts beside the next generation (max_staleness="
                         f"{plan.max_staleness}). Use an on-policy plan (max_staleness 0), or set "
                         "ppo.dynamic_sampling false.")


def round_key(iteration: int, generation_round: int) -> int:
    """The sampling key of a generation round: the iteration itself for the first (so a run without dynamic sampling
    draws what it always drew), a distinct one for each later round (a prompt drawn twice in one update gets fresh
    samples)."""
    return iteration if generation_round == 0 else iteration + (generation_round << 40)


@dataclasses.dataclass
class CollectedBatch:
    """The batch one update trains on, assembled from the rounds' informative groups."""

    rollout: Rollout
    outputs: dict[str, torch.Tensor]
    """Forward role -> its gathered result for the rows of :attr:`rollout`."""
    kept: torch.Tensor
    """[B] False for the rows that only fill a short batch: left out of the loss and the statistics."""
    filtered_groups: int
    """Groups dropped over the rounds: no spread in their scores."""
    generation_rounds: int
    generated_scores: torch.Tensor
    """[N] the raw scores of every response the rounds generated, informative or not."""
    generated_lengths: torch.Tensor
    """[N] their lengths."""


@dataclasses.dataclass
class GroupCollector:
    """The informative groups of the rounds of one update, and the rounds' count.

    Args:
        group_size: Responses per prompt.
        max_rounds: Rounds after which the update runs whatever it collected (``ppo.max_generation_rounds``).
        pad_token_id: Pads prompts and responses of rounds of different lengths to one width.
    """

    group_size: int
    max_rounds: int
    pad_token_id: int
    rollouts: list[Rollout] = dataclasses.field(default_factory=list)
    """Per round: its informative groups' rows."""
    outputs: list[dict[str, torch.Tensor]] = dataclasses.field(default_factory=list)
    """Per round: each forward role's gathered result for those rows."""
    rounds: int = 0
    filtered: int = 0
    scores: list[torch.Tensor] = dataclasses.field(default_factory=list)
    """Per round: the raw scores of all its responses."""
    lengths: list[torch.Tensor] = dataclasses.field(default_factory=list)
    """Per round: their lengths."""
    fill: tuple[Rollout, dict[str, torch.Tensor]] | None = None
    """The last round's uninformative groups: rows that only give a short batch its shape."""

    @property
    def groups(self) -> int:
        """Informative groups collected so far."""
        return sum(len(r.sequences) for r in self.rollouts) // self.group_size

    def add(self, rollout: Rollout, outputs: dict[str, torch.Tensor], scores: torch.Tensor) -> int:
        """One scored round; returns how many of its groups were dropped."""
        informative = informative_groups(scores, self.group_size)
        rows = informative.repeat_interleave(self.group_size)
        self.rollouts.append(rollout.select(rows))
        self.outputs.append({role: out[rows] for role, out in outputs.items()})
        self.fill = (rollout.select(~rows), {role: out[~rows] for role, out in outputs.items()})
        self.scores.append(scores)
        self.lengths.append(rollout.response_mask.sum(1))
        self.rounds += 1
        dropped = int((~informative).sum())
        self.filtered += dropped
        return dropped

    def ready(self, target: int) -> bool:
        """Whether the update runs now: ``target`` groups collected, or the last round done."""
        return self.groups >= target or self.rounds >= self.max_rounds

    def take(self, target: int) -> CollectedBatch:
        """The first ``target`` collected groups, in round order, as one batch, and a fresh collection. Short of
        ``target`` (the last round done): filled up with dropped groups, marked not :attr:`CollectedBatch.kept`."""
        rows = target * self.group_size
        rollouts, outputs = list(self.rollouts), list(self.outputs)
        have = self.groups * self.group_size
        if have < rows:
            # Rounds of ``target`` prompts: the last round's dropped groups are at least the groups still missing.
            assert self.fill is not None and len(self.fill[0].sequences) >= rows - have
            fill_rollout, fill_outputs = self.fill
            take = slice(0, rows - have)
            rollouts.append(fill_rollout.select(take))
            outputs.append({role: out[take] for role, out in fill_outputs.items()})
        rollout = concat_rollouts([r for r in rollouts if len(r.sequences)], self.pad_token_id)
        width = rollout.response_mask.shape[1]
        joined = {role: torch.cat([_pad_right(part[role], width) for part in outputs])[:rows] for role in outputs[0]}
        kept = torch.arange(rows, device=rollout.sequences.device) < have
        batch = CollectedBatch(rollout.select(slice(0, rows)), joined, kept, self.filtered, self.rounds,
                               torch.cat(self.scores), torch.cat(self.lengths))
        self.clear()
        return batch

    def clear(self) -> None:
        """Forget every round: the next update starts afresh."""
        self.rollouts, self.outputs, self.scores, self.lengths, self.fill = [], [], [], [], None
        self.rounds = self.filtered = 0


def _pad_right(tensor: torch.Tensor, width: int) -> torch.Tensor:
    """A per-token result ([B, T]) padded with zeros to ``width`` columns; a per-sample one ([B]) as it is."""
    if tensor.dim() == 1 or tensor.shape[1] == width:
        return tensor
    return torch.nn.functional.pad(tensor, (0, width - tensor.shape[1]))
