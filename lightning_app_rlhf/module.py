"""``RLHFModule``: PPO over the four roles as a LightningModule. One ``training_step`` is one PPO iteration."""

from __future__ import annotations

import copy
import dataclasses
import os
import time
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from torch import nn
from transformers import PreTrainedTokenizerBase
from typing_extensions import override

from lightning_app_rlhf.calls import (
    Experience,
    actor_loss,
    critic_forward,
    critic_loss,
    describe_nonfinite,
    minibatch_permutation,
    reference_forward,
    reward_forward,
    split_minibatches,
)
from lightning_app_rlhf.config import GenerationConfig, PPOConfig
from lightning_app_rlhf.generation import Rollout, generate, sample_keys
from lightning_app_rlhf.memory import RoleMemory, role_memory
from lightning_app_rlhf.placement import Placement, TensorSpec
from lightning_app_rlhf.plan import CALLS, PlacementPlan, role_of
from lightning_app_rlhf.ppo import (
    AdaptiveKLController,
    FixedKLController,
    RunningMoments,
    gae_advantages,
    kl_penalty,
    masked_whiten,
    token_rewards,
)
from lightning_app_rlhf.roles import (
    AdapterDisabledReference,
    ModelSpec,
    RewardFunction,
    as_model_spec,
    build_causal_lm,
    build_critic,
    build_reference,
    build_reward_model,
    check_no_lora,
    check_vocabularies,
    freeze,
    is_lora,
    load_tokenizer,
    resolve_import,
)

ModelSource = ModelSpec | dict[str, Any] | str
ACTOR_STATS = ("policy/loss", "policy/clipfrac", "policy/approx_kl", "policy/entropy")
CRITIC_STATS = ("value/loss", "value/clipfrac")


def _default_optimizer(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-5, foreach=True)  # one kernel per step for all tensors, not one per tensor


class RLHFModule(pl.LightningModule):
    """PPO for a causal LM with a critic, a frozen reference and a reward model or function.

    Args:
        actor: The policy: a :class:`ModelSpec`, its fields as a dict, or a local model directory.
        tokenizer: The actor's tokenizer, a local directory, or ``"package.module:function"`` building one.
        critic: The value model's backbone. Defaults to the actor's spec (a fresh copy, with a value head, and
            the actor's LoRA settings if it has any).
        reference: The frozen reference policy. Defaults to an exact copy of the initial actor; for a LoRA actor,
            to the actor's own base model with its adapters disabled (no second copy).
        reward_model: A sequence classifier with one label. Give this or ``reward_fn``.
        reward_fn: ``(prompts, responses) -> scores`` on decoded text, or its import path.
        generation: Sampling settings for rollouts.
        ppo: PPO hyper-parameters.
        actor_optimizer: Builds the actor's optimizer from its parameters. Default: AdamW, lr 1e-5.
        critic_optimizer: Builds the critic's optimizer. Default: AdamW, lr 1e-5.
        actor_scheduler: Builds the actor's LR scheduler; stepped once per PPO iteration.
        critic_scheduler: Builds the critic's LR scheduler; stepped once per PPO iteration.
        seed: Keys sampling noise and minibatch order. Default: the seed of ``seed_everything``, else 0.
    """

    def __init__(
        self,
        actor: ModelSource,
        tokenizer: str | PreTrainedTokenizerBase,
        critic: ModelSource | None = None,
        reference: ModelSource | None = None,
        reward_model: ModelSource | None = None,
        reward_fn: Callable[[list[str], list[str]], Any] | str | None = None,
        generation: GenerationConfig = GenerationConfig(),
        ppo: PPOConfig = PPOConfig(),
        actor_optimizer: OptimizerCallable | None = None,
        critic_optimizer: OptimizerCallable | None = None,
        actor_scheduler: LRSchedulerCallable | None = None,
        critic_scheduler: LRSchedulerCallable | None = None,
        seed: int | None = None,
    ) -> None:
        super().__init__()
        if (reward_model is None) == (reward_fn is None):
            raise ValueError(
                "Give exactly one reward: `reward_model` (a sequence classifier) or `reward_fn` (a function "
                f"`(prompts, responses) -> scores`). Got reward_model={reward_model!r}, reward_fn={reward_fn!r}."
            )
        self.automatic_optimization = False
        self.actor_spec = as_model_spec(actor)
        self.critic_spec = as_model_spec(critic) if critic is not None else self.actor_spec
        self.reference_spec = as_model_spec(reference) if reference is not None else None
        self.reward_spec = as_model_spec(reward_model) if reward_model is not None else None
        self._check_lora_specs()
        self.reward_fn: RewardFunction | None = resolve_import(reward_fn) if isinstance(reward_fn, str) else reward_fn
        self.tokenizer = load_tokenizer(tokenizer)
        if reward_model is not None and self.tokenizer.pad_token_id == self.tokenizer.eos_token_id:
            warnings.warn("The tokenizer's pad token is its EOS token: Hugging Face sequence classifiers skip trailing "
                          "pad ids, so the reward model scores the token before EOS. Add a distinct pad token if "
                          "the reward model was trained to read EOS.")
        self.generation = dataclasses.replace(generation)  # a copy: the default instance is shared
        self.ppo = dataclasses.replace(ppo)
        self.actor_optimizer = actor_optimizer or _default_optimizer
        self.critic_optimizer = critic_optimizer or _default_optimizer
        self.actor_scheduler = actor_scheduler
        self.critic_scheduler = critic_scheduler
        self.seed = seed if seed is not None else int(os.environ.get("PL_GLOBAL_SEED", 0))
        self.kl_controller = (
            AdaptiveKLController(self.ppo.kl_coef, self.ppo.kl_target, self.ppo.kl_horizon)
            if self.ppo.kl_target is not None
            else FixedKLController(self.ppo.kl_coef)
        )
        self.reward_moments = RunningMoments()
        self.actor: nn.Module | None = None
        self.critic: nn.Module | None = None
        self.reference: nn.Module | None = None
        self.reward_model: nn.Module | None = None
        self.placement: Placement | None = None
        """Set by a placement strategy before ``configure_model``; None means one process holding every role."""
        self.fabric_schedulers: list[Any] = []
        """LR schedulers under Fabric (the Trainer keeps its own)."""
        self._fabric_iteration = 0
        self.pending_experience: Experience | None = None
        """With ``overlap``: the rollout scored last iteration, trained on in the next one."""
        self.train_modules: dict[str, nn.Module] = {}
        """Role -> the module its train call runs (DDP/FSDP2-wrapped by the strategy; a plain dict so the
        wrappers are not registered as submodules)."""

    @property
    def reference_shares_actor(self) -> bool:
        """Whether the reference is the LoRA actor's base with adapters disabled, rather than a model of its own."""
        return self.reference_spec is None and self.actor_spec.lora is not None

    def _check_lora_specs(self) -> None:
        check_no_lora("reference", self.reference_spec)
        check_no_lora("reward_model", self.reward_spec)
        if self.reference_shares_actor and self.actor_spec.lora.get("bias", "none") != "none":
            raise ValueError(f"actor.lora.bias={self.actor_spec.lora['bias']!r} trains the base model's biases, so the "
                             "base with adapters disabled would drift from the initial actor and could not serve as "
                             "the reference. Use bias='none', or give a separate `reference` model.")

    def _placement(self) -> Placement:
        if self.placement is None:
            self.placement = Placement.single_process(self.device)
        return self.placement

    @override
    def configure_model(self) -> None:
        if any(m is not None for m in (self.actor, self.critic, self.reference, self.reward_model)):
            return
        placement = self._placement()
        if self.reference_shares_actor:
            placement.plan.validate_shared_reference()
        # Each rank builds only the roles its calls need; random init is seeded per role, so every copy of
        # a role (trained weights or a shadow) starts identical on every rank.
        if placement.holds("actor"):
            self.actor = build_causal_lm(self.actor_spec)
        if placement.holds("reference"):
            if self.reference_shares_actor:
                self.reference = AdapterDisabledReference(self.actor)  # type: ignore[assignment]
            elif self.reference_spec is None and self.actor is not None:
                self.reference = build_reference(self.actor, None)
            else:
                self.reference = freeze(build_causal_lm(self.reference_spec or self.actor_spec))
        if placement.holds("critic"):
            self.critic = build_critic(self.critic_spec)
        if self.reward_spec is not None and placement.holds("reward"):
            self.reward_model = build_reward_model(self.reward_spec, self.tokenizer.pad_token_id)
        check_vocabularies(self.tokenizer, self.actor, self.reference, self.critic, self.reward_model)

    @override
    def setup(self, stage: str) -> None:
        precision = str(getattr(self.trainer, "precision", "32-true")) if self._trainer is not None else "32-true"
        if precision.startswith("16"):
            raise ValueError(f"precision={precision!r} needs a gradient scaler, which the PPO update does not use. "
                             "Use precision='bf16-mixed' (or 'bf16-true', '32-true').")
        datamodule = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        batch_size = getattr(datamodule, "batch_size", None)
        if stage == "fit" and batch_size is not None:
            self._check_minibatches(batch_size)

    def _check_minibatches(self, batch_size: int) -> None:
        if batch_size % self.ppo.num_minibatches:
            raise ValueError(
                f"The rollout batch size {batch_size} is not divisible by ppo.num_minibatches="
                f"{self.ppo.num_minibatches}. Pick a data.batch_size that is a multiple of it, or a "
                f"num_minibatches that divides {batch_size}."
            )
        plan = self._placement().plan
        widest = max(plan.calls, key=lambda call: len(plan.ranks(call)))
        if batch_size < len(plan.ranks(widest)):
            raise ValueError(f"The rollout batch of {batch_size} prompts is split over the {len(plan.ranks(widest))} "
                             f"ranks of {widest!r}: raise data.batch_size to at least that.")
        minibatch = batch_size // self.ppo.num_minibatches
        for role in ("actor", "critic"):
            ranks = len(plan.ranks(f"{role}.train"))
            if minibatch < ranks:
                raise ValueError(f"Each PPO minibatch of {minibatch} samples is split over the {ranks} ranks of "
                                 f"'{role}.train': raise data.batch_size or lower ppo.num_minibatches so that "
                                 f"batch_size / num_minibatches >= {ranks}.")

    def trained_roles(self) -> list[str]:
        """The trainable roles whose train call runs on this rank, in optimizer order."""
        return [role for role in ("actor", "critic") if self._placement().runs(f"{role}.train")]

    @override
    def configure_optimizers(self) -> Any:
        builders = {
            "actor": (self.actor_optimizer, self.actor_scheduler),
            "critic": (self.critic_optimizer, self.critic_scheduler),
        }
        optimizers, schedulers = [], []
        for role in self.trained_roles():
            build_optimizer, build_scheduler = builders[role]
            optimizer = build_optimizer(p for p in getattr(self, role).parameters() if p.requires_grad)
            optimizers.append(optimizer)
            if build_scheduler is not None:
                schedulers.append(build_scheduler(optimizer))
        return optimizers, schedulers

    def _optimizer(self, role: str) -> torch.optim.Optimizer:
        optimizers = self.optimizers()
        optimizers = optimizers if isinstance(optimizers, list) else [optimizers]
        return optimizers[self.trained_roles().index(role)].optimizer

    # ---- placement summary ----

    @override
    def on_fit_start(self) -> None:
        rows = self.gather_memory()
        if self.trainer.is_global_zero:
            print_placement_summary(self._placement(), rows)
        metrics: dict[str, float] = {}
        for rank, rank_rows in enumerate(rows):
            metrics[f"memory/param_bytes_rank{rank}"] = float(sum(r.param_bytes for r in rank_rows))
            metrics[f"memory/state_bytes_rank{rank}"] = float(sum(r.grad_bytes + r.optimizer_bytes for r in rank_rows))
        for logger in self.loggers:
            logger.log_metrics(metrics, step=0)

    def gather_memory(self) -> list[list[RoleMemory]]:
        """Every rank's :class:`RoleMemory` rows, on every rank (one object all-gather)."""
        placement = self._placement()
        mine = []
        for role in ("actor", "critic", "reference", "reward"):
            module = self.reward_model if role == "reward" else getattr(self, role)
            if module is None:
                continue
            calls = [call.split(".")[1] for call in CALLS if role_of(call) == role and placement.runs(call)]
            if isinstance(module, AdapterDisabledReference):  # runs on the actor's weights, counted there
                mine.append(RoleMemory(role, "+".join(calls), 0, 0, 0, shares="actor"))
                continue
            optimizer = self._optimizer(role) if role in self.trained_roles() else None
            mine.append(role_memory(role, module, calls, optimizer))
        if not placement.distributed:
            return [mine]
        everyone: list[Any] = [None] * placement.plan.world_size
        torch.distributed.all_gather_object(everyone, mine)
        return everyone

    # ---- one PPO iteration ----

    @override
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        iteration = self.iteration
        batch_size = batch["input_ids"].shape[0]
        self._check_minibatches(batch_size)
        overlap = self._placement().plan.overlap
        times = {"start": _now(self.device)}
        local = self.generate_local(batch, iteration)
        times["generated"] = _now(self.device)
        if overlap:
            # One-step off-policy: the training group updates on the previous rollout while the generation group
            # sampled this one; both meet in the gathers below.
            train_stats, trained_on = self._train(self.pending_experience)
            times["trained"] = _now(self.device)
        rollout = self.gather_rollout(batch, local)
        experience, stats = self.score_rollout(rollout, iteration)
        times["scored"] = _now(self.device)
        if overlap:
            self.pending_experience = experience
        else:
            train_stats, trained_on = self._train(experience)
            times["trained"] = _now(self.device)
        stats.update(train_stats)
        stats["reallocate/bytes"] = float(sum(self.reallocate_shadows())) if trained_on is not None else 0.0
        times["reallocated"] = _now(self.device)
        if overlap:
            stats["overlap/staleness"] = float(iteration - trained_on.iteration) if trained_on is not None else 0.0
        self.kl_controller.update(stats["kl/mean"].item(), n_samples=batch_size)
        self._step_schedulers()
        self._count_one_optimizer_step()
        total = times["reallocated"] - times["start"]
        stats.update({
            "time/generate_s": times["generated"] - times["start"],
            "time/score_s": times["scored"] - (times["trained"] if overlap else times["generated"]),
            "time/train_s": times["trained"] - (times["generated"] if overlap else times["scored"]),
            "time/reallocate_s": times["reallocated"] - max(times["trained"], times["scored"]),
            "perf/samples_per_sec": batch_size / total,
            "perf/gen_tokens_per_sec": rollout.response_mask.sum().item() / (times["generated"] - times["start"]),
        })
        self._log_stats(stats, batch_size)

    def _train(self, experience: Experience | None) -> tuple[dict[str, torch.Tensor], Experience | None]:
        """Both train calls on ``experience``; nothing when there is none yet or every score was skipped."""
        if experience is None or not bool(experience.response_mask.any()):
            return {}, None
        stats = self.train_role("actor", experience)
        stats.update(self.train_role("critic", experience))
        return stats, experience

    def generate_local(self, batch: dict[str, torch.Tensor], iteration: int) -> dict[str, torch.Tensor] | None:
        """``actor.generate`` on this rank's shard of the global batch (no collective); None off its group."""
        placement = self._placement()
        if not placement.runs("actor.generate"):
            return None
        rows = placement.shard("actor.generate", batch["input_ids"].shape[0])
        part = generate(
            self.actor,
            batch["input_ids"][rows],
            batch["attention_mask"][rows],
            self.generation,
            sample_keys(self.seed, iteration, batch["index"][rows]),
            eos_token_id=self.tokenizer.eos_token_id,
            pad_token_id=self.tokenizer.pad_token_id,
            lockstep_group=placement.groups.get("actor.generate") if placement.sharded_here("actor") else None,
        )
        return {"responses": part.responses, "response_mask": part.response_mask, "logprobs": part.logprobs}

    def gather_rollout(self, batch: dict[str, torch.Tensor], local: dict[str, torch.Tensor] | None) -> Rollout:
        """Every rank receives the whole rollout from the shards of ``actor.generate``'s ranks."""
        specs = {
            "responses": TensorSpec(torch.long, 2, self.tokenizer.pad_token_id),
            "response_mask": TensorSpec(batch["attention_mask"].dtype, 2),
            "logprobs": TensorSpec(torch.float32, 2),
        }
        out = self._placement().gather_to_world("actor.generate", local, specs)
        return Rollout(
            sequences=torch.cat([batch["input_ids"], out["responses"]], dim=1),
            attention_mask=torch.cat([batch["attention_mask"], out["response_mask"]], dim=1),
            response_mask=out["response_mask"],
            logprobs=out["logprobs"],
            prompt_length=batch["input_ids"].shape[1],
        )

    def score_rollout(self, rollout: Rollout, iteration: int) -> tuple[Experience, dict[str, torch.Tensor]]:
        """``reference.forward``, ``reward.forward`` and ``critic.forward``, each on its group's ranks, then
        KL-shaped rewards and GAE on every rank (cheap, and it saves a broadcast)."""
        placement = self._placement()
        batch_size = len(rollout.sequences)
        # Every rank first runs the calls it owns, then joins the gathers: calls on disjoint groups overlap.
        parts: dict[str, dict[str, torch.Tensor] | None] = {"reference": None, "reward": None, "critic": None}
        if placement.runs("reference.forward"):
            shard = rollout.select(placement.shard("reference.forward", batch_size))
            parts["reference"] = {"ref_logprobs": reference_forward(self.reference, shard, self.generation.temperature)}
        if placement.runs("reward.forward"):
            shard = rollout.select(placement.shard("reward.forward", batch_size))
            parts["reward"] = {"scores": reward_forward(self.reward_model or self.reward_fn, shard, self.tokenizer)}
        if placement.runs("critic.forward"):
            shard = rollout.select(placement.shard("critic.forward", batch_size))
            parts["critic"] = {"values": critic_forward(self.critic, shard)}
        response_length = rollout.response_mask.shape[1]
        ref_logprobs = placement.gather_to_world(
            "reference.forward", parts["reference"], {"ref_logprobs": TensorSpec(torch.float32, 2)}
        )["ref_logprobs"][:, :response_length]
        scores = placement.gather_to_world("reward.forward", parts["reward"], {"scores": TensorSpec(torch.float32, 1)})[
            "scores"
        ]
        values = placement.gather_to_world("critic.forward", parts["critic"], {"values": TensorSpec(torch.float32, 2)})[
            "values"
        ][:, :response_length]
        return self._experience(rollout, ref_logprobs, scores, values, iteration)

    def _experience(
        self, rollout: Rollout, ref_logprobs: torch.Tensor, scores: torch.Tensor, values: torch.Tensor, iteration: int
    ) -> tuple[Experience, dict[str, torch.Tensor]]:
        mask = rollout.response_mask.clone()
        finite = self._handle_nonfinite(scores)
        scores = torch.where(finite, scores, torch.zeros_like(scores))
        mask = mask * finite.unsqueeze(1).to(mask.dtype)
        raw_scores = scores[finite]
        if self.ppo.missing_eos_penalty is not None:
            last = rollout.responses.gather(1, (rollout.response_mask.sum(1, keepdim=True) - 1).clamp(min=0))
            scores = scores - self.ppo.missing_eos_penalty * (last.squeeze(1) != self.tokenizer.eos_token_id)
        scores = self._normalise_scores(scores, finite)
        kl = kl_penalty(rollout.logprobs, ref_logprobs, self.ppo.kl_estimator) * mask
        rewards = token_rewards(scores, kl, self.kl_controller.value, mask)
        advantages, returns = gae_advantages(rewards, values, mask, self.ppo.gamma, self.ppo.lam)
        if self.ppo.whiten_advantages and mask.sum() > 1:  # every score skipped: nothing to whiten or learn
            advantages = masked_whiten(advantages, mask)
        experience = Experience(
            sequences=rollout.sequences,
            attention_mask=rollout.attention_mask,
            response_mask=mask,
            logprobs=rollout.logprobs,
            values=values * mask,
            advantages=advantages,
            returns=returns,
            prompt_length=rollout.prompt_length,
            iteration=iteration,
        )
        kept = finite.float().sum().clamp(min=1.0)
        stats = {
            "reward/mean": raw_scores.mean() if raw_scores.numel() else scores.new_tensor(float("nan")),
            "reward/std": raw_scores.std() if raw_scores.numel() > 1 else scores.new_tensor(0.0),
            "kl/mean": kl.sum(1).sum() / kept,
            "kl/coef": torch.tensor(self.kl_controller.value),
            "response/length_mean": rollout.response_mask.sum(1).float().mean(),
        }
        return experience, stats

    def _handle_nonfinite(self, scores: torch.Tensor) -> torch.Tensor:
        finite = torch.isfinite(scores)
        if bool(finite.all()):
            return finite
        message = describe_nonfinite(scores)
        if self.ppo.nonfinite_rewards == "raise":
            raise ValueError(
                f"{message}. Fix the reward, or set ppo.nonfinite_rewards='skip' to leave such samples out of "
                "the update with a warning."
            )
        warnings.warn(f"{message}; these samples are left out of this PPO update (ppo.nonfinite_rewards='skip').")
        return finite

    def _normalise_scores(self, scores: torch.Tensor, finite: torch.Tensor) -> torch.Tensor:
        if self.ppo.reward_norm:
            self.reward_moments.update(scores[finite])
            scores = (scores - self.reward_moments.mean) / (self.reward_moments.std + 1e-8)
        if self.ppo.reward_clip is not None:
            scores = scores.clamp(-self.ppo.reward_clip, self.ppo.reward_clip)
        return scores * finite

    def train_role(self, role: str, experience: Experience) -> dict[str, torch.Tensor]:
        """``actor.train`` or ``critic.train`` on its group; the statistics reach every rank."""
        placement = self._placement()
        call = f"{role}.train"
        stats = self._ppo_epochs(role, experience) if placement.runs(call) else None
        names = ACTOR_STATS if role == "actor" else CRITIC_STATS
        return placement.broadcast_stats(call, stats, names)

    def _loss(self, role: str, model: nn.Module, batch: Experience, token_count: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if role == "actor":
            return actor_loss(model, batch, self.ppo, self.generation.temperature, token_count)
        return critic_loss(model, batch, self.ppo, token_count)

    def _ppo_epochs(self, role: str, experience: Experience) -> dict[str, torch.Tensor]:
        """PPO epochs over global minibatches. Each of the D ranks of the train group takes 1/D of every
        minibatch and normalises by the whole minibatch's token count; the wrapper averages gradients over
        D ranks, so the loss is scaled by D. The update is the same whatever D is."""
        placement = self._placement()
        call = f"{role}.train"
        ranks, my_rank = placement.group_size(call), placement.group_rank(call)
        model = self.train_modules.get(role, getattr(self, role))
        optimizer = self._optimizer(role)
        totals: dict[str, torch.Tensor] = defaultdict(lambda: torch.zeros((), device=self.device))
        steps = 0
        for epoch in range(self.ppo.ppo_epochs):
            order = minibatch_permutation(len(experience.sequences), self.seed, experience.iteration, epoch)
            for indices in split_minibatches(order, self.ppo.num_minibatches):
                token_count = experience.response_mask[indices].sum().clamp(min=1).float()
                shard = experience.minibatch(indices.tensor_split(ranks)[my_rank])
                loss, stats = self._loss(role, model, shard, token_count)
                self.manual_backward(loss * ranks)
                if self.ppo.max_grad_norm is not None:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), self.ppo.max_grad_norm)
                self._optimizer_step(optimizer)
                optimizer.zero_grad(set_to_none=True)
                for name, value in stats.items():
                    totals[name] = totals[name] + value.detach()
                steps += 1
        names = sorted(totals)
        summed = placement.all_reduce_sum(call, torch.stack([totals[n] for n in names]))
        return {name: value / steps for name, value in zip(names, summed)}

    def reallocate_shadows(self) -> list[int]:
        """Refresh every shadow copy of a trained role after its update; bytes moved per role on this rank."""
        placement = self._placement()
        moved = []
        for role in ("actor", "critic"):
            shadows = placement.plan.shadow_ranks(role)
            if shadows and (placement.runs(f"{role}.train") or placement.rank in shadows):
                moved.append(placement.reallocate_weights(role, getattr(self, role)))
        return moved

    # ---- export ----

    def export_actor(self, directory: str | os.PathLike[str], merge: bool = True) -> Path | None:
        """Save the trained actor and the tokenizer in Hugging Face format.

        Call it on every rank; it runs no collective. The lowest rank of ``actor.train``, which holds the trained
        weights, writes and returns the directory; the other ranks return None.

        Args:
            directory: Where to write; created if missing.
            merge: ``True``: full weights with any LoRA adapter merged in, for
                ``AutoModelForCausalLM.from_pretrained(directory)``. ``False``: the LoRA adapter alone
                (``adapter_config.json`` + ``adapter_model.safetensors``), for
                ``PeftModel.from_pretrained(base_model, directory)``; needs a LoRA actor.
        """
        if not merge and self.actor_spec.lora is None:
            raise ValueError("The actor has no LoRA adapter to export: use merge=True to save its full weights.")
        placement = self._placement()
        if placement.rank != placement.leader("actor.train"):
            return None
        if self.actor is None:
            raise RuntimeError("The actor is not built yet: export after `fit` (or after `configure_model`).")
        if placement.sharded_here("actor"):
            raise ValueError(f"The actor is sharded ({placement.plan.wrappers['actor']}) over "
                             f"{placement.group_size('actor.train')} ranks; exporting a sharded actor is not supported "
                             "yet. Train it with wrapper 'ddp' to export it.")
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        if not merge:
            self.actor.save_pretrained(path)
        elif is_lora(self.actor):
            # Merge into a copy: the live actor keeps its adapters (and its reference, the base with them off).
            copy.deepcopy(self.actor).merge_and_unload().save_pretrained(path)
        else:
            self.actor.save_pretrained(path)
        self.tokenizer.save_pretrained(path)
        return path

    # ---- Trainer or Fabric ----

    @property
    def iteration(self) -> int:
        """PPO iterations done: ``global_step`` under the Trainer, a counter of our own under Fabric."""
        return self._fabric_iteration if self._fabric is not None else self.global_step

    def _optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        # Through the strategy (precision plugin, hooks) but not the LightningOptimizer, which would add one to
        # global_step for every minibatch: see _count_one_optimizer_step.
        if self._fabric is not None:
            self._fabric.strategy.optimizer_step(optimizer)
        else:
            self.trainer.strategy.optimizer_step(optimizer, closure=_no_closure, model=self)

    def _step_schedulers(self) -> None:
        schedulers = self.fabric_schedulers if self._fabric is not None else self.lr_schedulers()
        if schedulers is None:
            return
        for scheduler in schedulers if isinstance(schedulers, list) else [schedulers]:
            scheduler.step()

    def _count_one_optimizer_step(self) -> None:
        """Advance ``global_step`` by exactly one per PPO iteration, however many optimizer steps it took.

        Lightning counts every ``LightningOptimizer.step`` as a global step; with two optimizers and many
        minibatches, ``max_steps`` and checkpoint names would drift from the iteration count.
        """
        if self._fabric is not None:
            self._fabric_iteration += 1
            return
        progress = self.trainer.fit_loop.epoch_loop.manual_optimization.optim_step_progress
        progress.increment_ready()
        progress.increment_completed()

    def _log_stats(self, stats: dict[str, Any], batch_size: int) -> None:
        values = {k: float(v.item() if torch.is_tensor(v) else v) for k, v in stats.items()}
        if self._fabric is not None:
            self._fabric.log_dict(values, step=self._fabric_iteration - 1)
            return
        progress_bar = {"reward/mean", "kl/mean"}
        self.log_dict({k: v for k, v in values.items() if k in progress_bar}, prog_bar=True, batch_size=batch_size)
        self.log_dict({k: v for k, v in values.items() if k not in progress_bar}, batch_size=batch_size)

    # ---- checkpoint state beyond weights and optimizers ----

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["rlhf"] = {
            # Plain tensors and ints, so weights-only loading accepts the checkpoint.
            "pending_experience": vars(self.pending_experience) if self.pending_experience is not None else None,
            "kl_controller": self.kl_controller.state_dict(),
            "reward_moments": self.reward_moments.state_dict(),
            "seed": self.seed,
        }

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint.get("rlhf")
        if state is not None:
            self.kl_controller.load_state_dict(state["kl_controller"])
            self.reward_moments.load_state_dict(state["reward_moments"])
            self.seed = state["seed"]
            pending = state.get("pending_experience")
            self.pending_experience = Experience(**pending).to(self.device) if pending is not None else None


def print_placement_summary(placement: Placement, rows: list[list[RoleMemory]]) -> None:
    """Rich tables: every call with its ranks and wrapper, then bytes per rank and role."""
    from rich.console import Console
    from rich.table import Table

    plan = placement.plan
    calls = Table(title=f"Placement plan: {plan.name}, {plan.world_size} rank(s)")
    for column in ("call", "ranks", "wrapper"):
        calls.add_column(column)
    for call in CALLS:
        calls.add_row(call, ",".join(map(str, plan.ranks(call))), _call_wrapper(plan, call))
    memory = Table(title="Memory per rank (MB)")
    for column in ("rank", "role", "calls", "params", "grads", "optimizer"):
        memory.add_column(column, justify="right" if column in ("params", "grads", "optimizer") else "left")
    for rank, rank_rows in enumerate(rows):
        for row in rank_rows:
            role = f"{row.role} (shared)" if row.shares else row.role
            memory.add_row(str(rank), role, row.calls, *(f"{b / 2**20:.2f}" for b in (
                row.param_bytes, row.grad_bytes, row.optimizer_bytes)))
    console = Console()
    console.print(calls)
    console.print(memory)
    shared = sorted({(row.role, row.shares) for rank_rows in rows for row in rank_rows if row.shares})
    for role, owner in shared:
        console.print(f"{role} (shared): runs on the {owner}'s base weights with its LoRA adapters disabled, "
                      "so it holds no parameters of its own.")


def _call_wrapper(plan: PlacementPlan, call: str) -> str:
    role = role_of(call)
    if f"{role}.train" not in plan.calls:  # a frozen role: held whole, or sharded over its forward group
        return f"frozen, {plan.wrappers[role]}" if role in plan.wrappers else "frozen"
    if call.endswith(".train"):
        return plan.wrappers[role]
    return "shadow copy" if set(plan.ranks(call)) - set(plan.ranks(f"{role}.train")) else "trained copy"


def _no_closure() -> None:
    return None


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
