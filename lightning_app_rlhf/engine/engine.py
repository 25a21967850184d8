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
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from lightning_app_rlhf.algorithms import Algorithm
from lightning_app_rlhf.core.config import GenerationConfig, PPOConfig
from lightning_app_rlhf.core.role_table import ACTOR, CRITIC, REFERENCE, REWARD, role_of
from lightning_app_rlhf.engine.batch_split import check_batch_split
from lightning_app_rlhf.engine.dynamic_sampling import GroupCollector, check_dynamic_sampling_plan, round_key
from lightning_app_rlhf.engine.experience import RewardShaping, make_experience, rollout_stats
from lightning_app_rlhf.engine.free_running import FreeRunningLink, experience_payload
from lightning_app_rlhf.engine.iteration import Recipe, Step, iteration_recipe
from lightning_app_rlhf.engine.iteration_state import IterationResult, IterationState
from lightning_app_rlhf.engine.role_calls import RoleCalls
from lightning_app_rlhf.engine.update_guard import DivergenceError
from lightning_app_rlhf.engine.update_loop import DIVERGED, SKIPPED_UPDATES, UpdateLoop
from lightning_app_rlhf.generation import Rollout, repeat_samples
from lightning_app_rlhf.models.calls import Experience
from lightning_app_rlhf.models.roles import AdapterDisabledReference, RewardFunction
from lightning_app_rlhf.parallel.heartbeat import entering
from lightning_app_rlhf.parallel.memory import RoleMemory, role_memory
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
    ) -> None:
        self.placed, self.algorithm, self.generation, self.config = placed, algorithm, generation, config
        self.tokenizer, self.shaping, self.modules = tokenizer, shaping, modules
        self.calls = RoleCalls(placed, generation, config, tokenizer, modules, reward_fn, seed, precisions or {},
                               shadow_precisions or {})
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

    @property
    def placement(self) -> Placement:
        return self.placed.placement

    @property
    def wrappers(self) -> dict[str, RoleWrapper]:
        return self.placed.wrappers

    @property
    def seed(self) -> int:
        return self.calls.seed

    @seed.setter
    def seed(self, seed: int) -> None:  # a resume restores the checkpoint's
        self.calls.seed = seed

    @property
    def precisions(self) -> dict[str, str]:
        return self.calls.precisions

    @precisions.setter
    def precisions(self, precisions: dict[str, str]) -> None:  # another Trainer may run another precision
        self.calls.precisions = precisions

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
        prompts = batch["input_ids"].shape[0]
        if prompts != self._checked_prompts:
            self.check_batch(prompts)
        if self.collector is not None:
            if more_prompts is None:
                raise ValueError("ppo.dynamic_sampling generates on more prompts when a batch has too few "
                                 "informative groups: pass more_prompts (e.g. PromptDataModule.refill_batch).")
            self.collector.clear()  # what an iteration that raised midway had collected
        previous = self._stale_experience()
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

    def _stale_experience(self) -> Experience | None:
        """With a staleness bound on the fixed schedule, the rollout the update trains on: the oldest of the queue
        once it holds ``k`` (None in the first ``k`` iterations, and without a bound)."""
        plan, queue = self.placement.plan, self.pending_experiences
        if not plan.overlap or plan.free_running or len(queue) < plan.max_staleness:
            return None
        return queue[0]

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
        oldest = state.iteration - self.placement.plan.max_staleness
        self.policy_version = self.link.take(self.policy_version, oldest,
                                             lambda role: shadow_buckets(self.modules(role)))

    def _step_generate(self, step: Step, state: IterationState) -> None:
        state.generated = self.generate_shard(state.batch, state.sampling_key)

    def _step_gather_rollout(self, step: Step, state: IterationState) -> None:
        state.rollout = self.calls.gather_rollout(state.batch, state.generated, step.among)

    def _step_forward(self, step: Step, state: IterationState) -> None:
        role = role_of(step.name)
        assert state.rollout is not None
        state.forwards[role] = self.forward_shard(role, state.rollout, state.batch.get("fields"), state.iteration)

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
            stats = self._broadcast_train_stats(role, state.trained.get(role), among=step.among)
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
        state.learning_rates.update(self.role_learning_rates(role_of(step.name),
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

    # ---- the experience ----

    def _make_experience(self, state: IterationState) -> bool:
        """The algorithm's advantages on the gathered rollout, on every rank that holds it (cheap, and it saves a
        broadcast). With dynamic sampling, on the batch of informative groups the rounds collected, once it is
        complete; until then the round only adds its groups and this returns False (another round follows)."""
        assert state.rollout is not None
        rollout, outputs, kept = state.rollout, state.gathered, None
        state.scores = outputs[REWARD.name]
        collector = self.collector
        if collector is not None:
            self.shaping.finite(state.scores)  # a non-finite score raises here, even in a group that is dropped
            collector.add(state.rollout, outputs, state.scores)
            if not collector.ready(state.prompts):
                return False
            batch = collector.take(state.prompts)
            # The reward and length of every response the rounds generated: the policy's, unfiltered.
            scores = batch.generated_scores
            state.stats.update(rollout_stats(scores, torch.isfinite(scores), batch.generated_lengths))
            if not bool(batch.kept.all()):
                groups = int(batch.kept.sum()) // self.generation.num_samples
                warnings.warn(f"Dynamic sampling found {groups} of {state.prompts} informative groups in "
                              f"{batch.generation_rounds} generation rounds (ppo.max_generation_rounds); iteration "
                              f"{state.iteration} trains on those, the rest of the batch left out of the loss. Most "
                              "groups score alike: raise ppo.max_generation_rounds, or use prompts of mixed "
                              "difficulty.", stacklevel=2)
            rollout, outputs, kept = batch.rollout, batch.outputs, batch.kept
            state.stats.update({"train/filtered_groups": float(batch.filtered_groups),
                                "train/generation_rounds": float(batch.generation_rounds)})
        state.experience, stats = make_experience(rollout, outputs.get(REFERENCE.name), outputs[REWARD.name],
                                                  outputs.get(CRITIC.name), self.algorithm, self.shaping,
                                                  state.iteration, kept)
        state.experience.policy_version = self.policy_version  # the weights that generated it
        if collector is not None:  # the trained batch's own reward: biased by the filter, the policy's is above
            stats = {k: v for k, v in stats.items() if k not in ("reward/std", "response/length_mean")}
            stats["reward/trained_mean"] = stats.pop("reward/mean")
        state.stats.update(stats)
        return True

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
            stats.update(self._staleness(state.trained_on))
            self.policy_version += 1
        self.iterations_done = state.iteration + 1
        if state.diverged:
            raise DivergenceError(next(iter(state.diverged.values())))
        assert state.rollout is not None and state.scores is not None
        if plan.free_running:
            return self._free_running_result(state)
        assert state.experience is not None
        stats["reallocate/bytes"] = float(state.reallocated_bytes)
        stats.update(state.timings(plan.overlap, len(state.experience.sequences),
                                   state.rollout.response_mask.sum().item()))
        return IterationResult(stats, state.rollout, state.scores, state.learning_rates)

    def _free_running_result(self, state: IterationState) -> IterationResult:
        """A free-running side's statistics: the training side's own update; the generation side's rollout, with the
        newest update it took (its statistics and learning rates come from that version's announcement)."""
        assert self.link is not None and state.rollout is not None and state.scores is not None
        stats, end = state.stats, self._now()
        if state.trained_on is not None:  # the training side
            stats["rollout/policy_version"] = float(state.trained_on.policy_version)
            stats.update(state.training_side_timings(end))
            return IterationResult(stats, state.rollout, state.scores, state.learning_rates)
        assert state.experience is not None
        staleness = float(state.iteration - self.policy_version)  # trained on at training iteration `iteration`
        stats.update({"rollout/staleness_mean": staleness, "rollout/staleness_max": staleness,
                      "rollout/policy_version": float(self.policy_version)})
        stats.update({name: value for name, value in self.link.train_stats.items() if not name.startswith("lr-")})
        samples = len(state.experience.sequences)
        stats.update(state.timings(False, samples, state.rollout.response_mask.sum().item()))
        stats["time/wait_for_weights_s"] = state.marks.get("taken", state.start) - state.start
        stats["perf/samples_per_sec"] = samples / (end - state.start)
        rates = {name: value for name, value in self.link.train_stats.items() if name.startswith("lr-")}
        return IterationResult(stats, state.rollout, state.scores, rates)

    def _staleness(self, trained_on: Experience) -> dict[str, float]:
        """How many versions old the policy that generated the trained rollout is; never above the plan's bound."""
        staleness = self.policy_version - trained_on.policy_version
        bound = self.placement.plan.max_staleness
        if not 0 <= staleness <= bound:
            raise RuntimeError(f"Iteration {trained_on.iteration}'s rollout, generated by policy version "
                               f"{trained_on.policy_version}, was trained on at version {self.policy_version}: "
                               f"{staleness} versions stale, outside the bound 0..{bound} (max_staleness). This is a "
                               "bug; please report it.")
        return {"rollout/staleness_mean": float(staleness), "rollout/staleness_max": float(staleness)}

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

    # ---- calls and statistics that the steps and evaluation share ----

    def generate_shard(self, batch: dict[str, Any], iteration: int,
                       generation: GenerationConfig | None = None) -> dict[str, torch.Tensor] | None:
        """``actor.generate`` on this rank's shard (:meth:`RoleCalls.generate_shard`)."""
        return self.calls.generate_shard(batch, iteration, generation)

    def forward_shard(self, role: str, rollout: Rollout, row_fields: dict[str, list[Any]] | None,
                      iteration: int | None = None) -> dict[str, torch.Tensor] | None:
        """``role.forward`` on this rank's shard (:meth:`RoleCalls.forward_shard`)."""
        return self.calls.forward_shard(role, rollout, row_fields, iteration)

    def sample_and_score(
        self, batch: dict[str, Any], iteration: int, generation: GenerationConfig
    ) -> tuple[Rollout, torch.Tensor]:
        """Evaluation: ``actor.generate`` (one response per prompt, with ``generation``) and ``reward.forward`` only,
        each on its group, gathered to every rank. Returns the whole rollout and its raw scores [B]."""
        batch = repeat_samples(batch, 1)
        rollout = self.calls.gather_rollout(batch, self.generate_shard(batch, iteration, generation))
        part = self.forward_shard(REWARD.name, rollout, batch.get("fields"), iteration)
        scores = self.placement.gather_to_world(REWARD.call("forward"), part, {"scores": TensorSpec(torch.float32, 1)})
        return rollout, scores["scores"]

    def _broadcast_train_stats(self, role: str, stats: dict[str, torch.Tensor] | None,
                               among: str | None = None) -> dict[str, torch.Tensor]:
        """``role``'s train statistics (``stats`` on its train ranks, None elsewhere), with
        ``train/skipped_updates``, on every rank (or the ranks of the call ``among``). Raises
        :class:`DivergenceError` on those ranks once the role diverged."""
        call = role + ".train"
        names = (*self.algorithm.stat_names(role), SKIPPED_UPDATES, DIVERGED)
        stats = self.placement.broadcast_stats(call, stats, names, among_call_ranks=among is not None)
        if stats.pop(DIVERGED) > 0:
            wrapper = self.wrappers.get(role)
            raise DivergenceError(self._leader_message(call, wrapper.skipped.diverged if wrapper else None, among))
        return stats

    def _leader_message(self, call: str, message: str | None, among: str | None) -> str:
        """The message of ``call``'s leader, on every rank (an object broadcast, on the error path only)."""
        if self.placement.distributed:
            box = [message]
            group = self.placement.groups.get(among) if among is not None else None
            torch.distributed.broadcast_object_list(box, src=self.placement.leader(call), group=group)
            message = box[0]
        return message or f"{call} diverged."

    def learning_rates(self) -> dict[str, float]:
        """``lr-{role}`` (and ``-momentum``, ``-weight_decay``) of each trained role's first parameter group, on every
        rank, from the ranks that hold its optimizer (a collective: call it on every rank)."""
        rates: dict[str, float] = {}
        for role in self.algorithm.trainable_roles:
            rates.update(self.role_learning_rates(role))
        return rates

    def role_learning_rates(self, role: str, among_call_ranks: bool = False) -> dict[str, float]:
        """:meth:`learning_rates` of one role: a broadcast from its train call's leader (to its train ranks only with
        ``among_call_ranks``)."""
        names = [f"lr-{role}", f"lr-{role}-momentum", f"lr-{role}-weight_decay"]
        mine = None
        if self.placement.runs(f"{role}.train"):
            group = self.wrappers[role].optimizer.param_groups[0]
            momentum = group.get("momentum", group.get("betas", (0.0,))[0])
            values = (group.get("lr", 0.0), momentum, group.get("weight_decay", 0.0))
            mine = {name: torch.tensor(float(v), device=self.placement.device) for name, v in zip(names, values)}
        stats = self.placement.broadcast_stats(f"{role}.train", mine, names, among_call_ranks=among_call_ranks)
        return {name: float(value) for name, value in stats.items()}

    # ---- where both free-running sides meet ----

    def settle(self) -> None:
        """Under a free-running plan, a collective of the whole world (validation, the end of the fit): the
        generation side takes every published version (its shadows then hold the newest weights), and no send stays
        in flight. Nothing to do on the fixed schedule."""
        if self.link is None:
            return
        self.link.meet()
        if self.placement.rank in self.placement.plan.generation_ranks:
            self.policy_version = self.link.take(self.policy_version, self.policy_version,
                                                 lambda role: shadow_buckets(self.modules(role)))
        self.link.finish_sends()

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
        bound = self.placement.plan.max_staleness
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
        if self.link is not None:
            self.link.load_state_dict(state, self.policy_version)

    # ---- memory ----

    def gather_memory(self) -> list[list[RoleMemory]]:
        """Every rank's :class:`RoleMemory` rows, on every rank (one small object all-gather)."""
        mine = []
        for role in self.algorithm.roles:
            module = self.modules(role)
            if module is None:
                continue
            calls = [call.split(".")[1] for call in self.placement.plan.calls
                     if call.startswith(role + ".") and self.placement.runs(call)]
            if isinstance(module, AdapterDisabledReference):  # runs on the actor's weights, counted there
                mine.append(RoleMemory(role, "+".join(calls), 0, 0, 0, shares=ACTOR.name))
                continue
            mine.append(role_memory(role, calls, module, self.wrappers.get(role)))
        for call, copy in self.placed.tp_copies.items():
            role, kind = call.split(".")
            mine.append(RoleMemory(role, kind, copy.local_bytes(), 0, 0, tp_copy=self.placement.plan.tp_degree(call)))
        if not self.placement.distributed:
            return [mine]
        everyone: list[Any] = [None] * self.placement.plan.world_size
        torch.distributed.all_gather_object(everyone, mine)
        return everyone


def _learns_from(experience: Experience | None) -> bool:
    """Whether a train call has anything to learn from: an experience with a valid token (else every score was
    skipped, or there is no earlier rollout yet)."""
    return experience is not None and bool(experience.response_mask.any())
