"""How a role's generate and forward calls run on this rank, and how its layouts take new weights. Plain PyTorch.

A call runs on the role's own module, on its tensor-parallel copy (a call with a degree of its own), or for a LoRA
actor's reference on the actor's base with the adapters off; inside its wrapper's context (DeepSpeed's group scope),
under the role's precision, and under ``torch.inference_mode`` where the wrapper allows it. A sharded role's ranks
forward in lockstep. :class:`RoleCalls` resolves all of that in one place, so the engine's recipe only says which
call runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from lightning_app_rlhf.agents import Environment, run_episodes
from lightning_app_rlhf.core.config import AgentConfig, GenerationConfig, PPOConfig
from lightning_app_rlhf.core.role_table import ACTOR, CRITIC, REFERENCE, REWARD
from lightning_app_rlhf.engine.critic_reuse import KeptValues, reuses_critic_forward
from lightning_app_rlhf.generation import Rollout, generate, model_eos_token_ids, repeat_samples, sample_keys
from lightning_app_rlhf.models.calls import (
    critic_forward,
    critic_values,
    reference_forward,
    reward_forward,
    with_environment_rewards,
)
from lightning_app_rlhf.models.roles import AdapterDisabledReference, RewardFunction, precision_context
from lightning_app_rlhf.parallel.memory import RoleMemory, role_memory
from lightning_app_rlhf.parallel.pipeline import PipelinedRole
from lightning_app_rlhf.parallel.placed_roles import Models, PlacedRoles
from lightning_app_rlhf.parallel.placement import Placement, TensorSpec
from lightning_app_rlhf.parallel.reallocation import shadow_buckets, trained_buckets
from lightning_app_rlhf.parallel.tensor_parallel import TensorParallelCopy, received_bytes
from lightning_app_rlhf.parallel.whole_copy import WholeCopy
from lightning_app_rlhf.parallel.wrappers import RoleWrapper
from lightning_app_rlhf.parallel.wrappers.pipeline_ddp import PipelineDDPWrapper

FORWARD_OUTPUTS = {REFERENCE.name: ("ref_logprobs", 2), REWARD.name: ("scores", 1), CRITIC.name: ("values", 2)}
"""Forward role -> the tensor its call produces and that tensor's number of dimensions."""


@dataclass
class RoleCalls:
    """This rank's generate and forward calls, and the reallocation of its layouts.

    Args:
        placed: The placement, and this rank's wrappers and tensor-parallel copies.
        generation: Sampling settings of the training rollouts (and the forwards' chunk size).
        config: The train calls' settings that the forwards share (padding-free, critic-forward reuse).
        tokenizer: Decodes responses for a reward function; gives the EOS and pad ids.
        modules: Role -> its module on this rank (None where this rank does not hold it).
        reward_fn: The reward function, when the reward is not a model.
        seed: Keys the sampling noise.
        precisions: Role -> its precision (``32-true``, ``bf16-mixed``, ``bf16-true``); a role not named keeps the
            caller's.
        shadow_precisions: Trained role -> ``bf16-true`` where its shadows are held in bfloat16.
        environment: The task's environment, for multi-turn episodes (None: one response per sample).
        agent: The episodes' limits.
    """

    placed: PlacedRoles
    generation: GenerationConfig
    config: PPOConfig
    tokenizer: PreTrainedTokenizerBase
    modules: Models
    reward_fn: RewardFunction | None
    seed: int
    precisions: dict[str, str] = field(default_factory=dict)
    shadow_precisions: dict[str, str] = field(default_factory=dict)
    environment: Environment | None = None
    """Multi-turn rollouts: copied per episode, stepped between the actor's turns on the generating ranks."""
    agent: AgentConfig = field(default_factory=AgentConfig)
    """The episodes' turn and token limits."""
    kept_values: KeptValues | None = field(default=None, init=False, repr=False)
    """The critic's scoring forward of this iteration, with its graph, kept for its train call."""
    batch_rows: int = field(default=0, init=False, repr=False)
    """Rows of the rollout being scored (the critic train call's one minibatch when it reuses the forward)."""

    @property
    def placement(self) -> Placement:
        return self.placed.placement

    # ---- actor.generate ----

    def generate_shard(
        self, batch: dict[str, Any], iteration: int, policy_version: int | None,
        generation: GenerationConfig | None = None,
    ) -> dict[str, torch.Tensor] | None:
        """``actor.generate`` on this rank's shard of the global batch (no collective), with ``generation`` (default:
        the training rollouts' settings) by weights of ``policy_version`` (the updates they have had; a backend with
        its own copy of the weights reloads them when it changes); None off its group."""
        call = ACTOR.call("generate")
        if not self.placement.runs(call):
            return None
        rows = self.placement.shard(call, batch["input_ids"].shape[0])
        with self.running(ACTOR.name):
            if self.environment is not None:
                return self.run_episodes(batch, rows, iteration, generation or self.generation, policy_version)
            part = self.generate_rows(batch, rows, iteration, generation or self.generation, policy_version)
        return {"responses": part.responses, "response_mask": part.response_mask, "logprobs": part.logprobs,
                "stopped": part.stopped.to(torch.uint8)}

    def run_episodes(self, batch: dict[str, Any], rows: slice, iteration: int, generation: GenerationConfig,
                     policy_version: int | None) -> dict[str, torch.Tensor]:
        """The actor's multi-turn episodes for ``rows``, their environments stepping here (see
        :func:`~lightning_app_rlhf.agents.run_episodes`); the prompts are the environments' opening messages."""
        assert self.environment is not None
        actor = self.call_module(ACTOR.name)
        prompts = batch.get("prompts")
        if prompts is None:
            raise ValueError("Multi-turn rollouts reset each environment on its dataset row, and this batch carries no "
                             "prompt rows: build the batches with PromptDataModule (or collate_left_padded), or add "
                             "batch['prompts'], one per row.")
        fields = batch.get("fields") or {}
        episode_rows = [{"prompt": prompts[i], **{name: values[i] for name, values in fields.items()}}
                        for i in range(rows.start or 0, rows.stop if rows.stop is not None else len(prompts))]
        out = run_episodes(actor, self.environment, episode_rows,
                           sample_keys(self.seed, iteration, batch["index"][rows], batch["sample"][rows]),
                           self.tokenizer, generation, self.agent,
                           [self.tokenizer.eos_token_id, *model_eos_token_ids(actor)], batch["input_ids"].device,
                           self.lockstep_group(ACTOR.name), self.inference_mode(ACTOR.name), policy_version)
        part = out.rollout
        return {"prompt_ids": part.sequences[:, : part.prompt_length],
                "prompt_mask": part.attention_mask[:, : part.prompt_length],
                "responses": part.responses, "response_mask": part.response_mask, "logprobs": part.logprobs,
                "stopped": part.stopped.to(torch.uint8),
                "response_attention": part.attention_mask[:, part.prompt_length :],
                "turn_rewards": out.turn_rewards, "episode_stats": out.stats}

    def generate_rows(self, batch: dict[str, Any], rows: slice, iteration: int, generation: GenerationConfig,
                      policy_version: int | None) -> Rollout:
        """The actor's responses for ``rows``: each stops at the tokenizer's EOS, any end id of the actor's
        generation config, ``generation.stop_token_ids`` or ``generation.stop_strings``."""
        keys = sample_keys(self.seed, iteration, batch["index"][rows], batch["sample"][rows])
        return self.generate_keyed(batch["input_ids"][rows], batch["attention_mask"][rows], keys, generation,
                                   policy_version)

    def generate_keyed(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, keys: torch.Tensor,
                       generation: GenerationConfig, policy_version: int | None) -> Rollout:
        """The actor's responses for left-padded prompts with their sample ``keys`` (:meth:`generate_rows`'s rows, or a
        partial rollout's round: :mod:`~lightning_app_rlhf.engine.partial_rollout`)."""
        actor = self.call_module(ACTOR.name)
        lockstep = self.lockstep_group(ACTOR.name)
        # The hybrid engine: a sharded actor generating on its own train group gathers its weights once for the
        # rollout (plan.unshard_for_generation); its forwards then gather nothing, and under FSDP2 run no collective
        # at all, so its ranks need not decode in lockstep.
        once = self.placement.plan.unshard_for_generation and lockstep is not None and self.tp_copy(ACTOR.name) is None
        wrapper = self.placed.wrappers.get(ACTOR.name) if once else None
        if wrapper is not None and not wrapper.lockstep_when_unsharded:
            lockstep = None
        with wrapper.unsharded() if wrapper is not None else contextlib.nullcontext():
            return generate(
                actor,
                input_ids,
                attention_mask,
                generation,
                keys,
                eos_token_id=[self.tokenizer.eos_token_id, *model_eos_token_ids(actor)],
                pad_token_id=self.tokenizer.pad_token_id,
                lockstep_group=lockstep,
                tokenizer=self.tokenizer,
                inference_mode=self.inference_mode(ACTOR.name),
                weights_version=policy_version,
            )

    def generate_round(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, keys: torch.Tensor,
                       max_new_tokens: int, policy_version: int, among: str | None) -> dict[str, torch.Tensor]:
        """One round of a partial rollout: this rank's shard of the rows (``actor.generate``'s ranks; the others only
        gather), at most ``max_new_tokens`` each, then the round's tokens of every row on every rank of the world (or
        of the call ``among``)."""
        call = ACTOR.call("generate")
        local = None
        if self.placement.runs(call):
            rows = self.placement.shard(call, input_ids.shape[0])
            generation = dataclasses.replace(self.generation, max_new_tokens=max_new_tokens)
            with self.running(ACTOR.name):
                part = self.generate_keyed(input_ids[rows], attention_mask[rows], keys[rows], generation,
                                           policy_version)
            local = {"responses": part.responses, "response_mask": part.response_mask, "logprobs": part.logprobs,
                     "stopped": part.stopped.to(torch.uint8)}
        specs = {"responses": TensorSpec(torch.long, 2, self.tokenizer.pad_token_id),
                 "response_mask": TensorSpec(attention_mask.dtype, 2),
                 "logprobs": TensorSpec(torch.float32, 2), "stopped": TensorSpec(torch.uint8, 1)}
        return self.placement.gather_to_world(call, local, specs, among)

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
        if self.environment is not None:
            specs |= {"prompt_ids": TensorSpec(torch.long, 2, self.tokenizer.pad_token_id),
                      "prompt_mask": TensorSpec(batch["attention_mask"].dtype, 2),
                      "response_attention": TensorSpec(batch["attention_mask"].dtype, 2),
                      "turn_rewards": TensorSpec(torch.float32, 2),
                      "episode_stats": TensorSpec(torch.float32, 2)}
        out = self.placement.gather_to_world(ACTOR.call("generate"), local, specs, among)
        self.batch_rows = len(out["responses"])
        if self.environment is None:
            return Rollout.from_responses(batch["input_ids"], batch["attention_mask"], out["responses"],
                                          out["response_mask"], out["logprobs"], out["stopped"].bool())
        prompts, prompt_mask = left_aligned(out["prompt_ids"], out["prompt_mask"], self.tokenizer.pad_token_id)
        rollout = Rollout.from_responses(prompts, prompt_mask, out["responses"], out["response_mask"],
                                         out["logprobs"], out["stopped"].bool(), out["response_attention"])
        rollout.turn_rewards, rollout.episode_stats = out["turn_rewards"], out["episode_stats"]
        return rollout

    def sample_and_score(
        self, batch: dict[str, Any], iteration: int, generation: GenerationConfig, policy_version: int | None
    ) -> tuple[Rollout, torch.Tensor]:
        """Evaluation: ``actor.generate`` (one response per prompt, with ``generation``) and ``reward.forward`` only,
        each on its group, gathered to every rank. Returns the whole rollout and its raw scores [B]."""
        batch = repeat_samples(batch, 1)
        rollout = self.gather_rollout(batch, self.generate_shard(batch, iteration, policy_version, generation))
        scores = self.gather_forward(REWARD.name, self.forward_shard(REWARD.name, rollout, batch.get("fields"),
                                                                     iteration), 0)
        return rollout, scores

    # ---- forward calls ----

    def forward_shard(
        self, role: str, rollout: Rollout, row_fields: dict[str, list[Any]] | None, iteration: int | None = None
    ) -> dict[str, torch.Tensor] | None:
        """``role.forward`` on this rank's shard of the rollout (no collective); None off its group. ``iteration``
        is named by a failing reward function's error."""
        call = role + ".forward"
        if not self.placement.runs(call):
            return None
        rows = self.placement.shard(call, len(rollout.sequences))
        with self.running(role):
            return {FORWARD_OUTPUTS[role][0]: self._forward(role, rollout.select(rows), rows, row_fields, iteration)}

    def gather_forward(self, role: str, local: dict[str, torch.Tensor] | None, width: int,
                       among: str | None = None) -> torch.Tensor:
        """``role.forward``'s result for the whole rollout, on every rank (or every rank of the call ``among``); a
        per-token result cut to the rollout's ``width`` response columns."""
        name, ndim = FORWARD_OUTPUTS[role]
        out = self.placement.gather_to_world(role + ".forward", local, {name: TensorSpec(torch.float32, ndim)}, among)
        return out[name][:, :width] if ndim == 2 else out[name]

    def _forward(
        self, role: str, shard: Rollout, rows: slice, row_fields: dict[str, list[Any]] | None, iteration: int | None
    ) -> torch.Tensor:
        stage = self.placed.pipelines.get(role + ".forward")
        if stage is not None:
            return self._pipelined_forward(role, stage, shard)
        chunks = {"batch_size": self.generation.batch_size, "lockstep_group": self.lockstep_group(role),
                  "inference_mode": self.inference_mode(role)}
        if role == REFERENCE.name:
            return reference_forward(self.call_module(role), shard, self.generation.temperature, **chunks,
                                     padding_free=self.config.padding_free)
        if role == REWARD.name:
            fields = {name: values[rows] for name, values in (row_fields or {}).items()}
            return reward_forward(self.call_module(role) or self.reward_fn, shard, self.tokenizer, fields,
                                  iteration=iteration, **chunks)
        if self.reuses_critic_forward and iteration is not None:
            # The scoring forward is also the train call's: keep its graph (critic_reuse).
            with torch.enable_grad():
                values = critic_values(self.placed.wrappers[CRITIC.name].train_module, shard)
            self.kept_values = KeptValues(iteration, rows, values)
            return values.detach() * shard.response_mask
        return critic_forward(self.call_module(role), shard, **chunks)

    def _pipelined_forward(self, role: str, stage: PipelinedRole, shard: Rollout) -> torch.Tensor:
        """``role.forward`` through this rank's pipeline stage (forward-only schedule), its result on every stage:
        the numbers of the unpipelined call. Micro-batches: ``generation.batch_size`` rows each, and at least one
        per stage (fewer would leave stages idle)."""
        if self.config.padding_free and role == REFERENCE.name:
            raise ValueError("reference.forward is pipelined, and ppo.padding_free packs each forward's rows into one: "
                             "a pipeline runs padded micro-batches. Set ppo.padding_free: false, or remove "
                             "'reference.forward' from the plan's `pp`.")
        size = self.generation.batch_size
        count = max(stage.pipeline.num_stages, -(-len(shard.sequences) // size) if size else 1)
        if role == REFERENCE.name:
            return stage.logprobs(shard.sequences, shard.attention_mask, shard.response_mask, shard.prompt_length,
                                  self.generation.temperature, count)
        if role == CRITIC.name:
            return stage.values(shard.sequences, shard.attention_mask, shard.response_mask, shard.prompt_length,
                                count)
        return with_environment_rewards(stage.scores(shard.sequences, shard.attention_mask, count), shard)

    @property
    def reuses_critic_forward(self) -> bool:
        """:func:`~lightning_app_rlhf.engine.critic_reuse.reuses_critic_forward` for this rollout's size."""
        return reuses_critic_forward(self.placement.plan, self.config, self.generation, self.batch_rows)

    # ---- the settings each call runs under ----

    def wrapper_of(self, role: str) -> RoleWrapper | None:
        """The wrapper whose weights a call of ``role`` runs on here: the role's own, or for a LoRA actor's
        reference (its base, adapters off) the actor's."""
        wrapper = self.placed.wrappers.get(role)
        if wrapper is None and isinstance(self.modules(role), AdapterDisabledReference):
            wrapper = self.placed.wrappers.get(ACTOR.name)
        return wrapper

    @contextlib.contextmanager
    def running(self, role: str) -> Iterator[None]:
        """A wrapper's context around a call of ``role`` on this rank (DeepSpeed's group scope), if it has one (none
        around a tensor-parallel copy, which runs outside the wrapper); inside it, the role's autocast."""
        wrapper = self.wrapper_of(role) if self.tp_copy(role) is None else None
        with wrapper.running() if wrapper is not None else contextlib.nullcontext(), self.precision(role):
            yield

    def precision(self, role: str) -> contextlib.AbstractContextManager[None]:
        """``role``'s autocast (:func:`~lightning_app_rlhf.models.roles.precision_context`); the caller's when it has no
        precision here."""
        precision = self.precisions.get(role)
        return precision_context(precision, self.placement.device) if precision else contextlib.nullcontext()

    def inference_mode(self, role: str) -> bool:
        """Whether ``role``'s generate / forward calls here run under ``torch.inference_mode`` (less per-op work than
        ``torch.no_grad``, the same numbers): on its own module, where its wrapper allows it
        (:attr:`~lightning_app_rlhf.parallel.wrappers.base.RoleWrapper.forwards_in_inference_mode`); a
        tensor-parallel copy's calls stay under ``torch.no_grad``."""
        if self.tp_copy(role) is not None:
            return False
        wrapper = self.wrapper_of(role)
        return wrapper is None or wrapper.forwards_in_inference_mode

    def lockstep_group(self, role: str) -> torch.distributed.ProcessGroup | None:
        """The group over which ``role``'s weights are sharded here, whose ranks must run the same number of
        forwards (each gathers weights collectively); None when this rank holds them whole. For a call with a
        tensor-parallel degree: its replica's group (every forward is a collective over it)."""
        copy = self.tp_copy(role)
        if copy is not None:
            return self.placement.tp_group(copy.call)
        wrapper = self.wrapper_of(role)
        if wrapper is None or not wrapper.shards_params or wrapper.group_size == 1:
            return None
        return wrapper.group

    # ---- which module a call runs: the role's own, or its tensor-parallel copy ----

    def tp_copy(self, role: str) -> TensorParallelCopy | WholeCopy | None:
        """This rank's copy of ``role`` for its generate / forward call, in the call's own layout (tensor-parallel, or
        whole beside a pipelined train call); None: the call runs on the role's own module."""
        call = ACTOR.call("generate") if role == ACTOR.name else role + ".forward"
        return self.placed.tp_copies.get(call)

    def call_module(self, role: str) -> nn.Module | None:
        """The module ``role``'s generate / forward call runs on here: its tensor-parallel copy (given the current
        trained weights first if it has none yet, e.g. after a resume) or the role's own module."""
        copy = self.tp_copy(role)
        if copy is None:
            return self.modules(role)
        if copy.stale:
            self.refresh_layout(role, copy)
        return copy.module

    # ---- new weights into the other layouts (ReaLHF's parameter reallocation) ----

    def reallocate(self, role: str) -> int:
        """Refresh ``role``'s shadow copy after its update, then its tensor-parallel copy (:meth:`refresh_layout`);
        the bytes this rank moved."""
        moved = 0
        shadows = self.placement.plan.shadow_ranks(role)
        if shadows and self.placement.runs(role + ".train"):
            moved += self.placement.reallocate_weights(role, self.trained_buckets(role))
        elif self.placement.rank in shadows:
            moved += self.placement.reallocate_weights(role, shadow_buckets(self.modules(role)))
        copy = self.tp_copy(role)
        if copy is not None:
            moved += self.refresh_layout(role, copy)
        return moved

    def trained_buckets(self, role: str) -> Iterator[list[torch.Tensor]]:
        """``role``'s trained weights in reallocation buckets, rounded to its shadows' precision."""
        return trained_buckets(self.placed.wrappers[role], self.shadow_precisions.get(role))

    def refresh_layout(self, role: str, copy: TensorParallelCopy | WholeCopy) -> int:
        """Redistribute ``role``'s current trainable weights into ``copy``'s tensor-parallel layout, bit for bit;
        returns the bytes this rank received for it.

        On the role's train ranks the weights come whole from its wrapper, a bucket at a time (an all-gather over the
        train group per bucket when sharded, where every train rank runs the call: the plan's rule for sharded roles);
        on a shadow rank from the shadow, refreshed just before. Each rank keeps only its slice: no further
        transfer, and a sharded role is never whole on a rank."""
        if self.placement.runs(role + ".train"):
            wrapper = self.placed.wrappers[role]
            received = received_bytes(p for p in wrapper.module.parameters() if p.requires_grad)
            with self.placement.collective(copy.call, "weight reallocation into the tensor-parallel layout"), \
                    wrapper.running():
                copy.load(itertools.chain.from_iterable(wrapper.full_parameter_buckets()))
            if isinstance(wrapper, PipelineDDPWrapper):
                received = wrapper.gathered_bytes()
            return received
        copy.load([p for p in self.modules(role).parameters() if p.requires_grad])
        return 0

    # ---- memory ----

    def memory_rows(self, roles: tuple[str, ...]) -> list[RoleMemory]:
        """A :class:`RoleMemory` row for each of ``roles`` this rank holds (a LoRA actor's reference counted with the
        actor), and one for each tensor-parallel copy."""
        mine = []
        for role in roles:
            module = self.modules(role)
            if module is None:
                continue
            calls = [call.split(".")[1] for call in self.placement.plan.calls
                     if call.startswith(role + ".") and self.placement.runs(call)]
            if isinstance(module, AdapterDisabledReference):  # runs on the actor's weights, counted there
                mine.append(RoleMemory(role, "+".join(calls), 0, 0, 0, shares=ACTOR.name))
                continue
            mine.append(role_memory(role, calls, module, self.placed.wrappers.get(role)))
        for call, copy in self.placed.tp_copies.items():
            role, kind = call.split(".")
            mine.append(RoleMemory(role, kind, copy.local_bytes(), 0, 0, tp_copy=self.placement.plan.tp_degree(call)))
        return mine


def left_aligned(ids: torch.Tensor, mask: torch.Tensor, pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts gathered from ranks with different widths (each rank's left-padded, then right-padded to the widest)
    left-padded again: each row's real tokens moved to its end."""
    if not len(ids) or not ids.shape[1]:
        return ids, mask
    trailing = mask.long().flip(1).argmax(1).tolist()  # pads after the last real token (0 for an empty row)
    return (torch.stack([row.roll(k) for row, k in zip(ids, trailing)]),
            torch.stack([row.roll(k) for row, k in zip(mask, trailing)]))
