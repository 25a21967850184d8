"""``RLHFEngine``: one RLHF iteration on this rank, read top to bottom. Plain PyTorch, no Lightning.

:meth:`RLHFEngine.run_iteration` runs the plan's :class:`~lightning_app_rlhf.engine.iteration.Recipe` (the same one the
planner's cost model prices), phase by phase, for every schedule:

1. **rollout**: generate, then score, then make the experience; with dynamic sampling, again on fresh prompts
   until a batch of informative groups is collected (an explicit loop);
2. **handoff**: a free-running generation side sends the experience to the training side;
3. **update**: each trainable role's train call (:class:`~lightning_app_rlhf.engine.update_loop.UpdateLoop`);
4. **publish**: the learning rates, then the new weights to the generation side.

Each step runs on its group's ranks (the :class:`~lightning_app_rlhf.parallel.placement.Placement` decides which),
through :class:`~lightning_app_rlhf.engine.role_calls.RoleCalls` (which module, wrapper, precision) and the role's
:class:`~lightning_app_rlhf.parallel.wrappers.RoleWrapper`. The caller owns the loop, the optimizers and the
schedulers: :class:`~lightning_app_rlhf.RLHFModule` binds it to Lightning's Trainer and Fabric. The engine owns its
state across iterations (:meth:`RLHFEngine.state_dict`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from lightning_app_rlhf.agents import Environment
from lightning_app_rlhf.agents.episodes import TurnOutcome
from lightning_app_rlhf.algorithms import Algorithm
from lightning_app_rlhf.core.config import AgentConfig, GenerationConfig, PPOConfig
from lightning_app_rlhf.core.role_table import ACTOR, role_of
from lightning_app_rlhf.engine.batch_split import check_batch_split
from lightning_app_rlhf.engine.dynamic_sampling import GroupCollector, check_dynamic_sampling_plan, round_key
from lightning_app_rlhf.engine.experience import RewardShaping, collect_experience
from lightning_app_rlhf.engine.free_running import FreeRunningLink, experience_payload, free_running_result
from lightning_app_rlhf.engine.iteration import Recipe, Step, iteration_recipe
from lightning_app_rlhf.engine.iteration_state import (
    IterationResult,
    IterationState,
    stale_experience,
    staleness_stats,
)
from lightning_app_rlhf.engine.partial_rollout import (
    EpisodeEnvironments,
    PartialRollouts,
    PartialSample,
    check_partial_rollout,
    fill_pool,
)
from lightning_app_rlhf.engine.role_calls import RoleCalls
from lightning_app_rlhf.engine.update_guard import DivergenceError
from lightning_app_rlhf.engine.update_loop import SKIPPED_UPDATES, UpdateLoop
from lightning_app_rlhf.generation import Rollout, model_eos_token_ids, repeat_samples, sample_keys
from lightning_app_rlhf.models.calls import Experience
from lightning_app_rlhf.models.roles import RewardFunction
from lightning_app_rlhf.parallel.heartbeat import entering
from lightning_app_rlhf.parallel.memory import RoleMemory
from lightning_app_rlhf.parallel.placed_roles import Models, PlacedRoles
from lightning_app_rlhf.parallel.placement import Placement, TensorSpec
from lightning_app_rlhf.parallel.reallocation import shadow_buckets
from lightning_app_rlhf.parallel.wrappers import RoleWrapper


class RLHFEngine:
    """One iteration over the roles this rank holds, and the state it carries to the next one.

    Args:
        placed: The placement, and this rank's wrappers and tensor-parallel copies.
        algorithm: Roles, advantages and losses.
        generation: Sampling settings of the training rollouts.
        config: Epochs, minibatches and gradient clipping of the train calls.
        tokenizer: Decodes responses for a reward function; gives the EOS and pad ids.
        shaping: Score shaping and the KL coefficient, stateful across iterations.
        modules: Role -> its module on this rank (None where this rank does not hold it).
        reward_fn: The reward function, when the reward is not a model.
        seed: Keys the sampling noise and the minibatch order.
        precisions: Role -> its precision (``32-true``, ``bf16-mixed``, ``bf16-true``); every call of the role runs
            under its autocast. A role not named keeps the caller's.
        shadow_precisions: Trained role -> ``bf16-true`` where its shadows are held in bfloat16: the weights are
            rounded to bfloat16 before they are sent to them.
        environment: Multi-turn rollouts: the task's environment, copied per episode (None: one response each).
        agent: The episodes' turn and token limits.
    """

    def __init__(
        self,
        placed: PlacedRoles,
        algorithm: Algorithm,
        generation: GenerationConfig,
        config: PPOConfig,
        tokenizer: PreTrainedTokenizerBase,
        shaping: RewardShaping,
        modules: Models,
        reward_fn: RewardFunction | None,
        seed: int,
        precisions: dict[str, str] | None = None,
        shadow_precisions: dict[str, str] | None = None,
        environment: Environment | None = None,
        agent: AgentConfig | None = None,
    ) -> None:
        self.placed, self.algorithm, self.generation, self.config = placed, algorithm, generation, config
        if algorithm is not None:  # a generation config set on the module after the algorithm was built
            algorithm.resolve_num_samples(generation)
        self.tokenizer, self.shaping, self.modules = tokenizer, shaping, modules
        self.calls = RoleCalls(placed, generation, config, tokenizer, modules, reward_fn, seed, precisions or {},
                               shadow_precisions or {}, environment, agent or AgentConfig())
        self.updates = UpdateLoop(self.calls, algorithm, config)
        self.pending_experiences: list[Experience] = []
        """With ``plan.max_staleness`` k above 0 on the fixed schedule: the last k scored rollouts, oldest first; the
        oldest is trained on in the next iteration."""
        self.policy_version = 0
        """Updates the policy has had: the version of the weights that generate the next rollout. Free-running: the
        training side's iterations done there, the version its shadows hold on the generation side."""
        self.iterations_done = 0
        """Iterations this engine has run (or a checkpoint had run)."""
        self.link = FreeRunningLink(placed.placement) if placed.placement.plan.free_running else None
        """With ``plan.free_running``: the transport between the two sides, and what is in flight."""
        self.collector: GroupCollector | None = None
        """With ``ppo.dynamic_sampling``: the informative groups of the current update's generation rounds (empty
        between iterations: an update collects and trains within one :meth:`run_iteration`)."""
        self._checked_prompts: int | None = None
        if config is not None and config.dynamic_sampling:  # (generation-only engines take no config)
            check_dynamic_sampling_plan(self.placement.plan)
            self.collector = GroupCollector(generation.num_samples, config.max_generation_rounds,
                                            tokenizer.pad_token_id)
        self.partial: PartialRollouts | None = None
        """With ``plan.partial_rollout``: the samples in flight across generation calls, the same on every rank that
        gathers the rollout."""
        self.episodes: EpisodeEnvironments | None = None
        """With ``plan.partial_rollout`` and an environment: the environments of the pool's episodes held here."""
        if self.placement.plan.partial_rollout:
            check_partial_rollout(self.collector is not None)
            self.partial = PartialRollouts(generation.num_samples, generation.max_new_tokens,
                                           generation.partial_segment, tokenizer.pad_token_id,
                                           self.calls.agent if environment is not None else None)
            if environment is not None:
                generate = ACTOR.call("generate")
                self.episodes = EpisodeEnvironments(
                    environment, tokenizer, self.calls.agent, self.placement.replicas(generate),
                    self.placement.replica(generate) if self.placement.runs(generate) else None,
                    lambda: [tokenizer.eos_token_id, *model_eos_token_ids(self.calls.call_module(ACTOR.name))])
        self._refill: Callable[[int, int], dict[str, Any]] | None = None
        """This iteration's ``more_prompts`` (:meth:`run_iteration`): where partial rollouts top up their pool."""

    @property
    def placement(self) -> Placement:
        return self.placed.placement

    @property
    def wrappers(self) -> dict[str, RoleWrapper]:
        return self.placed.wrappers

    # ---- one iteration: the recipe, phase by phase ----

    def run_iteration(
        self,
        batch: dict[str, Any],
        iteration: int,
        schedulers: Iterable[Any] = (),
        more_prompts: Callable[[int, int], dict[str, Any]] | None = None,
    ) -> IterationResult:
        """One iteration on the prompts of ``batch``: this rank takes, in order, the steps of the plan's
        :func:`~lightning_app_rlhf.engine.iteration.iteration_recipe` whose ranks include it.

        Args:
            batch: The global batch of prompts (every rank has all of it); each is sampled ``generation.num_samples``
                times.
            iteration: The iteration's number: keys the sampling noise and the minibatch order.
            schedulers: This rank's LR schedulers, stepped once after the updates, before the learning rates are
                broadcast.
            more_prompts: With dynamic sampling: ``(iteration, round) -> batch``, the prompts of a further
                generation round (round 1, 2, ...), the same on every rank (``PromptDataModule.refill_batch``).

        Raises:
            DivergenceError: On every rank (free-running: of the side that meets it), once a role's updates diverged.
        """
        self._refill = more_prompts
        prompts = batch["input_ids"].shape[0]
        if prompts != self._checked_prompts:
            self.check_batch(prompts)
        if self.collector is not None:
            if more_prompts is None:
                raise ValueError("ppo.dynamic_sampling generates on more prompts when a batch has too few "
                                 "informative groups: pass more_prompts (e.g. PromptDataModule.refill_batch).")
            self.collector.clear()  # what an iteration that raised midway had collected
        previous = stale_experience(self.placement.plan, self.pending_experiences)
        recipe = iteration_recipe(self.placement.plan, first=previous is None)
        state = IterationState(repeat_samples(batch, self.generation.num_samples), iteration, self._now(), prompts,
                               iteration, previous, list(schedulers))
        # 1. The rollout: generate, score, make the experience; dynamic sampling repeats it on fresh prompts.
        while True:
            self._run_steps([*recipe.generate, *recipe.beside, *recipe.score], state)
            if self.placement.rank not in recipe.experience_ranks or self._make_experience(state):
                break
            assert self.collector is not None and more_prompts is not None
            generation_round = self.collector.rounds
            state = state.next_round(repeat_samples(more_prompts(iteration, generation_round),
                                                    self.generation.num_samples),
                                     round_key(iteration, generation_round), self._now())
        # 2-4. The handoff (free-running), the update, the publish.
        self._run_steps([*recipe.handoff, *recipe.update, *recipe.publish], state)
        entering(f"iteration {iteration} done: outside the engine (the training loop, callbacks, checkpoints)")
        return self._finish(state, recipe)

    def _run_steps(self, steps: Iterable[Step], state: IterationState) -> None:
        """Take each of ``steps`` whose ranks include this rank, in order; mark the time after each."""
        for step in steps:
            if self.placement.rank in step.ranks:
                entering(f"iteration {state.iteration}: {step.label}")  # a stuck-rank verdict names it
                self.run_step(step, state)
            state.mark(step, self._now)

    def run_step(self, step: Step, state: IterationState) -> None:
        """One step on this rank (one of the step's ranks): the engine's action for it."""
        getattr(self, f"_step_{step.action}")(step, state)

    # ---- the steps ----

    def _step_take(self, step: Step, state: IterationState) -> None:
        assert self.link is not None
        oldest = state.iteration - self.placement.plan.schedule_staleness
        self.policy_version = self.link.take(self.policy_version, oldest,
                                             lambda role: shadow_buckets(self.modules(role)))

    def _step_generate(self, step: Step, state: IterationState) -> None:
        if self.partial is None:  # partial rollouts generate in rounds, each gathered (_partial_rollout)
            state.generated = self.calls.generate_shard(state.batch, state.sampling_key, self.policy_version)

    def _step_gather_rollout(self, step: Step, state: IterationState) -> None:
        if self.partial is not None:
            self._partial_rollout(step, state)
        else:
            state.rollout = self.calls.gather_rollout(state.batch, state.generated, step.among)

    def _partial_rollout(self, step: Step, state: IterationState) -> None:
        """Partial rollouts (:mod:`~lightning_app_rlhf.engine.partial_rollout`), on every rank of the gather: fill the
        pool, decode its unfinished rows in rounds (on the generating ranks), each round gathered, until the call is
        done; then the batch of complete groups becomes the iteration's prompts and rollout."""
        pool, iteration, device = self.partial, state.iteration, self.placement.device
        assert pool is not None
        refill = self._refill

        def more(generation_round: int) -> dict[str, Any]:
            assert refill is not None
            return repeat_samples(refill(iteration, generation_round), self.generation.num_samples)

        def keys(rows: dict[str, Any], generation_round: int) -> torch.Tensor:
            return sample_keys(self.calls.seed, round_key(iteration, generation_round), rows["index"], rows["sample"])

        drawn = fill_pool(pool, state.batch, state.prompts, keys, more if refill is not None else None)
        if self.episodes is not None:
            self.episodes.replay(pool)
            self._reset_episodes(pool.unstarted(), step.among)
        rounds = 0
        while not pool.call_done(state.prompts, self.policy_version):
            entering(f"iteration {iteration}: call actor.generate (partial rollout, round {rounds})")
            rows = pool.unfinished()
            input_ids, attention_mask, row_keys, max_new = pool.round_inputs(rows, device)
            out = self.calls.generate_round(input_ids, attention_mask, row_keys, max_new, self.policy_version,
                                            step.among)
            pool.record(rows, out, self.policy_version)
            if self.episodes is not None:
                self._step_episodes(pool.awaiting_step(), step.among)
                self.episodes.close_finished(pool)
            rounds += 1
        state.marks["generated"] = self._now()
        state.batch, state.rollout, stats = pool.take(state.prompts, device)
        self.calls.batch_rows = len(state.rollout.sequences)
        state.stats.update({**stats, "rollout/partial_rounds": float(rounds),
                            "rollout/partial_refills": float(drawn)})

    def _reset_episodes(self, samples: list[PartialSample], among: str | None) -> None:
        """Multi-turn partial rollouts: the owners of ``samples``' environments reset them
        (:meth:`EpisodeEnvironments.reset`); every rank of the pool takes the rendered prompts."""
        assert self.episodes is not None
        out = self._gather_answers(self.episodes.reset, samples, among,
                                   {"prompt": TensorSpec(torch.long, 2, -1), "seconds": TensorSpec(torch.float64, 1)})
        for i, sample in enumerate(self.episodes.in_gather_order(samples)):
            prompt = out["prompt"][i]
            sample.prompt_ids, sample.started = prompt[prompt >= 0].tolist(), True
            sample.seconds += float(out["seconds"][i])

    def _step_episodes(self, samples: list[PartialSample], among: str | None) -> None:
        """Multi-turn partial rollouts: the owners of ``samples``' environments step them on their ended turns
        (:meth:`EpisodeEnvironments.step`); every rank of the pool applies the answers alike."""
        assert self.partial is not None and self.episodes is not None
        out = self._gather_answers(self.episodes.step, samples, among, {"observation": TensorSpec(torch.long, 2, -1),
                                                                        "outcome": TensorSpec(torch.float64, 2)})
        for i, sample in enumerate(self.episodes.in_gather_order(samples)):
            reward, done, answered, calls, errors, seconds = out["outcome"][i].tolist()
            observation = out["observation"][i]
            self.partial.answer(sample, TurnOutcome(reward, bool(done),
                                                    observation[observation >= 0].tolist() if answered else None,
                                                    int(calls), int(errors), seconds), self.policy_version)

    def _gather_answers(self, ask: Callable[[list[PartialSample]], dict[str, torch.Tensor] | None],
                        samples: list[PartialSample], among: str | None,
                        specs: dict[str, TensorSpec]) -> dict[str, torch.Tensor]:
        """``ask``'s answers for ``samples`` (each rank's for the episodes it owns), gathered to every rank of the pool
        in :meth:`EpisodeEnvironments.in_gather_order`; nothing where there are no samples (the same on every rank
        of the pool: all skip the gather)."""
        if not samples:
            return {name: torch.empty(0) for name in specs}
        assert self.episodes is not None
        entering(f"{type(self.episodes.prototype).__name__}: {ask.__name__} ({len(samples)} episodes)")
        return self.placement.gather_to_world(ACTOR.call("generate"), ask(samples), specs, among)

    def _step_forward(self, step: Step, state: IterationState) -> None:
        role = role_of(step.name)
        assert state.rollout is not None
        state.forwards[role] = self.calls.forward_shard(role, state.rollout, state.batch.get("fields"),
                                                        state.iteration)

    def _step_gather_output(self, step: Step, state: IterationState) -> None:
        role = role_of(step.name)
        assert state.rollout is not None
        state.gathered[role] = self.calls.gather_forward(role, state.forwards.get(role),
                                                         state.rollout.response_mask.shape[1], step.among)

    def _step_send(self, step: Step, state: IterationState) -> None:
        assert self.link is not None and state.experience is not None and state.scores is not None
        self.link.send_experience(experience_payload(vars(state.experience), state.rollout, state.scores),
                                  state.iteration)

    def _step_receive(self, step: Step, state: IterationState) -> None:
        assert self.link is not None
        payload = self.link.receive_experience(state.iteration)
        state.experience = Experience(**payload["experience"]).to(self.placement.device)
        state.rollout, state.scores = Rollout(**payload["rollout"]), payload["scores"]
        state.trained_on = state.experience  # the update makes a new version, whether or not anything is learnt

    def _step_train(self, step: Step, state: IterationState) -> None:
        experience = state.experience_of(step)
        if _learns_from(experience):
            role = role_of(step.name)
            state.trained[role] = self.updates.update(role, experience, self.wrappers[role])

    def _step_stats(self, step: Step, state: IterationState) -> None:
        experience = state.experience_of(step)
        if not _learns_from(experience):
            return
        role = role_of(step.name)
        try:
            stats = self.updates.broadcast_stats(role, state.trained.get(role), among=step.among)
        except DivergenceError as err:
            if not self.placement.plan.free_running:
                raise
            # The generation side learns of it from the version's announcement (publish), then both sides raise.
            state.diverged[role], stats = str(err), {SKIPPED_UPDATES: torch.tensor(0.0)}
        state.add_train_stats(role, stats, experience)

    def _step_lr(self, step: Step, state: IterationState) -> None:
        if not state.schedulers_stepped:
            for scheduler in state.schedulers:
                scheduler.step()
            state.schedulers_stepped = True
        state.learning_rates.update(self.updates.role_learning_rates(role_of(step.name),
                                                                     among_call_ranks=step.among is not None))

    def _step_reallocate(self, step: Step, state: IterationState) -> None:
        if state.trained_on is not None:
            state.reallocated_bytes += self.calls.reallocate(step.name)

    def _step_publish(self, step: Step, state: IterationState) -> None:
        assert self.link is not None
        role = step.name
        rates = {name: value for name, value in state.learning_rates.items() if name.startswith(f"lr-{role}")}
        self.link.publish(role, self.policy_version + 1, self.calls.trained_buckets(role),
                          {**state.role_stats.get(role, {}), **rates}, state.diverged.get(role))

    def _make_experience(self, state: IterationState) -> bool:
        """The experience of the gathered rollout (:func:`collect_experience`); False while dynamic sampling needs
        another generation round."""
        return collect_experience(state, self.algorithm, self.shaping, self.collector, self.policy_version)

    # ---- the end of an iteration ----

    def _finish(self, state: IterationState, recipe: Recipe) -> IterationResult:
        """The state carried to the next iteration, and what this one logs."""
        plan = self.placement.plan
        stats = state.stats
        if plan.overlap and not plan.free_running:
            assert state.experience is not None
            self.pending_experiences = [*self.pending_experiences[state.previous is not None:], state.experience]
        if self.placement.rank in recipe.experience_ranks and "kl/mean" in stats:  # no reference: no KL to control
            assert state.experience is not None
            self.shaping.kl_controller.update(stats["kl/mean"].item(), n_samples=len(state.experience.sequences))
        if state.trained_on is not None:
            stats.update(staleness_stats(self.policy_version, state.trained_on, plan.max_staleness))
            self.policy_version += 1
        self.iterations_done = state.iteration + 1
        if state.diverged:
            raise DivergenceError(next(iter(state.diverged.values())))
        assert state.rollout is not None and state.scores is not None
        if plan.free_running:
            return free_running_result(state, self.link, self.policy_version, self._now())
        assert state.experience is not None
        stats["reallocate/bytes"] = float(state.reallocated_bytes)
        stats.update(state.timings(plan.overlap, len(state.experience.sequences),
                                   state.rollout.response_mask.sum().item()))
        return IterationResult(stats, state.rollout, state.scores, state.learning_rates)

    def check_batch(self, prompts: int) -> None:
        """Raise a ``ValueError`` naming the fix unless ``prompts`` per iteration split over this plan's minibatches,
        ranks and micro-batches (:func:`~lightning_app_rlhf.engine.batch_split.check_batch_split`)."""
        check_batch_split(prompts, self.generation.num_samples, self.config.num_minibatches,
                          self.config.micro_batch_size, self.placement.plan, self.algorithm.trainable_roles)
        self._checked_prompts = prompts

    def _now(self) -> float:
        if self.placement.device.type == "cuda":
            torch.cuda.synchronize(self.placement.device)
        return time.perf_counter()

    def learning_rates(self) -> dict[str, float]:
        """``lr-{role}`` (and ``-momentum``, ``-weight_decay``) of each trained role, on every rank (a collective:
        :meth:`UpdateLoop.learning_rates`)."""
        return self.updates.learning_rates()

    # ---- where both free-running sides meet ----

    def settle(self) -> None:
        """Under a free-running plan, a collective of the whole world (validation, the end of the fit): the
        generation side takes every published version, and no send stays in flight. Nothing to do otherwise."""
        if self.link is not None:
            self.policy_version = self.link.settle(self.policy_version, lambda role: shadow_buckets(self.modules(role)))

    # ---- the state carried across iterations ----

    def state_dict(self) -> dict[str, Any]:
        """What the next iteration needs from the earlier ones: the queue of scored rollouts not trained on yet, the
        policy version, the KL controller and the reward moments (:class:`RewardShaping`), the dynamic-sampling
        collection (empty between iterations), and a free-running generation side's newest update statistics.
        Plain tensors and numbers: a weights-only load reads it. Free-running, a collective of both sides (the
        generation side waits for the saved version's announcement)."""
        free_running = self.link is not None
        state = {
            "pending_experiences": [vars(experience) for experience in self.pending_experiences],
            # Free-running: the version is the iterations done (the training side's count; rank 0 generates).
            "policy_version": self.iterations_done if free_running else self.policy_version,
            "iterations_done": self.iterations_done,
            **self.shaping.state_dict(),
            "collected_groups": self.collector.groups if self.collector is not None else 0,
            "train_stats": {},
            "partial_rollouts": self.partial.state_dict() if self.partial is not None else None,
        }
        if self.link is not None and self.placement.rank in self.placement.plan.generation_ranks:
            # The update that made the saved weights, which the generation side logs with its next rollout.
            state["train_stats"] = self.link.stats_of_version(self.iterations_done)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`, or the RLHF state of a checkpoint from an earlier version (a single
        ``pending_experience``; no version, no iteration count).

        Raises:
            ValueError: The state holds more rollouts not trained on yet than this plan's staleness bound allows.
        """
        pending = state.get("pending_experiences")
        if pending is None:  # saved before bounded staleness: at most one rollout, under "pending_experience"
            pending = [state["pending_experience"]] if state.get("pending_experience") is not None else []
        bound = self.placement.plan.schedule_staleness
        if len(pending) > bound:  # they would never be trained on, or be trained on beyond the bound
            n = len(pending)
            raise ValueError(f"holds {n} scored rollouts not trained on yet (saved with max_staleness {n}), more than "
                             f"this run's plan allows ({bound}). Resume with SeparationStrategy(max_staleness={n}) "
                             f"(--trainer.strategy.max_staleness {n}), or from a checkpoint saved without a "
                             "staleness bound.")
        self.shaping.load_state_dict(state)
        self.pending_experiences = [Experience(**experience).to(self.placement.device) for experience in pending]
        self.policy_version = state.get("policy_version", 0)
        self.iterations_done = state.get("iterations_done", self.policy_version)
        if self.collector is not None:
            self.collector.clear()  # a checkpoint is saved between iterations: nothing was being collected
        if self.partial is not None:
            self.partial.load_state_dict(state.get("partial_rollouts") or {})
        elif state.get("partial_rollouts"):
            raise ValueError("This checkpoint holds partial rollouts in flight (saved with partial_rollout=True); "
                             "resume with the same setting (--trainer.strategy.partial_rollout true), or from a "
                             "checkpoint saved without it.")
        if self.link is not None:
            self.link.load_state_dict(state, self.policy_version)

    def gather_memory(self) -> list[list[RoleMemory]]:
        """Every rank's :class:`RoleMemory` rows (:meth:`RoleCalls.memory_rows`), on every rank (one small object
        all-gather)."""
        mine = self.calls.memory_rows(self.algorithm.roles)
        if not self.placement.distributed:
            return [mine]
        everyone: list[Any] = [None] * self.placement.plan.world_size
        torch.distributed.all_gather_object(everyone, mine)
        return everyone


def _learns_from(experience: Experience | None) -> bool:
    """Whether a train call has anything to learn from: an experience with a valid token (else every score was
    skipped, or there is no earlier rollout yet)."""
    return experience is not None and bool(experience.response_mask.any())
