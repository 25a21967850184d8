"""``RLHFEngine``: one RLHF iteration on this rank. Plain PyTorch, no Lightning.

:meth:`RLHFEngine.run_iteration` is the one place that runs an iteration: it takes, in order, the steps that
:func:`~lightning_app_rlhf.engine.iteration.iteration_steps` lists for the plan (the same steps the planner's cost model
prices): generate, gather the rollout, the forward calls and their gathers, the advantages (the algorithm's), the
train calls and their statistics, the reallocations, the learning rates. Each call runs on its group's ranks (the
:class:`~lightning_app_rlhf.parallel.placement.Placement` decides which), through its role's
:class:`~lightning_app_rlhf.parallel.wrappers.RoleWrapper` (backward, clipping, step, full parameters). The caller owns the
loop, the optimizers and the schedulers: :class:`~lightning_app_rlhf.RLHFModule` binds it to Lightning's Trainer and
Fabric.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from lightning_app_rlhf.algorithms import Algorithm, LossScale
from lightning_app_rlhf.algorithms.functional import rollout_correction
from lightning_app_rlhf.core.config import GenerationConfig, PPOConfig
from lightning_app_rlhf.core.role_table import ACTOR, CRITIC, REFERENCE, REWARD
from lightning_app_rlhf.engine import free_running
from lightning_app_rlhf.engine.batch_split import check_batch_split, micro_batch_count
from lightning_app_rlhf.engine.dynamic_sampling import GroupCollector, check_dynamic_sampling_plan, round_key
from lightning_app_rlhf.engine.experience import RewardShaping, make_experience, rollout_stats
from lightning_app_rlhf.engine.iteration import FORWARD_ROLES, Step, iteration_steps
from lightning_app_rlhf.engine.update_guard import (
    GRAD_NORM,
    LOSS_TERMS,
    DivergenceError,
    divergence_message,
    first_nonfinite,
    record_update,
    skip_message,
)
from lightning_app_rlhf.generation import Rollout, generate, model_eos_token_ids, repeat_samples, sample_keys
from lightning_app_rlhf.models.calls import (
    Experience,
    critic_forward,
    critic_values,
    minibatch_permutation,
    policy_logprobs,
    reference_forward,
    reward_forward,
    split_minibatches,
)
from lightning_app_rlhf.models.roles import AdapterDisabledReference, RewardFunction, precision_context
from lightning_app_rlhf.parallel.heartbeat import entering
from lightning_app_rlhf.parallel.memory import RoleMemory, role_memory
from lightning_app_rlhf.parallel.placed_roles import Models, PlacedRoles
from lightning_app_rlhf.parallel.placement import Placement, TensorSpec
from lightning_app_rlhf.parallel.reallocation import shadow_buckets, trained_buckets
from lightning_app_rlhf.parallel.tensor_parallel import TensorParallelCopy, received_bytes
from lightning_app_rlhf.parallel.wrappers import RoleWrapper

FORWARD_OUTPUTS = {REFERENCE.name: ("ref_logprobs", 2), REWARD.name: ("scores", 1), CRITIC.name: ("values", 2)}
"""Forward role -> the tensor its call produces and that tensor's number of dimensions."""
SKIPPED_UPDATES = "train/skipped_updates"
"""A train call's statistic: its optimizer updates skipped in the iteration (a non-finite loss or gradient norm)."""
_DIVERGED = "train/diverged"
"""Sent with a train call's statistics, so that every rank raises the :class:`DivergenceError`, not only its group."""


@dataclass
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
            under its autocast (:func:`~lightning_app_rlhf.models.roles.precision_context`). A role not named keeps the
            caller's.
        shadow_precisions: Trained role -> ``bf16-true`` where its shadows are held in bfloat16: the weights are
            rounded to bfloat16 before they are sent to them.
    """

    placed: PlacedRoles
    algorithm: Algorithm
    generation: GenerationConfig
    config: PPOConfig
    tokenizer: PreTrainedTokenizerBase
    shaping: RewardShaping
    modules: Models
    reward_fn: RewardFunction | None
    seed: int
    precisions: dict[str, str] = field(default_factory=dict)
    shadow_precisions: dict[str, str] = field(default_factory=dict)
    pending_experiences: list[Experience] = field(default_factory=list, init=False)
    """With ``plan.max_staleness`` k above 0: the last k scored rollouts, oldest first; the oldest is trained on
    in the next iteration (checkpointed)."""
    policy_version: int = field(default=0, init=False)
    """Updates the policy has had: the version of the weights that generate the next rollout (checkpointed). Free-
    running: the training side's iterations done there, the version its shadows hold on the generation side."""
    free_running_state: free_running.FreeRunningState = field(default_factory=free_running.FreeRunningState,
                                                              init=False)
    """With ``plan.free_running``: the sends in flight and the newest update's statistics
    (:mod:`~lightning_app_rlhf.engine.free_running`)."""
    _checked_prompts: int | None = field(default=None, init=False, repr=False)
    """The batch size :func:`check_batch_split` last passed (checked again only when it changes)."""
    _batch_rows: int = field(default=0, init=False, repr=False)
    """Rows of the rollout being scored (the train call's one minibatch)."""
    _kept_values: KeptValues | None = field(default=None, init=False, repr=False)
    """The critic's scoring forward of this iteration, with its graph, kept for its train call
    (:attr:`reuses_critic_forward`)."""
    collector: GroupCollector | None = field(default=None, init=False)
    """With ``ppo.dynamic_sampling``: the informative groups of the current update's generation rounds (empty
    between iterations: an update collects and trains within one :meth:`run_iteration`)."""

    def __post_init__(self) -> None:
        if self.config is None or not self.config.dynamic_sampling:  # (generation-only engines take no config)
            return
        check_dynamic_sampling_plan(self.placement.plan)
        self.collector = GroupCollector(self.generation.num_samples, self.config.max_generation_rounds,
                                        self.tokenizer.pad_token_id)

    @property
    def placement(self) -> Placement:
        return self.placed.placement

    @property
    def wrappers(self) -> dict[str, RoleWrapper]:
        return self.placed.wrappers

    # ---- one iteration: the steps of iteration_steps(plan), in order ----

    def run_iteration(
        self,
        batch: dict[str, Any],
        iteration: int,
        schedulers: Iterable[Any] = (),
        more_prompts: Callable[[int, int], dict[str, Any]] | None = None,
    ) -> IterationResult:
        """One iteration on the prompts of ``batch``: this rank takes, in order, the steps of
        :func:`~lightning_app_rlhf.engine.iteration.iteration_steps` whose ranks include it. Each step is a
        collective on its ranks.

        With dynamic sampling (``ppo.dynamic_sampling``), the generation and scoring steps run again, on
        ``more_prompts(iteration, round)``, until the rounds collected a batch's worth of informative groups (or
        ``ppo.max_generation_rounds`` rounds ran); the rest of the steps then train on those.

        Args:
            batch: The global batch of prompts (every rank has all of it); each is sampled ``generation.num_samples``
                times.
            iteration: The iteration's number: keys the sampling noise and the minibatch order.
            schedulers: This rank's LR schedulers, stepped once after the updates, before the learning rates are
                broadcast.
            more_prompts: With dynamic sampling: ``(iteration, round) -> batch``, the prompts of a further
                generation round (round 1, 2, ...), the same on every rank (``PromptDataModule.refill_batch``).

        Raises:
            DivergenceError: On every rank, once a role's updates diverged.
        """
        prompts = batch["input_ids"].shape[0]
        if prompts != self._checked_prompts:
            self.check_batch(prompts)
        if self.placement.plan.free_running:
            return free_running.run_iteration(self, batch, iteration, schedulers)
        if self.collector is not None and more_prompts is None:
            raise ValueError("ppo.dynamic_sampling generates on more prompts when a batch has too few informative "
                             "groups: pass more_prompts (e.g. PromptDataModule.refill_batch).")
        if self.collector is not None:
            self.collector.clear()  # what an iteration that raised midway had collected
        plan = self.placement.plan
        state = IterationState(repeat_samples(batch, self.generation.num_samples), iteration, self._now(), prompts,
                               iteration)
        # With a staleness bound k, the train steps work on the rollout of k iterations ago: none in the first k.
        queue = self.pending_experiences
        previous = queue[0] if plan.overlap and len(queue) == plan.max_staleness else None
        steps = iteration_steps(plan, first=plan.overlap and previous is None)
        taken = 0
        while taken < len(steps):
            step = steps[taken]
            if self.placement.rank in step.ranks:
                entering(f"iteration {iteration}: {step.kind} {step.name}")  # a stuck-rank verdict names it
                self._run_step(step, state, previous, schedulers)
            state.mark(step, self._now)
            taken += 1
            if state.collecting:  # too few informative groups so far: generate and score another batch of prompts
                assert self.collector is not None and more_prompts is not None
                generation_round = self.collector.rounds
                state = state.next_round(repeat_samples(more_prompts(iteration, generation_round),
                                                        self.generation.num_samples),
                                         round_key(iteration, generation_round), self._now())
                taken = 0  # dynamic sampling runs without overlap: the steps start with generation and scoring
        entering(f"iteration {iteration} done: outside the engine (the training loop, callbacks, checkpoints)")
        assert state.rollout is not None and state.experience is not None and state.scores is not None
        if plan.overlap:
            self.pending_experiences = [*queue[previous is not None :], state.experience]
        stats = state.stats
        stats["reallocate/bytes"] = float(state.reallocated_bytes)
        if state.trained_on is not None:
            stats.update(self._staleness(state.trained_on))
            self.policy_version += 1
        if "kl/mean" in stats:  # without a reference there is no KL to control
            self.shaping.kl_controller.update(stats["kl/mean"].item(), n_samples=len(state.experience.sequences))
        stats.update(state.timings(plan.overlap, len(state.experience.sequences),
                                   state.rollout.response_mask.sum().item()))
        return IterationResult(stats, state.rollout, state.scores, state.learning_rates)

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

    def _run_step(
        self, step: Step, state: IterationState, previous: Experience | None, schedulers: Iterable[Any]
    ) -> None:
        """One step of the iteration on this rank (it is one of the step's ranks)."""
        role = step.name.split(".")[0]
        experience = previous if step.previous_rollout else state.experience
        trains = experience is not None and bool(experience.response_mask.any())  # else every score was skipped
        if step.kind == "call" and step.name == ACTOR.call("generate"):
            state.generated = self.generate_shard(state.batch, state.sampling_key)
        elif step.kind == "gather" and step.name == ACTOR.call("generate"):
            state.rollout = self.gather_rollout(state.batch, state.generated, state.among)
            self._batch_rows = len(state.rollout.sequences)
        elif step.kind == "call" and step.name.endswith(".forward"):
            state.forwards[role] = self.forward_shard(role, state.rollout, state.batch.get("fields"), state.iteration)
        elif step.kind == "gather":
            name, ndim = FORWARD_OUTPUTS[role]
            spec = {name: TensorSpec(torch.float32, ndim)}
            out = self.placement.gather_to_world(step.name, state.forwards.get(role), spec, state.among)
            state.gathered[role] = out[name][:, : state.rollout.response_mask.shape[1]] if ndim == 2 else out[name]
            if len(state.gathered) == sum(r in self.placement.plan.roles for r in FORWARD_ROLES):
                self._make_experience(state)
        elif step.kind == "call" and trains:  # a train call
            state.trained[role] = self._update(role, experience, self.wrappers[role])
        elif step.kind == "broadcast" and step.what == "stats" and trains:
            state.add_train_stats(self._broadcast_train_stats(role, state.trained.get(role)), experience)
        elif step.kind == "reallocate" and state.trained_on is not None:
            state.reallocated_bytes += self._reallocate(role)
        elif step.kind == "broadcast" and step.what == "lr":
            if not state.schedulers_stepped:
                for scheduler in schedulers:
                    scheduler.step()
                state.schedulers_stepped = True
            state.learning_rates.update(self.role_learning_rates(role))

    def _make_experience(self, state: IterationState) -> None:
        """The algorithm's advantages on the gathered rollout, on every rank (cheap, and it saves a broadcast). With
        dynamic sampling, on the batch of informative groups the rounds collected, once it is complete; until
        then the round only adds its groups (``state.collecting``)."""
        rollout, outputs, kept = state.rollout, state.gathered, None
        state.scores = outputs[REWARD.name]
        collector = self.collector
        if collector is not None:
            self.shaping.finite(state.scores)  # a non-finite score raises here, even in a group that is dropped
            collector.add(state.rollout, outputs, state.scores)
            if not collector.ready(state.prompts):
                state.collecting = True
                return
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

    def _now(self) -> float:
        if self.placement.device.type == "cuda":
            torch.cuda.synchronize(self.placement.device)
        return time.perf_counter()

    # ---- actor.generate ----

    def generate_shard(
        self, batch: dict[str, Any], iteration: int, generation: GenerationConfig | None = None
    ) -> dict[str, torch.Tensor] | None:
        """``actor.generate`` on this rank's shard of the global batch (no collective), with ``generation`` (default:
        the training rollouts' settings); None off its group."""
        call = ACTOR.call("generate")
        if not self.placement.runs(call):
            return None
        rows = self.placement.shard(call, batch["input_ids"].shape[0])
        with self._running(ACTOR.name):
            part = self._generate(batch, rows, iteration, generation or self.generation)
        return {"responses": part.responses, "response_mask": part.response_mask, "logprobs": part.logprobs,
                "stopped": part.stopped.to(torch.uint8)}

    def _generate(self, batch: dict[str, Any], rows: slice, iteration: int, generation: GenerationConfig) -> Rollout:
        """The actor's responses for ``rows``: each stops at the tokenizer's EOS, any end id of the actor's
        generation config, ``generation.stop_token_ids`` or ``generation.stop_strings``."""
        actor = self._call_module(ACTOR.name)
        lockstep = self._lockstep_group(ACTOR.name)
        # The hybrid engine: a sharded actor generating on its own train group gathers its weights once for the
        # rollout (plan.unshard_for_generation); its forwards then gather nothing, and under FSDP2 run no collective
        # at all, so its ranks need not decode in lockstep.
        once = self.placement.plan.unshard_for_generation and lockstep is not None and self._tp_copy(ACTOR.name) is None
        wrapper = self.wrappers.get(ACTOR.name) if once else None
        if wrapper is not None and not wrapper.lockstep_when_unsharded:
            lockstep = None
        with wrapper.unsharded() if wrapper is not None else contextlib.nullcontext():
            return generate(
                actor,
                batch["input_ids"][rows],
                batch["attention_mask"][rows],
                generation,
                sample_keys(self.seed, iteration, batch["index"][rows], batch["sample"][rows]),
                eos_token_id=[self.tokenizer.eos_token_id, *model_eos_token_ids(actor)],
                pad_token_id=self.tokenizer.pad_token_id,
                lockstep_group=lockstep,
                tokenizer=self.tokenizer,
                inference_mode=self._inference_mode(ACTOR.name),
            )

    def gather_rollout(self, batch: dict[str, Any], local: dict[str, torch.Tensor] | None,
                       among: str | None = None) -> Rollout:
        """Every rank (or every rank of the call ``among``) receives the whole rollout from the shards of
        ``actor.generate``'s ranks."""
        specs = {
            "responses": TensorSpec(torch.long, 2, self.tokenizer.pad_token_id),
            "response_mask": TensorSpec(batch["attention_mask"].dtype, 2),
            "logprobs": TensorSpec(torch.float32, 2),
            "stopped": TensorSpec(torch.uint8, 1),
        }
        out = self.placement.gather_to_world(ACTOR.call("generate"), local, specs, among)
        return Rollout.from_responses(batch["input_ids"], batch["attention_mask"], out["responses"],
                                      out["response_mask"], out["logprobs"], out["stopped"].bool())

    # ---- forward calls ----

    def sample_and_score(
        self, batch: dict[str, Any], iteration: int, generation: GenerationConfig
    ) -> tuple[Rollout, torch.Tensor]:
        """Evaluation: ``actor.generate`` (one response per prompt, with ``generation``) and ``reward.forward`` only,
        each on its group, gathered to every rank. Returns the whole rollout and its raw scores [B]."""
        batch = repeat_samples(batch, 1)
        rollout = self.gather_rollout(batch, self.generate_shard(batch, iteration, generation))
        part = self.forward_shard(REWARD.name, rollout, batch.get("fields"), iteration)
        scores = self.placement.gather_to_world(REWARD.call("forward"), part, {"scores": TensorSpec(torch.float32, 1)})
        return rollout, scores["scores"]

    def forward_shard(
        self, role: str, rollout: Rollout, row_fields: dict[str, list[Any]] | None, iteration: int | None = None
    ) -> dict[str, torch.Tensor] | None:
        """``role.forward`` on this rank's shard of the rollout (no collective); None off its group. ``iteration``
        is named by a failing reward function's error."""
        call = role + ".forward"
        if not self.placement.runs(call):
            return None
        rows = self.placement.shard(call, len(rollout.sequences))
        with self._running(role):
            return {FORWARD_OUTPUTS[role][0]: self._forward(role, rollout.select(rows), rows, row_fields, iteration)}

    def _forward(
        self, role: str, shard: Rollout, rows: slice, row_fields: dict[str, list[Any]] | None, iteration: int | None
    ) -> torch.Tensor:
        chunks = {"batch_size": self.generation.batch_size, "lockstep_group": self._lockstep_group(role),
                  "inference_mode": self._inference_mode(role)}
        if role == REFERENCE.name:
            return reference_forward(self._call_module(role), shard, self.generation.temperature, **chunks,
                                     padding_free=self.config.padding_free)
        if role == REWARD.name:
            fields = {name: values[rows] for name, values in (row_fields or {}).items()}
            return reward_forward(self._call_module(role) or self.reward_fn, shard, self.tokenizer, fields,
                                  iteration=iteration, **chunks)
        if self.reuses_critic_forward and iteration is not None:
            return self._kept_critic_forward(shard, rows, iteration)
        return critic_forward(self._call_module(role), shard, **chunks)

    @property
    def reuses_critic_forward(self) -> bool:
        """Whether the critic's scoring forward is also its training forward (``ppo.reuse_critic_forward``): one epoch
        and one minibatch (the train call's only forward sees the weights the scoring forward saw), the same ranks for
        both calls and one plain forward per rank (``ddp``, no chunks, no micro-batches, no tensor-parallel degree),
        and no one-step overlap (which trains on the previous rollout). The same answer on every rank."""
        plan, config, critic = self.placement.plan, self.config, CRITIC.name
        if not (config.reuse_critic_forward and critic in self.algorithm.trainable_roles and config.ppo_epochs == 1
                and config.num_minibatches == 1 and not plan.overlap):
            return False
        forward, train = critic + ".forward", critic + ".train"
        ranks = plan.ranks(train)
        if list(plan.ranks(forward)) != list(ranks) or plan.wrappers.get(critic, "ddp") != "ddp":
            return False
        if any(plan.tp.get(call, 1) > 1 for call in (forward, train)):
            return False
        largest_shard = -(-self._batch_rows // len(ranks)) if self._batch_rows else 0
        one_chunk = self.generation.batch_size is None or self.generation.batch_size >= largest_shard
        return one_chunk and micro_batch_count(self._batch_rows, len(ranks), config.micro_batch_size) == 1

    def _kept_critic_forward(self, shard: Rollout, rows: slice, iteration: int) -> torch.Tensor:
        """The critic's values on this rank's shard, through its train module with gradients: the graph is kept for
        ``critic.train`` (:meth:`_accumulate_gradients`); the scores are the detached values, masked."""
        with torch.enable_grad():
            values = critic_values(self.wrappers[CRITIC.name].train_module, shard)
        self._kept_values = KeptValues(iteration, rows, values)
        return values.detach() * shard.response_mask

    def _wrapper_of(self, role: str) -> RoleWrapper | None:
        """The wrapper whose weights a call of ``role`` runs on here: the role's own, or for a LoRA actor's
        reference (its base, adapters off) the actor's."""
        wrapper = self.wrappers.get(role)
        if wrapper is None and isinstance(self.modules(role), AdapterDisabledReference):
            wrapper = self.wrappers.get(ACTOR.name)
        return wrapper

    @contextlib.contextmanager
    def _running(self, role: str) -> Iterator[None]:
        """A wrapper's context around a call of ``role`` on this rank (DeepSpeed's group scope), if it has one (none
        around a tensor-parallel copy, which runs outside the wrapper); inside it, the role's autocast."""
        wrapper = self._wrapper_of(role) if self._tp_copy(role) is None else None
        with wrapper.running() if wrapper is not None else contextlib.nullcontext(), self._precision(role):
            yield

    def _precision(self, role: str) -> contextlib.AbstractContextManager[None]:
        """``role``'s autocast (:func:`~lightning_app_rlhf.models.roles.precision_context`); the caller's when it has no
        precision here."""
        precision = self.precisions.get(role)
        return precision_context(precision, self.placement.device) if precision else contextlib.nullcontext()

    def _inference_mode(self, role: str) -> bool:
        """Whether ``role``'s generate / forward calls here run under ``torch.inference_mode`` (less per-op work than
        ``torch.no_grad``, the same numbers): on its own module, where its wrapper allows it
        (:attr:`~lightning_app_rlhf.parallel.wrappers.base.RoleWrapper.forwards_in_inference_mode`); a
        tensor-parallel copy's calls stay under ``torch.no_grad``."""
        if self._tp_copy(role) is not None:
            return False
        wrapper = self._wrapper_of(role)
        return wrapper is None or wrapper.forwards_in_inference_mode

    def _lockstep_group(self, role: str) -> torch.distributed.ProcessGroup | None:
        """The group over which ``role``'s weights are sharded here, whose ranks must run the same number of
        forwards (each gathers weights collectively); None when this rank holds them whole. For a call with a
        tensor-parallel degree: its replica's group (every forward is a collective over it)."""
        copy = self._tp_copy(role)
        if copy is not None:
            return self.placement.tp_group(copy.call)
        wrapper = self._wrapper_of(role)
        if wrapper is None or not wrapper.shards_params or wrapper.group_size == 1:
            return None
        return wrapper.group

    # ---- which module a call runs: the role's own, or its tensor-parallel copy ----

    def _tp_copy(self, role: str) -> TensorParallelCopy | None:
        """This rank's tensor-parallel copy for ``role``'s generate / forward call (None: the call runs on the role's
        own module)."""
        call = ACTOR.call("generate") if role == ACTOR.name else role + ".forward"
        return self.placed.tp_copies.get(call)

    def _call_module(self, role: str) -> nn.Module | None:
        """The module ``role``'s generate / forward call runs on here: its tensor-parallel copy (given the current
        trained weights first if it has none yet, e.g. after a resume) or the role's own module."""
        copy = self._tp_copy(role)
        if copy is None:
            return self.modules(role)
        if copy.stale:
            self._refresh_layout(role, copy)
        return copy.module

    def _refresh_layout(self, role: str, copy: TensorParallelCopy) -> int:
        """Redistribute ``role``'s current trainable weights into ``copy``'s tensor-parallel layout, bit for bit
        (ReaLHF's parameter reallocation); returns the bytes this rank received for it.

        On the role's train ranks the weights come whole from its wrapper, a bucket at a time (an all-gather over the
        train group per bucket when sharded, where every train rank runs the call: the plan's rule for sharded roles);
        on a shadow rank from the shadow, refreshed just before. Each rank keeps only its slice: no further
        transfer, and a sharded role is never whole on a rank."""
        call = role + ".train"
        if self.placement.runs(call):
            wrapper = self.wrappers[role]
            received = received_bytes(p for p in wrapper.module.parameters() if p.requires_grad)
            with self.placement._collective(copy.call, "weight reallocation into the tensor-parallel layout"), \
                    wrapper.running():
                copy.load(itertools.chain.from_iterable(wrapper.full_parameter_buckets()))
            return received
        copy.load([p for p in self.modules(role).parameters() if p.requires_grad])
        return 0

    # ---- train calls ----

    def _broadcast_train_stats(self, role: str, stats: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
        """``role``'s train statistics (``stats`` on its train ranks, None elsewhere), with
        ``train/skipped_updates``, on every rank. Raises :class:`DivergenceError` on every rank once the role
        diverged."""
        call = role + ".train"
        names = (*self.algorithm.stat_names(role), SKIPPED_UPDATES, _DIVERGED)
        # Free-running: among the train ranks only (the generation side reads them from the version's announcement).
        stats = self.placement.broadcast_stats(call, stats, names, among_call_ranks=self.placement.plan.free_running)
        if stats.pop(_DIVERGED) > 0:
            wrapper = self.wrappers.get(role)
            raise DivergenceError(self._leader_message(call, wrapper.skipped.diverged if wrapper else None))
        return stats

    def _update(self, role: str, experience: Experience, wrapper: RoleWrapper) -> dict[str, torch.Tensor]:
        """Epochs over global minibatches. Each of the D ranks of the train group takes 1/D of every minibatch,
        in micro-batches, and divides by the whole minibatch's sizes; the wrapper averages gradients over D
        ranks, so the loss is scaled by D. The update is the same whatever D and the micro-batch size are. A
        minibatch with no valid token takes no step, nor does one whose loss or gradient norm is not finite
        (:meth:`_guarded_step`); after ``ppo.max_consecutive_skipped_updates`` of those in a row the role stops.
        The statistics average the minibatches that stepped (NaN when every one was skipped)."""
        call = role + ".train"
        names = self.algorithm.stat_names(role)
        mismatch: dict[str, torch.Tensor] = {}
        if role == ACTOR.name and self.config.recompute_old_logprobs:
            experience, mismatch = self._recompute_old_logprobs(experience, wrapper)
        totals = torch.zeros(len(names), device=experience.advantages.device)
        steps = skipped = 0
        wrapper.skipped.diverged = None  # a divergence that the caller caught does not stop a later fit at once
        for epoch, number, indices in self._minibatches(experience):
            if experience.response_mask[indices].sum() == 0:
                continue  # every sample skipped: AdamW would still move the weights (momentum, decay)
            # Summed over the group: a non-finite loss on any rank is non-finite on all, so all skip together.
            summed = self.placement.all_reduce_sum(call, self._accumulate_gradients(role, experience, wrapper,
                                                                                    indices, names))
            where = f"iteration {experience.iteration} (epoch {epoch}, minibatch {number})"
            if self._guarded_step(role, wrapper, dict(zip(("loss", *names), summed.tolist())), where):
                totals += summed[1:]
                steps += 1
            else:
                skipped += 1
            if wrapper.skipped.diverged is not None:
                break
        if role == CRITIC.name:
            self._kept_values = None  # not kept past its train call, used or not
        means = totals / steps if steps else totals.fill_(math.nan if skipped else 0.0)
        flags = torch.tensor([float(skipped), float(wrapper.skipped.diverged is not None)], device=totals.device)
        return {**dict(zip(names, means)), **mismatch, SKIPPED_UPDATES: flags[0], _DIVERGED: flags[1]}

    def _recompute_old_logprobs(
        self, experience: Experience, wrapper: RoleWrapper
    ) -> tuple[Experience, dict[str, torch.Tensor]]:
        """``ppo.recompute_old_logprobs``: the trainer's log-probabilities of the whole rollout before this update,
        each replica of the train group computing its share (in micro-batches, as the loss's forward) and the group
        summing them; then :func:`~lightning_app_rlhf.algorithms.functional.rollout_correction`. Returns the
        experience the actor learns from (the trainer's old log-probabilities, ``rollout_is``'s weights or mask)
        and the mismatch statistics. The shared experience is left as it is: the critic trains on it too."""
        call = ACTOR.call("train")
        rows = torch.arange(len(experience.sequences), device=experience.advantages.device)
        ranks = self.placement.replicas(call)
        share = rows.tensor_split(ranks)[self.placement.replica(call)]
        trainer = torch.zeros_like(experience.logprobs, dtype=torch.float32)
        with torch.no_grad(), self._precision(ACTOR.name):
            for part in share.tensor_split(micro_batch_count(len(rows), ranks, self.config.micro_batch_size)):
                logprobs, _ = policy_logprobs(wrapper.train_module, experience.minibatch(part),
                                              self.generation.temperature, entropy_grad=False,
                                              padding_free=self.config.padding_free)
                trainer[part] = logprobs.float()
        trainer = self.placement.all_reduce_sum(call, trainer) * experience.response_mask
        config = self.config
        weights, mask, stats = rollout_correction(trainer, experience.logprobs, experience.response_mask,
                                                  config.rollout_is, config.rollout_is_level,
                                                  config.rollout_is_threshold)
        return dataclasses.replace(experience, logprobs=trainer, response_mask=mask, is_weights=weights), stats

    def _minibatches(self, experience: Experience) -> Iterator[tuple[int, int, torch.Tensor]]:
        """``(epoch, minibatch number, sample indices)`` of every minibatch of every epoch, in training order."""
        for epoch in range(self.config.ppo_epochs):
            order = minibatch_permutation(len(experience.sequences), self.seed, experience.iteration, epoch)
            for number, indices in enumerate(split_minibatches(order, self.config.num_minibatches)):
                yield epoch, number, indices

    def _accumulate_gradients(
        self, role: str, experience: Experience, wrapper: RoleWrapper, indices: torch.Tensor, names: tuple[str, ...]
    ) -> torch.Tensor:
        """Forward and backward of this rank's share of one minibatch, in micro-batches. Returns ``[loss, *stats]``
        (``names`` order) summed over its micro-batches: each is already a share of the whole minibatch's."""
        call = role + ".train"
        # Data-parallel shares: one per tensor-parallel replica (one per rank without a degree).
        ranks, my_rank = self.placement.replicas(call), self.placement.replica(call)
        scale = LossScale(experience.response_mask[indices].sum().float(), len(indices),
                          self.generation.max_new_tokens)
        shard = indices.tensor_split(ranks)[my_rank]
        micro = shard.tensor_split(micro_batch_count(len(indices), ranks, self.config.micro_batch_size))
        sums = torch.zeros(1 + len(names), device=experience.advantages.device)
        kept = self._kept_values if role == CRITIC.name else None
        reused = kept is not None and kept.iteration == experience.iteration
        if reused:
            # The scoring forward was this one (reuses_critic_forward): this rank's loss on the rows it scored. The
            # group's summed gradient is the same whichever rank takes which rows (the scale is the minibatch's).
            micro = [torch.arange(kept.rows.start, kept.rows.stop, device=indices.device)]
        for i, rows in enumerate(micro):
            with wrapper.accumulating(last=i == len(micro) - 1):
                batch = experience.minibatch(rows)
                with self._precision(role):
                    if role == CRITIC.name:
                        # The scoring forward's values, graph kept, or this micro-batch's forward: one loss for both.
                        values = kept.values if reused else critic_values(wrapper.train_module, batch)
                        loss, stats = self.algorithm.value_loss(values, batch, scale)
                    else:
                        # No entropy term in the loss: the entropy is only logged, so no graph for it (backward
                        # skips a vocabulary pass).
                        logprobs, entropy = policy_logprobs(wrapper.train_module, batch, self.generation.temperature,
                                                            entropy_grad=self.config.entropy_coef != 0,
                                                            padding_free=self.config.padding_free)
                        loss, stats = self.algorithm.policy_loss(logprobs, entropy, batch, scale)
                wrapper.backward(loss * ranks)
            zero = loss.new_zeros(())
            sums += torch.stack([loss.detach().float(), *(stats.get(n, zero).detach().float() for n in names)])
        return sums

    def _guarded_step(self, role: str, wrapper: RoleWrapper, losses: Mapping[str, float], where: str) -> bool:
        """Step ``role``'s optimizer unless a loss term or the gradient norm is NaN or infinite; True if it stepped.

        ``losses`` are the minibatch's, summed over the train group, and the norm is the group's, so every rank of
        the group decides alike and their collectives stay matched. A skip zeroes the gradients and warns; the
        ``ppo.max_consecutive_skipped_updates``-th in a row, or a non-finite update that the wrapper applied anyway,
        marks the role diverged (``wrapper.skipped.diverged``)."""
        terms = {label: losses[name] for name, label in LOSS_TERMS.items() if name in losses}
        result = wrapper.step(skip=first_nonfinite(terms) is not None)
        values = {**terms, GRAD_NORM: result.grad_norm}
        reason = first_nonfinite(values) or (None if result.stepped else GRAD_NORM)
        limit, record = self.config.max_consecutive_skipped_updates, wrapper.skipped
        stop = record_update(record, values, where, reason, result.stepped, limit)
        if reason is not None and not result.stepped and self.placement.group_rank(role + ".train") == 0:
            # One warning per group: its ranks decided alike.
            warnings.warn(skip_message(role, reason, values[reason], where, record.in_a_row, limit), stacklevel=2)
        if stop:
            record.diverged = divergence_message(role, reason, values[reason], where, record, limit,
                                                 applied_by=wrapper.name if result.stepped else None)
        return result.stepped

    def _leader_message(self, call: str, message: str | None) -> str:
        """The message of ``call``'s leader, on every rank (an object broadcast, on the error path only)."""
        if self.placement.distributed:
            box = [message]
            group = self.placement.groups.get(call) if self.placement.plan.free_running else None
            torch.distributed.broadcast_object_list(box, src=self.placement.leader(call), group=group)
            message = box[0]
        return message or f"{call} diverged."

    # ---- reallocation and memory ----

    def _reallocate(self, role: str) -> int:
        """Refresh ``role``'s shadow copy after its update, then its tensor-parallel copy (:meth:`_refresh_layout`);
        the bytes this rank moved."""
        moved = 0
        shadows = self.placement.plan.shadow_ranks(role)
        if shadows and self.placement.runs(role + ".train"):
            buckets = trained_buckets(self.wrappers[role], self.shadow_precisions.get(role))
            moved += self.placement.reallocate_weights(role, buckets)
        elif self.placement.rank in shadows:
            moved += self.placement.reallocate_weights(role, shadow_buckets(self.modules(role)))
        copy = self._tp_copy(role)
        if copy is not None:
            moved += self._refresh_layout(role, copy)
        return moved

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


@dataclass
class IterationResult:
    """What one iteration hands back to its caller, the same on every rank."""

    stats: dict[str, Any]
    """The rollout's statistics (reward, KL, length), the train calls', the reallocation's, time and throughput."""
    rollout: Rollout
    """The whole rollout."""
    scores: torch.Tensor
    """[B] the reward's raw scores."""
    learning_rates: dict[str, float]
    """``lr-{role}`` (and ``-momentum``, ``-weight_decay``) after this iteration's scheduler steps."""


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
    collecting: bool = False
    """A generation round of dynamic sampling ended short of informative groups: another round follows."""
    earlier_rounds_s: tuple[float, float] = (0.0, 0.0)
    """Generation and scoring seconds of the iteration's earlier generation rounds (dynamic sampling)."""
    earlier_rounds_tokens: float = 0.0
    """Tokens those rounds generated."""
    among: str | None = None
    """The call whose ranks the gathers deliver to (a free-running plan's generation side); None: the world."""

    def next_round(self, batch: dict[str, Any], sampling_key: int, now: float) -> IterationState:
        """A fresh state for the next generation round of dynamic sampling, on ``batch``, carrying this round's
        time and tokens."""
        generate_s, score_s = self.earlier_rounds_s
        assert self.rollout is not None
        return IterationState(
            batch, self.iteration, now, self.prompts, sampling_key,
            earlier_rounds_s=(generate_s + self.marks["generated"] - self.start,
                              score_s + self.marks["scored"] - self.marks["generated"]),
            earlier_rounds_tokens=self.earlier_rounds_tokens + self.rollout.response_mask.sum().item(),
        )
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
    trained_on: Experience | None = None
    """The experience the train calls updated on (None: no update this iteration)."""
    stats: dict[str, Any] = field(default_factory=lambda: {SKIPPED_UPDATES: 0.0})
    reallocated_bytes: int = 0
    schedulers_stepped: bool = False
    learning_rates: dict[str, float] = field(default_factory=dict)
    marks: dict[str, float] = field(default_factory=dict)

    def add_train_stats(self, stats: dict[str, torch.Tensor], experience: Experience) -> None:
        """A train call's broadcast statistics; the roles' skipped updates add up in one ``train/skipped_updates``."""
        self.stats[SKIPPED_UPDATES] += stats.pop(SKIPPED_UPDATES)
        self.stats.update(stats)
        self.trained_on = experience

    def mark(self, step: Step, clock: Callable[[], float]) -> None:
        """The time after ``step`` (taken or not by this rank) where it ends a phase so far; the clock (a device
        sync on CUDA) is read only then."""
        if step.kind == "call" and step.name == ACTOR.call("generate"):
            self.marks["generated"] = clock()
        elif step.kind == "gather" and step.name != ACTOR.call("generate"):
            self.marks["scored"] = clock()
        elif step.kind == "broadcast" and step.what == "stats":
            self.marks["trained"] = clock()
        elif step.kind == "reallocate":
            self.marks["reallocated"] = clock()
        elif step.kind == "broadcast" and step.what == "lr":  # no reallocation this iteration: it took no time
            self.marks.setdefault("reallocated", max(self.marks.get("trained", 0.0), self.marks["scored"]))

    def timings(self, overlap: bool, samples: int, tokens: float) -> dict[str, float]:
        """Phase seconds and throughput of the iteration; a phase with no step this time (the first iteration under
        overlap trains nothing) takes no time."""
        marks = self.marks
        generated, scored = marks["generated"], marks["scored"]
        trained = marks.get("trained", generated if overlap else scored)
        reallocated = marks.get("reallocated", max(trained, scored))
        generate_s, score_s = self.earlier_rounds_s  # dynamic sampling's earlier generation rounds
        return {
            "time/generate_s": generate_s + generated - self.start,
            "time/score_s": score_s + scored - (trained if overlap else generated),
            "time/train_s": trained - (generated if overlap else scored),
            "time/reallocate_s": reallocated - max(trained, scored),
            "perf/samples_per_sec": samples / (generate_s + score_s + reallocated - self.start),
            "perf/gen_tokens_per_sec": (self.earlier_rounds_tokens + tokens) / (generate_s + generated - self.start),
        }


@dataclass
class KeptValues:
    """The critic's scoring forward on this rank's rows, with its graph, for its train call."""

    iteration: int
    rows: slice
    """This rank's rows of the rollout (its ``critic.forward`` shard)."""
    values: torch.Tensor
    """[rows, T] unmasked values, with gradients."""
