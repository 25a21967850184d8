"""``RLHFModule``: the Lightning glue around the engine. One ``training_step`` is one iteration, run by
:meth:`~lightning_app_rlhf.engine.engine.RLHFEngine.run_iteration` over the roles a strategy placed
(:class:`~lightning_app_rlhf.parallel.placed_roles.PlacedRoles`); models come from
:class:`~lightning_app_rlhf.models.role_specs.RoleSpecs`, checkpoint state from
:mod:`~lightning_app_rlhf.module_checkpoint`, the Trainer's checks, callbacks and logging from
:mod:`~lightning_app_rlhf.module_trainer`."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from torch import nn
from transformers import PreTrainedTokenizerBase
from typing_extensions import override

from lightning_app_rlhf import module_checkpoint, module_trainer
from lightning_app_rlhf.agents import (
    Environment,
    EnvironmentFactory,
    as_environment,
    environment_rewards_only,
)
from lightning_app_rlhf.algorithms import build_algorithm
from lightning_app_rlhf.checkpoint.format import check_checkpoint_file, checkpoint_file
from lightning_app_rlhf.core.config import AgentConfig, GenerationConfig, PPOConfig, as_config
from lightning_app_rlhf.core.role_table import CRITIC, ROLES
from lightning_app_rlhf.data import check_prompts_fit
from lightning_app_rlhf.engine import export
from lightning_app_rlhf.engine.engine import RLHFEngine
from lightning_app_rlhf.engine.experience import RewardShaping
from lightning_app_rlhf.generation import Rollout, close_backends, config_context_length
from lightning_app_rlhf.models.reward_args import check_reward_fields
from lightning_app_rlhf.models.role_specs import ModelSource, RoleSpecs
from lightning_app_rlhf.models.roles import (
    RewardFunction,
    check_vocabularies,
    default_optimizer,
    load_tokenizer,
    resolve_import,
)
from lightning_app_rlhf.parallel.memory import RoleMemory
from lightning_app_rlhf.parallel.placed_roles import PlacedRoles


class RLHFModule(pl.LightningModule):
    """RLHF of a causal LM: PPO with a critic, or a critic-free algorithm (GRPO and its family, RLOO, REINFORCE++),
    with a frozen reference and a reward model or function.

    Args:
        actor: The policy: a :class:`ModelSpec`, its fields as a dict, or a local model directory.
        tokenizer: The actor's tokenizer, a local directory, or ``"package.module:function"`` building one.
        algorithm: ``ppo``, ``grpo``, ``dr_grpo``, ``dapo``, ``gspo``, ``gspo_token``, ``cispo``, ``rloo``,
            ``reinforce_pp``, ``reinforce_pp_baseline``, or a name registered with
            :func:`~lightning_app_rlhf.algorithms.register_algorithm` (docs/algorithms.md). Only ``ppo`` has a critic.
        critic: The value model's backbone (``ppo`` only). Defaults to the actor's spec (a fresh copy, with a value
            head, and the actor's LoRA settings if it has any).
        reference: The frozen reference policy. Defaults to an exact copy of the initial actor; for a LoRA actor,
            to the actor's own base model with its adapters disabled (no second copy). ``{"precision": "bf16-true"}``
            (no path or config): the actor's copy at that precision.
        reward_model: A sequence classifier with one label. Give this or ``reward_fn``.
        reward_fn: ``(prompts, responses, **row_fields) -> scores`` on decoded text, or its import path; a reward
            function written for TRL's ``GRPOTrainer`` (``(completions, answer, **kwargs)``, all by name) works as it
            is. It also receives the prompt rows' other fields (e.g. ``answer``) when its signature names them or
            takes ``**kwargs``; parameters the rows cannot fill fail in ``setup``, naming the rows' fields.
        generation: Sampling settings for rollouts (``num_samples`` responses per prompt; None: the algorithm's own).
        ppo: Hyper-parameters of the update, for every algorithm; those of one family (``scale_rewards``,
            ``whiten_advantages``) default to the algorithm's own, and ``per_algorithm`` scopes settings to algorithms.
        actor_optimizer: Builds the actor's optimizer from its parameters. Default: fused AdamW, lr 1e-5.
        critic_optimizer: Builds the critic's optimizer (``ppo`` only). Default: ``actor_optimizer`` (the same
            optimizer and settings, as TRL's one learning rate for policy and value), else fused AdamW, lr 1e-5; so a
            config need not name the critic, and every algorithm runs it.
        actor_scheduler: Builds the actor's LR scheduler; stepped once per iteration.
        critic_scheduler: Builds the critic's LR scheduler; stepped once per iteration.
        seed: Keys sampling noise and minibatch order. Default: the seed of ``seed_everything``, else 0.
        eval_generation: Sampling settings of ``validate``, ``test`` and ``predict`` (one response per prompt).
            Default: ``generation``'s, greedy (``do_sample=False``).
        preemption_checkpoint: Stop cleanly on SIGTERM (and SLURM's requeue signal) under the Trainer: unless the
            Trainer has a :class:`~lightning_app_rlhf.callbacks.PreemptionCheckpoint`, one is added (finish the
            iteration, save, exit 0). ``False`` (``--model.preemption_checkpoint false``) leaves Lightning's own
            stop, without a checkpoint.
        environment: Multi-turn rollouts (docs/agents.md): an :class:`~lightning_app_rlhf.agents.Environment`
            (on the command line its ``class_path`` and ``init_args``), copied per episode and reset on the episode's
            dataset row, or a factory returning one. Each sample is then an episode: the actor's turns, each
            answered by the environment (tool results, a game's state) until it is done. An episode's score is the sum
            of its environment rewards plus ``reward_fn``'s (or ``reward_model``'s) score of its final turn; with an
            environment, neither is required. None: one response per sample.
        agent: The episodes' limits: ``max_turns`` and ``max_episode_tokens``.
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
        environment: Environment | EnvironmentFactory | None = None,
        agent: AgentConfig = AgentConfig(),
    ) -> None:
        super().__init__()
        self.save_hyperparameters(module_checkpoint.plain_hyperparameters(locals()))
        self.environment = as_environment(environment)
        self.agent = as_config(AgentConfig, agent)
        if self.environment is not None and reward_fn is None and reward_model is None:
            reward_fn = environment_rewards_only
        self.automatic_optimization = False
        self.generation = as_config(GenerationConfig, generation)
        self.eval_generation = self.generation.for_evaluation(eval_generation)
        self.ppo = as_config(PPOConfig, ppo)
        self.algorithm = build_algorithm(algorithm, self.ppo, self.generation)
        self.specs = RoleSpecs.from_arguments(actor, critic, reference, reward_model, reward_fn, self.algorithm.name,
                                              self.has_critic, critic_optimizer, critic_scheduler)
        self.reward_fn: RewardFunction | None = resolve_import(reward_fn) if isinstance(reward_fn, str) else reward_fn
        self.tokenizer = load_tokenizer(tokenizer)
        # Named `{role}_optimizer` / `{role}_scheduler`, as the arguments: configure_optimizers finds them by role.
        self.actor_optimizer = actor_optimizer or default_optimizer
        self.critic_optimizer = (critic_optimizer or actor_optimizer or default_optimizer) if self.has_critic else None
        self.actor_scheduler, self.critic_scheduler = actor_scheduler, critic_scheduler
        self.seed = seed if seed is not None else int(os.environ.get("PL_GLOBAL_SEED", "0"))
        self.preemption_checkpoint = preemption_checkpoint
        self.shaping = RewardShaping(self.ppo, self.tokenizer.eos_token_id,
                                     self.agent.max_episode_tokens if self.environment is not None else None)
        self.actor = self.critic = self.reference = self.reward_model = None
        self.placed_roles: PlacedRoles | None = None
        """Handed over by a placement strategy before ``configure_model``; else one process holds every role."""
        self.learning_rates: dict[str, float] = {}
        """``lr-{role}`` (and ``-momentum``, ``-weight_decay``) of each trained role, on every rank."""
        self.refill_prompts: Callable[[int, int], dict[str, Any]] | None = None
        """``(iteration, round) -> batch``: where dynamic sampling (``ppo.dynamic_sampling``) draws the prompts of a
        further generation round, and partial rollouts the prompts that fill their pool. None: the Trainer's datamodule's ``refill_batch``
        (:meth:`~lightning_app_rlhf.data.PromptDataModule.refill_batch`); under Fabric, set it."""
        self._fabric_iteration = 0
        self._engine: RLHFEngine | None = None
        self._latest: tuple[Rollout, torch.Tensor] | None = None

    @property
    def has_critic(self) -> bool:
        return CRITIC.name in self.algorithm.roles

    @property
    def engine(self) -> RLHFEngine:
        """The iteration over the roles this rank holds, built once their placement is known."""
        placed = self._placed()
        if not placed.placement.distributed:  # one process: the Trainer moves the module after it was placed
            placed.placement.device = self.device
        if self._engine is None or self._engine.placed is not placed:
            self._engine = RLHFEngine(placed, self.algorithm, self.generation, self.ppo, self.tokenizer, self.shaping,
                                      self.role_module, self.reward_fn, self.seed, self.role_precisions(),
                                      self.specs.shadow_precisions(), self.environment, self.agent)
        # What a resume (the checkpoint's seed) or another Trainer (its precision) may have changed since.
        self._engine.calls.seed, self._engine.calls.precisions = self.seed, self.role_precisions()
        return self._engine

    def _placed(self) -> PlacedRoles:
        if self.placed_roles is None and self._fabric is not None:
            raise RuntimeError("Under Fabric, set the module up with fabric.strategy.setup_rlhf(fabric, module), "
                               "with a placement strategy (Fabric(strategy='rlhf_flattening'), or another rlhf_ "
                               "preset).")
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
        module_trainer.check_trainer(self.trainer, stage, lambda: self.engine)
        if self.reward_fn is not None:  # before any generation: the reward's parameters against the rows' fields
            check_reward_fields(self.reward_fn, module_trainer.stage_datasets(self.trainer.datamodule, stage))
        self._check_prompt_lengths(stage)
        if stage == "fit":
            self._more_prompts()  # dynamic sampling without a source of prompts fails now, not at iteration 0

    @override
    def teardown(self, stage: str) -> None:
        # A generation engine's processes (vLLM's) end with the run: a rank started by Lightning's fork launcher exits
        # without atexit handlers, and would wait on the engine's threads. The next run's first call starts anew.
        close_backends()

    def _check_prompt_lengths(self, stage: str) -> None:
        """Every prompt ``stage`` reads, plus the tokens generated for it, fits the actor's context: checked on the
        tokenised datasets (the datamodule's ``setup`` runs first) against the actor's config, before any model is
        built, rather than when the longest prompt's batch comes."""
        datasets = module_trainer.stage_datasets(self.trainer.datamodule, stage)
        if not datasets:
            return
        context = config_context_length(self.specs.actor.load_config())
        training = getattr(self.trainer.datamodule, "dataset", None) if stage == "fit" else None
        for where, dataset in datasets:
            new_tokens = (self.generation if dataset is training else self.eval_generation).max_new_tokens
            check_prompts_fit([(where, dataset)], context, new_tokens)

    @override
    def configure_model(self) -> None:
        if any(self.role_module(r) is not None for r in self.algorithm.roles):
            return
        placement = self._placed().placement  # a strategy checked its plan against the algorithm's roles
        if self.specs.reference_shares_actor:
            placement.plan.validate_shared_reference()
        built = self.specs.build(placement.holds, lambda role: placement.runs(f"{role}.train"),
                                 self.tokenizer.pad_token_id)
        for entry in ROLES:
            if entry.name in built:
                setattr(self, entry.attribute, built[entry.name])
        for role, model in built.items():  # from_pretrained returns eval mode; a frozen role (or shadow) shows as such
            if isinstance(model, nn.Module):  # not a LoRA actor's base with its adapters off: the actor's own mode
                model.train(placement.runs(f"{role}.train"))
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
        self._placed().attach_optimizers(self.trained_roles(), optimizers, self.ppo.max_grad_norm,
                                         self.manual_backward, self._optimizer_step)

    def _wrap_whole_roles(self) -> None:
        """Under a Trainer without a placement strategy (one process): plain wrappers, with Lightning's optimizers."""
        placed = self._placed()
        if not placed.wrapped and self.trained_roles():
            placed.wrap_whole(self.role_module, self.trained_roles(), self.device)
            optimizers = self.optimizers()
            self.attach_optimizers(optimizers if isinstance(optimizers, list) else [optimizers])

    @override
    def configure_callbacks(self) -> list[pl.Callback]:
        return module_trainer.added_callbacks(self.trainer.callbacks, self.preemption_checkpoint)

    def gather_memory(self) -> list[list[RoleMemory]]:
        """Every rank's :class:`RoleMemory` rows, on every rank (a collective: call it on every rank)."""
        self._wrap_whole_roles()
        return self.engine.gather_memory()

    # ---- one iteration, and evaluation ----

    @override
    def on_fit_start(self) -> None:
        frozen = [model for role in self.algorithm.roles  # a LoRA actor's base with its adapters off is no module
                  if isinstance(model := self.role_module(role), nn.Module) and role not in self.trained_roles()]
        module_trainer.expect_frozen_roles_in_eval_mode(self, frozen)

    @override
    def on_train_start(self) -> None:
        self._wrap_whole_roles()  # also when the batch-size tuner runs the fit loop without on_fit_start
        self.learning_rates = self.engine.learning_rates()

    @override
    def on_validation_start(self) -> None:
        self._settle_free_running()  # validation samples with the newest weights

    @override
    def on_train_end(self) -> None:
        self._settle_free_running()  # the shadows hold the final weights; no transfer left in flight

    def _settle_free_running(self) -> None:
        """Under a free-running plan, where both sides of the world meet: the generation side takes every published
        weight version (:meth:`~lightning_app_rlhf.engine.engine.RLHFEngine.settle`)."""
        self.engine.settle()

    @override
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        if self._fabric is not None and not self.learning_rates:
            self.learning_rates = self.engine.learning_rates()  # Fabric calls no on_train_start
        schedulers = self._fabric.strategy.lr_schedulers if self._fabric is not None else self.lr_schedulers()
        schedulers = list(schedulers) if isinstance(schedulers, (list, tuple)) else [s for s in [schedulers] if s]
        result = self.engine.run_iteration(batch, self.iteration, schedulers, self._more_prompts())
        self._latest = (result.rollout, result.scores)
        if self._fabric is not None:
            self._fabric_iteration += 1
        else:
            module_trainer.count_one_global_step(self.trainer)
        values = {k: float(v.item() if torch.is_tensor(v) else v) for k, v in result.stats.items()}
        if self._fabric is not None:  # the lr of this iteration (no LearningRateMonitor under Fabric)
            self._fabric.log_dict({**values, **self.learning_rates}, step=self._fabric_iteration - 1)
        else:
            module_trainer.log_iteration(self, values, len(result.scores))
        self.learning_rates = result.learning_rates

    def _more_prompts(self) -> Callable[[int, int], dict[str, Any]] | None:
        """The further prompts of dynamic sampling and of partial rollouts (:attr:`refill_prompts`), on this module's
        device; None without either."""
        partial = self.placed_roles is not None and self.placed_roles.placement.plan.partial_rollout
        if not self.ppo.dynamic_sampling and not partial:
            return None
        wants = "ppo.dynamic_sampling generates on more prompts when a batch has too few informative groups" if \
            self.ppo.dynamic_sampling else "partial_rollout keeps more prompts in flight than a batch holds"
        fix = "set ppo.dynamic_sampling false" if self.ppo.dynamic_sampling else "set partial_rollout false"
        refill = self.refill_prompts
        if refill is None and self._trainer is not None:
            refill = getattr(self.trainer.datamodule, "refill_batch", None)
        if refill is None:
            where = "module.refill_prompts = datamodule.refill_batch" if self._fabric is not None else (
                "a PromptDataModule (trainer.fit(module, datamodule=...)), or set module.refill_prompts")
            raise ValueError(f"{wants}, and this run has no source of them: use {where} "
                             f"((iteration, round) -> batch), or {fix}.")
        return lambda iteration, generation_round: move_data_to_device(refill(iteration, generation_round),
                                                                       self.device)

    def latest_completions(self, max_rows: int | None = None) -> list[dict[str, Any]]:
        """Prompt, completion and raw reward (:meth:`Rollout.completion_rows`) of the last training iteration's rollout
        (every rank has it), at most ``max_rows`` rows; empty before the first iteration."""
        if self._latest is None:
            return []
        rollout, scores = self._latest
        return rollout.select(slice(0, max_rows)).completion_rows(self.tokenizer, scores[:max_rows])

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
        rollout, scores = self.engine.calls.sample_and_score(batch, self.iteration, self.eval_generation,
                                                             self.engine.policy_version)
        return [{**row, "index": int(index)}
                for row, index in zip(rollout.completion_rows(self.tokenizer, scores), batch["index"].tolist())]

    def _evaluate(self, batch: dict[str, Any], stage: str) -> None:
        rollout, scores = self.engine.calls.sample_and_score(batch, self.iteration, self.eval_generation,
                                                             self.engine.policy_version)
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
        if self._fabric is not None:
            self._fabric.strategy.optimizer_step(optimizer)
        else:
            module_trainer.optimizer_step(self, optimizer)

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
        self._fabric_iteration = int(checkpoint.get("global_step", 0))  # the iteration under Fabric

    def export_actor(self, directory: str | os.PathLike[str], merge: bool = True) -> Path | None:
        """Save the trained actor and the tokenizer in Hugging Face format (:func:`~lightning_app_rlhf.engine.export.
        export_actor`): call it on every rank; the lowest rank of ``actor.train`` writes and returns ``directory``.
        ``merge=False`` saves a LoRA actor's adapter alone."""
        return export.export_actor(self.role_module, self.specs.actor, self._placed(), self.tokenizer, directory,
                                   merge)

