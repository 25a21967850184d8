"""``PlacementTuner``: choose the placement before the models are built, and keep it across a resume."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lightning_app_rlhf.checkpoint.format import load_checkpoint_file
from lightning_app_rlhf.parallel.plan import PlacementPlan
from lightning_app_rlhf.strategies.placement_strategy import PlacementStrategy

if TYPE_CHECKING:
    from lightning_app_rlhf.planner import DeviceType


class PlacementTuner(Callback):
    """Profiles this machine briefly, searches placements with the planner, and hands the best plan to the
    placement strategy, all in ``setup()``: the one hook after the process group exists and before any model is
    built. Rank 0 decides and broadcasts. The answer is kept in :attr:`optimal_plan`, logged, and saved in
    checkpoints, so a resumed run reuses it instead of searching again.

    Works with any placement strategy (``rlhf_flattening``, ``rlhf_interleaving``, ``rlhf_separation``,
    ``PlacementStrategy``): the tuned plan replaces the strategy's own. It plans the module's algorithm: its roles
    only (no critic calls for a critic-free algorithm such as ``grpo``) and its rollout of ``data.batch_size x
    generation.num_samples`` sequences. The planner keeps training on-policy
    (staleness only with ``max_staleness`` above 0) and searches every wrapper this machine can run; the run uses
    the chosen plan's generation batch and micro-batch (see :attr:`batch_sizes`).

    Args:
        search: ``both`` (APP grid + ReaLHF MCMC), ``app``, ``mcmc``, or ``presets`` (the three presets only).
        seed: Seeds the MCMC chain; the choice is deterministic under it for a given profile.
        time_budget_s: An outer bound on the MCMC chain's wall time (None: none). The chain's budget is
            ``mcmc_steps``, so that its answer does not depend on the machine's load; a chain stopped by this bound
            says so in the tuner's report.
        mcmc_steps: Proposals of the MCMC chain: its budget.
        profile: Measure this machine's op times first (a few seconds, and with ``generation.backend: vllm`` a vLLM
            engine's start for the actor's generation; cached on disk per hardware and model shape). ``False`` uses
            the analytic model only.
        cluster: Describe the devices instead of reading the running job, e.g. ``"1x8xA100-80GB"``; its device
            count must equal the job's world size.
        ckpt_path: A checkpoint whose saved plan to reuse. Default: ``trainer.ckpt_path`` when it is set before
            ``fit`` (``RLHFCLI`` sets it from ``--ckpt_path``).
        max_staleness: Let the search train beside generation on the previous rollout (staleness 1) where that is
            faster; 0 (default): on-policy plans only. Off-policy data changes what is learned: opt in.
    """

    def __init__(
        self,
        search: str = "both",
        seed: int = 0,
        time_budget_s: float | None = None,
        mcmc_steps: int = 2000,
        profile: bool = True,
        cluster: str | None = None,
        ckpt_path: str | None = None,
        max_staleness: int = 0,
    ) -> None:
        from lightning_app_rlhf.planner.search import SEARCHES

        if search not in SEARCHES:
            raise ValueError(f"search must be one of {sorted(SEARCHES)}, got {search!r}.")
        if time_budget_s is not None and time_budget_s <= 0:
            raise ValueError(f"time_budget_s must be > 0, got {time_budget_s}.")
        self.search_options: dict[str, Any] = {"search": search, "seed": seed, "time_budget_s": time_budget_s,
                                               "mcmc_steps": mcmc_steps, "max_staleness": max_staleness}
        """The planner's search settings, as :func:`~lightning_app_rlhf.planner.plan_placement` takes them."""
        self.profile = profile
        self.cluster = cluster
        self.ckpt_path = ckpt_path
        self.optimal_plan: PlacementPlan | None = None
        """The plan the run uses, once ``setup`` has run."""
        self.algorithm: str | None = None
        """The module's algorithm the plan was made for (its roles are the plan's), once ``setup`` has run."""
        self.prediction: dict[str, Any] = {}
        """What the planner predicted for :attr:`optimal_plan` (seconds and samples per iteration, peak bytes,
        source), or where the plan came from on a resume."""
        self.batch_sizes: dict[str, int | None] = {}
        """The planner's ``generation.batch_size`` and ``ppo.micro_batch_size`` for :attr:`optimal_plan` (None: a
        rank's whole shard); the module runs with them, or with smaller ones it was given."""

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        strategy = trainer.strategy
        if not isinstance(strategy, PlacementStrategy):
            raise TypeError(
                f"PlacementTuner chooses among placements, so it needs a placement strategy; got "
                f"{type(strategy).__name__}. Use strategy='rlhf_flattening' (any preset: the tuned plan replaces it)."
            )
        self.algorithm = pl_module.algorithm.name
        saved = self._saved_state(trainer)
        if saved:  # a checkpoint written without a tuner (or before it chose) has no plan to reuse
            plan, self.prediction = PlacementPlan.from_dict(saved["plan"]), {**saved["prediction"], "source": "checkpoint"}
            _check_saved_plan(plan, saved, pl_module)
            self.batch_sizes = saved.get("batch_sizes", {})
        else:
            from lightning_app_rlhf.planner.profiler import measure_collectives, measure_device

            # Every rank joins the measurement of the job's own collectives; rank 0 decides with it.
            device = measure_collectives(measure_device()) if self.profile and self.cluster is None else None
            outcome = self._decide(trainer, pl_module, device) if trainer.is_global_zero else None
            outcome = strategy.broadcast(outcome)  # every rank applies the same plan, or raises the same error
            if isinstance(outcome, str):
                raise RuntimeError(outcome)
            plan, self.prediction, self.batch_sizes = outcome
        strategy.apply_plan(plan)
        self.optimal_plan = plan
        applied = _apply_batch_sizes(pl_module, self.batch_sizes)
        rank_zero_info(f"PlacementTuner: using {describe(plan)}{applied} ({_prediction_text(self.prediction)}).")

    def _decide(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, device: DeviceType | None
    ) -> tuple[PlacementPlan, dict, dict] | str:
        """Rank 0: profile, search, and return the best plan with its prediction and batch sizes (or the error's
        message).

        Args:
            trainer: The trainer being set up.
            pl_module: The RLHF module, read for the workload.
            device: This machine's measured ceilings and collectives (None: the profile's, or the cluster's).
        """
        from lightning_app_rlhf.planner import (
            cluster_from_environment,
            parse_cluster,
            plan_placement,
            profile_workload,
            workload_from_data,
        )

        try:
            datamodule = trainer.datamodule
            if datamodule is None or getattr(datamodule, "dataset", None) is None:
                raise ValueError("PlacementTuner reads the batch size and prompt lengths from a PromptDataModule: "
                                 "pass one to fit (datamodule=...).")
            workload = workload_from_data(pl_module, datamodule)
            profile = None
            if self.profile:
                profile = profile_workload(workload, reward_fn=pl_module.reward_fn, tokenizer=pl_module.tokenizer,
                                           prompts=datamodule.dataset.prompts[:64], device=device,
                                           fields=datamodule.dataset.fields[:64],
                                           vllm_engine_args=pl_module.generation.vllm_engine_args)
            if self.cluster is not None:
                cluster = parse_cluster(self.cluster)
            else:
                cluster = cluster_from_environment(trainer.world_size, device=profile.device if profile else None,
                                                   nodes=trainer.num_nodes)
            if cluster.world_size != trainer.world_size:
                raise ValueError(f"cluster={self.cluster!r} has {cluster.world_size} devices but the job runs "
                                 f"{trainer.world_size} processes: describe the job's devices, or leave cluster unset.")
            result = plan_placement(cluster, workload, profile=profile, **self.search_options)
        except Exception as err:  # noqa: BLE001 - sent to every rank, which all raise it
            return f"PlacementTuner failed on rank 0: {type(err).__name__}: {err}"
        best = result.best
        prediction = {"source": best.source, "iteration_s": best.iteration_s, "samples_per_s": best.samples_per_s,
                      "peak_memory_bytes": best.estimate.peak_bytes,
                      "speedup_over_flattening": result.speedup_over("flattening")}
        batch_sizes = {"generation.batch_size": best.choice.generation_batch,
                       "ppo.micro_batch_size": best.choice.micro_batch}
        return best.plan, prediction, batch_sizes

    def _saved_state(self, trainer: pl.Trainer) -> dict[str, Any] | None:
        """The tuner state saved in the checkpoint this run resumes from, if any."""
        path = self.ckpt_path or trainer.ckpt_path
        if path is None:
            return None
        if not os.path.isfile(path) and not os.path.isdir(path):
            raise ValueError(f"PlacementTuner reuses the plan saved in the checkpoint it resumes from, and needs "
                             f"that checkpoint's path (a file, or a directory with sharded roles); got {path!r}. "
                             "Pass the checkpoint itself.")
        checkpoint = load_checkpoint_file(path)  # weights-only (a directory: its meta file); runs no code from it
        return checkpoint.get("callbacks", {}).get(self.state_key)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.optimal_plan is None or not trainer.is_global_zero:
            return
        plan = self.optimal_plan
        params = {"placement_tuner/plan": describe(plan), "placement_tuner/source": self.prediction.get("source")}
        metrics = {f"placement_tuner/predicted_{k}": float(v) for k, v in self.prediction.items()
                   if isinstance(v, (int, float)) and v is not None}
        for logger in trainer.loggers:
            logger.log_hyperparams(params)
            if metrics:
                logger.log_metrics(metrics, step=trainer.global_step)

    @override
    def state_dict(self) -> dict[str, Any]:
        if self.optimal_plan is None:
            return {}
        return {"plan": self.optimal_plan.to_dict(), "prediction": self.prediction, "algorithm": self.algorithm,
                "batch_sizes": self.batch_sizes}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict and self.optimal_plan is not None and PlacementPlan.from_dict(state_dict["plan"]) != self.optimal_plan:
            raise RuntimeError(
                f"The checkpoint was trained under {describe(PlacementPlan.from_dict(state_dict['plan']))}, but this run "
                f"tuned {describe(self.optimal_plan)}. Let the tuner read the checkpoint before the models are "
                "built: set `trainer.ckpt_path = PATH` before `fit` (RLHFCLI does it for --ckpt_path) or pass "
                "PlacementTuner(ckpt_path=PATH)."
            )


def _check_saved_plan(plan: PlacementPlan, saved: dict[str, Any], module: pl.LightningModule) -> None:
    """Raise a ``ValueError`` naming the fix when the checkpoint's plan was tuned for another algorithm than the
    module's (a plan places exactly its algorithm's roles: PPO's has critic calls, a critic-free one's has none)."""
    algorithm, tuned_for = module.algorithm, saved.get("algorithm")  # None: saved before the tuner recorded it
    if set(plan.roles) == set(algorithm.roles) and tuned_for in (None, algorithm.name):
        return
    made_for = f"algorithm {tuned_for!r}" if tuned_for else "another algorithm"
    resume = f"--model.algorithm {tuned_for}" if tuned_for else "the checkpoint's algorithm"
    raise ValueError(
        f"The checkpoint's tuned plan was made for {made_for} (roles {list(plan.roles)}), but this run uses algorithm "
        f"{algorithm.name!r} (roles {list(algorithm.roles)}). Resume with {resume}, or start a new run without "
        "--ckpt_path."
    )


def _apply_batch_sizes(module: pl.LightningModule, batch_sizes: dict[str, int | None]) -> str:
    """Run with the planner's generation batch and micro-batch, unless the module was given smaller ones: a plan
    may fit in memory only thanks to them. Returns what changed, for the log line."""
    changed = []
    for name, planned in batch_sizes.items():
        section, field = name.split(".")
        config = getattr(module, section)
        given = getattr(config, field)
        if planned is not None and (given is None or planned < given):
            setattr(config, field, planned)
            changed.append(f"{name}={planned}")
    return f" with {', '.join(changed)}" if changed else ""


def describe(plan: PlacementPlan) -> str:
    calls = "; ".join(f"{call} {_ranks(ranks)}" for call, ranks in plan.calls.items())
    wrappers = ", ".join(f"{role} {wrapper}" for role, wrapper in plan.wrappers.items())
    return f"plan {plan.name!r} on {plan.world_size} ranks [{calls}] ({wrappers})"


def _ranks(ranks: tuple[int, ...]) -> str:
    contiguous = ranks == tuple(range(ranks[0], ranks[-1] + 1))
    return f"{ranks[0]}-{ranks[-1]}" if contiguous and len(ranks) > 1 else ",".join(map(str, ranks))


def _prediction_text(prediction: dict[str, Any]) -> str:
    if prediction.get("source") == "checkpoint" or "iteration_s" not in prediction:
        return f"from {prediction.get('source', 'the checkpoint')}"
    speedup = prediction.get("speedup_over_flattening")
    versus = f"{speedup:.2f}x Flattening" if speedup else "Flattening does not fit"
    return (f"{prediction['source']}; predicted {prediction['iteration_s']:.3f} s/iteration, "
            f"{prediction['samples_per_s']:.1f} samples/s, {versus}")
