"""Free-running bounded staleness (:attr:`~lightning_app_rlhf.parallel.plan.PlacementPlan.free_running`): how the
generation side and the training side of a Separation plan exchange rollouts and weights without meeting. Plain
PyTorch.

The iteration itself is the engine's one recipe (:func:`~lightning_app_rlhf.engine.iteration.iteration_recipe`); this
module is the transport its free-running steps use. Policy version ``v`` is the weights after ``v`` training
iterations; ``k`` is ``plan.max_staleness``.

- **take** (generation side, before each rollout ``i``): join the bucketed broadcasts of every version the training
  side has published since this rank's own, in order (the existing reallocation), waiting only when the newest is
  older than ``i - k`` (``i - k + 1`` with partial rollouts: ``PlacementPlan.schedule_staleness``).
- **send** / **receive**: the generation leader sends the experience of rollout ``i`` to every training rank, point
  to point, and goes on; a training rank receives it at its iteration ``i`` (waiting when the generation side is
  slower).
- **publish** (training side, after each update): each role's train leader posts the broadcasts of the new weights
  to the shadows without waiting, then announces the version in the job's store, with the update's statistics and
  learning rates (which rank 0, a generating rank, logs).

So the generation side runs at most ``k + 1`` iterations ahead (:attr:`PlacementPlan.run_ahead`). A collective of
the whole world meets both sides at the same iteration: a checkpoint save (nothing is in flight across it but
published weights, which the next rollout takes) and validation and the end of the fit, before which
FreeRunningLink.settle hands the generation side every published version. The preemption check, an
all-reduce at the end of every iteration, lags by ``run_ahead + 1`` iterations so that it never holds the generation
side back (:class:`~lightning_app_rlhf.callbacks.PreemptionCheckpoint`).

With ``k = 0`` the generation side waits for every update: the on-policy schedule, logging the fixed schedule's
values. With ``k > 0`` which version generates each rollout depends on the two sides' speeds: the bound holds (it is
checked on every rollout trained on), the values are not reproducible run to run.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from lightning_app_rlhf.core.role_table import ACTOR
from lightning_app_rlhf.engine.iteration import published_roles
from lightning_app_rlhf.engine.iteration_state import IterationResult, IterationState
from lightning_app_rlhf.engine.update_guard import DivergenceError
from lightning_app_rlhf.parallel.heartbeat import job_store
from lightning_app_rlhf.parallel.placement import Placement

ROLLOUT_FIELDS = ("sequences", "attention_mask", "response_mask", "logprobs", "prompt_length", "stopped",
                  "turn_rewards", "episode_stats", "versions")
"""The rollout's fields that travel with the experience (the training side logs the rollout too)."""


@dataclass
class FreeRunningLink:
    """What a rank of a free-running plan carries between iterations, and its end of the transport.

    Args:
        placement: The placement (a free-running plan: disjoint generation and training groups).
    """

    placement: Placement
    in_flight: list[tuple[dist.Work, torch.Tensor]] = field(default_factory=list)
    """Sends (generation leader: rollouts) and weight broadcasts (train leaders) not known to be complete, with
    their buffers, kept alive until they are."""
    train_stats: dict[str, float] = field(default_factory=dict)
    """Generation side: the statistics and learning rates of the newest update taken (logged with each rollout)."""
    first_announced: int = 1
    """The first version this run's training side announces: the store holds versions from here on (a resumed run
    starts past the checkpoint's)."""

    @property
    def roles(self) -> tuple[str, ...]:
        return published_roles(self.placement.plan)

    # ---- weights ----

    def take(self, held: int, oldest: int, shadow_buckets: Any) -> int:
        """Generation side: take every version published since ``held`` (the shadows join each one's broadcasts,
        in order), waiting for version ``oldest`` if the training side has not published it yet (at most the
        placement's timeout). Returns the version the shadows now hold.

        Args:
            held: The version this rank's shadows hold.
            oldest: The oldest version the next rollout may be generated with (``i - k``).
            shadow_buckets: ``role -> buckets`` of the role's shadow parameters (the broadcasts' receive buffers).
        """
        store, placement = job_store(), self.placement
        if oldest > held:
            keys = [_key(placement.namespace, role, oldest) for role in self.roles]
            with placement.collective(ACTOR.call("train"), f"wait for policy version {oldest} (max_staleness)"):
                store.wait(keys, placement.timeout)
        newest = max(held, oldest)
        while self.roles and store.check([_key(placement.namespace, role, newest + 1) for role in self.roles]):
            newest += 1
        for version in range(held + 1, newest + 1):
            for role in self.roles:
                announcement = json.loads(store.get(_key(placement.namespace, role, version)))
                if announcement["diverged"] is not None:
                    raise DivergenceError(announcement["diverged"])
                placement.reallocate_weights(role, shadow_buckets(role))
                if version == newest:
                    self.train_stats.update(announcement["stats"])
        return newest

    def publish(self, role: str, version: int, buckets: Iterable[list[torch.Tensor]], stats: dict[str, float],
                diverged: str | None) -> None:
        """Training side: post ``role``'s new weights to its shadows (not waiting for them), then, on its train
        leader, announce ``version`` with the update's ``stats`` (learning rates included) and its divergence
        message, if any."""
        self.in_flight += self.placement.publish_weights(role, buckets)
        if self.placement.rank == self.placement.leader(role + ".train"):
            announcement = {"stats": stats, "diverged": diverged}
            job_store().set(_key(self.placement.namespace, role, version), json.dumps(announcement))
        self.in_flight = self.placement.pending_sends(self.in_flight)

    def stats_of_version(self, version: int) -> dict[str, float]:
        """The statistics and learning rates of the update that made ``version`` (waiting for its announcement, at
        most the placement's timeout), or the ones this rank holds where the version comes from a checkpoint: what a
        checkpoint saved after ``version`` iterations keeps, so that a resumed run logs them as the uninterrupted
        one."""
        if version < self.first_announced:
            return dict(self.train_stats)
        placement, store = self.placement, job_store()
        keys = [_key(placement.namespace, role, version) for role in self.roles]
        with placement.collective(ACTOR.call("train"), f"wait for policy version {version} (a checkpoint)"):
            store.wait(keys, placement.timeout)
        stats: dict[str, float] = {}
        for key in keys:
            stats.update(json.loads(store.get(key))["stats"])
        return stats

    # ---- the experience ----

    def send_experience(self, payload: dict[str, Any], iteration: int) -> None:
        """Generation leader: start sending rollout ``iteration``'s experience to every training rank."""
        for rank in self.placement.plan.training_ranks:
            self.in_flight += self.placement.send_payload(payload, rank, iteration,
                                                          f"the rollout of iteration {iteration}", ACTOR.call("generate"))
        self.in_flight = self.placement.pending_sends(self.in_flight)

    def receive_experience(self, iteration: int) -> dict[str, Any]:
        """Training rank: rollout ``iteration``'s experience, from the generation leader."""
        source = self.placement.leader(ACTOR.call("generate"))
        return self.placement.receive_payload(source, iteration, f"the rollout of iteration {iteration}",
                                              ACTOR.call("train"))

    # ---- both sides ----

    def settle(self, held: int, shadow_buckets: Any) -> int:
        """A collective of the whole world, where both sides meet (validation, the end of the fit): every iteration
        before it ran on both sides, and every version is announced; the generation side takes them all (its
        shadows then hold the newest weights), and no send stays in flight. Returns the version this rank's shadows
        hold (``held`` on the training side); the arguments are :meth:`take`'s."""
        with self.placement.collective(ACTOR.call("train"), "meeting of the generation and training sides"):
            dist.barrier()
        if self.placement.rank in self.placement.plan.generation_ranks:
            held = self.take(held, held, shadow_buckets)
        self.in_flight = self.placement.finish_sends(self.in_flight, "completion of the sends in flight",
                                                     ACTOR.call("train"))
        return held

    def state_dict(self) -> dict[str, Any]:
        return {"train_stats": dict(self.train_stats)}

    def load_state_dict(self, state: dict[str, Any], version: int) -> None:
        """Restore what a checkpoint saved after ``version`` iterations keeps: the generation side logs the
        statistics of the update that made it until it takes a newer one."""
        self.train_stats = dict(state.get("train_stats", {}))
        self.first_announced = version + 1


def experience_payload(experience_fields: dict[str, Any], rollout: Any, scores: torch.Tensor) -> dict[str, Any]:
    """What the generation leader sends: the experience's fields as ``torch.load(weights_only=True)`` reads them back
    (CPU tensors, numbers), the rollout's :data:`ROLLOUT_FIELDS` and the raw scores."""
    plain = {name: value.cpu() if torch.is_tensor(value) else value for name, value in experience_fields.items()}
    return {"experience": plain, "rollout": {name: getattr(rollout, name) for name in ROLLOUT_FIELDS},
            "scores": scores}


def _key(namespace: str, role: str, version: int) -> str:
    return f"{namespace}/{role}/{version}"


def free_running_result(state: IterationState, link: FreeRunningLink, policy_version: int,
                        end: float) -> IterationResult:
    """What a free-running side logs: the training side its own update; the generation side its rollout, with the
    newest update it took (whose statistics and learning rates come from that version's announcement).

    Args:
        state: The iteration's state on this rank.
        link: This rank's end of the transport.
        policy_version: The version this rank holds after the iteration.
        end: The clock at the end of the iteration.
    """
    assert state.rollout is not None and state.scores is not None
    stats = state.stats
    if state.trained_on is not None:  # the training side
        stats["rollout/policy_version"] = float(state.trained_on.policy_version)
        stats.update(state.training_side_timings(end))
        return IterationResult(stats, state.rollout, state.scores, state.learning_rates)
    assert state.experience is not None
    staleness = float(state.iteration - policy_version)  # trained on at training iteration `iteration`
    stats.update({"rollout/staleness_mean": staleness, "rollout/staleness_max": staleness,
                  "rollout/policy_version": float(policy_version)})
    versions, mask = state.rollout.versions, state.rollout.response_mask.bool()
    if versions is not None and mask.any():  # partial rollouts: the lag per token
        lags = (state.iteration - versions[mask]).float()
        stats.update({"rollout/staleness_mean": lags.mean().item(), "rollout/staleness_max": lags.max().item()})
    stats.update({name: value for name, value in link.train_stats.items() if not name.startswith("lr-")})
    samples = len(state.experience.sequences)
    stats.update(state.timings(False, samples, state.rollout.response_mask.sum().item()))
    stats["time/wait_for_weights_s"] = state.marks.get("taken", state.start) - state.start
    stats["perf/samples_per_sec"] = samples / (end - state.start)
    rates = {name: value for name, value in link.train_stats.items() if name.startswith("lr-")}
    return IterationResult(stats, state.rollout, state.scores, rates)
