"""Free-running bounded staleness (:attr:`~lightning_app_rlhf.parallel.plan.PlacementPlan.free_running`): the
generation side and the training side of a Separation plan, each at its own pace. Plain PyTorch.

Policy version ``v`` is the weights after ``v`` training iterations; ``k`` is ``plan.max_staleness``.

- **The generation side** (``actor.generate`` and every forward call, on shadow copies) runs iteration ``i`` as soon
  as it holds version ``i - k`` or newer. Before each rollout it takes every version the training side has
  published since its own (:func:`take_published_weights`: it joins their bucketed broadcasts, the existing
  reallocation), waiting only when the newest is older than ``i - k``. It generates and scores the rollout (gathers
  among its own ranks), sends the experience to every training rank point to point, and goes on.
- **The training side** receives rollout ``i`` at its iteration ``i`` (waiting for it when the generation side is
  slower), checks the bound (``i - version`` in ``0..k``), trains, and publishes version ``i + 1``: each role's train
  leader posts the broadcasts to the shadows without waiting, then announces the version in the job's store, with
  the update's statistics and learning rates (which rank 0, a generating rank, logs).

So the generation side runs at most ``k + 1`` iterations ahead (:attr:`PlacementPlan.run_ahead`). A collective of
the whole world meets both sides at the same iteration: a checkpoint save (nothing is in flight across it but
published weights, which the next rollout takes) and validation and the end of the fit, before which
:func:`settle` hands the generation side every published version. The preemption check, an all-reduce at the end
of every iteration, lags by ``run_ahead + 1`` iterations so that it never holds the generation side back
(:class:`~lightning_app_rlhf.callbacks.PreemptionCheckpoint`).

With ``k = 0`` the generation side waits for every update: the on-policy schedule, logging the fixed schedule's
values. With ``k > 0`` which version generates each rollout depends on the two sides' speeds: the bound holds (it is
checked on every rollout trained on), the values are not reproducible run to run.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from lightning_app_rlhf.core.role_table import ACTOR
from lightning_app_rlhf.engine.iteration import iteration_steps
from lightning_app_rlhf.engine.update_guard import DivergenceError
from lightning_app_rlhf.generation import Rollout, repeat_samples
from lightning_app_rlhf.models.calls import Experience
from lightning_app_rlhf.parallel.heartbeat import entering
from lightning_app_rlhf.parallel.reallocation import shadow_buckets, trained_buckets

if TYPE_CHECKING:
    from lightning_app_rlhf.engine.engine import IterationResult, RLHFEngine

ROLLOUT_FIELDS = ("sequences", "attention_mask", "response_mask", "logprobs", "prompt_length", "stopped")


@dataclass
class FreeRunningState:
    """What a rank of a free-running plan carries between iterations."""

    in_flight: list[tuple[dist.Work, torch.Tensor]] = field(default_factory=list)
    """Sends (generation leader: rollouts) and weight broadcasts (train leaders) not known to be complete, with
    their buffers, kept alive until they are."""
    train_stats: dict[str, float] = field(default_factory=dict)
    """Generation side: the statistics and learning rates of the newest update taken (logged with each rollout)."""
    first_announced: int = 1
    """The first version this run's training side announces: the store holds versions from here on (a resumed run
    starts past the checkpoint's)."""


def run_iteration(engine: RLHFEngine, batch: dict[str, Any], iteration: int,
                  schedulers: Iterable[Any]) -> IterationResult:
    """Iteration ``iteration`` of this rank's side (module docstring)."""
    if engine.placement.rank in engine.placement.plan.generation_ranks:
        return _generation_side(engine, batch, iteration)
    return _training_side(engine, batch, iteration, schedulers)


# ---- the generation side ----

def _generation_side(engine: RLHFEngine, batch: dict[str, Any], iteration: int) -> IterationResult:
    from lightning_app_rlhf.engine.engine import IterationResult, IterationState

    placement, plan = engine.placement, engine.placement.plan
    state_of_run = engine.free_running_state
    start = engine._now()
    take_published_weights(engine, oldest=iteration - plan.max_staleness)
    ready = engine._now()
    generate = ACTOR.call("generate")
    prompts = batch["input_ids"].shape[0]
    state = IterationState(repeat_samples(batch, engine.generation.num_samples), iteration, ready, prompts,
                           iteration, among=generate)
    for step in iteration_steps(plan, updates=False):  # generate, gather, the forwards and their gathers
        if placement.rank in step.ranks:
            entering(f"iteration {iteration}: {step.kind} {step.name}")
            engine._run_step(step, state, None, ())
        state.mark(step, engine._now)
    entering(f"iteration {iteration} done: outside the engine (the training loop, callbacks, checkpoints)")
    assert state.rollout is not None and state.experience is not None and state.scores is not None
    if placement.rank == placement.leader(generate):
        rollout = state.rollout
        payload = {"experience": _plain(vars(state.experience)),
                   "rollout": {name: getattr(rollout, name) for name in ROLLOUT_FIELDS},
                   "scores": state.scores}
        for rank in plan.training_ranks:
            state_of_run.in_flight += placement.send_payload(payload, rank, iteration)
    state_of_run.in_flight = placement.pending_sends(state_of_run.in_flight)
    stats = state.stats
    if "kl/mean" in stats:  # the shaping (and its KL controller) lives where the experience is made
        engine.shaping.kl_controller.update(stats["kl/mean"].item(), n_samples=len(state.experience.sequences))
    staleness = float(iteration - engine.policy_version)  # trained on at training iteration `iteration`
    stats.update({"rollout/staleness_mean": staleness, "rollout/staleness_max": staleness,
                  "rollout/policy_version": float(engine.policy_version)})
    stats.update({name: value for name, value in state_of_run.train_stats.items() if not name.startswith("lr-")})
    samples = len(state.experience.sequences)
    stats.update(state.timings(False, samples, state.rollout.response_mask.sum().item()))
    end = engine._now()
    stats["time/wait_for_weights_s"] = ready - start
    stats["perf/samples_per_sec"] = samples / (end - start)
    learning_rates = {name: value for name, value in state_of_run.train_stats.items() if name.startswith("lr-")}
    return IterationResult(stats, state.rollout, state.scores, learning_rates)


def take_published_weights(engine: RLHFEngine, oldest: int) -> int:
    """Generation side: take every policy version published since this rank's own (its shadows join each one's
    broadcasts, in order), waiting for version ``oldest`` if the training side has not published it yet (at most
    the placement's timeout). Returns the version its shadows now hold (``engine.policy_version``)."""
    placement = engine.placement
    roles = _published_roles(engine)
    store = _store()
    held = engine.policy_version
    if oldest > held:
        keys = [_key(placement.namespace, role, oldest) for role in roles]
        with placement._collective(ACTOR.call("train"), f"wait for policy version {oldest} (max_staleness)"):
            store.wait(keys, placement.timeout)
    newest = max(held, oldest)
    while roles and store.check([_key(placement.namespace, role, newest + 1) for role in roles]):
        newest += 1
    for version in range(held + 1, newest + 1):
        for role in roles:
            announcement = json.loads(store.get(_key(placement.namespace, role, version)))
            if announcement["diverged"] is not None:
                raise DivergenceError(announcement["diverged"])
            placement.reallocate_weights(role, shadow_buckets(engine.modules(role)))
            if version == newest:
                engine.free_running_state.train_stats.update(announcement["stats"])
    engine.policy_version = newest
    return newest


def stats_of_version(engine: RLHFEngine, version: int) -> dict[str, float]:
    """The statistics and learning rates of the update that made ``version`` (waiting for its announcement, at most
    the placement's timeout), or the ones this rank holds where the version comes from a checkpoint: what a
    checkpoint saved after ``version`` iterations keeps, so that a resumed run logs them as the uninterrupted one."""
    placement = engine.placement
    if version < engine.free_running_state.first_announced:
        return dict(engine.free_running_state.train_stats)
    roles, store = _published_roles(engine), _store()
    keys = [_key(placement.namespace, role, version) for role in roles]
    with placement._collective(ACTOR.call("train"), f"wait for policy version {version} (a checkpoint)"):
        store.wait(keys, placement.timeout)
    stats: dict[str, float] = {}
    for key in keys:
        stats.update(json.loads(store.get(key))["stats"])
    return stats


# ---- the training side ----

def _training_side(engine: RLHFEngine, batch: dict[str, Any], iteration: int,
                   schedulers: Iterable[Any]) -> IterationResult:
    from lightning_app_rlhf.engine.engine import SKIPPED_UPDATES, IterationResult

    placement, plan = engine.placement, engine.placement.plan
    state_of_run = engine.free_running_state
    start = engine._now()
    entering(f"iteration {iteration}: receive the rollout")
    source = placement.leader(ACTOR.call("generate"))
    payload = placement.receive_payload(source, iteration, f"the rollout of iteration {iteration}",
                                        ACTOR.call("train"))
    received = engine._now()
    device = placement.device
    experience = Experience(**payload["experience"]).to(device)
    staleness = engine.policy_version - experience.policy_version
    if not 0 <= staleness <= plan.max_staleness:
        raise RuntimeError(f"Iteration {iteration}'s rollout, generated by policy version {experience.policy_version}"
                           f", reached training at version {engine.policy_version}: {staleness} versions stale, "
                           f"outside the bound 0..{plan.max_staleness} (max_staleness). This is a bug; please "
                           "report it.")
    stats: dict[str, Any] = {SKIPPED_UPDATES: 0.0}
    trains = bool(experience.response_mask.any())  # else every score was skipped: nothing to learn from
    announced: dict[str, dict[str, Any]] = {}
    for role in plan.trainable_roles:
        call = role + ".train"
        if not placement.runs(call):
            continue
        entering(f"iteration {iteration}: call {call}")
        diverged = None
        if trains:
            try:
                role_stats = engine._broadcast_train_stats(role, engine._update(role, experience,
                                                                                engine.wrappers[role]))
            except DivergenceError as err:
                diverged, role_stats = str(err), {}
            stats[SKIPPED_UPDATES] += float(role_stats.pop(SKIPPED_UPDATES, 0.0))
            stats.update({name: float(value) for name, value in role_stats.items()})
        announced[role] = {"stats": {name: float(value) for name, value in role_stats.items()} if trains else {},
                           "diverged": diverged}
    trained = engine._now()
    for scheduler in schedulers:
        scheduler.step()
    learning_rates: dict[str, float] = {}
    for role in announced:
        learning_rates.update(engine.role_learning_rates(role, among_call_ranks=True))
    engine.policy_version += 1
    for role in _published_roles(engine):
        if placement.runs(role + ".train"):
            entering(f"iteration {iteration}: publish {role} version {engine.policy_version}")
            state_of_run.in_flight += placement.publish_weights(
                role, trained_buckets(engine.wrappers[role], engine.shadow_precisions.get(role)))
    store = _store()
    for role, announcement in announced.items():
        if placement.rank == placement.leader(role + ".train"):
            rates = {name: value for name, value in learning_rates.items() if name.startswith(f"lr-{role}")}
            announcement["stats"] = {**announcement["stats"], **rates}
            store.set(_key(placement.namespace, role, engine.policy_version), json.dumps(announcement))
    for role, announcement in announced.items():
        if announcement["diverged"] is not None:
            raise DivergenceError(announcement["diverged"])
    state_of_run.in_flight = placement.pending_sends(state_of_run.in_flight)
    published = engine._now()
    stats.update({"rollout/staleness_mean": float(staleness), "rollout/staleness_max": float(staleness),
                  "rollout/policy_version": float(experience.policy_version),
                  "time/wait_for_rollout_s": received - start, "time/train_s": trained - received,
                  "time/reallocate_s": published - trained,
                  "perf/samples_per_sec": len(experience.sequences) / (published - start)})
    rollout = Rollout(**payload["rollout"])
    return IterationResult(stats, rollout, payload["scores"], learning_rates)


# ---- both sides ----

def settle(engine: RLHFEngine) -> None:
    """A collective of the whole world, where both sides meet (validation, the end of the fit): the generation side
    takes every published version (its shadows then hold the newest weights), and no send stays in flight."""
    placement = engine.placement
    with placement._collective(ACTOR.call("train"), "meeting of the generation and training sides"):
        dist.barrier()  # every iteration before this point ran on both sides, and every version is announced
    if placement.rank in placement.plan.generation_ranks:
        take_published_weights(engine, oldest=engine.policy_version)
    state = engine.free_running_state
    state.in_flight = placement.finish_sends(state.in_flight, "completion of the sends in flight", ACTOR.call("train"))


def _published_roles(engine: RLHFEngine) -> list[str]:
    """Trainable roles with shadow copies: those whose versions the training side publishes."""
    plan = engine.placement.plan
    return [role for role in plan.trainable_roles if plan.shadow_ranks(role)]


def _key(namespace: str, role: str, version: int) -> str:
    return f"{namespace}/{role}/{version}"


def _plain(fields: dict[str, Any]) -> dict[str, Any]:
    """An experience's fields as ``torch.load(weights_only=True)`` reads them back (CPU tensors, numbers)."""
    return {name: value.cpu() if torch.is_tensor(value) else value for name, value in fields.items()}


def _store() -> dist.Store:
    """The job's store (the default process group's), which the heartbeat also uses."""
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()

