"""``python -m lightning_app_rlhf plan``: a dry run of the planner, no training. Plain Python (no Lightning).

``plan`` is a subcommand of the LightningCLI in ``lightning_app_rlhf/cli.py``: it reads a training config like
``fit`` (``--config``, ``--model.*``, ``--data.*``, ``--trainer.*``) and plans what ``fit`` would run; without
one, the named-size flags describe the workload. This module holds the command's own flags (:class:`PlanOptions`),
the named-size workloads, the search, and the printing::

    python -m lightning_app_rlhf plan --config examples/configs/demo_cpu.yaml --cluster 1x4xcpu
    python -m lightning_app_rlhf plan --cluster 1x8xA100-80GB --actor llama-7b --critic llama-7b
    python -m lightning_app_rlhf plan --cluster 1x8xA100-80GB --actor llama-7b --algorithm grpo --num_samples 4
    python -m lightning_app_rlhf plan --cluster 1x4xcpu --actor gpt2-tiny --batch_size 32 --json
    python -m lightning_app_rlhf plan --cluster 1x8xH100-80GB --actor llama2-7b --algorithm grpo --num_samples 8 \
        --turns 4 --generation_length 256 --observation_tokens 128   # multi-turn episodes
    python -m lightning_app_rlhf plan --config examples/configs/demo_vllm_cpu.yaml --backends eager,vllm
    python -m lightning_app_rlhf plan --sweep   # the LLaMA table of docs/planner.md
    python -m lightning_app_rlhf plan --cluster 1x4xcpu --actor gpt2-tiny --batch_size 32 --generation_length 128 \
        --mean_response_length 16 --max_staleness 2 --partial_rollout   # uneven lengths, partial rollouts priced
"""

from __future__ import annotations

import contextlib
import json as json_module
import os
import shlex
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from lightning_app_rlhf.algorithms import ALGORITHMS
from lightning_app_rlhf.core.role_table import ACTOR, CRITIC
from lightning_app_rlhf.generation import get_backend, vllm_available
from lightning_app_rlhf.generation.vllm import VLLM_INSTALL
from lightning_app_rlhf.parallel.plan import PlacementPlan, flattening_plan
from lightning_app_rlhf.parallel.wrappers import wrapper_class
from lightning_app_rlhf.planner.cluster import Cluster, parse_cluster
from lightning_app_rlhf.planner.cost_model import (
    ENGINE_OPS,
    SYNC_COPIES,
    CostModel,
    PlanChoice,
    calibrate_engine,
    call_ranks,
    gib,
    ranks_text,
    role_wrappers,
)
from lightning_app_rlhf.planner.plan_picture import draw_plan_picture, require_matplotlib
from lightning_app_rlhf.planner.profiler import VLLM, VLLM_OPS, VLLM_SYNC, Profile, profile_machine
from lightning_app_rlhf.planner.search import Candidate, PlannerError, PlannerResult, plan_placement
from lightning_app_rlhf.planner.workload import Workload, installed_wrappers, role_shape

SWEEP_MODELS = ("llama-7b", "llama-13b", "llama-33b", "llama-65b")
SWEEP_CLUSTERS = ("1x8xA100-80GB", "2x8xA100-80GB", "4x8xA100-80GB", "8x8xA100-80GB")
SWEEP_LORA_RANK = 128
"""The sweep trains LoRA adapters of this rank unless ``--lora_rank`` says otherwise (as APP)."""
REALHF_CASES = (("llama2-7b", "1x8xH100-80GB"), ("llama2-13b", "2x8xH100-80GB"), ("llama2-34b", "4x8xH100-80GB"),
                ("llama2-70b", "8x8xH100-80GB"), ("llama2-70b", "16x8xH100-80GB"))
"""ReaLHF's scaling experiment: the model grows with the GPUs (actor, critic, reference and reward of one size)."""
REALHF_LENGTHS = ((128, 512), (384, 256), (896, 128))
"""ReaLHF's released benchmark: (generated tokens, prompts per iteration); prompts of 128 tokens, 4 minibatches."""
CALIBRATION_ITERATIONS = 40
"""Iterations of the config that ``--profile auto`` runs under Flattening with DDP (the first 6 left out: a young
policy's responses, and so its iterations, change most). 40, as many as the calibration's measured runs
(``benchmarks/plan_candidates.py``), so that the reference plan is timed over the iterations its price is checked
against."""
DEFAULT_CLUSTER = "1x8xA100-80GB"
"""The cluster of a named-size plan without ``--cluster``."""
NAMED_SIZE_DEFAULTS: dict[str, Any] = {
    "actor": "llama-7b",
    "algorithm": "ppo",
    "num_samples": 1,
    "batch_size": 512,
    "prompt_length": 256,
    "generation_length": 480,
    "ppo_epochs": 1,
    "num_minibatches": 8,
}
"""What a named-size flag left unset means."""
CONFIG_KEYS: dict[str, str] = {
    "actor": "--model.actor",
    "critic": "--model.critic",
    "reference": "--model.reference",
    "reward": "--model.reward_model (or --model.reward_fn)",
    "algorithm": "--model.algorithm",
    "num_samples": "--model.generation.num_samples",
    "dtype": "the model specs' dtype (e.g. --model.actor.dtype bfloat16)",
    "batch_size": "--data.batch_size",
    "prompt_length": "--data.max_prompt_length (the configured prompts are tokenised)",
    "generation_length": "--model.generation.max_new_tokens",
    "ppo_epochs": "--model.ppo.ppo_epochs",
    "num_minibatches": "--model.ppo.num_minibatches",
    "lora_rank": "--model.actor.lora (peft LoraConfig fields, e.g. r)",
}
"""Each named-size flag, and what sets the same thing in a training config."""
FIT_STRATEGY = "lightning_app_rlhf.strategies.PlacementStrategy"
"""The strategy class that runs any plan given as ``--trainer.strategy.plan`` (the presets only build theirs)."""
PLAN_DEFAULTS: dict[str, Any] = {"wrappers": {}, "name": "custom", "max_staleness": 0, "tp": {},
                                 "unshard_for_generation": True, "free_running": False}
""":meth:`PlacementPlan.to_dict` fields left out of the printed flags when they hold the plan's default."""


@dataclass(frozen=True)
class PlanOptions:
    """The plan command's own flags (the named-size ones describe a workload without a training config).

    With a training config (``--config``, ``--model.*``, ``--data.*``, ``--trainer.*`` as for ``fit``) ``plan`` plans
    what ``fit`` would run; without one, the named-size flags (``--actor``, ``--critic``, ``--batch_size``, ...)
    describe the workload.
    """

    cluster: str | None = None
    """Where it runs, NODESxDEVICESxTYPE: 1x8xA100-80GB, 8x8xH100-80GB, 1x4xcpu (device types: A100-40GB,
    A100-80GB, H100-80GB, H200, cpu). Default: with a training config on the cpu, trainer.num_nodes x
    trainer.devices x cpu; without one, 1x8xA100-80GB."""
    profile: Literal["auto", "none"] = "auto"
    """auto: with a training config on a cluster of this machine's CPU processes (one node, cpu), measure this
    machine first (about 30 s for the demo on 2 processes, 100 s on 4; the op times and wrapper costs are cached):
    each call's CPU time, what every wrapper and a pipeline add, the gloo collectives, the share of a core k busy
    processes get, and 40 iterations of the config under Flattening with DDP on the job's processes for the engine's
    own work; then price with them. none: price with the device's nominal figures (instant; on the demo's 2
    processes about half the measured time)."""
    wrappers: str | None = None
    """Comma-separated wrappers the search may give the roles: a subset of ddp, fsdp2, zero1, zero2, zero3 (the zero
    ones need deepspeed: pip install 'lightning-app-rlhf[deepspeed]'). Default: every one installed here."""
    backends: str | None = None
    """Comma-separated generation backends to price every plan under, e.g. eager,vllm: the search runs once per
    backend and the fastest (plan, backend) pair is the best, its backend in the fit flags (--model.generation.backend).
    vllm is priced from its generation measured on a vLLM engine (--profile auto: one engine start, about a minute;
    cached) plus the sync of the actor's weights to the engines once per iteration, and turns
    ppo.recompute_old_logprobs on, as a run on it does by default. Default: the training config's
    generation.backend alone (eager without a config)."""
    search: Literal["app", "mcmc", "both", "presets"] = "both"
    """app (APP's prior rules and grid), mcmc (ReaLHF's Metropolis chain), both, or presets (the three presets
    only)."""
    seed: int = 0
    """Seeds the MCMC chain."""
    mcmc_steps: int = 2000
    """Proposals of the MCMC chain (its budget: the same seed and steps give the same plan on any machine)."""
    time_budget: float | None = None
    """An outer safety: seconds after which the MCMC chain stops even before --mcmc_steps (reported under the
    tables when it does; the answer then depends on the machine's speed). Default: none."""
    top_k: int = 5
    """Searched plans shown besides the presets."""
    max_staleness: int = 0
    """The staleness bound the plans may use (SeparationStrategy(max_staleness=...)): above 0, plans whose training
    can run beside their generation are also priced training on the previous rollout (staleness 1, column
    "stale"), and Separation plans free-running too ("1 free"). 0: on-policy plans only."""
    partial_rollout: bool = False
    """Also price every plan with partial rollouts (SeparationStrategy(partial_rollout=true): a generation call ends
    once a batch of groups is complete, the unfinished samples resume under the next weights), one version of
    --max_staleness kept for their carried tokens: an on-policy plan at staleness 1, a staleness-1 plan at 2 (column
    "stale": "2 free partial"). Needs --max_staleness >= 1; refused with dynamic sampling (--generation_rounds above
    1) and multi-turn episodes. They pay where response lengths are uneven (--mean_response_length)."""
    mean_response_length: float | None = None
    """Responses of uneven length: each stops after a geometric number of tokens of this mean, cut at the generation
    length (the bench's uneven workload: random-init rows stopped by stop ids). A generate call is then priced until
    its longest row, a partial-rollout call until a batch of groups is complete (docs/planner.md, "Partial rollouts
    and uneven lengths"). Single-turn only. Default: every response runs to the generation length."""
    segment_tokens: int | None = None
    """Tokens a partial rollout's round decodes at most (generation.segment_tokens). Default: a training config's
    model.generation.segment_tokens, else a quarter of the generation length."""
    json: bool = False
    """Print JSON instead of tables."""
    picture: str | None = None
    """Write a PNG of the best plan here: a panel per call, the cluster's ranks a grid of nodes x devices, each rank of
    the call coloured by its data-parallel replica and labelled with its pipeline stage and tensor-parallel rank
    (needs matplotlib: pip install matplotlib)."""
    realhf_sweep: bool = False
    """Named sizes only: plan ReaLHF's benchmark, LLaMA-2 7B on 1x8 to 70B on 16x8 H100-80GB, full fine-tuning of
    actor and critic of one size, prompts of 128 tokens, 128/384/896 generated tokens with 512/256/128 prompts, 4
    minibatches, and print the markdown table of docs/planner.md (APP search and --mcmc_steps, 300 unless given)."""
    sweep: bool = False
    """Named sizes only: plan LLaMA 7B-65B actor + critic (the actor alone for a critic-free --algorithm) on 1x8 to
    8x8 A100-80GB with LoRA rank 128 (unless --lora_rank), and print the markdown table of docs/planner.md."""
    actor: str | None = None
    """Named sizes: the actor's size, one of llama-7b, llama-13b, llama-33b, llama-65b, llama2-7b, llama2-13b,
    llama2-34b, llama2-70b, gpt2-tiny, gpt2-small, a local model directory or a config.json (default: llama-7b)."""
    critic: str | None = None
    """Named sizes: the critic's size, --algorithm ppo only (default: the actor's)."""
    reference: str | None = None
    """Named sizes: the reference's size (default: the actor's)."""
    reward: str | None = None
    """Named sizes: the reward model's size, or 'function' for a Python reward (default: the critic's, the
    actor's without a critic)."""
    algorithm: str | None = None
    """Named sizes: the RL algorithm, as RLHFModule(algorithm=...): ppo (default), grpo, dr_grpo, dapo, gspo,
    gspo_token, cispo, rloo, reinforce_pp, reinforce_pp_baseline. Only ppo has a critic; the others are planned
    without critic calls. An algorithm whose default KL is none (dapo) is planned without a reference."""
    num_samples: int | None = None
    """Named sizes: responses sampled per prompt (generation.num_samples, the group size G of grpo and rloo): each
    iteration generates, scores and trains on batch_size x num_samples sequences (default: 1)."""
    dtype: Literal["bf16", "fp32"] | None = None
    """Named sizes: the models' dtype (default: bf16 on GPUs, with mixed-precision AdamW; fp32 on the cpu)."""
    batch_size: int | None = None
    """Named sizes: prompts per iteration, each sampled num_samples times (default: 512)."""
    prompt_length: int | None = None
    """Named sizes: padded prompt tokens (default: 256)."""
    generation_length: int | None = None
    """Named sizes: generated tokens per response (default: 480)."""
    ppo_epochs: int | None = None
    """Named sizes: passes of the train calls over the rollout (default: 1)."""
    num_minibatches: int | None = None
    """Named sizes: optimizer steps per epoch (default: 8)."""
    generation_rounds: int = 1
    """Generation rounds per update with dynamic sampling (ppo.dynamic_sampling, on for dapo): each update
    generates and scores this many batches of prompts before it trains (a run logs train/generation_rounds);
    default: 1."""
    lora_rank: int | None = None
    """Named sizes: train LoRA adapters of this rank (the reference is then the actor's base); 0 = full
    fine-tuning (default: full fine-tuning, and 128 with --sweep, as APP)."""
    turns: int | None = None
    """Multi-turn episodes: assistant turns per episode. Each turn is one generate call that prefills the episode's
    whole context so far, then decodes up to the generation length (--generation_length, or the config's
    model.generation.max_new_tokens: tokens per turn); the train and forward calls read the whole episode. Default:
    a training config's model.agent.max_turns where it has a model.environment, else 1 (single-turn)."""
    observation_tokens: int | None = None
    """Multi-turn: tokens of each observation the environment appends after a turn (turns - 1 per episode), as the
    chat template renders them (default: 0)."""
    environment_s: float | None = None
    """Multi-turn: Python seconds per episode and turn between the generate calls, on the generating ranks: the
    environment's step (a run logs the steps' and resets' sum as episode/environment_seconds) and the rendering of
    its observation (default: 0)."""

    def named(self, flag: str) -> Any:
        """A named-size flag's value, or its default (:data:`NAMED_SIZE_DEFAULTS`) when it was left unset."""
        value = getattr(self, flag)
        return NAMED_SIZE_DEFAULTS.get(flag) if value is None else value


@dataclass(frozen=True)
class TrainingRun:
    """What a training config runs, as ``plan`` reads it (``cli.py`` builds it from the parsed config)."""

    workload: Workload
    """The module's algorithm, model shapes, generation and PPO settings at the data's batch and prompt length."""
    cluster: str
    """The cluster to plan for: ``--cluster``, or the trainer's devices."""
    processes: int | None = None
    """Processes the config launches (``trainer.num_nodes x trainer.devices``); None where the machine decides."""
    strategy: str = "auto"
    """``trainer.strategy`` as configured."""
    strategy_plan: Callable[[int, tuple[str, ...]], PlacementPlan] | None = None
    """The configured placement strategy's plan for a world size and the algorithm's roles; None: not a placement
    strategy."""
    generation_batch: int | None = None
    """``model.generation.batch_size`` (None: a rank's whole shard)."""
    micro_batch: int | None = None
    """``model.ppo.micro_batch_size`` (None: a rank's whole shard of a minibatch)."""
    tuner: bool = False
    """A ``PlacementTuner`` callback replaces the strategy's plan at fit start."""
    notes: tuple[str, ...] = ()
    """How the cluster and the workload were read."""
    profile_inputs: dict[str, Any] = field(default_factory=dict)
    """The reward function, tokenizer, prompts and row fields that profiling times the reward with, and the vLLM
    engine's options (:func:`~lightning_app_rlhf.planner.profiler.profile_machine`'s keywords)."""
    measure_phases: Callable[[PlacementPlan], dict[str, float]] | None = None
    """Runs a few iterations of the config under a plan on this machine's processes: median seconds of its
    ``generate``, ``score`` and ``train`` phases on rank 0
    (:func:`~lightning_app_rlhf.planner.cost_model.calibrate_engine`)."""


@dataclass
class PlanReport:
    """What ``plan`` prints: the planner's result, the configured run's plan priced alike, and notes."""

    result: PlannerResult
    configured: Candidate | None = None
    """The plan the training config's strategy runs, priced by the same cost model (source ``config``)."""
    configured_strategy: str | None = None
    """``trainer.strategy`` of the training config."""
    notes: list[str] = field(default_factory=list)
    """Lines printed under the table."""
    profile: Profile | None = None
    """What ``--profile auto`` measured on this machine (None: priced with the device's nominal figures)."""
    backend_results: dict[str, PlannerResult] = field(default_factory=dict)
    """With ``--backends``: each generation backend's search, by name (``result`` is the fastest's); empty without."""

    @property
    def chosen_backend(self) -> str | None:
        """The generation backend ``plan`` chose among ``--backends`` (None: it chose none; the config's own runs)."""
        return self.result.workload.generation_backend if self.backend_results else None

    def to_dict(self) -> dict[str, Any]:
        """The planner's result as JSON (:meth:`PlannerResult.to_dict`), with the episode's shape (turns, tokens per
        observation, tokens of a whole sequence), the config's plan, the notes, and what was measured on this
        machine (the profile's ops and device, and the compute shares: enough to price any other plan alike)."""
        w = self.result.workload
        measured = None
        if self.profile is not None:
            measured = {"hardware": self.profile.hardware, "device": asdict(self.profile.device),
                        "ops": self.profile.ops, "compute_shares": self.result.cluster.compute_shares}
        backends = {name: {"iteration_s": r.best.iteration_s, "samples_per_s": r.best.samples_per_s,
                           "label": r.best.choice.label,
                           "weight_sync_s": r.best.estimate.call_s.get("weight_sync", 0.0)}
                    for name, r in self.backend_results.items()}
        return {
            "measured": measured,
            **self.result.to_dict(),
            "generation_backend": w.generation_backend,
            "backends": backends,
            "turns": w.turns,
            "observation_tokens": w.observation_length,
            "episode_length": w.episode_length,
            "configured_strategy": self.configured_strategy,
            "configured": self.configured.to_dict() if self.configured is not None else None,
            "fit_flags": fit_flags(self.result.best, self.result.cluster, self.chosen_backend),
            "notes": self.notes,
        }


def fit_flags(candidate: Candidate, cluster: Cluster, backend: str | None = None) -> list[str]:
    """The ``fit`` command-line arguments that run ``candidate`` on ``cluster``: the trainer's accelerator, nodes and
    devices, :data:`FIT_STRATEGY` with the plan as JSON (``--trainer.strategy.plan``), the plan's generation and
    micro-batch sizes where it sets them, and the generation backend where ``plan`` chose it. Appended to a ``fit``
    command with the same training config, they override its ``trainer.strategy``.

    Args:
        candidate: A priced plan (the planner's best, usually).
        cluster: The cluster it was planned for.
        backend: The generation backend it was priced with, where chosen among ``--backends``
            (``--model.generation.backend``); None: the config's own.
    """
    plan = {k: v for k, v in candidate.plan.to_dict().items() if k not in PLAN_DEFAULTS or v != PLAN_DEFAULTS[k]}
    flags = ["--trainer.accelerator", "cpu" if cluster.cores_per_node is not None else "gpu",
             "--trainer.num_nodes", str(cluster.nodes), "--trainer.devices", str(cluster.devices_per_node),
             "--trainer.strategy", FIT_STRATEGY, "--trainer.strategy.plan", json_module.dumps(plan)]
    if candidate.choice.generation_batch is not None:
        flags += ["--model.generation.batch_size", str(candidate.choice.generation_batch)]
    if candidate.choice.micro_batch is not None:
        flags += ["--model.ppo.micro_batch_size", str(candidate.choice.micro_batch)]
    if backend is not None:
        flags += ["--model.generation.backend", backend]
    return flags


# ---------------------------------------------------------------- the workload


def check_algorithm_options(options: PlanOptions) -> None:
    """Raise a ``ValueError`` naming the fix when the named-size flags do not fit ``--algorithm``."""
    name = options.named("algorithm")
    if name not in ALGORITHMS:
        raise ValueError(f"Unknown --algorithm {name!r}: choose one of {sorted(ALGORITHMS)}.")
    algorithm = ALGORITHMS[name]
    if options.critic is not None and CRITIC.name not in algorithm.roles:
        raise ValueError(
            f"--critic {options.critic} sets the critic's size, but algorithm {name!r} has no critic. Remove "
            "--critic (use --reward to size the reward model), or use --algorithm ppo."
        )
    num_samples = options.named("num_samples")
    if algorithm.min_group_size > 1 and num_samples < algorithm.min_group_size:
        raise ValueError(
            f"Algorithm {name!r} compares the responses of one prompt with each other and needs at least "
            f"{algorithm.min_group_size} per prompt; --num_samples is {num_samples}. Pass --num_samples "
            f"{max(algorithm.min_group_size, 4)} (or more)."
        )


def check_no_named_sizes(options: PlanOptions) -> None:
    """With a training config the workload is the config's: a named-size flag is an error naming its config key."""
    for flag, config_key in CONFIG_KEYS.items():
        if getattr(options, flag) is not None:
            raise ValueError(
                f"--{flag} describes a named-size workload, but a training config (--config, --model.*, --data.*) "
                f"describes this one: set {config_key} instead, or plan named sizes without a training config."
            )
    if options.sweep or options.realhf_sweep:
        flag = "--sweep" if options.sweep else "--realhf_sweep"
        raise ValueError(f"{flag} plans a LLaMA table of named sizes, not a training config: drop --config "
                         "(and --model.*, --data.*) to run it.")


def wrappers_option(options: PlanOptions) -> tuple[str, ...]:
    """``--wrappers`` as a tuple (default: every installed wrapper); an unknown or uninstalled one is a
    ``ValueError`` with the choices or the install command."""
    if options.wrappers is None:
        return installed_wrappers()
    wrappers = tuple(w.strip() for w in options.wrappers.split(",") if w.strip())
    if not wrappers:
        raise ValueError(f"--wrappers {options.wrappers!r} names no wrapper: give some of "
                         f"{','.join(installed_wrappers())}, comma-separated.")
    for wrapper in wrappers:
        wrapper_class(wrapper)  # unknown, or its package missing: a ValueError with the choices or the install
    return wrappers


def backends_option(options: PlanOptions, workload: Workload) -> tuple[str, ...]:
    """``--backends`` as a tuple, in its order (default: the workload's own generation backend); an unregistered
    backend is a ``ValueError`` listing those registered, vllm without vLLM installed one naming its install."""
    if options.backends is None:
        return (workload.generation_backend,)
    backends = tuple(dict.fromkeys(b.strip() for b in options.backends.split(",") if b.strip()))
    if not backends:
        raise ValueError(f"--backends {options.backends!r} names no generation backend: give some of "
                         f"{','.join(sorted({'eager', VLLM, workload.generation_backend}))}, comma-separated.")
    for backend in backends:
        get_backend(backend)  # unknown: the registered names, and how to register another
        if backend == VLLM and not vllm_available():
            raise ValueError(f"--backends lists vllm, which is not installed here: {VLLM_INSTALL}; or drop vllm "
                             "from --backends.")
    return backends


def backend_workload(workload: Workload, backend: str) -> Workload:
    """``workload`` generating with ``backend``: a backend of other numerics than the trainer's (vLLM) also recomputes
    the rollout's log-probabilities before the update, as ``ppo.recompute_old_logprobs`` resolves by default with it;
    the workload's own setting stays otherwise (a config's resolved value does not say whether it was set).

    Args:
        workload: The config's (or the named sizes') workload.
        backend: A registered ``generation.backend`` name.
    """
    if backend == workload.generation_backend:
        return workload
    recompute = workload.recompute_old_logprobs or get_backend(backend).separate_numerics
    return replace(workload, generation_backend=backend, recompute_old_logprobs=recompute)


def workload_name(actor: str, critic: str | None, algorithm: str, num_samples: int, lora_rank: int | None) -> str:
    """``llama-7b+llama-7b``, ``llama-7b grpo G=4``, ``... LoRA 128``: a workload's label in tables."""
    name = f"{actor}+{critic}" if critic is not None else f"{actor} {algorithm}"
    if num_samples > 1:
        name += f" G={num_samples}"
    return name + (f" LoRA {lora_rank}" if lora_rank else "")


def named_size_workload(options: PlanOptions, gpu: bool) -> Workload:
    """The workload the named-size flags describe: the roles of ``--algorithm`` (no critic for a critic-free one).

    Args:
        options: The flags; unset ones take :data:`NAMED_SIZE_DEFAULTS`.
        gpu: Whether the cluster has GPUs (bf16, gradient checkpointing and fused attention) or CPUs (fp32).
    """
    check_algorithm_options(options)
    algorithm, actor = options.named("algorithm"), options.named("actor")
    dtype_bytes = {"bf16": 2, "fp32": 4}[options.dtype or ("bf16" if gpu else "fp32")]
    critic = (options.critic or actor) if CRITIC.name in ALGORITHMS[algorithm].roles else None
    reward = (
        None if options.reward == "function" else role_shape(options.reward or critic or actor, "classifier", dtype_bytes)
    )
    return Workload(
        actor=role_shape(actor, "causal_lm", dtype_bytes),
        critic=role_shape(critic, "value", dtype_bytes) if critic is not None else None,
        # Its default KL coefficients (in the reward, in the loss): none at all means no reference role.
        reference=role_shape(options.reference or actor, "causal_lm", dtype_bytes)
        if any(ALGORITHMS[algorithm].default_kl) else None,
        reward=reward,
        batch_size=options.named("batch_size"),
        prompt_length=options.named("prompt_length"),
        generation_length=options.named("generation_length"),
        ppo_epochs=options.named("ppo_epochs"),
        num_minibatches=options.named("num_minibatches"),
        num_samples=options.named("num_samples"),
        algorithm=algorithm,
        wrappers=wrappers_option(options),
        # AdamW: two state tensors per element (the wrappers count them in memory); the analytic step time reads
        # 12 bytes per parameter at bf16 (fp32 master weights and moments), 8 at fp32.
        optimizer_bytes_per_param=12.0 if dtype_bytes == 2 else 8.0,
        optimizer_slots=2,
        gradient_checkpointing=gpu,
        flash_attention=gpu,
        lora_rank=options.lora_rank or None,
        generation_rounds=options.generation_rounds,
        name=workload_name(actor, critic, algorithm, options.named("num_samples"), options.lora_rank),
        **multi_turn_fields(options),
        **length_fields(options),
    )


def length_fields(options: PlanOptions) -> dict[str, Any]:
    """The :class:`Workload` fields that ``--mean_response_length`` and ``--segment_tokens`` set (only those given;
    the workload checks their range)."""
    given = {"mean_response_length": options.mean_response_length, "segment_tokens": options.segment_tokens}
    return {name: value for name, value in given.items() if value is not None}


def multi_turn_fields(options: PlanOptions) -> dict[str, Any]:
    """The :class:`Workload` fields that ``--turns``, ``--observation_tokens`` and ``--environment_s`` set (only
    those given); a value out of range is a ``ValueError`` naming the flag."""
    given = {"turns": (options.turns, "--turns", 1),
             "observation_length": (options.observation_tokens, "--observation_tokens", 0),
             "environment_s_per_turn": (options.environment_s, "--environment_s", 0)}
    for value, flag, least in given.values():
        if value is not None and value < least:
            raise ValueError(f"{flag} must be >= {least}, got {value}.")
    return {name: value for name, (value, _, _) in given.items() if value is not None}


# ---------------------------------------------------------------- planning


def measured_machine(options: PlanOptions, run: TrainingRun, workload: Workload,
                     backends: tuple[str, ...]) -> tuple[Cluster, Profile | None, list[str]]:
    """The cluster to plan for and, where ``--profile auto`` applies (a cluster of this machine's CPU processes), the
    profile measured on this machine (:func:`~lightning_app_rlhf.planner.profiler.profile_machine`, with the
    generation of each of ``backends`` that runs on an engine of its own, then
    :func:`~lightning_app_rlhf.planner.cost_model.calibrate_engine` from :data:`CALIBRATION_ITERATIONS` iterations of
    the config under Flattening with DDP on the job's processes), with a note saying what was measured."""
    cluster = parse_cluster(run.cluster)
    if options.profile == "none" or cluster.cores_per_node is None:
        return cluster, None, []
    if cluster.nodes > 1:
        return cluster, None, [f"Not profiled: {cluster.name} spans {cluster.nodes} nodes, and only this machine "
                               "can be measured; priced with the cpu's nominal figures (--profile none)."]
    start = time.perf_counter()
    # The reference plan: every call on every rank, DDP, no degrees (what the profile prices most directly). Its run
    # goes first, while this process is lean: its ranks are forked from it.
    reference = flattening_plan(cluster.world_size, "ddp", roles=workload.roles)
    calibrated = run.measure_phases is not None and "ddp" in workload.wrappers
    with stdout_to_stderr():
        phases = run.measure_phases(reference) if calibrated else None
        profile, measured = profile_machine(workload, cluster.world_size, generation_backends=backends,
                                            **run.profile_inputs)
    if phases is not None:
        profile = calibrate_engine(profile, measured, workload, reference, phases)
    shares = " ".join(f"{x:.2f}" for x in measured.compute_shares or ())
    engine = profile.ops.get(ENGINE_OPS, {})
    n = cluster.world_size
    across = (f"what each wrapper ({', '.join(workload.wrappers)}) and a pipeline add on 2..{n} processes, gloo "
              f"latency {measured.device.collective_latency_s * 1e3:.2f} ms, " if n > 1 else "")
    return measured, profile, [
        f"Profiled this machine in {time.perf_counter() - start:.0f} s (--profile none skips it): CPU seconds per "
        f"op, {across}a core's share with {'1..' if n > 1 else ''}{n} busy process{'es' if n > 1 else ''} {shares}"
        + (f", and from {CALIBRATION_ITERATIONS} iterations of the config under flattening (DDP) the engine's own "
           f"work: {engine['generate'][0][2] * 1e3:.1f} ms per generate call, {engine['score'][0][2] * 1e3:.1f} ms "
           f"per rollout, {engine['train_step'][0][2] * 1e3:.1f} ms per optimizer step" if engine else "")
        + (f", and vLLM's generation on its engine with the sync of the actor's weights to it "
           f"({profile.ops[workload.actor.key][VLLM_SYNC][0][2] * 1e3:.0f} ms)" if VLLM in backends else "") + "."]


@contextlib.contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """This process's file descriptor 1 pointed at its stderr for the block: the processes a measurement starts
    inherit it (a vLLM engine's, which log to their stdout), so the command's stdout stays its report alone (one JSON
    document with ``--json``)."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def search(options: PlanOptions, cluster: Cluster, workload: Workload, profile: Profile | None = None) -> PlannerResult:
    """Run the planner's searches for ``workload`` on ``cluster`` as the flags ask (with the ops of ``profile`` where
    it measured them)."""
    return plan_placement(
        cluster,
        workload,
        profile=profile,
        search=options.search,
        seed=options.seed,
        time_budget_s=options.time_budget,
        mcmc_steps=options.mcmc_steps,
        top_k=options.top_k,
        max_staleness=options.max_staleness,
        partial_rollout=options.partial_rollout,
    )


def search_backends(options: PlanOptions, cluster: Cluster, workload: Workload, backends: tuple[str, ...],
                    profile: Profile | None = None) -> tuple[PlannerResult, dict[str, PlannerResult], list[str]]:
    """The planner's searches for ``workload`` generating with each of ``backends`` (:func:`backend_workload`): the
    result of the fastest (plan, backend) pair (the first backend listed on a tie), every backend's result where
    ``--backends`` asked for a choice (else none), and notes: a backend with no plan that fits, vllm priced without its
    measured points.

    Args:
        options: The flags.
        cluster: Where it runs.
        workload: The config's (or the named sizes') workload.
        backends: :func:`backends_option`.
        profile: The ops measured on this machine (None: the analytic model).

    Raises:
        PlannerError: No plan fits under any of ``backends`` (the first's message).
    """
    results: dict[str, PlannerResult] = {}
    notes, errors = [], []
    for backend in backends:
        try:
            results[backend] = search(options, cluster, backend_workload(workload, backend), profile)
        except PlannerError as err:
            errors.append(err)
            notes.append(f"No plan fits with generation backend {backend}: {err}")
    if not results:
        raise errors[0]
    actor_ops = profile.ops.get(workload.actor.key, {}) if profile is not None else {}
    measured = all(op in actor_ops for op in (*VLLM_OPS, VLLM_SYNC))
    if VLLM in results and not measured:
        notes.append(f"vllm is priced without its measured points: its generation at the analytic op times, its weight "
                     f"sync at {SYNC_COPIES} copies of the weights at memory bandwidth (--profile auto on a cluster of "
                     "this machine's CPU processes measures both).")
    best = min(results, key=lambda backend: results[backend].best.iteration_s)
    return results[best], results if options.backends is not None else {}, notes


def plan_named_sizes(options: PlanOptions) -> PlanReport:
    """The plans of the named-size workload on ``--cluster`` (default :data:`DEFAULT_CLUSTER`), under each backend of
    ``--backends``."""
    cluster = parse_cluster(options.cluster or DEFAULT_CLUSTER)
    workload = named_size_workload(options, gpu=cluster.cores_per_node is None)
    result, by_backend, notes = search_backends(options, cluster, workload, backends_option(options, workload))
    return PlanReport(result, notes=notes, backend_results=by_backend)


def plan_training_run(options: PlanOptions, run: TrainingRun) -> PlanReport:
    """The plans of a training config's workload, beside the plan its ``trainer.strategy`` runs.

    Args:
        options: The flags (named-size ones must be unset).
        run: What the config runs.
    """
    check_no_named_sizes(options)
    workload = replace(run.workload, generation_rounds=options.generation_rounds, **multi_turn_fields(options),
                       **length_fields(options))
    workload = replace(workload, wrappers=wrappers_option(options)) if options.wrappers else workload
    backends = backends_option(options, workload)  # checked before the machine is measured
    cluster, profile, measured_note = measured_machine(options, run, workload, backends)
    result, by_backend, backend_notes = search_backends(options, cluster, workload, backends, profile)
    report = PlanReport(result, configured_strategy=run.strategy, notes=[*run.notes, *measured_note, *backend_notes],
                        profile=profile, backend_results=by_backend)
    cluster = result.cluster
    if run.processes is not None and run.processes != cluster.world_size:
        report.notes.append(
            f"The config launches {run.processes} process(es) (trainer.num_nodes x trainer.devices); these plans "
            f"are for the {cluster.world_size} devices of {cluster.name}: fit with --trainer.num_nodes "
            f"{cluster.nodes} --trainer.devices {cluster.devices_per_node}."
        )
    plan = None
    if run.strategy_plan is not None:
        try:
            plan = run.strategy_plan(cluster.world_size, workload.roles)
            plan.check_roles(workload.roles, workload.algorithm)
        except ValueError as err:
            report.notes.append(f"The configured trainer.strategy {run.strategy} cannot run on {cluster.world_size} "
                                f"rank(s): {err}")
            plan = None
    elif cluster.world_size == 1:
        plan = flattening_plan(1, roles=workload.roles)  # one process holds every role, as RLHFModule does
    elif run.strategy == "auto":  # Lightning's default: RLHFModule holds every role in one process
        report.notes.append(
            f"The configured trainer.strategy is Lightning's default 'auto': every role in one process (Flattening "
            f"on 1 rank). For these {cluster.world_size} ranks fit with a placement strategy: --trainer.strategy "
            "rlhf_flattening, rlhf_interleaving or rlhf_separation."
        )
    else:
        report.notes.append(
            f"The configured trainer.strategy {run.strategy} is not a placement strategy, so no plan of its is "
            "priced: place the calls with --trainer.strategy rlhf_flattening, rlhf_interleaving or rlhf_separation "
            "(or a custom plan: class_path lightning_app_rlhf.PlacementStrategy with init_args.plan)."
        )
    if plan is not None:
        choice = PlanChoice(plan, run.generation_batch, run.micro_batch)
        model = CostModel(cluster, workload, profile)
        report.configured = Candidate(model.evaluate(choice), "config")
        report.configured.estimate.efficiency = model.efficiencies(choice)
    if run.tuner:
        report.notes.append(
            "trainer.callbacks has a PlacementTuner: fit searches again at its start, with a profile of the machine, "
            "and runs its choice (and its batch sizes) instead of the strategy's plan."
        )
    else:
        report.notes.append(
            "The fit flags printed last (fit_flags in --json) run the best plan as priced here. To search again at fit "
            "start with a profile of the machine, fit with a placement strategy and the PlacementTuner callback "
            "instead (--trainer.callbacks+=lightning_app_rlhf.callbacks.PlacementTuner)."
        )
    return report


def run_plan_command(options: PlanOptions, training_run: Callable[[], TrainingRun] | None) -> int:
    """Plan, print the plans (tables, or JSON with ``--json``) and return the exit status: 0, or 2 after printing
    an error that names the fix.

    Args:
        options: The flags.
        training_run: Reads what the training config runs; None: no training config (named sizes).
    """
    try:
        if options.picture is not None:
            check_picture_option(options)  # before the search, which may take minutes
        if options.sweep and training_run is None:
            rows = sweep(options)
            print(json_module.dumps(rows, indent=1)) if options.json else print_sweep(rows)
            return 0
        if options.realhf_sweep and training_run is None:
            rows = realhf_sweep(options)
            print(json_module.dumps(rows, indent=1)) if options.json else print_realhf_sweep(rows)
            return 0
        if training_run is None:
            report = plan_named_sizes(options)
        else:
            check_no_named_sizes(options)  # before reading the config's prompts
            report = plan_training_run(options, training_run())
    except (ValueError, FileNotFoundError) as err:  # PlannerError is a ValueError
        return report_error(err, options.json)
    if options.json:
        print(json_module.dumps(report.to_dict(), indent=1, default=_json_default))
    else:
        print_report(report)
    if options.picture is not None:
        path = draw_best_plan(report.result, options.picture)
        # On stderr under --json, whose stdout is one JSON document.
        print(f"picture of the best plan written to {path}", file=sys.stderr if options.json else sys.stdout)
    return 0


def check_picture_option(options: PlanOptions) -> None:
    """Raise a ``ValueError`` naming the fix when ``--picture`` cannot be drawn: with a sweep (many plans, no single
    best), or without matplotlib."""
    if options.sweep or options.realhf_sweep:
        flag = "--sweep" if options.sweep else "--realhf_sweep"
        raise ValueError(f"--picture draws the best plan of one workload, and {flag} plans many: drop --picture, or "
                         f"drop {flag} and plan one case (--cluster, --actor, ...).")
    try:
        require_matplotlib()
    except ImportError as missing:  # printed as the command's other errors are, before the search
        raise ValueError(f"--picture: {missing}") from None


def draw_best_plan(result: PlannerResult, path: str) -> Path:
    """Draw the best plan of ``result`` (:func:`~lightning_app_rlhf.planner.plan_picture.draw_plan_picture`), headed
    with the workload, the cluster and the prediction; returns the path written."""
    best, w = result.best, result.workload
    heading = (f"{w.name} on {result.cluster.name}: best plan {best.plan.name!r} ({best.source}), "
               f"{_prediction(best)}")
    return draw_plan_picture(best.plan, result.cluster.devices_per_node, path, heading)


def report_error(err: Exception, as_json: bool = False) -> int:
    """Print ``error: ...`` to stderr (and ``{"error": ...}`` to stdout with ``--json``); return the exit status 2."""
    if as_json:
        print(json_module.dumps({"error": str(err)}))
    print(f"error: {err}", file=sys.stderr)
    return 2


# ---------------------------------------------------------------- printing


def print_report(report: PlanReport) -> None:
    """Two tables keyed by plan number: each plan's wrappers, batch sizes and prediction (the best marked ``*``,
    the training config's own plan as source ``config``), then the ranks of each call; then a summary."""
    from rich.console import Console
    from rich.table import Table

    result = report.result
    w = result.workload
    batch = f"batch {w.batch_size}" if w.num_samples == 1 else f"batch {w.batch_size} prompts x {w.num_samples} samples"
    uneven = f" (geometric lengths of mean {w.mean_response_length:g})" if w.mean_response_length else ""
    tokens = (f"generation {w.generation_length} tokens{uneven}" if w.turns == 1 else
              f"{w.turns} turns x {w.generation_length} generated + {w.turns - 1} x {w.observation_length} "
              f"observation tokens = {w.episode_length} tokens per episode")
    heading = (f"{w.name} ({w.algorithm}: {', '.join(w.roles)}) on {result.cluster.name}: {batch}, prompt "
               f"{w.prompt_length} + {tokens}, {w.ppo_epochs} epoch(s) x "
               f"{w.num_minibatches} minibatches ({result.search_s:.1f} s search)")
    plans = Table(title="Plans, fastest first" + (" (the config's own last)" if report.configured else ""))
    right = ("#", "iter s", "samples/s", "vs flattening")
    for column in ("#", "", "source", "plan", "wrappers", "stale", "gen batch", "micro", "iter s", "samples/s",
                   "peak/device", "vs flattening", "note"):
        plans.add_column(column, justify="right" if column in right else "left")
    ranks = Table(title="Ranks of each call")
    for column in ("#", "plan", *w.calls):
        ranks.add_column(column, justify="right" if column == "#" else "left")
    flat = result.presets.get("flattening")
    candidates = [*result.candidates, *([report.configured] if report.configured is not None else [])]
    for number, c in enumerate(candidates, 1):
        e = c.estimate
        fits_both = e.fits and flat is not None and flat.estimate.fits
        plans.add_row(
            str(number),
            "*" if c is result.best else "",
            c.source,
            c.plan.name,
            " ".join(role_wrappers(c.plan.wrappers)) + ("" if c.plan.unshard_for_generation else " gen:gather/step"),
            (f"{c.plan.max_staleness} free" if c.plan.free_running else str(c.plan.max_staleness))
            + (" partial" if c.plan.partial_rollout else ""),
            str(c.choice.generation_batch or "all"),
            str(c.choice.micro_batch or "all"),
            _seconds_per_iteration(e.iteration_s) if e.fits else "-",
            f"{e.samples_per_s:.2f}" if e.fits else "-",
            f"{gib(e.peak_bytes)} / {gib(e.capacity_bytes)}",
            f"{flat.iteration_s / e.iteration_s:.2f}x" if fits_both else "-",
            e.rejected or "",
        )
        ranks.add_row(str(number), c.plan.name, *(_call_cell(c.plan, call) for call in w.calls))
    console = Console(width=200)
    console.print(heading, markup=False, highlight=False, soft_wrap=True)
    console.print(plans)
    console.print(ranks)
    for line in summary_lines(report, candidates):
        console.print(line, markup=False, highlight=False, soft_wrap=True)
    number = candidates.index(result.best) + 1
    print(f"fit flags that run #{number} (append them to a fit command of this training config):")
    print(shlex.join(fit_flags(result.best, result.cluster, report.chosen_backend)))


def _call_cell(plan: PlacementPlan, call: str) -> str:
    """A call's ranks, with its tensor- and pipeline-parallel degrees where above 1 (``0-7 tp4``: two replicas of 4
    ranks; ``0-15 tp8 pp2 1f1b``: one replica of two 8-way stages)."""
    return ranks_text(plan.ranks(call)) + plan.layout_text(call)


def summary_lines(report: PlanReport, candidates: list[Candidate]) -> list[str]:
    """The best plan, the training config's plan beside it, the search's pruning rules and the notes.

    Args:
        report: What to summarise.
        candidates: The plans in table order (numbered from 1).
    """
    best, configured = report.result.best, report.configured
    lines = [f"best: #{candidates.index(best) + 1} {best.plan.name} ({best.source}), {_prediction(best)}."]
    if best.estimate.efficiency:
        lines.append(f"efficiency of #{candidates.index(best) + 1}: {efficiency_text(best.estimate.efficiency)}.")
    if configured is not None:
        versus = (f"{configured.iteration_s / best.iteration_s:.2f}x the best's time" if configured.estimate.fits
                  else f"does not fit: {configured.rejected}")
        lines.append(f"config: #{candidates.index(configured) + 1} {configured.plan.name} from trainer.strategy "
                     f"{report.configured_strategy}, {_prediction(configured)}: {versus}.")
        if configured.estimate.efficiency:
            lines.append(f"efficiency of #{candidates.index(configured) + 1}: "
                         f"{efficiency_text(configured.estimate.efficiency)}.")
    if report.backend_results:
        lines.append(backend_line(report))
    lines += [f"rule: {rule}" for rule in report.result.rules]
    lines += [f"note: {note}" for note in report.notes]
    return lines


def backend_line(report: PlanReport) -> str:
    """``backend: vllm, the fastest of eager (0.412 s/iteration at its best plan, flattening) and vllm (0.300
    s/iteration at its best plan, flattening; 20.0 ms of it the weight sync to the engines) (...)``: the choice among
    ``--backends``.

    Args:
        report: A report of ``plan --backends``.
    """
    priced = []
    for name, result in report.backend_results.items():
        sync = result.best.estimate.call_s.get("weight_sync")
        priced.append(f"{name} ({_seconds_per_iteration(result.best.iteration_s)} s/iteration at its best plan, "
                      f"{result.best.plan.name}" + (f"; {sync * 1e3:.1f} ms of it the weight sync to the engines"
                                                    if sync is not None else "") + ")")
    chosen = (f"the one --backends lists: {priced[0]}" if len(priced) == 1
              else "the fastest of " + ", ".join(priced[:-1]) + " and " + priced[-1])
    return f"backend: {report.chosen_backend}, {chosen} (--model.generation.backend in the fit flags)."


def efficiency_text(efficiency: dict[str, dict[str, float]]) -> str:
    """``actor.generate decode 69% of peak HBM bandwidth priced, 52% achieved; actor.train MFU 39% priced, 31%
    achieved; ...``: a GPU plan's :meth:`~lightning_app_rlhf.planner.cost_model.CostModel.efficiencies`, each
    call's cited prior beside what the whole call achieves (with its communication and bubble)."""
    parts = []
    for call, e in efficiency.items():
        if "mfu" in e:
            parts.append(f"{call} MFU {e['mfu']:.0%} priced, {e['achieved_mfu']:.0%} achieved")
        else:
            parts.append(f"{call} decode {e['decode_bandwidth_share']:.0%} of peak HBM bandwidth priced, "
                         f"{e['achieved_decode_share']:.0%} achieved")
    return "; ".join(parts)


def _prediction(candidate: Candidate) -> str:
    e = candidate.estimate
    time = f"{_seconds_per_iteration(e.iteration_s)} s/iteration, {e.samples_per_s:.1f} samples/s, " if e.fits else ""
    return f"{time}peak {gib(e.peak_bytes)} of {gib(e.capacity_bytes)} per device"


def sweep(options: PlanOptions) -> list[dict[str, Any]]:
    """Every LLaMA size on every cluster of the docs table; one row each (errors included)."""
    check_algorithm_options(options)
    has_critic = CRITIC.name in ALGORITHMS[options.named("algorithm")].roles
    lora_rank = SWEEP_LORA_RANK if options.lora_rank is None else options.lora_rank
    rows = []
    for model in SWEEP_MODELS:
        for cluster in SWEEP_CLUSTERS:
            case = replace(options, cluster=cluster, actor=model, critic=model if has_critic else None,
                           lora_rank=lora_rank)
            try:
                result = plan_named_sizes(case).result
            except PlannerError as err:
                rows.append({"model": model, "cluster": cluster, "error": str(err)})
                continue
            best = result.best
            rows.append(
                {
                    "model": model,
                    "cluster": cluster,
                    "best": f"{best.plan.name}: {' '.join(call_ranks(best.plan))}",
                    "wrappers": " ".join(role_wrappers(best.plan.wrappers)),
                    "peak_memory_gib": best.estimate.peak_bytes / 2**30,
                    "source": best.source,
                    "iteration_s": best.iteration_s,
                    "samples_per_s": best.samples_per_s,
                    "speedup_over_flattening": result.speedup_over("flattening"),
                    "presets_s": {n: (c.iteration_s if c.estimate.fits else None) for n, c in result.presets.items()},
                    "search_s": result.search_s,
                    "efficiency": best.estimate.efficiency,
                }
            )
    return rows


def realhf_sweep(options: PlanOptions) -> list[dict[str, Any]]:
    """Every case of :data:`REALHF_CASES` x :data:`REALHF_LENGTHS`; one row each."""
    rows = []
    steps = options.mcmc_steps if options.mcmc_steps != PlanOptions.mcmc_steps else 300
    for model, cluster in REALHF_CASES:
        for generation_length, batch_size in REALHF_LENGTHS:
            case = replace(options, cluster=cluster, actor=model, critic=model, batch_size=batch_size,
                           prompt_length=128, generation_length=generation_length, num_minibatches=4,
                           search="both", mcmc_steps=steps)
            try:
                result = plan_named_sizes(case).result
            except PlannerError as err:
                rows.append({"model": model, "cluster": cluster, "generation_length": generation_length,
                             "batch_size": batch_size, "error": str(err)})
                continue
            best, flat = result.best, result.presets["flattening"]
            rows.append({
                "model": model, "cluster": cluster, "generation_length": generation_length, "batch_size": batch_size,
                "best": f"{best.plan.name}: {' '.join(call_ranks(best.plan))}",
                "wrappers": " ".join(role_wrappers(best.plan.wrappers))
                + ("" if best.plan.unshard_for_generation else " (gen: gather per step)"),
                "iteration_s": best.iteration_s, "peak_memory_gib": best.estimate.peak_bytes / 2**30,
                "flattening_s": flat.iteration_s if flat.estimate.fits else None,
                "flattening": " ".join(role_wrappers(flat.plan.wrappers)) + " " + " ".join(
                    f"{c.split('.')[0][:3]}.{c.split('.')[1][:3]}:tp{t}" for c, t in flat.plan.tp.items()),
                "search_s": result.search_s, "efficiency": best.estimate.efficiency,
            })  # fmt: skip
    return rows


def print_realhf_sweep(rows: list[dict[str, Any]]) -> None:
    """The ReaLHF sweep as the markdown table of docs/planner.md."""
    print("| model | cluster | gen x batch | chosen plan (ranks per call, TP degree) | wrappers | iter s | peak GiB | "
          "flattening s (its best layout) | actor MFU train / HBM share decode, priced (achieved) | search s |")
    print("| --- | --- | --- | --- | --- | ---: | ---: | --- | --- | ---: |")
    for r in rows:
        case = f"| {r['model']} | {r['cluster']} | {r['generation_length']} x {r['batch_size']} |"
        if "error" in r:
            print(f"{case} does not fit: {r['error']} | | | | | | |")
            continue
        print(f"{case} {r['best']} | {r['wrappers']} | {r['iteration_s']:.1f} | {r['peak_memory_gib']:.1f} | "
              f"{_seconds(r['flattening_s'])} ({r['flattening']}) | {_actor_efficiency(r.get('efficiency', {}))} | "
              f"{r['search_s']:.1f} |")


def _actor_efficiency(efficiency: dict[str, dict[str, float]]) -> str:
    """``39% (31%) / 69% (52%)``: the actor's training MFU and decode bandwidth share, priced (achieved)."""
    train, generate = efficiency.get(ACTOR.call("train")), efficiency.get(ACTOR.call("generate"))
    if train is None or generate is None:
        return "-"
    return (f"{train['mfu']:.0%} ({train['achieved_mfu']:.0%}) / {generate['decode_bandwidth_share']:.0%} "
            f"({generate['achieved_decode_share']:.0%})")


def print_sweep(rows: list[dict[str, Any]]) -> None:
    """The sweep as the markdown table of docs/planner.md."""
    print(
        "| model | cluster | chosen plan (ranks per call) | wrappers | iter s | peak GiB | flattening s | "
        "interleaving s | separation s | speedup vs flattening | search s |"
    )
    print("| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        if "error" in r:
            print(f"| {r['model']} | {r['cluster']} | does not fit: {r['error']} | | | | | | | | |")
            continue
        presets = r["presets_s"]
        speedup = r["speedup_over_flattening"]
        print(
            f"| {r['model']} | {r['cluster']} | {r['best']} ({r['source']}) | {r['wrappers']} | "
            f"{r['iteration_s']:.1f} | {r['peak_memory_gib']:.1f} | {_seconds(presets.get('flattening'))} | "
            f"{_seconds(presets.get('interleaving'))} | {_seconds(presets.get('separation'))} | "
            f"{f'{speedup:.2f}x' if speedup else 'flattening OOM'} | {r['search_s']:.1f} |"
        )


def _seconds_per_iteration(seconds: float) -> str:
    """Two decimals, three below a second (CPU plans of small models differ in milliseconds)."""
    return f"{seconds:.3f}" if seconds < 1 else f"{seconds:.2f}"


def _seconds(value: float | None) -> str:
    return f"{value:.1f}" if value is not None else "OOM"


def _json_default(value: Any) -> Any:
    if isinstance(value, float):
        return None
    return str(value)
