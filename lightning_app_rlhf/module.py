"""``RLHFModule``: an RLHF algorithm over its roles as a LightningModule, the Lightning glue around the engine.

One ``training_step`` is one iteration, run by :meth:`~lightning_app_rlhf.engine.engine.RLHFEngine.run_iteration`; this
class binds it to the Trainer and Fabric: hooks, optimizers and schedulers, logging, checkpoint hooks. The models
come from :class:`~lightning_app_rlhf.models.role_specs.RoleSpecs`, their placement from a strategy
(:class:`~lightning_app_rlhf.parallel.placed_roles.PlacedRoles`), the checkpoint state from
:mod:`~lightning_app_rlhf.module_checkpoint`, the export from :mod:`~lightning_app_rlhf.engine.export`.
"""

from __future__ import annotations

import dataclasses
import math
import os
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch.callbacks import LearningRateFinder, LearningRateMonitor, RichProgressBar
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from lightning.pytorch.utilities.warnings import PossibleUserWarning
from torch import nn
from transformers import PreTrainedTokenizerBase
from typing_extensions import override

from lightning_app_rlhf import module_checkpoint
from lightning_app_rlhf.algorithms import build_algorithm
from lightning_app_rlhf.algorithms.shaping import AdaptiveKLController, FixedKLController, RunningMoments
from lightning_app_rlhf.callbacks import PlacementSummary, PreemptionCheckpoint, RLHFProgressBar
from lightning_app_rlhf.callbacks.role_lr_monitor import RoleLearningRateMonitor
from lightning_app_rlhf.checkpoint.format import check_checkpoint_file, checkpoint_file
from lightning_app_rlhf.core.config import GenerationConfig, PPOConfig
from lightning_app_rlhf.core.role_table import CRITIC, ROLES
from lightning_app_rlhf.engine import export
from lightning_app_rlhf.engine.engine import RLHFEngine
from lightning_app_rlhf.engine.experience import RewardShaping
from lightning_app_rlhf.generation import Rollout
from lightning_app_rlhf.models.role_specs import ModelSource, RoleSpecs
from lightning_app_rlhf.models.roles import RewardFunction, check_vocabularies, load_tokenizer, resolve_import
from lightning_app_rlhf.parallel.memory import RoleMemory
from lightning_app_rlhf.parallel.placed_roles import PlacedRoles
from lightning_app_rlhf.strategies.atomic_checkpoint_io import AtomicCheckpointIO

EPOCH_METRICS = ("reward/mean", "kl/mean", "response/length_mean")
"""Also logged as ``{name}_epoch``: the mean over the epoch's iterations, for ``ModelCheckpoint`` and
``EarlyStopping`` to judge the epoch rather than its last batch."""
EPOCH_SYNC_ADVICE = (r"It is recommended to use `self\.log\('((val|test)/(reward/mean|response/length_mean)|"
                     r"(reward/mean|kl/mean|response/length_mean)_epoch)', \.\.\., sync_dist=True\)`")
"""Lightning's warning about our epoch metrics, which are equal on every rank (silenced in :meth:`RLHFModule.setup`)."""
LR_FINDER_REFUSAL = (
    "lr_find / LearningRateFinder does not apply to RLHF: its sweep reads the lr off a loss curve, and an RLHF loss is "
    "measured on rollouts the policy itself keeps changing, so its minimum says nothing about the lr. Set the lr in "
    "the optimizers (model.actor_optimizer, model.critic_optimizer) and watch reward/mean and kl/mean. For batch "
    "sizes, Tuner.scale_batch_size scales data.batch_size, and the PlacementTuner callback picks the generation and "
    "micro-batch sizes per placement.")


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
        self.save_hyperparameters(module_checkpoint.plain_hyperparameters(locals()))
        self.automatic_optimization = False
        self.generation = _as_config(GenerationConfig, generation)
        self.eval_generation = dataclasses.replace(_as_config(GenerationConfig, eval_generation or generation),
                                                   num_samples=1, **({} if eval_generation else {"do_sample": False}))
        self.ppo = _as_config(PPOConfig, ppo)
        self.algorithm = build_algorithm(algorithm, self.ppo, self.generation)
        self.specs = RoleSpecs.from_arguments(actor, critic, reference, reward_model, reward_fn, self.algorithm.name,
                                              self.has_critic, critic_optimizer, critic_scheduler)
        self.reward_fn: RewardFunction | None = resolve_import(reward_fn) if isinstance(reward_fn, str) else reward_fn
        self.tokenizer = load_tokenizer(tokenizer)
        # Named `{role}_optimizer` / `{role}_scheduler`, as the arguments: configure_optimizers finds them by role.
        self.actor_optimizer = actor_optimizer or _default_optimizer
        self.critic_optimizer = (critic_optimizer or _default_optimizer) if self.has_critic else None
        self.actor_scheduler, self.critic_scheduler = actor_scheduler, critic_scheduler
        self.seed = seed if seed is not None else int(os.environ.get("PL_GLOBAL_SEED", "0"))
        self.preemption_checkpoint = preemption_checkpoint
        self.shaping = RewardShaping(self.ppo, self.tokenizer.eos_token_id)
        self.actor = self.critic = self.reference = self.reward_model = None
        self.placed_roles: PlacedRoles | None = None
        """Handed over by a placement strategy before ``configure_model``; else one process holds every role."""
        self.fabric_schedulers: list[Any] = []
        """LR schedulers under Fabric (the Trainer keeps its own)."""
        self.learning_rates: dict[str, float] = {}
        """``lr-{role}`` (and ``-momentum``, ``-weight_decay``) of each trained role, on every rank."""
        self._fabric_iteration = 0
        self._engine: RLHFEngine | None = None
        self._latest: tuple[Rollout, torch.Tensor] | None = None

    @property
    def has_critic(self) -> bool:
        return CRITIC.name in self.algorithm.roles

    @property
    def kl_controller(self) -> AdaptiveKLController | FixedKLController:
        """The KL coefficient in the reward (``kl_controller.value``), fixed or adaptive."""
        return self.shaping.kl_controller

    @property
    def reward_moments(self) -> RunningMoments:
        """The running reward statistics of ``ppo.reward_norm`` (``mean``, ``std``, ``count``)."""
        return self.shaping.reward_moments

    @property
    def engine(self) -> RLHFEngine:
        """The iteration over the roles this rank holds, built once their placement is known."""
        placed = self._placed()
        if not placed.placement.distributed:  # one process: the Trainer moves the module after it was placed
            placed.placement.device = self.device
        if self._engine is None or self._engine.placed is not placed:
            self._engine = RLHFEngine(placed, self.algorithm, self.generation, self.ppo, self.tokenizer, self.shaping,
                                      self.role_module, self.reward_fn, self.seed, self.role_precisions(),
                                      self.specs.shadow_precisions())
        # What a resume (the checkpoint's seed) or another Trainer (its precision) may have changed since.
        self._engine.seed, self._engine.precisions = self.seed, self.role_precisions()
        return self._engine

    def _placed(self) -> PlacedRoles:
        if self.placed_roles is None:
            self.placed_roles = PlacedRoles.single_process(self.device, self.algorithm.roles)
        return self.placed_roles

    def role_module(self, role: str) -> nn.Module | None:
        """The module of ``role`` on this rank (None where this rank does not hold it)."""
        return getattr(self, next(entry.attribute for entry in ROLES if entry.name == role))

    def trained_roles(self) -> list[str]:
        """The trainable roles whose train call runs on this rank, in optimizer order."""
        return [role for role in self.algorithm.trainable_roles if self._placed().placement.runs(f"{role}.train")]

    def scheduled_roles(self) -> list[str]:
        """The roles of :meth:`trained_roles` that have an LR scheduler, in scheduler order."""
        return [role for role in self.trained_roles() if getattr(self, f"{role}_scheduler") is not None]

    def role_precisions(self) -> dict[str, str]:
        """Each model role's precision: its spec's, else the ``Trainer``'s or Fabric's (docs/api.md, "Precision")."""
        run = self.trainer.precision if self._trainer is not None else "32-true"
        run = self._fabric.strategy.precision.precision if self._fabric is not None else run
        return self.specs.precisions(self.algorithm.trainable_roles, run)

    # ---- set-up: validation once, models, optimizers, callbacks ----

    @override
    def setup(self, stage: str) -> None:
        if self._trainer is None:
            return
        if any(isinstance(callback, LearningRateFinder) for callback in self.trainer.callbacks):
            raise ValueError(LR_FINDER_REFUSAL)
        # Our epoch-level metrics are already global and equal on every rank (gathered, then logged everywhere), so
        # Lightning's advice to sync them does not apply (placement strategies leave `is_distributed` unset).
        warnings.filterwarnings("ignore", message=EPOCH_SYNC_ADVICE, category=PossibleUserWarning)
        if type(self.trainer.strategy.checkpoint_io) is TorchCheckpointIO:  # atomic writes, checked reads
            self.trainer.strategy.checkpoint_io = AtomicCheckpointIO()
        if str(self.trainer.precision).startswith("16"):
            raise ValueError(f"precision={self.trainer.precision!r} needs a gradient scaler, which the update does not "
                             "use. Use precision='bf16-mixed' (or 'bf16-true', '32-true').")
        datamodule = self.trainer.datamodule
        batch_size = getattr(datamodule, "batch_size", None)
        engine = self.engine  # resolves the role precisions: a contradiction fails here, before any model is built
        if stage == "fit" and batch_size is not None:
            engine.check_batch(batch_size)
        if stage == "fit" and getattr(datamodule, "has_val_prompts", True) is False:
            self.trainer.limit_val_batches = 0  # no held-out prompts: no validation, and no warning about it
        path = self.trainer.ckpt_path
        if stage == "fit" and path is not None and "://" not in str(path):
            check_checkpoint_file(path)  # before any model is built; a bare EOFError would name no file

    @override
    def configure_model(self) -> None:
        if any(self.role_module(r) is not None for r in self.algorithm.roles):
            return
        placement = self._placed().placement
        placement.plan.check_roles(self.algorithm.roles, self.algorithm.name)
        if self.specs.reference_shares_actor:
            placement.plan.validate_shared_reference()
        built = self.specs.build(placement.holds, lambda role: placement.runs(f"{role}.train"),
                                 self.tokenizer.pad_token_id)
        for entry in ROLES:
            if entry.name in built:
                setattr(self, entry.attribute, built[entry.name])
        check_vocabularies(self.tokenizer, self.actor, self.reference, self.critic, self.reward_model)

    @override
    def configure_optimizers(self) -> Any:
        optimizers, schedulers = [], []
        for role in self.trained_roles():
            build_optimizer, build_scheduler = getattr(self, f"{role}_optimizer"), getattr(self, f"{role}_scheduler")
            optimizers.append(build_optimizer(p for p in self.role_module(role).parameters() if p.requires_grad))
            if build_scheduler is not None:
                schedulers.append(build_scheduler(optimizers[-1]))
        return optimizers, schedulers

    def attach_optimizers(self, optimizers: list[Any]) -> None:
        """Give each trained role's wrapper its optimizer (in :meth:`trained_roles` order), with this module's
        backward and optimizer step (Lightning's precision plugin and hooks) and the configured clipping. The
        strategy calls it once the wrappers and the optimizers exist."""
        for role, optimizer in zip(self.trained_roles(), optimizers, strict=True):
            self._placed().wrappers[role].attach_optimizer(
                getattr(optimizer, "optimizer", optimizer),  # a Fabric or Lightning optimizer wraps the torch one
                self.ppo.max_grad_norm, self.manual_backward, self._optimizer_step,
            )

    def _wrap_whole_roles(self) -> None:
        """Under a Trainer without a placement strategy (one process): plain wrappers, with Lightning's optimizers."""
        placed = self._placed()
        if not placed.wrapped and self.trained_roles():
            placed.wrap_whole(self.role_module, self.trained_roles(), self.device)
            optimizers = self.optimizers()
            self.attach_optimizers(optimizers if isinstance(optimizers, list) else [optimizers])

    @override
    def configure_callbacks(self) -> list[pl.Callback]:
        have = self.trainer.callbacks
        # Once per trainer: validate and predict after fit would otherwise replace it, with a note saying so.
        callbacks: list[pl.Callback] = [] if any(isinstance(c, PlacementSummary) for c in have) else [PlacementSummary()]
        # Lightning replaces a callback with a subclass of it returned here: a user's LearningRateMonitor sees only
        # this rank's optimizers, named by class; Lightning's RichProgressBar reads "Epoch 0/-2" under max_steps.
        for theirs, ours in ((LearningRateMonitor, RoleLearningRateMonitor), (RichProgressBar, RLHFProgressBar)):
            callbacks += [ours.like(c) for c in have if type(c) is theirs][:1]
        # A clean stop on SIGTERM by default; a user's own (e.g. with a dirpath) is kept.
        if self.preemption_checkpoint and not any(isinstance(c, PreemptionCheckpoint) for c in have):
            callbacks.append(PreemptionCheckpoint())
        return callbacks

    def gather_memory(self) -> list[list[RoleMemory]]:
        """Every rank's :class:`RoleMemory` rows, on every rank (a collective: call it on every rank)."""
        self._wrap_whole_roles()
        return self.engine.gather_memory()

    # ---- one iteration, and evaluation ----

    @override
    def on_train_start(self) -> None:
        self._wrap_whole_roles()  # also when the batch-size tuner runs the fit loop without on_fit_start
        self.learning_rates = self.engine.learning_rates()

    @override
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        if self._fabric is not None and not self.learning_rates:
            self.learning_rates = self.engine.learning_rates()  # Fabric calls no on_train_start
        schedulers = self.fabric_schedulers if self._fabric is not None else self.lr_schedulers()
        schedulers = schedulers if isinstance(schedulers, list) else [s for s in [schedulers] if s is not None]
        result = self.engine.run_iteration(batch, self.iteration, schedulers)
        self._latest = (result.rollout, result.scores)
        self._count_one_optimizer_step()
        values = {k: float(v.item() if torch.is_tensor(v) else v) for k, v in result.stats.items()}
        samples = len(result.scores)
        if self._fabric is not None:  # the lr of this iteration (no LearningRateMonitor under Fabric)
            self._fabric.log_dict({**values, **self.learning_rates}, step=self._fabric_iteration - 1)
        else:
            progress_bar = {"reward/mean", "kl/mean"}
            self.log_dict({k: v for k, v in values.items() if k in progress_bar}, prog_bar=True, batch_size=samples)
            self.log_dict({k: v for k, v in values.items() if k not in progress_bar}, batch_size=samples)
            epoch = {f"{k}_epoch": values[k] for k in EPOCH_METRICS if k in values and not math.isnan(values[k])}
            self.log_dict(epoch, on_step=False, on_epoch=True, batch_size=samples)
        self.learning_rates = result.learning_rates

    def latest_completions(self, max_rows: int | None = None) -> list[dict[str, Any]]:
        """Prompt, completion and raw reward of the last training iteration's rollout (every rank has it), at most
        ``max_rows`` rows; empty before the first iteration."""
        if self._latest is None:
            return []
        rollout, scores = self._latest
        rows = slice(0, max_rows)
        return [{"prompt": prompt, "completion": completion, "reward": float(score)}
                for prompt, completion, score in zip(*rollout.select(rows).texts(self.tokenizer),
                                                     scores[rows].tolist())]

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
        rollout, scores = self.engine.sample_and_score(batch, self.iteration, self.eval_generation)
        prompts, completions = rollout.texts(self.tokenizer)
        ids = [response[mask.bool()].tolist() for response, mask in zip(rollout.responses, rollout.response_mask)]
        return [{"prompt": p, "completion": c, "completion_ids": i, "reward": float(r), "index": int(index)}
                for p, c, i, r, index in zip(prompts, completions, ids, scores.tolist(), batch["index"].tolist())]

    def _evaluate(self, batch: dict[str, Any], stage: str) -> None:
        rollout, scores = self.engine.sample_and_score(batch, self.iteration, self.eval_generation)
        size = len(scores)
        # Every rank holds the whole batch's results (gathered), so no sync_dist: the means are already global.
        self.log(f"{stage}/reward/mean", scores.float().mean(), on_epoch=True, batch_size=size, prog_bar=True)
        self.log(f"{stage}/response/length_mean", rollout.response_mask.sum(1).float().mean(), on_epoch=True,
                 batch_size=size)

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

    def _count_one_optimizer_step(self) -> None:
        """Advance ``global_step`` by exactly one per iteration, however many optimizer steps it took: Lightning
        counts every ``LightningOptimizer.step`` as a global step, so ``max_steps`` and checkpoint names would drift
        from the iteration count with two optimizers and many minibatches."""
        if self._fabric is not None:
            self._fabric_iteration += 1
            return
        progress = self.trainer.fit_loop.epoch_loop.manual_optimization.optim_step_progress
        progress.increment_ready()
        progress.increment_completed()

    # ---- checkpoints and export ----

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
        return super().load_from_checkpoint(checkpoint_file(checkpoint_path), map_location=map_location,
                                            hparams_file=hparams_file, strict=strict, weights_only=True, **kwargs)

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        module_checkpoint.save_rlhf_state(self, checkpoint)

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        module_checkpoint.load_rlhf_state(self, checkpoint, self.trainer.ckpt_path if self._trainer else None)

    def export_actor(self, directory: str | os.PathLike[str], merge: bool = True) -> Path | None:
        """Save the trained actor and the tokenizer in Hugging Face format (:func:`~lightning_app_rlhf.engine.export.
        export_actor`): call it on every rank; the lowest rank of ``actor.train`` writes and returns ``directory``.
        ``merge=False`` saves a LoRA actor's adapter alone."""
        return export.export_actor(self.role_module, self.specs.actor, self._placed(), self.tokenizer, directory,
                                   merge)


def _as_config(cls: type[Any], value: Any) -> Any:
    """A copy of a config dataclass (a default instance is shared), or one built from its fields as a dict (how
    hyperparameters are saved)."""
    return cls(**value) if isinstance(value, dict) else dataclasses.replace(value)


def _no_closure() -> None:
    return None
