"""What the steps of one iteration hand each other on this rank, its timing marks, and what it returns. Plain
PyTorch."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_app_rlhf.engine.iteration import Step
from lightning_app_rlhf.engine.update_loop import SKIPPED_UPDATES
from lightning_app_rlhf.generation import Rollout
from lightning_app_rlhf.models.calls import Experience
from lightning_app_rlhf.parallel.plan import PlacementPlan


@dataclass
class IterationResult:
    """What one iteration hands back to its caller, the same on every rank (a free-running side: on its ranks)."""

    stats: dict[str, Any]
    """The rollout's statistics (reward, KL, length), the train calls', the reallocation's, time and throughput."""
    rollout: Rollout
    """The whole rollout."""
    scores: torch.Tensor
    """[B] the reward's raw scores."""
    learning_rates: dict[str, float]
    """``lr-{role}`` (and ``-momentum``, ``-weight_decay``) after this iteration's scheduler steps."""


MARKS = {"generate": "generated", "take": "taken", "gather_output": "scored", "stats": "trained",
         "receive": "received", "reallocate": "reallocated", "publish": "reallocated"}
"""Step action -> the timing mark taken after it (the last such step of the iteration sets it)."""


@dataclass
class IterationState:
    """What the steps of one iteration hand each other on this rank (:meth:`RLHFEngine.run_iteration`)."""

    batch: dict[str, Any]
    """The prompts, each repeated ``generation.num_samples`` times."""
    iteration: int
    start: float
    """``time.perf_counter()`` at the start; the other marks follow the steps (:meth:`mark`)."""
    prompts: int
    """Prompts of the batch: the groups an update trains on."""
    sampling_key: int
    """Keys the sampling noise: the iteration, or with dynamic sampling its generation round's key."""
    previous: Experience | None = None
    """With a staleness bound on the fixed schedule: the rollout of ``k`` iterations ago, which the update trains on
    (None in the first ``k``)."""
    schedulers: list[Any] = field(default_factory=list)
    """This rank's LR schedulers, stepped once before the first learning-rate broadcast."""
    earlier_rounds_s: tuple[float, float] = (0.0, 0.0)
    """Generation and scoring seconds of the iteration's earlier generation rounds (dynamic sampling)."""
    earlier_rounds_tokens: float = 0.0
    """Tokens those rounds generated."""
    generated: dict[str, torch.Tensor] | None = None
    """This rank's shard of ``actor.generate`` (None off its ranks)."""
    rollout: Rollout | None = None
    forwards: dict[str, dict[str, torch.Tensor] | None] = field(default_factory=dict)
    """Forward role -> this rank's shard of its call's output."""
    gathered: dict[str, torch.Tensor] = field(default_factory=dict)
    """Forward role -> its call's output for the whole rollout."""
    experience: Experience | None = None
    scores: torch.Tensor | None = None
    trained: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    """Trained role -> its train call's statistics on this rank, before their broadcast."""
    role_stats: dict[str, dict[str, float]] = field(default_factory=dict)
    """Trained role -> its broadcast statistics (a free-running training side announces them)."""
    diverged: dict[str, str] = field(default_factory=dict)
    """Free-running: role -> its divergence message, raised after the version is announced."""
    trained_on: Experience | None = None
    """The experience the train calls updated on (None: no update this iteration)."""
    stats: dict[str, Any] = field(default_factory=lambda: {SKIPPED_UPDATES: 0.0})
    reallocated_bytes: int = 0
    schedulers_stepped: bool = False
    learning_rates: dict[str, float] = field(default_factory=dict)
    marks: dict[str, float] = field(default_factory=dict)

    def next_round(self, batch: dict[str, Any], sampling_key: int, now: float) -> IterationState:
        """A fresh state for the next generation round of dynamic sampling, on ``batch``, carrying this round's
        time and tokens."""
        generate_s, score_s = self.earlier_rounds_s
        assert self.rollout is not None
        return IterationState(
            batch, self.iteration, now, self.prompts, sampling_key, self.previous, self.schedulers,
            earlier_rounds_s=(generate_s + self.marks["generated"] - self.start,
                              score_s + self.marks["scored"] - self.marks["generated"]),
            earlier_rounds_tokens=self.earlier_rounds_tokens + self.rollout.response_mask.sum().item(),
        )

    def experience_of(self, step: Step) -> Experience | None:
        """The experience a train step works on: the previous rollout's (a staleness bound) or this one's."""
        return self.previous if step.previous_rollout else self.experience

    def add_train_stats(self, role: str, stats: dict[str, torch.Tensor], experience: Experience) -> None:
        """A train call's broadcast statistics; the roles' skipped updates add up in one ``train/skipped_updates``."""
        self.stats[SKIPPED_UPDATES] += float(stats.pop(SKIPPED_UPDATES))
        self.stats.update(stats)
        self.role_stats[role] = {name: float(value) for name, value in stats.items()}
        self.trained_on = experience

    def mark(self, step: Step, clock: Callable[[], float]) -> None:
        """The time after ``step`` (taken or not by this rank) where it ends a phase so far; the clock (a device
        sync on CUDA) is read only then."""
        name = MARKS.get(step.action)
        if name is not None:
            self.marks[name] = clock()

    def timings(self, overlap: bool, samples: int, tokens: float) -> dict[str, float]:
        """Phase seconds and throughput of the iteration on the fixed schedule (and a free-running generation
        side); a phase with no step this time (the first iteration under overlap trains nothing) takes no time."""
        marks = self.marks
        start = marks.get("taken", self.start)  # a free-running generation side's wait is timed apart
        generated, scored = marks["generated"], marks["scored"]
        trained = marks.get("trained", generated if overlap else scored)
        reallocated = marks.get("reallocated", max(trained, scored))
        generate_s, score_s = self.earlier_rounds_s  # dynamic sampling's earlier generation rounds
        return {
            "time/generate_s": generate_s + generated - start,
            "time/score_s": score_s + scored - (trained if overlap else generated),
            "time/train_s": trained - (generated if overlap else scored),
            "time/reallocate_s": reallocated - max(trained, scored),
            "perf/samples_per_sec": samples / (generate_s + score_s + reallocated - start),
            "perf/gen_tokens_per_sec": (self.earlier_rounds_tokens + tokens) / (generate_s + generated - start),
        }

    def training_side_timings(self, end: float) -> dict[str, float]:
        """A free-running training side's phases: the wait for the rollout, the update, the publish (learning
        rates included)."""
        received, trained = self.marks["received"], self.marks.get("trained", self.marks["received"])
        assert self.trained_on is not None
        return {"time/wait_for_rollout_s": received - self.start, "time/train_s": trained - received,
                "time/reallocate_s": end - trained,
                "perf/samples_per_sec": len(self.trained_on.sequences) / (end - self.start)}


def staleness_stats(policy_version: int, trained_on: Experience, bound: int) -> dict[str, float]:
    """How many versions old the policy that generated the trained rollout is, at ``policy_version``, and that version
    (``rollout/policy_version``); never above the plan's ``bound`` (``max_staleness``): a rollout outside it is a bug,
    and raises. With partial rollouts (a version per token, :attr:`Experience.token_versions`) the lag is per
    token: its mean and maximum over the response tokens, and the newest version that sampled any of them."""
    versions = trained_on.token_versions
    mask = trained_on.response_mask.bool()
    if versions is not None and mask.any():
        lags = (policy_version - versions[mask]).float()
        mean, largest, newest = lags.mean().item(), lags.max().item(), int(versions[mask].max())
        smallest = lags.min().item()
    else:
        mean = largest = smallest = float(policy_version - trained_on.policy_version)
        newest = trained_on.policy_version
    if not 0 <= smallest <= largest <= bound:
        raise RuntimeError(f"Iteration {trained_on.iteration}'s rollout, generated by policy versions "
                           f"{policy_version - int(largest)}..{policy_version - int(smallest)}, was trained on at "
                           f"version {policy_version}: up to {int(largest)} versions stale, outside the bound "
                           f"0..{bound} (max_staleness). This is a bug; please report it.")
    # The generating version itself too: what a backend with its own copy of the weights (vllm) held for the rollout.
    return {"rollout/staleness_mean": mean, "rollout/staleness_max": largest, "rollout/policy_version": float(newest)}


def stale_experience(plan: PlacementPlan, queue: list[Experience]) -> Experience | None:
    """With a staleness bound k on the fixed schedule, the rollout the update trains on: the oldest of the ``queue``
    of scored rollouts once it holds k (None in the first k iterations, and without a bound)."""
    if not plan.overlap or plan.free_running or len(queue) < plan.schedule_staleness:
        return None
    return queue[0]
