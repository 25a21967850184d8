"""``RLHFModule``: an RLHF algorithm over its roles as a LightningModule. One ``training_step`` is one iteration:
generate, score, advantages, train, reallocate."""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import time
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import LearningRateFinder, LearningRateMonitor, RichProgressBar
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from lightning.pytorch.utilities.warnings import PossibleUserWarning
from torch import nn
from transformers import PreTrainedTokenizerBase
from typing_extensions import override

from lightning_app_rlhf.algorithms import build_algorithm
from lightning_app_rlhf.calls import Experience
from lightning_app_rlhf.checkpoint import (
    LAYOUT_KEY,
    OPTIMIZERS_KEY,
    CheckpointError,
    check_checkpoint_file,
    checkpoint_file,
    rank_state,
    recv_state,
    seal,
    send_state,
    verify,
)
from lightning_app_rlhf.config import GenerationConfig, PPOConfig
from lightning_app_rlhf.engine import SKIPPED_UPDATES, RLHFEngine, micro_batch_count
from lightning_app_rlhf.experience import RewardShaping
from lightning_app_rlhf.generation import Rollout, repeat_samples
from lightning_app_rlhf.memory import RoleMemory
from lightning_app_rlhf.placement import Placement
from lightning_app_rlhf.ppo import AdaptiveKLController, FixedKLController, RunningMoments
from lightning_app_rlhf.role_table import ACTOR, CRITIC, REFERENCE, REWARD, ROLES
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
    hold_in,
    is_lora,
    load_tokenizer,
    reference_source,
    resolve_import,
    role_precisions,
    tokenizer_files,
)
from lightning_app_rlhf.wrappers import DDPWrapper, RoleWrapper

ModelSource = ModelSpec | dict[str, Any] | str

EPOCH_METRICS = ("reward/mean", "kl/mean", "response/length_mean")
"""Also logged as ``{name}_epoch``: the mean over the epoch's iterations, for ``ModelCheckpoint`` and
``EarlyStopping`` to judge the epoch rather than its last batch."""
EPOCH_SYNC_ADVICE = (r"It is recommended to use `self\.log\('((val|test)/(reward/mean|response/length_mean)|"
                     r"(reward/mean|kl/mean|response/length_mean)_epoch)', \.\.\., sync_dist=True\)`")
"""Lightning's warning about our epoch metrics, which are equal on every rank (silenced in :meth:`RLHFModule.setup`)."""


def _default_optimizer(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-5, foreach=True)  # one kernel per step for all tensors, not one per tensor


class RLHFModule(pl.LightningModule):
    """RLHF of a causal LM: PPO with a critic, or a critic-free algorithm (GRPO, Dr. GRPO, RLOO, REINFORCE++),
    with a frozen reference and a reward model or function.

    Args:
        actor: The policy: a :class:`ModelSpec`, its fields as a dict, or a local model directory.
        tokenizer: The actor's tokenizer, a local directory, or ``"package.module:function"`` building one.
        algorithm: ``ppo``, ``grpo``, ``dr_grpo``, ``rloo``, ``reinforce_pp`` or ``reinforce_pp_baseline`` (or
            any name registered with :func:`~lightning_app_rlhf.algorithms.register_algorithm`). Only ``ppo``
            has a critic.
        critic: The value model's backbone (``ppo`` only). Defaults to the actor's spec (a fresh copy, with a value
            head, and the actor's LoRA settings if it has any).
        reference: The frozen reference policy. Defaults to an exact copy of the initial actor; for a LoRA actor,
            to the actor's own base model with its adapters disabled (no second copy). ``{"precision": "bf16-true"}``
            (no path or config): the actor's copy at that precision.
        reward_model: A sequence classifier with one label. Give this or ``reward_fn``.
        reward_fn: ``(prompts, responses, **row_fields) -> scores`` on decoded text, or its import path. It also
            receives the prompt rows' other fields (e.g. ``answer``) when its signature names them.
        generation: Sampling settings for rollouts (``num_samples`` responses per prompt).
        ppo: Hyper-parameters of the update, for every algorithm.
        actor_optimizer: Builds the actor's optimizer from its parameters. Default: AdamW, lr 1e-5.
        critic_optimizer: Builds the critic's optimizer (``ppo`` only). Default: AdamW, lr 1e-5.
        actor_scheduler: Builds the actor's LR scheduler; stepped once per iteration.
        critic_scheduler: Builds the critic's LR scheduler; stepped once per iteration.
        seed: Keys sampling noise and minibatch order. Default: the seed of ``seed_everything``, else 0.
        eval_generation: Sampling settings of ``validate``, ``test`` and ``predict`` (one response per prompt).
            Default: ``generation``'s, greedy (``do_sample=False``).
        preemption_checkpoint: Stop cleanly on SIGTERM (and SLURM's requeue signal) under the Trainer: unless the
            Trainer has a :class:`~lightning_app_rlhf.callbacks.PreemptionCheckpoint`, one is added (finish the
            iteration, save, exit 0). ``False`` (``--model.preemption_checkpoint false``) leaves Lightning's own
            stop, without a checkpoint.
    """

    def __init__(
        self,
        actor: ModelSource,
        tokenizer: str | PreTrainedTokenizerBase,
        critic: ModelSource | None = None,
        reference: ModelSource | None = None,
        reward_model: ModelSource | None = None,
        reward_fn: Callable[..., Any] | str | None = None,
        generation: GenerationConfig = GenerationConfig(),
        ppo: PPOConfig = PPOConfig(),
        actor_optimizer: OptimizerCallable | None = None,
        critic_optimizer: OptimizerCallable | None = None,
        actor_scheduler: LRSchedulerCallable | None = None,
        critic_scheduler: LRSchedulerCallable | None = None,
        seed: int | None = None,
        algorithm: str = "ppo",
        eval_generation: GenerationConfig | None = None,
        preemption_checkpoint: bool = True,
    ) -> None:
        super().__init__()
        self._save_plain_hyperparameters(locals())
        if (reward_model is None) == (reward_fn is None):
            raise ValueError(
                "Give exactly one reward: `reward_model` (a sequence classifier) or `reward_fn` (a function "
                f"`(prompts, responses) -> scores`). Got reward_model={reward_model!r}, reward_fn={reward_fn!r}. "
                "Checkpoints keep a reward function only as its import path: with "
                "`RLHFModule.load_from_checkpoint(path, reward_fn=...)` pass a function object again."
            )
        self.automatic_optimization = False
        self.generation = _as_config(GenerationConfig, generation)
        self.eval_generation = dataclasses.replace(_as_config(GenerationConfig, eval_generation or generation),
                                                   num_samples=1, **({} if eval_generation else {"do_sample": False}))
        self.ppo = _as_config(PPOConfig, ppo)
        self.algorithm = build_algorithm(algorithm, self.ppo, self.generation)
        if self.ppo.scale_rewards != "group" and self.algorithm.name != "grpo":
            raise ValueError(f"ppo.scale_rewards={self.ppo.scale_rewards!r} applies to algorithm 'grpo' only, not "
                             f"{self.algorithm.name!r}: remove it, or use --model.algorithm grpo.")
        self._check_critic_arguments(critic, critic_optimizer, critic_scheduler)
        self.actor_spec = as_model_spec(actor, "actor")
        self.critic_spec = (as_model_spec(critic, "critic") if critic is not None else self.actor_spec) if self.has_critic else None
        # {"precision": ...} alone: the actor's copy, held at that precision.
        self.reference_spec, self.reference_precision = reference_source(reference)
        self.reward_spec = as_model_spec(reward_model, "reward model") if reward_model is not None else None
        self._check_lora_specs()
        self.reward_fn: RewardFunction | None = resolve_import(reward_fn) if isinstance(reward_fn, str) else reward_fn
        self.tokenizer = load_tokenizer(tokenizer)
        if reward_model is not None and self.tokenizer.pad_token_id == self.tokenizer.eos_token_id:
            warnings.warn("The tokenizer's pad token is its EOS token: Hugging Face sequence classifiers skip trailing "
                          "pad ids, so the reward model scores the token before EOS. Add a distinct pad token if "
                          "the reward model was trained to read EOS.")
        # Named `{role}_optimizer` / `{role}_scheduler`, as the arguments: configure_optimizers finds them by role.
        self.actor_optimizer = actor_optimizer or _default_optimizer
        self.critic_optimizer = (critic_optimizer or _default_optimizer) if self.has_critic else None
        self.actor_scheduler = actor_scheduler
        self.critic_scheduler = critic_scheduler
        self.seed = seed if seed is not None else int(os.environ.get("PL_GLOBAL_SEED", "0"))
        self.preemption_checkpoint = preemption_checkpoint
        self.shaping = RewardShaping(self.ppo, self.tokenizer.eos_token_id)
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
        self.role_wrappers: dict[str, RoleWrapper] = {}
        """Role -> its wrapper on this rank (the roles it trains, and frozen roles the plan shards here); set by
        the strategy. A plain dict, so wrapped modules are not registered as submodules."""
        self.learning_rates: dict[str, float] = {}
        """``lr-{role}`` (and ``-momentum``, ``-weight_decay``) of each trained role's first parameter group, on
        every rank whichever ranks hold the optimizers; refreshed at the start of fit and after every iteration."""
        self._latest: tuple[Rollout, torch.Tensor] | None = None

    def _save_plain_hyperparameters(self, arguments: dict[str, Any]) -> None:
        """Save the arguments as plain data (specs and configs as dicts; no objects, so a weights-only load reads
        them). A tokenizer object is embedded in checkpoints (see :meth:`on_save_checkpoint`); a reward function is
        saved as its import path when it has one; optimizer and scheduler builders (code) are not saved."""
        plain = {}
        for name, value in arguments.items():
            if name in ("self", "__class__"):
                continue
            if dataclasses.is_dataclass(value):
                value = dataclasses.asdict(value)
            elif isinstance(value, PreTrainedTokenizerBase):
                value = f"<{type(value).__name__}: embedded in checkpoints>"
            elif callable(value):  # a reward function by its import path; builders of optimizers are not saved
                value = _import_path(value) if name == "reward_fn" else None
            plain[name] = value
        self.save_hyperparameters(plain)

    @property
    def has_critic(self) -> bool:
        return CRITIC.name in self.algorithm.roles

    @property
    def kl_controller(self) -> AdaptiveKLController | FixedKLController:
        return self.shaping.kl_controller

    @property
    def reward_moments(self) -> RunningMoments:
        return self.shaping.reward_moments

    @property
    def reference_shares_actor(self) -> bool:
        """Whether the reference is the LoRA actor's base with adapters disabled, rather than a model of its own."""
        return self.reference_spec is None and self.actor_spec.lora is not None

    def _check_critic_arguments(self, critic: Any, optimizer: Any, scheduler: Any) -> None:
        if self.has_critic:
            return
        given = [name for name, value in (("critic", critic), ("critic_optimizer", optimizer),
                                          ("critic_scheduler", scheduler)) if value is not None]
        if given:
            raise ValueError(f"Algorithm {self.algorithm.name!r} has no critic, but {given} were given. Remove them "
                             "(from the config's model section too), or use algorithm='ppo'.")

    def _check_lora_specs(self) -> None:
        if self.reference_shares_actor and self.reference_precision is not None:
            raise ValueError("A LoRA actor's reference is its own base model with the adapters off, so it computes at "
                             "the actor's precision: remove the reference's `precision`, or give a `reference` model "
                             "spec of its own.")
        check_no_lora("reference", self.reference_spec)
        check_no_lora("reward_model", self.reward_spec)
        if self.reference_shares_actor and self.actor_spec.lora.get("bias", "none") != "none":
            raise ValueError(f"actor.lora.bias={self.actor_spec.lora['bias']!r} trains the base model's biases, so the "
                             "base with adapters disabled would drift from the initial actor and could not serve as "
                             "the reference. Use bias='none', or give a separate `reference` model.")

    def _placement(self) -> Placement:
        if self.placement is None:
            self.placement = Placement.single_process(self.device, self.algorithm.roles)
        return self.placement

    def role_module(self, role: str) -> nn.Module | None:
        """The module of ``role`` on this rank (None where this rank does not hold it)."""
        return getattr(self, next(entry.attribute for entry in ROLES if entry.name == role))

    @override
    def configure_model(self) -> None:
        if any(self.role_module(r) is not None for r in self.algorithm.roles):
            return
        placement = self._placement()
        placement.plan.check_roles(self.algorithm.roles, self.algorithm.name)
        if self.reference_shares_actor:
            placement.plan.validate_shared_reference()
        # Each rank builds only the roles its calls need; random init is seeded per role, so every copy of
        # a role (trained weights or a shadow) starts identical on every rank.
        if placement.holds(ACTOR.name):
            self.actor = self._as_shadow(ACTOR.name, build_causal_lm(self.actor_spec))
        if placement.holds(REFERENCE.name):
            self.reference = self._build_reference()
        if self.has_critic and placement.holds(CRITIC.name):
            self.critic = self._as_shadow(CRITIC.name, build_critic(self.critic_spec))
        if self.reward_spec is not None and placement.holds(REWARD.name):
            self.reward_model = build_reward_model(self.reward_spec, self.tokenizer.pad_token_id)
        check_vocabularies(self.tokenizer, self.actor, self.reference, self.critic, self.reward_model)

    def _as_shadow(self, role: str, module: nn.Module) -> nn.Module:
        """A trained role built on a rank that does not train it (a Separation shadow), held at the role's
        ``shadow_precision``."""
        spec = self.actor_spec if role == ACTOR.name else self.critic_spec
        return module if self._placement().runs(f"{role}.train") else hold_in(module, spec.shadow_precision)

    def _build_reference(self) -> nn.Module:
        if self.reference_shares_actor:
            return AdapterDisabledReference(self.actor)  # type: ignore[return-value]
        if self.reference_spec is None:
            # A copy of the initial actor: the actor here unless it is a shadow cast to bf16, else built from its spec
            # (the same seeded weights).
            if self.actor is not None and next(self.actor.parameters()).dtype == self.actor_spec.param_dtype:
                return hold_in(build_reference(self.actor, None), self.reference_precision)
            spec = dataclasses.replace(self.actor_spec, precision=self.reference_precision, shadow_precision=None)
            return freeze(build_causal_lm(spec))
        return freeze(build_causal_lm(self.reference_spec))

    def role_precisions(self) -> dict[str, str]:
        """Each model role's precision (``32-true``, ``bf16-mixed`` or ``bf16-true``): its spec's, else the
        ``Trainer``'s or Fabric's ``precision`` (docs/api.md, "Precision"). Raises a ``ValueError`` naming the fix for
        a combination that cannot hold."""
        run = "32-true"
        if self._trainer is not None:
            run = self.trainer.precision
        elif self._fabric is not None:
            run = self._fabric.strategy.precision.precision
        explicit: dict[str, str | None] = {ACTOR.name: self.actor_spec.precision}
        if self.has_critic:
            explicit[CRITIC.name] = self.critic_spec.precision
        explicit[REFERENCE.name] = (self.reference_spec.precision if self.reference_spec is not None
                                    else self.reference_precision)
        if self.reward_spec is not None:
            explicit[REWARD.name] = self.reward_spec.precision
        resolved = role_precisions(explicit, self.algorithm.trainable_roles, run)
        if self.reference_shares_actor:
            resolved[REFERENCE.name] = resolved[ACTOR.name]
        return resolved

    @override
    def setup(self, stage: str) -> None:
        self._refuse_tuner_callbacks()
        # Our epoch-level metrics are already global and equal on every rank (gathered, then logged everywhere), so
        # Lightning's advice to sync them across devices does not apply (the placement strategies leave
        # `is_distributed` unset on purpose: see PlacementStrategy).
        warnings.filterwarnings("ignore", message=EPOCH_SYNC_ADVICE, category=PossibleUserWarning)
        self._use_atomic_checkpoint_io()
        precision = str(getattr(self.trainer, "precision", "32-true")) if self._trainer is not None else "32-true"
        if precision.startswith("16"):
            raise ValueError(f"precision={precision!r} needs a gradient scaler, which the update does not use. "
                             "Use precision='bf16-mixed' (or 'bf16-true', '32-true').")
        self.role_precisions()  # a contradictory per-role precision fails here, before any model is built
        datamodule = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        batch_size = getattr(datamodule, "batch_size", None)
        if stage == "fit" and batch_size is not None:
            self._check_minibatches(batch_size)
        if stage == "fit" and getattr(datamodule, "has_val_prompts", True) is False:
            self.trainer.limit_val_batches = 0  # no held-out prompts: no validation, and no warning about it
        path = self.trainer.ckpt_path if self._trainer is not None else None
        if stage == "fit" and path is not None and "://" not in str(path):
            check_checkpoint_file(path)  # before any model is built; a bare EOFError would name no file

    def _use_atomic_checkpoint_io(self) -> None:
        """Where the user left Lightning's default writer, write checkpoints atomically beside the target and read
        them with the file checked first (as the placement strategies do)."""
        from lightning.fabric.plugins import TorchCheckpointIO

        from lightning_app_rlhf.strategies.atomic_checkpoint_io import AtomicCheckpointIO

        if self._trainer is not None and type(self.trainer.strategy.checkpoint_io) is TorchCheckpointIO:
            self.trainer.strategy.checkpoint_io = AtomicCheckpointIO()

    def _refuse_tuner_callbacks(self) -> None:
        if self._trainer is None:
            return
        for callback in self.trainer.callbacks:
            if isinstance(callback, LearningRateFinder):
                raise ValueError("lr_find / LearningRateFinder does not apply to RLHF: its sweep reads the lr off "
                                 "a loss curve, and an RLHF loss is measured on rollouts the policy itself keeps "
                                 "changing, so its minimum says nothing about the lr. Set the lr in the optimizers "
                                 "(model.actor_optimizer, model.critic_optimizer) and watch reward/mean and "
                                 "kl/mean. For batch sizes, Tuner.scale_batch_size scales data.batch_size, and the "
                                 "PlacementTuner callback picks the generation and micro-batch sizes per placement.")

    def _check_minibatches(self, prompts: int) -> None:
        """Raise a ``ValueError`` naming the fix unless ``prompts`` per iteration, times ``generation.num_samples``,
        split into the minibatches and over the ranks of every call."""
        group = self.generation.num_samples
        samples = prompts * group
        size = f"{samples}" if group == 1 else f"{samples} ({prompts} prompts x generation.num_samples={group})"
        fix = "data.batch_size" if group == 1 else "data.batch_size (or generation.num_samples)"
        if samples % self.ppo.num_minibatches:
            raise ValueError(f"The rollout batch size {size} is not divisible by ppo.num_minibatches="
                             f"{self.ppo.num_minibatches}. Pick a {fix} that makes it a multiple of it, or a "
                             f"num_minibatches that divides {samples}.")
        plan = self._placement().plan
        widest = max(plan.calls, key=lambda call: len(plan.ranks(call)))
        if samples < len(plan.ranks(widest)):
            what = f"{prompts} prompts" if group == 1 else f"{size} samples"
            raise ValueError(f"The rollout batch of {what} is split over the {len(plan.ranks(widest))} ranks of "
                             f"{widest!r}: raise {fix} to at least that.")
        minibatch = samples // self.ppo.num_minibatches
        for role in self.algorithm.trainable_roles:
            ranks = len(plan.ranks(f"{role}.train"))
            if minibatch < ranks:
                times_g = " x num_samples" if group > 1 else ""
                raise ValueError(f"Each PPO minibatch of {minibatch} samples is split over the {ranks} ranks of "
                                 f"'{role}.train': raise data.batch_size or lower ppo.num_minibatches so that "
                                 f"batch_size{times_g} / num_minibatches >= {ranks}.")
            self._check_micro_batches(role, minibatch, ranks)

    def _check_micro_batches(self, role: str, minibatch: int, ranks: int) -> None:
        """Every rank of a train group runs the same number of micro-batches (a sharded wrapper's passes are
        collectives), so the smallest share of a minibatch needs at least that many samples."""
        size = self.ppo.micro_batch_size
        if size is None:
            return
        smallest = minibatch // ranks
        if smallest >= micro_batch_count(minibatch, ranks, size):
            return
        fits = next(m for m in range(size, minibatch + 1) if micro_batch_count(minibatch, ranks, m) <= smallest)
        raise ValueError(f"ppo.micro_batch_size={size} splits the largest share of a {minibatch}-sample minibatch "
                         f"over the {ranks} ranks of '{role}.train' into {micro_batch_count(minibatch, ranks, size)} "
                         f"micro-batches, and every rank must run as many, but the smallest share has {smallest} "
                         f"samples. Use ppo.micro_batch_size >= {fits}, or a minibatch divisible by {ranks}.")

    def trained_roles(self) -> list[str]:
        """The trainable roles whose train call runs on this rank, in optimizer order."""
        return [role for role in self.algorithm.trainable_roles if self._placement().runs(f"{role}.train")]

    def scheduled_roles(self) -> list[str]:
        """The roles of :meth:`trained_roles` that have an LR scheduler, in scheduler order."""
        return [role for role in self.trained_roles() if getattr(self, f"{role}_scheduler") is not None]

    @override
    def configure_optimizers(self) -> Any:
        optimizers, schedulers = [], []
        for role in self.trained_roles():
            build_optimizer, build_scheduler = getattr(self, f"{role}_optimizer"), getattr(self, f"{role}_scheduler")
            optimizer = build_optimizer(p for p in self.role_module(role).parameters() if p.requires_grad)
            optimizers.append(optimizer)
            if build_scheduler is not None:
                schedulers.append(build_scheduler(optimizer))
        return optimizers, schedulers

    @override
    def configure_callbacks(self) -> list[pl.Callback]:
        from lightning_app_rlhf.callbacks.placement_summary import PlacementSummary
        from lightning_app_rlhf.callbacks.preemption_checkpoint import PreemptionCheckpoint
        from lightning_app_rlhf.callbacks.progress_bar import RLHFProgressBar
        from lightning_app_rlhf.callbacks.role_lr_monitor import RoleLearningRateMonitor

        have = self.trainer.callbacks
        # Once per trainer: validate and predict after fit would otherwise replace it, with a note saying so.
        callbacks: list[pl.Callback] = [] if any(isinstance(c, PlacementSummary) for c in have) else [PlacementSummary()]
        # A user's LearningRateMonitor sees only this rank's optimizers, named by class; Lightning replaces a
        # callback with a subclass of it returned here.
        monitor = next((c for c in have if type(c) is LearningRateMonitor), None)
        if monitor is not None:
            callbacks.append(RoleLearningRateMonitor.like(monitor))
        # Lightning's RichProgressBar reads "Epoch 0/-2" when max_steps (iterations) ends the run.
        bar = next((c for c in have if type(c) is RichProgressBar), None)
        if bar is not None:
            callbacks.append(RLHFProgressBar.like(bar))
        # A clean stop on SIGTERM by default; a user's own (e.g. with a dirpath) is kept, as returning one here
        # would replace it.
        if self.preemption_checkpoint and not any(isinstance(c, PreemptionCheckpoint) for c in have):
            callbacks.append(PreemptionCheckpoint())
        return callbacks

    def attach_optimizers(self, optimizers: list[Any]) -> None:
        """Give each trained role's wrapper its optimizer (in :meth:`trained_roles` order), with this module's
        backward and optimizer step (Lightning's precision plugin and hooks) and the configured clipping. The
        strategy calls it once the wrappers and the optimizers exist."""
        for role, optimizer in zip(self.trained_roles(), optimizers, strict=True):
            self.role_wrappers[role].attach_optimizer(
                getattr(optimizer, "optimizer", optimizer),  # a Fabric or Lightning optimizer wraps the torch one
                self.ppo.max_grad_norm, self.manual_backward, self._optimizer_step,
            )

    def gather_memory(self) -> list[list[RoleMemory]]:
        """Every rank's :class:`RoleMemory` rows, on every rank (a collective: call it on every rank)."""
        return self.engine.gather_memory()

    @property
    def engine(self) -> RLHFEngine:
        """The model calls of one iteration over the roles this rank holds now."""
        return RLHFEngine(self._placement(), self.algorithm, self.generation, self.ppo, self.tokenizer, self.shaping,
                          self.role_module, self._wrappers(), self.reward_fn, self.seed,
                          precisions=self.role_precisions(), shadow_precisions=self.shadow_precisions())

    def shadow_precisions(self) -> dict[str, str]:
        """Trained role -> the precision its non-training copies are held at, where it is ``bf16-true``."""
        specs = {ACTOR.name: self.actor_spec, CRITIC.name: self.critic_spec}
        return {role: "bf16-true" for role in self.algorithm.trainable_roles
                if specs[role] is not None and specs[role].shadow_precision == "bf16-true"}

    def _wrappers(self) -> dict[str, RoleWrapper]:
        """The strategy's wrappers; under a Trainer without a placement strategy (one process), plain ones."""
        if not self.role_wrappers and self.trained_roles():
            for role in self.trained_roles():
                self.role_wrappers[role] = DDPWrapper(self.role_module(role), None, 1, 0, self.device)
                self.role_wrappers[role].wrap()
            optimizers = self.optimizers()
            self.attach_optimizers(optimizers if isinstance(optimizers, list) else [optimizers])
        return self.role_wrappers

    # ---- one iteration ----

    @override
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        iteration, engine = self.iteration, self.engine
        self._check_minibatches(batch["input_ids"].shape[0])
        if self._fabric is not None and not self.learning_rates:
            self.refresh_learning_rates()  # Fabric calls no on_train_start
        batch = repeat_samples(batch, self.generation.num_samples)
        overlap = self._placement().plan.overlap
        times = {"start": _now(self.device)}
        local = engine.generate_shard(batch, iteration)
        times["generated"] = _now(self.device)
        if overlap:
            # One-step off-policy: the training group updates on the previous rollout while the generation group
            # sampled this one; both meet in the gathers below.
            train_stats, trained_on = self._train(engine, self.pending_experience)
            times["trained"] = _now(self.device)
        rollout = engine.gather_rollout(batch, local)
        experience, stats, scores = engine.score_rollout(rollout, iteration, batch.get("fields"))
        self._latest = (rollout, scores)
        times["scored"] = _now(self.device)
        if overlap:
            self.pending_experience = experience
        else:
            train_stats, trained_on = self._train(engine, experience)
            times["trained"] = _now(self.device)
        stats.update(train_stats)
        stats["reallocate/bytes"] = float(sum(engine.reallocate_shadows())) if trained_on is not None else 0.0
        times["reallocated"] = _now(self.device)
        if overlap:
            stats["overlap/staleness"] = float(iteration - trained_on.iteration) if trained_on is not None else 0.0
        samples = len(rollout.sequences)
        self.kl_controller.update(stats["kl/mean"].item(), n_samples=samples)
        self._step_schedulers()
        self._count_one_optimizer_step()
        stats.update(_timings(times, overlap, samples, rollout.response_mask.sum().item()))
        if self._fabric is not None:
            stats.update(self.learning_rates)  # the lr of this iteration (no LearningRateMonitor under Fabric)
        self._log_stats(stats, samples)
        self.refresh_learning_rates()

    @override
    def on_train_start(self) -> None:
        self.refresh_learning_rates()

    def refresh_learning_rates(self) -> None:
        """Fill :attr:`learning_rates` on every rank from the ranks that hold each trained role's optimizer
        (a collective: call it on every rank)."""
        if self._fabric is None and self._trainer is not None and self.trainer.state.fn != "fit":
            return
        placement, rates = self._placement(), {}
        for role in self.algorithm.trainable_roles:
            names = [f"lr-{role}", f"lr-{role}-momentum", f"lr-{role}-weight_decay"]
            mine = None
            if placement.runs(f"{role}.train"):
                group = self._wrappers()[role].optimizer.param_groups[0]
                momentum = group.get("momentum", group.get("betas", (0.0,))[0])
                values = (group.get("lr", 0.0), momentum, group.get("weight_decay", 0.0))
                mine = {name: torch.tensor(float(v), device=self.device) for name, v in zip(names, values)}
            stats = placement.broadcast_stats(f"{role}.train", mine, names)
            rates.update({name: float(value) for name, value in stats.items()})
        self.learning_rates = rates

    def latest_completions(self, max_rows: int | None = None) -> list[dict[str, Any]]:
        """Prompt, completion and raw reward of the last training iteration's rollout (every rank has it), at most
        ``max_rows`` rows; empty before the first iteration."""
        if self._latest is None:
            return []
        rollout, scores = self._latest
        rows = slice(0, max_rows)
        return [{"prompt": prompt, "completion": completion, "reward": float(score)}
                for prompt, completion, score in zip(*self._decode(rollout.select(rows)), scores[rows].tolist())]

    def _decode(self, rollout: Rollout) -> tuple[list[str], list[str]]:
        """Prompt texts (padding dropped) and completion texts (up to and including the stop token)."""
        prompt_mask = rollout.attention_mask[:, : rollout.prompt_length].bool()
        prompts = [self.tokenizer.decode(ids[mask]) for ids, mask in
                   zip(rollout.sequences[:, : rollout.prompt_length], prompt_mask)]
        completions = [self.tokenizer.decode(ids[mask]) for ids, mask in
                       zip(rollout.responses, rollout.response_mask.bool())]
        return prompts, completions

    # ---- evaluation: validate, test, predict ----

    @override
    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self._evaluate(batch, "val")

    @override
    def test_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self._evaluate(batch, "test")

    @override
    def predict_step(self, batch: dict[str, Any], batch_idx: int) -> list[dict[str, Any]]:
        """Completions of a batch of prompts with ``eval_generation``: per prompt, its text, the completion's text
        and token ids (up to and including the stop token), and the reward's score."""
        rollout, scores = self._sample_and_score(batch)
        prompts, completions = self._decode(rollout)
        ids = [response[mask.bool()].tolist() for response, mask in zip(rollout.responses, rollout.response_mask)]
        return [{"prompt": p, "completion": c, "completion_ids": i, "reward": float(r), "index": int(index)}
                for p, c, i, r, index in zip(prompts, completions, ids, scores.tolist(), batch["index"].tolist())]

    def _evaluate(self, batch: dict[str, Any], stage: str) -> None:
        rollout, scores = self._sample_and_score(batch)
        size = len(scores)
        # Every rank holds the whole batch's results (gathered), so no sync_dist: the means are already global.
        self.log(f"{stage}/reward/mean", scores.float().mean(), on_epoch=True, batch_size=size, prog_bar=True)
        self.log(f"{stage}/response/length_mean", rollout.response_mask.sum(1).float().mean(), on_epoch=True,
                 batch_size=size)

    def _sample_and_score(self, batch: dict[str, Any]) -> tuple[Rollout, torch.Tensor]:
        """``actor.generate`` (with ``eval_generation``) and ``reward.forward`` on a batch, on their groups."""
        engine = RLHFEngine(self._placement(), self.algorithm, self.eval_generation, self.ppo, self.tokenizer,
                            self.shaping, self.role_module, self.role_wrappers, self.reward_fn, self.seed,
                            precisions=self.role_precisions(), shadow_precisions=self.shadow_precisions())
        return engine.sample_and_score(repeat_samples(batch, 1), self.iteration)

    def _train(
        self, engine: RLHFEngine, experience: Experience | None
    ) -> tuple[dict[str, torch.Tensor], Experience | None]:
        """Every train call on ``experience``; nothing when there is none yet or every score was skipped. The
        roles' skipped updates are summed into one ``train/skipped_updates``."""
        if experience is None or not bool(experience.response_mask.any()):
            return {SKIPPED_UPDATES: 0.0}, None
        stats: dict[str, Any] = {SKIPPED_UPDATES: 0.0}
        # Role-table order, as lightning_app_rlhf.iteration describes it (with a reused critic forward, its graph is
        # kept through the actor's train call).
        for role in self.algorithm.trainable_roles:
            role_stats = engine.train_role(role, experience)
            stats[SKIPPED_UPDATES] += role_stats.pop(SKIPPED_UPDATES)
            stats.update(role_stats)
        return stats, experience

    # ---- export ----

    def export_actor(self, directory: str | os.PathLike[str], merge: bool = True) -> Path | None:
        """Save the trained actor and the tokenizer in Hugging Face format.

        Call it on every rank. The lowest rank of ``actor.train``, which holds the trained weights, writes and
        returns the directory; the other ranks return None. An actor sharded over its train group (FSDP2, ZeRO-3)
        is gathered first: a collective over that group.

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
        gathered = self._gather_sharded_actor() if placement.sharded_here(ACTOR.name) else None
        if placement.rank != placement.leader(ACTOR.call("train")):
            return None
        if self.actor is None:
            raise RuntimeError("The actor is not built yet: export after `fit` (or after `configure_model`).")
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        if not merge:
            self.actor.save_pretrained(path)  # peft writes the adapter from whichever rank calls it
        elif is_lora(self.actor):
            # Merge into a copy: the live actor keeps its adapters (and its reference, the base with them off).
            save_hf_model(copy.deepcopy(self.actor).merge_and_unload(), path)
        else:
            save_hf_model(self.actor, path, gathered)
        self.tokenizer.save_pretrained(path)
        return path

    def _gather_sharded_actor(self) -> dict[str, torch.Tensor]:
        """The sharded actor's full weights (every rank of ``actor.train`` takes part)."""
        if self.actor_spec.lora is not None:
            raise ValueError(f"Exporting a LoRA actor sharded with {self._placement().plan.wrappers[ACTOR.name]} is "
                             "not supported: train a LoRA actor with wrapper 'ddp' (its adapters are small).")
        if not all(p.requires_grad for p in self.actor.parameters()):
            raise ValueError("Exporting a sharded actor with frozen parameters is not supported: train every "
                             "parameter, or use wrapper 'ddp'.")
        return self._full_trainable_weights(ACTOR.name)

    def _full_trainable_weights(self, role: str) -> dict[str, torch.Tensor]:
        """The trainable parameters of a sharded role, whole, by name, on the CPU: a collective over its train
        group, a bucket at a time (the device never holds the whole role)."""
        names = iter([name for name, p in self.role_module(role).named_parameters() if p.requires_grad])
        return {next(names): p.detach().cpu().clone() for bucket in self.role_wrappers[role].full_parameter_buckets()
                for p in bucket}

    def gather_trained_weights(self) -> dict[str, dict[str, torch.Tensor]] | None:
        """Each trained role's weights, whole and on the CPU, on global rank 0 (None on the other ranks): what a
        ``fork`` or ``spawn`` launch hands back to the main process. Collective: every rank calls it.

        A whole role comes from the leader of its train call, all of its state dict; a sharded role (FSDP2, ZeRO-3)
        is gathered over its train group first, its trainable parameters only (frozen ones never change)."""
        placement = self._placement()
        gathered: dict[str, dict[str, torch.Tensor]] = {}
        for role in self.algorithm.trainable_roles:
            leader = placement.leader(f"{role}.train")
            state = None
            if placement.sharded_here(role):
                state = self._full_trainable_weights(role)
            elif placement.rank == leader:
                state = {name: tensor.detach() for name, tensor in self.role_module(role).state_dict().items()}
            if leader != 0 and placement.rank == leader:
                send_state({name: tensor.to(placement.device) for name, tensor in state.items()}, dst=0)
            elif leader != 0 and placement.rank == 0:
                state = recv_state(leader, placement.device)
            if placement.rank == 0:
                gathered[role] = {name: tensor.cpu() for name, tensor in state.items()}
        return gathered if placement.rank == 0 else None

    def load_trained_weights(self, weights: dict[str, dict[str, torch.Tensor]]) -> None:
        """Load what :meth:`gather_trained_weights` returned, building every role first where none is built (the
        main process of a ``fork`` or ``spawn`` launch, where no model was built)."""
        if all(self.role_module(role) is None for role in self.algorithm.roles):
            self.configure_model()
        for role, state in weights.items():
            result = self.role_module(role).load_state_dict(state, strict=False)
            if result.unexpected_keys:
                raise RuntimeError(f"The trained {role} does not match the {role} built here: unexpected weights "
                                   f"{result.unexpected_keys[:5]}. Build the module with the same model specs.")

    # ---- Trainer or Fabric ----

    @property
    def iteration(self) -> int:
        """Iterations done: ``global_step`` under the Trainer, a counter of our own under Fabric."""
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
        """Advance ``global_step`` by exactly one per iteration, however many optimizer steps it took.

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
        epoch = {f"{k}_epoch": values[k] for k in EPOCH_METRICS if k in values and not math.isnan(values[k])}
        self.log_dict(epoch, on_step=False, on_epoch=True, batch_size=batch_size)

    # ---- checkpoint state beyond weights and optimizers ----

    @classmethod
    @override
    def load_from_checkpoint(  # type: ignore[override]
        cls, checkpoint_path: str | os.PathLike[str], map_location: Any = None, hparams_file: Any = None,
        strict: bool | None = None, **kwargs: Any,
    ) -> RLHFModule:
        """Lightning's ``load_from_checkpoint``, weights-only (a crafted file cannot run code), with the file checked
        first. The saved hyperparameters rebuild the module; keyword arguments override them (e.g. ``reward_fn``,
        which is saved only as an import path)."""
        if kwargs.pop("weights_only", True) is False:
            raise ValueError("RLHFModule checkpoints load with weights_only=True only: drop weights_only=False.")
        check_checkpoint_file(checkpoint_path)
        path = checkpoint_file(checkpoint_path)
        return super().load_from_checkpoint(path, map_location=map_location, hparams_file=hparams_file,
                                            strict=strict, weights_only=True, **kwargs)

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        hparams = checkpoint.get(self.CHECKPOINT_HYPER_PARAMS_KEY)
        if hparams is not None and str(hparams.get("tokenizer", "")).startswith("<"):
            # A tokenizer object: its files, so load_from_checkpoint rebuilds it without the original.
            checkpoint[self.CHECKPOINT_HYPER_PARAMS_KEY] = {**hparams, "tokenizer": tokenizer_files(self.tokenizer)}
        checkpoint["rlhf"] = {
            # Plain tensors and ints, so weights-only loading accepts the checkpoint.
            "pending_experience": vars(self.pending_experience) if self.pending_experience is not None else None,
            **self.shaping.state_dict(),
            "seed": self.seed,
            "algorithm": self.algorithm.name,
        }
        if not self._placement().distributed:  # a placement strategy seals the file it assembles on rank 0
            seal(checkpoint)

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        path = self.trainer.ckpt_path if self._trainer is not None else None
        verify(checkpoint, path)
        if OPTIMIZERS_KEY in checkpoint:  # one entry per role (a placement strategy saved it): take this rank's
            held = [role for role in self.algorithm.roles if self.role_module(role) is not None]
            rank_state(checkpoint, held, self.trained_roles(), self.scheduled_roles(), path)
        elif "rlhf_ranks" in checkpoint:
            saved = checkpoint["rlhf_plan"]
            raise CheckpointError(f"Checkpoint {path} keeps each of its {saved['world_size']} ranks' state apart (the "
                                  "layout of earlier versions), and this run has no placement strategy to pick its "
                                  f"rank's part. Resume with the strategy it was saved with ({saved['name']!r}) and "
                                  f"--trainer.devices {saved['world_size']}.")
        _check_role_shapes(self, checkpoint, path)  # before any weight loads, which would name no role nor fix
        state = checkpoint.get("rlhf")
        if state is not None:
            saved = state.get("algorithm", "ppo")
            if saved != self.algorithm.name:
                raise ValueError(f"The checkpoint was trained with algorithm {saved!r}; this run uses "
                                 f"{self.algorithm.name!r}. Resume with --model.algorithm {saved}, or start a new run.")
            self.shaping.load_state_dict(state)
            self.seed = state["seed"]
            pending = state.get("pending_experience")
            self.pending_experience = Experience(**pending).to(self.device) if pending is not None else None


def _check_role_shapes(module: RLHFModule, checkpoint: dict[str, Any], path: Any) -> None:
    """Raise a :class:`CheckpointError` naming the role and the parameters when the weights saved for a role this
    rank holds do not fit its module: a shape changed (``saved [512, 32], now [512, 64]``), or parameters are
    missing or extra (another number of layers, LoRA on or off), with the model settings that differ from the
    saved hyperparameters. A role the checkpoint keeps as shards (FSDP2, ZeRO) is left to its wrapper's loader; a
    role this rank does not hold is checked by the ranks that hold it."""
    saved = checkpoint.get("state_dict")
    if not isinstance(saved, dict):
        return
    layout = checkpoint.get(LAYOUT_KEY) or {}
    strict = getattr(module, "strict_loading", True)
    problems, attributes = [], []
    for entry in ROLES:
        held = module.role_module(entry.name) if entry.name in module.algorithm.roles else None
        if not isinstance(held, nn.Module) or layout.get(entry.name, {}).get("format", "whole") != "whole":
            continue
        start = entry.attribute + "."
        now = {start + k: tuple(getattr(v, "ds_shape", v.shape)) for k, v in held.state_dict(keep_vars=True).items()}
        then = {k: tuple(v.shape) for k, v in saved.items() if k.startswith(start) and isinstance(v, torch.Tensor)}
        changed = [f"{k} saved {list(then[k])}, now {list(now[k])}" for k in then if k in now and then[k] != now[k]]
        missing = [k for k in now if k not in then] if strict else []
        extra = [k for k in then if k not in now] if strict else []
        parts = [f"{len(names)} {what} (e.g. {'; '.join(names[:3])})"
                 for what, names in (("changed shape", changed), ("missing from the checkpoint", missing),
                                     ("in the checkpoint but not in this model", extra)) if names]
        if parts:
            problems.append(f"role {entry.name!r}: {', '.join(parts)}")
            attributes.append(entry.attribute)
    if not problems:
        return
    before = checkpoint.get(module.CHECKPOINT_HYPER_PARAMS_KEY) or {}
    differences = [f"{key} saved {value!r}, now {current!r}" for attribute in attributes
                   for key, value, current in _differences(before.get(attribute), module.hparams.get(attribute),
                                                           f"model.{attribute}")]
    settings = f" Its settings differ: {'; '.join(differences[:5])}." if differences else ""
    raise CheckpointError(
        f"Checkpoint {path} does not fit this run's model: {' | '.join(problems)}.{settings} Resume with the model "
        "config it was saved with, or start a new run without --ckpt_path (to start from its weights in a new run, "
        "export them with RLHFModule.load_from_checkpoint(...).export_actor(directory) and pass --model.actor.path "
        "directory).")


def _differences(saved: Any, current: Any, prefix: str) -> Iterable[tuple[str, Any, Any]]:
    """``(key path, saved, current)`` for each plain setting that differs between two nested dicts."""
    if isinstance(saved, dict) and isinstance(current, dict):
        for key in dict.fromkeys([*saved, *current]):
            yield from _differences(saved.get(key), current.get(key), f"{prefix}.{key}")
    elif saved != current and (saved is None or isinstance(saved, (str, int, float, bool, list, tuple))):
        yield prefix, saved, current


def save_hf_model(model: nn.Module, path: Path, state_dict: dict[str, torch.Tensor] | None = None) -> None:
    """What ``model.save_pretrained(path)`` writes (config, generation config, ``model.safetensors``), from any
    rank: under torch.distributed, transformers writes the weights only on global rank 0, which under Separation
    does not hold the trained actor."""
    from safetensors.torch import save_file

    model.config.save_pretrained(path)
    if model.can_generate() and getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(path)
    if state_dict is None:  # tied weights once (named_parameters dedups them); copies, as a flat buffer's views
        keys = set(model.state_dict())
        state_dict = {name: tensor for name, tensor in (*model.named_parameters(), *model.named_buffers())
                      if name in keys}
    save_file({k: v.detach().cpu().contiguous().clone() for k, v in state_dict.items()},
              str(path / "model.safetensors"), metadata={"format": "pt"})


def _import_path(function: Any) -> str | None:
    """``"package.module.name"`` when that path imports back to ``function`` (not a lambda, closure or partial)."""
    path = f"{getattr(function, '__module__', '')}.{getattr(function, '__qualname__', '')}"
    try:
        return path if resolve_import(path) is function else None
    except (ImportError, AttributeError, ValueError):
        return None


def _as_config(cls: type[Any], value: Any) -> Any:
    """A copy of a config dataclass (a default instance is shared), or one built from its fields as a dict (how
    hyperparameters are saved)."""
    return cls(**value) if isinstance(value, dict) else dataclasses.replace(value)


def _no_closure() -> None:
    return None


def _timings(times: dict[str, float], overlap: bool, samples: int, tokens: float) -> dict[str, float]:
    """Phase seconds and throughput of one iteration from its time marks."""
    total = times["reallocated"] - times["start"]
    return {
        "time/generate_s": times["generated"] - times["start"],
        "time/score_s": times["scored"] - (times["trained"] if overlap else times["generated"]),
        "time/train_s": times["trained"] - (times["generated"] if overlap else times["scored"]),
        "time/reallocate_s": times["reallocated"] - max(times["trained"], times["scored"]),
        "perf/samples_per_sec": samples / total,
        "perf/gen_tokens_per_sec": tokens / (times["generated"] - times["start"]),
    }


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
