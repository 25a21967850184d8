"""The update loop: one train call of a role, epochs over minibatches of the experience. Plain PyTorch.

This is where a role learns: for each epoch, the experience in a keyed random order, cut into minibatches; each
minibatch split over the train group's data-parallel replicas and into micro-batches; the algorithm's loss
(:meth:`~lightning_app_rlhf.algorithms.Algorithm.policy_loss`, :meth:`~lightning_app_rlhf.algorithms.Algorithm.value_loss`),
backward through the role's wrapper, then one optimizer step per minibatch, skipped when the loss or the gradient
norm is not finite. The update is the same whatever the group size and the micro-batch size are.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch

from lightning_app_rlhf.algorithms import Algorithm, LossScale
from lightning_app_rlhf.algorithms.functional import rollout_correction, superseded_token_mask
from lightning_app_rlhf.core.config import PPOConfig
from lightning_app_rlhf.core.role_table import ACTOR, CRITIC
from lightning_app_rlhf.engine.batch_split import micro_batch_count
from lightning_app_rlhf.engine.role_calls import RoleCalls
from lightning_app_rlhf.engine.update_guard import (
    GRAD_NORM,
    LOSS_TERMS,
    DivergenceError,
    divergence_message,
    first_nonfinite,
    record_update,
    skip_message,
)
from lightning_app_rlhf.models.calls import (
    Experience,
    critic_values,
    minibatch_permutation,
    policy_logprobs,
    split_minibatches,
)
from lightning_app_rlhf.parallel.pipeline import PipelineInputs
from lightning_app_rlhf.parallel.pipeline_losses import policy_loss_fn, value_loss_fn
from lightning_app_rlhf.parallel.placement import Placement
from lightning_app_rlhf.parallel.wrappers import RoleWrapper
from lightning_app_rlhf.parallel.wrappers.pipeline_ddp import PipelineDDPWrapper

SKIPPED_UPDATES = "train/skipped_updates"
"""A train call's statistic: its optimizer updates skipped in the iteration (a non-finite loss or gradient norm)."""
DIVERGED = "train/diverged"
"""Sent with a train call's statistics, so that every rank raises the ``DivergenceError``, not only its group."""


@dataclass
class UpdateLoop:
    """The train calls of this rank's trainable roles.

    Args:
        calls: This rank's calls: the placement, the roles' precisions, the sampling temperature and seed, and the
            critic's kept scoring forward.
        algorithm: The losses and their statistics.
        config: Epochs, minibatches, micro-batches, gradient clipping and the skip limit.
    """

    calls: RoleCalls
    algorithm: Algorithm
    config: PPOConfig

    @property
    def placement(self) -> Placement:
        return self.calls.placement

    def update(self, role: str, experience: Experience, wrapper: RoleWrapper) -> dict[str, torch.Tensor]:
        """``role``'s train call: epochs over global minibatches. Each of the D ranks of the train group takes 1/D
        of every minibatch, in micro-batches, and divides by the whole minibatch's sizes; the wrapper averages
        gradients over D ranks, so the loss is scaled by D. A minibatch with no valid token takes no step, nor does
        one whose loss or gradient norm is not finite (:meth:`guarded_step`); after
        ``ppo.max_consecutive_skipped_updates`` of those in a row the role stops. Returns the statistics, averaged
        over the minibatches that stepped (NaN when every one was skipped), with :data:`SKIPPED_UPDATES` and
        :data:`DIVERGED`."""
        call = role + ".train"
        names = self.algorithm.stat_names(role)
        mismatch: dict[str, torch.Tensor] = {}
        if role == ACTOR.name and self.config.recompute_old_logprobs:
            experience, mismatch = self.recompute_old_logprobs(experience, wrapper)
        if role == ACTOR.name and self.config.partial_rollout_loss == "mask_superseded":
            versions = experience.token_versions
            mask = experience.response_mask if versions is None else superseded_token_mask(experience.response_mask,
                                                                                            versions)
            valid = experience.response_mask.sum().clamp(min=1)
            mismatch["rollout/superseded_masked_frac"] = (experience.response_mask - mask).sum() / valid
            experience = dataclasses.replace(experience, response_mask=mask)
        totals = torch.zeros(len(names), device=experience.advantages.device)
        steps = skipped = 0
        wrapper.skipped.diverged = None  # a divergence that the caller caught does not stop a later fit at once
        for epoch, number, indices in self.minibatches(experience):
            if experience.response_mask[indices].sum() == 0:
                continue  # every sample skipped: AdamW would still move the weights (momentum, decay)
            # Summed over the group: a non-finite loss on any rank is non-finite on all, so all skip together.
            summed = self.placement.all_reduce_sum(call, self.accumulate_gradients(role, experience, wrapper,
                                                                                   indices, names))
            where = f"iteration {experience.iteration} (epoch {epoch}, minibatch {number})"
            if self.guarded_step(role, wrapper, dict(zip(("loss", *names), summed.tolist())), where):
                totals += summed[1:]
                steps += 1
            else:
                skipped += 1
            if wrapper.skipped.diverged is not None:
                break
        if role == CRITIC.name:
            self.calls.kept_values = None  # not kept past its train call, used or not
        means = totals / steps if steps else totals.fill_(math.nan if skipped else 0.0)
        flags = torch.tensor([float(skipped), float(wrapper.skipped.diverged is not None)], device=totals.device)
        return {**dict(zip(names, means)), **mismatch, SKIPPED_UPDATES: flags[0], DIVERGED: flags[1]}

    def minibatches(self, experience: Experience) -> Iterator[tuple[int, int, torch.Tensor]]:
        """``(epoch, minibatch number, sample indices)`` of every minibatch of every epoch, in training order (keyed
        by the seed and the iteration: the same under every placement)."""
        for epoch in range(self.config.ppo_epochs):
            order = minibatch_permutation(len(experience.sequences), self.calls.seed, experience.iteration, epoch)
            for number, indices in enumerate(split_minibatches(order, self.config.num_minibatches)):
                yield epoch, number, indices

    def accumulate_gradients(
        self, role: str, experience: Experience, wrapper: RoleWrapper, indices: torch.Tensor, names: tuple[str, ...]
    ) -> torch.Tensor:
        """Forward and backward of this rank's share of one minibatch, in micro-batches. Returns ``[loss, *stats]``
        (``names`` order) summed over its micro-batches: each is already a share of the whole minibatch's."""
        if isinstance(wrapper, PipelineDDPWrapper):
            return self.pipelined_gradients(role, experience, wrapper, indices)
        call = role + ".train"
        # Data-parallel shares: one per tensor-parallel replica (one per rank without a degree).
        ranks, my_rank = self.placement.replicas(call), self.placement.replica(call)
        scale = LossScale(experience.response_mask[indices].sum().float(), len(indices),
                          self.calls.generation.max_new_tokens)
        shard = indices.tensor_split(ranks)[my_rank]
        micro = shard.tensor_split(micro_batch_count(len(indices), ranks, self.config.micro_batch_size))
        sums = torch.zeros(1 + len(names), device=experience.advantages.device)
        kept = self.calls.kept_values if role == CRITIC.name else None
        reused = kept is not None and kept.iteration == experience.iteration
        if reused:
            # The scoring forward was this one (reuses_critic_forward): this rank's loss on the rows it scored. The
            # group's summed gradient is the same whichever rank takes which rows (the scale is the minibatch's).
            micro = [torch.arange(kept.rows.start, kept.rows.stop, device=indices.device)]
        for i, rows in enumerate(micro):
            with wrapper.accumulating(last=i == len(micro) - 1):
                batch = experience.minibatch(rows)
                with self.calls.precision(role):
                    if role == CRITIC.name:
                        # The scoring forward's values, graph kept, or this micro-batch's forward: one loss for both.
                        values = kept.values if reused else critic_values(wrapper.train_module, batch)
                        loss, stats = self.algorithm.value_loss(values, batch, scale)
                    else:
                        # No entropy term in the loss: the entropy is only logged, so no graph for it (backward
                        # skips a vocabulary pass).
                        logprobs, entropy = policy_logprobs(wrapper.train_module, batch,
                                                            self.calls.generation.temperature,
                                                            entropy_grad=self.config.entropy_coef != 0,
                                                            padding_free=self.config.padding_free)
                        loss, stats = self.algorithm.policy_loss(logprobs, entropy, batch, scale)
                wrapper.backward(loss * ranks)
            zero = loss.new_zeros(())
            sums += torch.stack([loss.detach().float(), *(stats.get(n, zero).detach().float() for n in names)])
        return sums

    def pipelined_gradients(self, role: str, experience: Experience, wrapper: PipelineDDPWrapper,
                            indices: torch.Tensor) -> torch.Tensor:
        """:meth:`accumulate_gradients` of a pipelined train call: this pipeline's share of the minibatch through
        the schedule, the algorithm's loss on the last stage for each micro-batch (divided by the whole minibatch's
        sizes, as above), each stage's gradients summed over the pipelines. Returns ``[loss, *stats]`` summed over
        the micro-batches, on every stage (broadcast from the last)."""
        if self.config.padding_free:
            raise ValueError(f"{role}.train is pipelined, and ppo.padding_free packs each forward's rows into one: a "
                             "pipeline runs padded micro-batches. Set ppo.padding_free: false, or remove "
                             f"'{role}.train' from the plan's `pp`.")
        call = role + ".train"
        replicas = self.placement.replicas(call)  # one per pipeline
        scale = LossScale(experience.response_mask[indices].sum().float(), len(indices),
                          self.calls.generation.max_new_tokens)
        batch = experience.minibatch(indices.tensor_split(replicas)[self.placement.replica(call)])
        count = wrapper.micro_batches(len(batch.sequences),
                                      micro_batch_count(len(indices), replicas, self.config.micro_batch_size))
        if role == CRITIC.name:
            loss_fn, keep = value_loss_fn(self.algorithm, batch, scale), 0
        else:  # logits of the response tokens' predecessors only, as policy_logprobs takes them
            loss_fn = policy_loss_fn(self.algorithm, batch, scale, self.calls.generation.temperature,
                                     entropy_grad=self.config.entropy_coef != 0)
            keep = batch.sequences.shape[1] - batch.prompt_length + 1
        with self.calls.precision(role):
            wrapper.train_pipeline(PipelineInputs.from_mask(batch.sequences, batch.attention_mask), loss_fn, count,
                                   keep)
        totals = loss_fn.totals().to(experience.advantages.device)
        return wrapper.stage.broadcast_from_last(totals, f"{call}'s loss statistics")

    def guarded_step(self, role: str, wrapper: RoleWrapper, losses: Mapping[str, float], where: str) -> bool:
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

    def recompute_old_logprobs(
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
        count = micro_batch_count(len(rows), ranks, self.config.micro_batch_size)
        if isinstance(wrapper, PipelineDDPWrapper):  # the forward-only schedule; every stage receives the result
            part = experience.minibatch(share)
            with self.calls.precision(ACTOR.name):
                trainer[share] = wrapper.stage.logprobs(
                    part.sequences, part.attention_mask, part.response_mask, part.prompt_length,
                    self.calls.generation.temperature, max(count, wrapper.pipeline.num_stages))
        else:
            with torch.no_grad(), self.calls.precision(ACTOR.name):
                for part in share.tensor_split(count):
                    logprobs, _ = policy_logprobs(wrapper.train_module, experience.minibatch(part),
                                                  self.calls.generation.temperature, entropy_grad=False,
                                                  padding_free=self.config.padding_free)
                    trainer[part] = logprobs.float()
        trainer = self.placement.all_reduce_sum(call, trainer) * experience.response_mask
        config = self.config
        weights, mask, stats = rollout_correction(trainer, experience.logprobs, experience.response_mask,
                                                  "decoupled" if config.partial_rollout_loss == "decoupled"
                                                  else config.rollout_is, config.rollout_is_level,
                                                  config.rollout_is_threshold)
        return dataclasses.replace(experience, logprobs=trainer, response_mask=mask, is_weights=weights), stats

    # ---- what the train calls tell every rank (for the logger) ----

    def broadcast_stats(self, role: str, stats: dict[str, torch.Tensor] | None,
                        among: str | None = None) -> dict[str, torch.Tensor]:
        """``role``'s train statistics (``stats`` on its train ranks, None elsewhere), with
        ``train/skipped_updates``, on every rank (or the ranks of the call ``among``). Raises
        :class:`DivergenceError` on those ranks once the role diverged."""
        call = role + ".train"
        names = (*self.algorithm.stat_names(role), SKIPPED_UPDATES, DIVERGED)
        stats = self.placement.broadcast_stats(call, stats, names, among_call_ranks=among is not None)
        if stats.pop(DIVERGED) > 0:
            wrapper = self.calls.placed.wrappers.get(role)
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
            group = self.calls.placed.wrappers[role].optimizer.param_groups[0]
            momentum = group.get("momentum", group.get("betas", (0.0,))[0])
            values = (group.get("lr", 0.0), momentum, group.get("weight_decay", 0.0))
            mine = {name: torch.tensor(float(v), device=self.placement.device) for name, v in zip(names, values)}
        stats = self.placement.broadcast_stats(f"{role}.train", mine, names, among_call_ranks=among_call_ranks)
        return {name: float(value) for name, value in stats.items()}
