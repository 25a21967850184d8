"""Plan search: APP's two-phase grid and ReaLHF's Metropolis MCMC, over the cost model. Plain Python.

:func:`plan_placement` evaluates the registered placement presets
(:data:`~lightning_app_rlhf.parallel.placement_presets.PLACEMENT_PRESETS`: the three APP placements and any of the
user's), runs the searches, and returns a :class:`PlannerResult` whose
``best`` is a :class:`~lightning_app_rlhf.planner.cost_model.PlanChoice` (a ``PlacementPlan`` plus batch sizes).
Both searches are deterministic: the grid has no randomness, and the MCMC chain runs exactly its ``steps`` proposals
under a seed and reads no clock (an optional wall-time limit is an outer safety, reported in the result's rules
when it ends the chain). Every plan is searched with its tensor-parallel degrees per call (powers of two up to a
node), its pipeline-parallel degrees per train and scoring call (powers of two up to the nodes' count times a node's
devices, and the layers), and, for a sharded actor generating on its own train group, with both unshard choices.
They place the workload's roles only: a critic-free workload (``Workload(critic=None)``) gets plans without
``critic.*`` calls.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import random
import time
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from lightning_app_rlhf.core.role_table import (
    ACTOR,
    FROZEN_ROLES,
    REFERENCE,
    TRAINABLE_ROLES,
    calls_of,
    role_of,
)
from lightning_app_rlhf.engine.iteration import scores_on_train_ranks
from lightning_app_rlhf.parallel.placement_presets import PLACEMENT_PRESETS
from lightning_app_rlhf.parallel.plan import (
    PlacementPlan,
    flattening_plan,
    interleaving_plan,
    separation_plan,
)
from lightning_app_rlhf.parallel.wrappers import FROZEN_WRAPPERS, SHARDED_WRAPPERS, available_wrappers
from lightning_app_rlhf.planner.cluster import Cluster
from lightning_app_rlhf.planner.cost_model import (
    CostModel,
    Estimate,
    PlanChoice,
    gib,
)
from lightning_app_rlhf.planner.profiler import Profile
from lightning_app_rlhf.planner.workload import Workload, ceil_div

SEARCHES = ("app", "mcmc", "both", "presets")
OVERFLOW_PENALTY = 2.0
"""MCMC cost of a plan that does not fit: its time x (1 + OVERFLOW_PENALTY x the fraction it overflows by)."""


class PlannerError(ValueError):
    """No plan can run the workload on the cluster; the message carries the memory breakdown."""


@dataclass
class Candidate:
    """One evaluated plan."""

    estimate: Estimate
    source: str
    """``preset``, ``app`` or ``mcmc``."""

    @property
    def choice(self) -> PlanChoice:
        return self.estimate.choice

    @property
    def plan(self) -> PlacementPlan:
        return self.estimate.choice.plan

    @property
    def iteration_s(self) -> float:
        return self.estimate.iteration_s

    @property
    def samples_per_s(self) -> float:
        return self.estimate.samples_per_s

    @property
    def rejected(self) -> str | None:
        return self.estimate.rejected

    def to_dict(self) -> dict[str, Any]:
        e, plan = self.estimate, self.plan
        return {
            "name": plan.name,
            "source": self.source,
            "label": self.choice.label,
            "calls": {c: list(plan.ranks(c)) for c in calls_of(plan.roles)},
            "wrappers": dict(plan.wrappers),
            "max_staleness": plan.max_staleness,
            "tp": dict(plan.tp),
            "pp": dict(plan.pp),
            "pipeline_schedule": plan.pipeline_schedule,
            "free_running": plan.free_running,
            "partial_rollout": plan.partial_rollout,
            "unshard_for_generation": plan.unshard_for_generation,
            "generation_batch": self.choice.generation_batch,
            "micro_batch": self.choice.micro_batch,
            "iteration_s": e.iteration_s if e.fits else None,
            "samples_per_s": e.samples_per_s if e.fits else None,
            "trainer_idle_share": e.trainer_idle_share if e.fits else None,
            "peak_memory_bytes": e.peak_bytes,
            "capacity_bytes": e.capacity_bytes,
            "rejected": e.rejected,
            "call_s": e.call_s,
            "efficiency": e.efficiency,
            "memory": [
                {
                    "rank": m.rank,
                    "weights": m.weights,
                    "grads": m.grads,
                    "optimizer": m.optimizer,
                    "activations": m.activations,
                    "kv_cache": m.kv_cache,
                    "param_bytes": m.param_bytes,
                    "state_bytes": m.state_bytes,
                    "roles": m.roles,
                }
                for m in e.memory
            ],
        }


@dataclass
class PlannerResult:
    """What :func:`plan_placement` found."""

    best: Candidate
    """The fastest plan that fits."""
    candidates: list[Candidate]
    """The presets (each with its best wrapper and batches) and the top searched plans, fastest first;
    rejected ones last, with their reason."""
    presets: dict[str, Candidate]
    """``flattening``, ``interleaving``, ``separation`` (those the world size allows)."""
    cluster: Cluster
    workload: Workload
    rules: list[str] = field(default_factory=list)
    """What APP's prior rules pruned, and why."""
    search_s: float = 0.0

    @property
    def plan(self) -> PlacementPlan:
        return self.best.plan

    def speedup_over(self, preset: str = "flattening") -> float | None:
        """Predicted speedup of ``best`` over a preset (None when the preset does not fit)."""
        base = self.presets.get(preset)
        if base is None or not base.estimate.fits:
            return None
        return base.iteration_s / self.best.iteration_s

    def to_dict(self) -> dict[str, Any]:
        return {
            "cluster": self.cluster.name,
            "workload": self.workload.name,
            "algorithm": self.workload.algorithm,
            "roles": list(self.workload.roles),
            "batch_size": self.workload.batch_size,
            "num_samples": self.workload.num_samples,
            "world_size": self.cluster.world_size,
            "best": self.best.to_dict(),
            "speedup_over_flattening": self.speedup_over("flattening"),
            "presets": {name: c.to_dict() for name, c in self.presets.items()},
            "candidates": [c.to_dict() for c in self.candidates],
            "rules": self.rules,
            "search_s": self.search_s,
        }


def plan_placement(
    cluster: Cluster,
    workload: Workload,
    *,
    search: str = "both",
    seed: int = 0,
    time_budget_s: float | None = None,
    profile: Profile | None = None,
    top_k: int = 5,
    mcmc_steps: int = 2000,
    beta: float = 10.0,
    max_staleness: int = 0,
    partial_rollout: bool = False,
) -> PlannerResult:
    """Choose a placement and batch sizes for ``workload`` on ``cluster``.

    Args:
        cluster: Where it runs (:func:`~lightning_app_rlhf.planner.cluster.parse_cluster` or
            :func:`~lightning_app_rlhf.planner.cluster.cluster_from_environment`).
        workload: What an iteration computes (:func:`~lightning_app_rlhf.planner.workload.llama_workload`,
            :func:`~lightning_app_rlhf.planner.workload.workload_from_module`).
        search: ``app`` (prior rules + grid), ``mcmc`` (ReaLHF), ``both``, or ``presets`` only.
        seed: Seeds the MCMC chain.
        time_budget_s: An outer safety on the MCMC chain's wall time (None: none). The chain's budget is
            ``mcmc_steps``; a chain this limit stops early is reported in the result's ``rules`` (and its answer then
            depends on the machine's speed).
        profile: Measured op times; None uses the analytic model.
        top_k: Searched plans kept besides the presets.
        mcmc_steps: Proposals the MCMC chain makes: its budget.
        beta: MCMC inverse temperature: a plan ``d`` times slower (relative) is accepted with ``exp(-beta * d)``.
        max_staleness: The staleness bound the plans may use (``PlacementPlan.max_staleness``; 0: on-policy only).
            Above 0, every preset and searched plan whose training can run beside its generation is also priced
            with staleness 1 (:func:`staleness_variants`).
        partial_rollout: Also price every plan with partial rollouts where ``max_staleness`` leaves a version for
            their carried tokens (:func:`partial_variants`); refused (naming the fix) with dynamic sampling
            (``generation_rounds`` above 1) or multi-turn episodes, as the engine refuses them.

    Raises:
        PlannerError: Nothing fits (the message shows the memory breakdown of the closest plan).
    """
    if search not in SEARCHES:
        raise ValueError(f"search={search!r}: choose one of {SEARCHES}.")
    start = time.perf_counter()
    if partial_rollout:
        check_partial_pricing(workload, max_staleness)
    model = CostModel(cluster, workload, profile)
    _check_replica_fits(model)
    rules: list[str] = []
    presets = {name: _best_of(model, plans, "preset") for name, plans in _preset_plans(model, rules).items()}
    searched = _searched_candidates(model, list(presets.values()), search, rules, seed=seed,
                                    time_budget_s=time_budget_s, top_k=top_k, mcmc_steps=mcmc_steps, beta=beta,
                                    max_staleness=max_staleness, partial_rollout=partial_rollout)
    fitting = sorted((c for c in [*presets.values(), *searched] if c.estimate.fits), key=_cost)
    if not fitting:
        closest = min(presets.values(), key=lambda c: c.estimate.peak_bytes)
        raise PlannerError(
            f"No placement of {workload.name} fits on {cluster.name}. The closest, {closest.plan.name} "
            f"with {'/'.join(closest.plan.wrappers.values())}, is {closest.rejected}. Use more or "
            "larger devices, smaller models, or shorter sequences."
        )
    top = _distinct(sorted(searched, key=_cost), top_k)
    rejected = [c for c in presets.values() if not c.estimate.fits]
    # Room for every preset beside the searched plans; at least 3 (the built-in presets), so that a cluster where
    # fewer presets apply (one device) keeps as many searched plans.
    shown = 2 * top_k + max(3, len(presets))
    result = PlannerResult(
        fitting[0],
        [*_distinct([*presets.values(), *top], shown)] + rejected,
        presets,
        cluster,
        workload,
        rules,
    )
    result.candidates = sorted(_distinct(result.candidates, shown), key=_cost)
    for candidate in {id(c): c for c in [*result.candidates, *presets.values()]}.values():  # the reported plans only:
        candidate.estimate.efficiency = model.efficiencies(candidate.choice)  # the search never reads them
    result.search_s = time.perf_counter() - start
    return result


def _searched_candidates(model: CostModel, presets: list[Candidate], search: str, rules: list[str], *, seed: int,
                         time_budget_s: float | None, top_k: int, mcmc_steps: int, beta: float,
                         max_staleness: int, partial_rollout: bool = False) -> list[Candidate]:
    """The searched plans of :func:`plan_placement` (its arguments), presets not included: APP's grid with the
    role-block plans, then the MCMC chain seeded with the three cheapest fitting plans so far, then the staleness-1
    variants of every preset and searched plan. Each search appends what it decided to ``rules``."""
    searched: list[Candidate] = []
    if search in ("app", "both"):
        searched += with_tp(model, [*app_search(model, rules), *role_block_plans(model)])
    if search in ("mcmc", "both"):
        seeds = sorted((c for c in [*presets, *searched] if c.estimate.fits), key=_cost)
        try:
            searched += mcmc_search(
                model,
                seed=seed,
                steps=mcmc_steps,
                time_budget_s=time_budget_s,
                beta=beta,
                top_k=top_k,
                seeds=[c.plan for c in seeds[:3]],
                report=rules,
            )
        except PlannerError:
            if seeds:
                raise
            # nothing fits anywhere: plan_placement's error names the closest preset
    if max_staleness > 0:
        searched += staleness_variants(model, [*presets, *searched])
    if partial_rollout:
        searched += partial_variants(model, [*presets, *searched], max_staleness)
    return searched


def check_partial_pricing(workload: Workload, max_staleness: int) -> None:
    """Raise naming the fix where the planner cannot price ``workload`` with partial rollouts under the staleness
    bound ``max_staleness``: a bound below 1, dynamic sampling (the engine refuses it: its rounds are per update) and
    multi-turn episodes (the planner simulates the pool of single-turn responses only)."""
    if max_staleness < 1:
        raise ValueError("partial_rollout prices plans whose unfinished samples resume under the next weights, "
                         "one version older than the update that trains on them: give max_staleness >= 1 (plan "
                         "--max_staleness 1 --partial_rollout), or leave partial_rollout off.")
    if workload.generation_rounds > 1:
        raise ValueError("partial_rollout carries unfinished samples across updates, and dynamic sampling "
                         f"(generation_rounds {workload.generation_rounds}) collects groups over generation rounds "
                         "within one update: plan with --generation_rounds 1, or without --partial_rollout.")
    if workload.turns > 1:
        raise ValueError(f"The planner prices partial rollouts of single-turn responses only, and this workload runs "
                         f"episodes of {workload.turns} turns: plan it with --turns 1, or without --partial_rollout.")


def partial_variants(model: CostModel, candidates: list[Candidate], max_staleness: int) -> list[Candidate]:
    """Each distinct candidate priced with partial rollouts (``PlacementPlan.partial_rollout``), one version of
    staleness more for their carried tokens: an on-policy plan at ``max_staleness`` 1 (the same schedule), a
    staleness-1 variant (fixed or free-running) at 2; those the bound ``max_staleness`` leaves no version for are
    skipped. Where lengths are uneven (``Workload.mean_response_length``) a call ends once a batch of groups is
    complete; with equal lengths they cost a little more (the pool's extra rows and prefills)."""
    out = []
    for candidate in _distinct(candidates, len(candidates)):
        plan = candidate.plan
        if plan.partial_rollout or plan.max_staleness + 1 > max_staleness:
            continue
        try:  # the plan and the engine's rules refuse some (a pipelined call runs with max_staleness 0 only)
            variant = dataclasses.replace(plan, max_staleness=plan.max_staleness + 1, partial_rollout=True)
            model.check_plan(variant)
        except ValueError:
            continue
        out.append(Candidate(evaluate(model, variant), candidate.source))
    return out


def staleness_variants(model: CostModel, candidates: list[Candidate]) -> list[Candidate]:
    """Each distinct candidate whose train calls can run beside its generation (disjoint ranks, no trainable role
    scoring on its own train ranks), priced with ``max_staleness`` 1 on the fixed schedule, and free-running where
    its generation ranks hold every generate and forward call (a Separation plan, ``PlacementPlan.free_running``).
    A larger bound would cost the same and only train on older data: the fixed schedule is lockstep (the groups
    meet in every iteration's gathers), and free-running's two sides already run each at its own pace at 1."""
    out = []
    for candidate in _distinct(candidates, len(candidates)):
        plan = candidate.plan
        training = {r for c in plan.calls if c.endswith(".train") for r in plan.ranks(c)}
        if plan.overlap or training & set(plan.ranks(ACTOR.call("generate"))) or scores_on_train_ranks(plan):
            continue
        stale = dataclasses.replace(plan, max_staleness=1)
        try:  # the engine's rules refuse some (a pipelined call runs with max_staleness 0 only)
            model.check_plan(stale)
        except ValueError:
            continue
        out.append(Candidate(evaluate(model, stale), candidate.source))
        try:  # the plan validates the split: generate and forwards on the same ranks, no tensor-parallel copy there
            free = dataclasses.replace(plan, max_staleness=1, free_running=True)
        except ValueError:
            continue
        out.append(Candidate(evaluate(model, free), candidate.source))
    return out


def _cost(candidate: Candidate) -> tuple[float, str]:
    return candidate.iteration_s if candidate.estimate.fits else math.inf, candidate.choice.label


def _distinct(candidates: list[Candidate], limit: int) -> list[Candidate]:
    seen, out = set(), []
    for c in candidates:
        if c.choice.key not in seen:
            seen.add(c.choice.key)
            out.append(c)
    return out[:limit]


def _check_replica_fits(model: CostModel) -> None:
    """Fail early when even full sharding over every rank cannot hold the models."""
    w, cluster = model.workload, model.cluster
    n = cluster.world_size
    total, lines = 0, []
    wrappers = _wrappers(model)
    sharding = [wr for wr in SHARDED_WRAPPERS if wr in available_wrappers()]
    can_shard = any(wr in SHARDED_WRAPPERS for wr in wrappers)
    for role in sorted(w.roles, key=lambda r: r not in TRAINABLE_ROLES):  # trained roles first: they weigh most
        shape = w.shape(role)
        if shape is None:
            continue
        held = w.held_params(role) * shape.dtype_bytes
        if held > model.capacity and not can_shard:  # without FSDP2 / ZeRO-3 every copy is whole
            raise PlannerError(
                f"The {role} ({shape.name}, {gib(held)} of weights) does not fit on one "
                f"{cluster.device.name} ({gib(model.capacity)} usable) and no sharding wrapper "
                f"({', '.join(sharding)}) is allowed: the wrappers are {list(w.wrappers)}. Allow "
                f"{' or '.join(sharding)}, or use larger devices or a smaller model."
            )
        if role == REFERENCE.name and w.reference_is_actor_base:
            lines.append(f"{role} 0 (the actor's base, adapters off)")
            continue
        full = sum(model.role_bytes(role, wrappers[0], 1, 0))  # one whole copy, with its state if it trains
        lines.append(f"{role} {gib(full)}")
        total += full
    if total > n * model.capacity:
        raise PlannerError(
            f"{w.name} cannot fit on {cluster.name}: weights, grads and optimizer state take "
            f"{gib(total)} = {' + '.join(lines)}, more than {n} x {gib(model.capacity)} usable. Use "
            "more or larger devices, or smaller models."
        )


# ---------------------------------------------------------------- batch sizes for a plan


def choose_batches(model: CostModel, plan: PlacementPlan) -> PlanChoice:
    """The largest generation batch and micro-batch that fit (whole shards when they do, as the engine runs)."""
    w = model.workload
    generate = ACTOR.call("generate")
    gen_shard = ceil_div(w.samples, len(plan.ranks(generate)))
    generation = _fitting(model, plan, "generation_batch", gen_shard)
    micro_shard = ceil_div(w.samples, min(len(plan.ranks(c)) for c in plan.calls if c != generate))
    micro = _fitting(model, plan, "micro_batch", micro_shard)
    return PlanChoice(plan, generation, micro)


def _fitting(model: CostModel, plan: PlacementPlan, what: str, shard: int) -> int | None:
    """Largest value of ``what`` (None = the whole shard, then powers of two) whose calls fit next to the static
    bytes of their ranks."""
    static = [m.total for m in model.static_memory(plan)]
    generate = ACTOR.call("generate")
    calls = [generate] if what == "generation_batch" else [c for c in plan.calls if c != generate]
    headroom = {c: model.capacity - max(static[r] for r in plan.ranks(c)) for c in calls}
    options = [None] + [2**k for k in range(int(math.log2(max(shard, 1))), -1, -1) if 2**k < shard]
    for value in options:
        choice = PlanChoice(plan, **{what: value})
        if all(sum(model.transient(choice, c)) <= headroom[c] for c in calls):
            return value
    return 1


def evaluate(model: CostModel, plan: PlacementPlan) -> Estimate:
    """The estimate of ``plan`` with its largest fitting batch sizes; where the actor generates on its own sharded
    train group, the better of gathering its weights once per rollout (more memory) or per decoding step."""
    return _pick([model.evaluate(choose_batches(model, p)) for p in unshard_options(model, plan)])


def unshard_options(model: CostModel, plan: PlacementPlan) -> list[PlacementPlan]:
    """``plan`` with both ``unshard_for_generation`` choices where they differ (a sharded actor generating on its
    own train group), else ``plan`` alone."""
    once = dataclasses.replace(plan, unshard_for_generation=True)
    if not model.unshards_once(once):
        return [plan]
    return [once, dataclasses.replace(plan, unshard_for_generation=False)]


def _pick(estimates: list[Estimate]) -> Estimate:
    """The fastest estimate that fits, else the one with the least memory."""
    fitting = [e for e in estimates if e.fits]
    if fitting:
        return min(fitting, key=lambda e: e.iteration_s)
    return min(estimates, key=lambda e: e.peak_bytes)


def _best_of(model: CostModel, plans: list[PlacementPlan], source: str) -> Candidate:
    return Candidate(_pick([evaluate(model, v) for p in plans for v in tp_variants(model, p)]), source)


# ---------------------------------------------------------------- tensor parallelism per call


@functools.cache
def has_tp_plan(model_type: str) -> bool:
    """Whether transformers ships a tensor-parallel plan (``base_model_tp_plan``) for ``model_type``: the engine cuts
    only those families (llama, mistral, qwen2, ...; not gpt2)."""
    from transformers import AutoConfig

    try:
        # Empty counts as none: the engine refuses a model whose tp_plan is empty (family_tp_plan).
        return bool(AutoConfig.for_model(model_type).base_model_tp_plan)
    except ValueError:  # a model type transformers does not know: the engine could not build it either
        return False


def tp_degrees(model: CostModel) -> list[int]:
    """Tensor-parallel degrees the search gives a call: powers of two up to a node's devices that divide every
    model's attention and key/value heads; none above 1 when a model's family has no tensor-parallel plan in
    transformers (:func:`has_tp_plan`: the engine would refuse the plan)."""
    shapes = [model.workload.shape(r) for r in model.workload.roles]
    families = {s.config["model_type"] for s in shapes if s is not None and s.config and "model_type" in s.config}
    if not all(has_tp_plan(family) for family in families):
        return [1]
    heads = [h for s in shapes if s is not None for h in (s.heads, s.kv_heads)]
    per_node = model.cluster.devices_per_node
    return [t for t in (2**k for k in range(per_node.bit_length())) if t <= per_node and all(h % t == 0 for h in heads)]


def pp_degrees(model: CostModel) -> list[int]:
    """Pipeline-parallel degrees the search gives a train or scoring call: powers of two up to the cluster's devices
    that leave every modelled role at least one decoder layer per stage. ``actor.generate`` stays data x tensor
    parallel (as in ReaLHF: a pipeline would idle its stages at every decoding step)."""
    layers = [s.layers for r in model.workload.roles if (s := model.workload.shape(r)) is not None]
    most = min([model.cluster.world_size, *layers])
    return [2**k for k in range(most.bit_length()) if 2**k <= most]


def tp_variants(model: CostModel, plan: PlacementPlan) -> list[PlacementPlan]:
    """``plan`` (its own degrees) and, for every degree ``t > 1`` of :func:`tp_degrees`: generation alone ``t``-way
    tensor parallel, generation and the scoring forwards, and every call (training DP x TP). Then each of these with
    its train calls, and with its train and scoring calls, that have no TP degree pipelined ``p``-way, for every
    degree ``p > 1`` of :func:`pp_degrees` (DP x PP beside TP generation: a call grows past a node by its stages,
    where tensor parallelism would cross nodes; the engine runs one of the two per call). Degrees a call's group
    cannot take, plans the engine refuses, and tensor-parallel replicas that would span nodes are left out."""
    out = [plan]
    generate = ACTOR.call("generate")
    modelled = [c for c in plan.calls if model.workload.shape(role_of(c)) is not None]  # a reward function: no TP
    scoring = [c for c in modelled if not c.endswith(".train")]
    for t in tp_degrees(model)[1:]:
        for calls in ([generate], scoring, modelled):
            tp = {c: t for c in calls if len(plan.ranks(c)) % t == 0}
            if not tp or generate not in tp:
                continue
            try:
                # Generation on its TP copy never gathers shards: the unshard choice no longer applies.
                variant = dataclasses.replace(plan, tp={**plan.tp, **tp}, unshard_for_generation=True)
                model.check_plan(variant)
            except ValueError:
                continue
            if variant not in out:
                out.append(variant)
    for base in list(out):
        # The engine runs one of tp and pp per call (pipeline_checks): pipeline the calls the base left without TP,
        # the train calls alone or with the scoring calls.
        untensored = [c for c in modelled if c != generate and base.tp_degree(c) == 1]
        for p in pp_degrees(model)[1:]:
            fitting = [c for c in untensored if len(base.ranks(c)) % p == 0]
            for calls in ([c for c in fitting if c.endswith(".train")], fitting):
                if not calls:
                    continue
                try:
                    variant = dataclasses.replace(base, pp={**base.pp, **dict.fromkeys(calls, p)})
                    model.check_plan(variant)
                except ValueError:
                    continue
                if variant not in out:
                    out.append(variant)
    return out


def with_tp(model: CostModel, candidates: list[Candidate], keep: int = 8) -> list[Candidate]:
    """``candidates`` plus the :func:`tp_variants` of the ``keep`` most promising distinct ones (the fastest that
    fit, then the rest by their overflow-penalised time) and of the ``keep / 2`` most promising of each source
    (``app``, ``blocks``): a grid over every degree of every plan would cost ``3 x log2(node)`` times the grid."""
    ranked = sorted(_distinct(candidates, len(candidates)), key=lambda c: (_penalised(c.estimate), c.choice.label))
    # The best of each source too: a layout that is slow without TP (a node-sized block generating with sharded
    # weights) can be the fastest with it.
    chosen = ranked[:keep] + [c for source in sorted({c.source for c in ranked})
                              for c in [c for c in ranked if c.source == source][: keep // 2]]
    # Role blocks are few: rank them by their widest variant, every call at the largest degree (a block too slow or
    # too big without TP can be the best plan with it).
    blocks = [c for c in ranked if c.source == "blocks"]
    widest = [(_penalised(evaluate(model, v)), c) for c in blocks for v in tp_variants(model, c.plan)[-1:]]
    chosen += [c for _, c in sorted(widest, key=lambda x: (x[0], x[1].choice.label))[: keep // 2]]
    refined = [
        Candidate(evaluate(model, v), c.source)
        for c in _distinct(chosen, len(chosen)) for v in tp_variants(model, c.plan)[1:]
    ]
    return [*candidates, *refined]


def _penalised(e: Estimate) -> float:
    """Seconds per iteration, times ``1 + OVERFLOW_PENALTY x`` the fraction a plan overflows memory by; infinite for a
    plan its generation backend cannot run (no amount of memory would help)."""
    if e.fits:
        return e.iteration_s
    if e.refused:
        return math.inf
    return e.iteration_s * (1 + OVERFLOW_PENALTY * (e.peak_bytes / e.capacity_bytes - 1))


def _wrappers(model: CostModel) -> list[str]:
    """The search space of the trainable roles' wrappers: the registry's, in its order, that this machine can run
    (:func:`~lightning_app_rlhf.parallel.wrappers.available_wrappers`) and the workload allows."""
    return [w for w in available_wrappers() if w in model.workload.wrappers]


def _frozen_choices(model: CostModel) -> list[str | None]:
    """Options for a frozen role's wrapper: held whole (None), or sharded over its forward group by one of the
    searched wrappers that can (:data:`~lightning_app_rlhf.parallel.wrappers.FROZEN_WRAPPERS`)."""
    return [None, *[w for w in _wrappers(model) if w in FROZEN_WRAPPERS]]


def _frozen_options(model: CostModel) -> list[dict[str, str]]:
    """Frozen-role wrappers to try: whole copies, then for each wrapper of :func:`_frozen_choices` every frozen
    model sharded with it."""
    roles = [r for r in _frozen_roles(model.workload) if model.workload.shape(r) is not None]
    if model.workload.reference_is_actor_base:
        roles = [r for r in roles if r != REFERENCE.name]
    sharded = [w for w in _frozen_choices(model) if w is not None]
    return [{}, *[dict.fromkeys(roles, wrapper) for wrapper in sharded]] if roles else [{}]


def _frozen_roles(workload: Workload) -> tuple[str, ...]:
    """The workload's frozen roles, in role-table order."""
    return tuple(r for r in FROZEN_ROLES if r in workload.roles)


def with_frozen(plan: PlacementPlan, frozen: dict[str, str]) -> PlacementPlan:
    """``plan`` with frozen-role wrappers added."""
    if not frozen:
        return plan
    return dataclasses.replace(plan, wrappers={**plan.wrappers, **frozen})


def _preset_plans(model: CostModel, rules: list[str] | None = None) -> dict[str, list[PlacementPlan]]:
    """Every registered placement preset's variants (:data:`PLACEMENT_PRESETS`, in registration order), each with
    every frozen-role wrapper option.

    A preset without variants on this cluster (fewer ranks than its ``min_world_size``) is left out; so is one whose
    plan builder refuses the cluster or the workload's roles (a ``ValueError``, e.g. a preset registered for the
    Trainer without a ``min_world_size``), with the reason appended to ``rules``.
    """
    n, roles, wrappers = model.cluster.world_size, model.workload.roles, _wrappers(model)
    plans: dict[str, list[PlacementPlan]] = {}
    for preset in PLACEMENT_PRESETS.entries():
        try:
            plans[preset.name] = preset.candidate_plans(n, wrappers, roles)
        except ValueError as err:
            if rules is not None:
                rules.append(f"preset {preset.name} left out: {err}")
    frozen = _frozen_options(model)
    return {name: [with_frozen(p, f) for p in group for f in frozen] for name, group in plans.items() if group}


# ---------------------------------------------------------------- APP: prior rules, then a grid


def _ratio_steps(n: int) -> list[int]:
    """Rank counts a ratio may give: every count on up to 8 ranks, multiples of n/8 beyond."""
    step = max(1, n // 8)
    return list(range(step, n, step))


def app_search(model: CostModel, rules: list[str]) -> list[Candidate]:
    """APP's adaptive planner: prune placements with prior rules, then a grid over placement ratios and ZeRO stages,
    with the generation batch and micro-batch set to the largest that fit."""
    w, n = model.workload, model.cluster.world_size
    capacity = model.capacity
    plans: list[PlacementPlan] = [flattening_plan(n, wr, roles=w.roles) for wr in _wrappers(model)]
    if n == 1:
        rules.append("one device: only flattening")
        return [Candidate(evaluate(model, p), "app") for p in plans]
    frozen_shapes = [w.shape(r) for r in _frozen_roles(w)]
    frozen = sum(s.param_bytes for s in frozen_shapes if s is not None)
    if frozen >= 0.05 * capacity:
        for n_ref in _ratio_steps(n):
            for n_rew in _ratio_steps(n):
                if n_ref + n_rew <= n:
                    plans += [
                        interleaving_plan(n, Fraction(n_ref, n), Fraction(n_rew, n), wr, roles=w.roles)
                        for wr in _wrappers(model)
                    ]
    else:
        rules.append(
            f"interleaving grid skipped: reference + reward weights ({gib(frozen)}) are under 5% of a "
            "device, so splitting them saves little memory"
        )
    # Generation copies of the trainable models (actor, critic if any) are whole; frozen models may be sharded
    # where a wrapper of FROZEN_WRAPPERS is searched.
    shadows = sum(w.held_params(r) * w.shape(r).dtype_bytes for r in w.trainable) + (
        0 if len(_frozen_choices(model)) > 1 else frozen
    )
    widest = tp_degrees(model)[-1]  # a generation copy split over a node by tensor parallelism
    if shadows > capacity * widest:
        rules.append(
            f"separation skipped: the generation group holds copies of the models ({gib(shadows)}), more than "
            f"{widest} device(s) hold ({gib(capacity)} each), the widest tensor-parallel replica"
        )
    elif n < 4:
        rules.append(
            "separation grid skipped: it pays off at scale (>= 4 devices); only its preset is evaluated"
        )
    else:
        for n_gen in _ratio_steps(n):
            plans += [
                separation_plan(n, generation_ratio=Fraction(n_gen, n), wrapper=wr, roles=w.roles)
                for wr in _wrappers(model)
            ]
    return [
        Candidate(evaluate(model, with_frozen(p, f)), "app") for p in plans for f in _frozen_options(model)
    ]


def role_block_plans(model: CostModel) -> list[Candidate]:
    """Each model on its own contiguous block of ranks: the actor's calls (generate, reference on its base or a copy,
    train) on the first half; the other models (the critic's forward and train where there is one, then the reward
    model) on the second half together, or, with two of them, on a quarter each. Sharded roles then gather within
    their block (a node, on multi-node clusters) instead of across the cluster, which a chain moving one call at a
    time rarely reaches (source ``blocks``)."""
    w, n = model.workload, model.cluster.world_size
    if n < 2 or n % 2:
        return []
    half = n // 2
    first, second = tuple(range(half)), tuple(range(half, n))
    # Trainable models first: the critic takes the first quarter, the reward model the second.
    others = sorted((r for r in w.roles if r not in (ACTOR.name, REFERENCE.name)), key=lambda r: r not in w.trainable)
    layouts = [dict.fromkeys(others, second)]
    if len(others) > 1 and half % len(others) == 0:
        size = half // len(others)
        layouts.append({r: tuple(range(half + i * size, half + (i + 1) * size)) for i, r in enumerate(others)})
    plans = []
    for layout in layouts:
        calls = {c: layout.get(role_of(c), first) for c in w.calls}
        for wrapper in _wrappers(model):
            for frozen in _frozen_options(model):
                wrappers = {**dict.fromkeys(w.trainable, wrapper), **frozen}
                plans.append(PlacementPlan(n, calls, wrappers, name="blocks"))
    return [Candidate(evaluate(model, p), "blocks") for p in plans]


# ---------------------------------------------------------------- ReaLHF: Metropolis MCMC over per-call groups


def device_groups(cluster: Cluster) -> list[tuple[int, ...]]:
    """Contiguous, aligned blocks of ranks (ReaLHF's meshes): power-of-two sizes up to a node, then whole nodes;
    on multi-node clusters no smaller than half a node."""
    n, per_node = cluster.world_size, cluster.devices_per_node
    smallest = max(1, per_node // 2) if cluster.nodes > 1 else 1
    sizes = sorted(
        {s for s in (2**k for k in range(n.bit_length())) if smallest <= s <= per_node}
        | {k * per_node for k in range(1, cluster.nodes + 1) if n % (k * per_node) == 0}
    )
    return [tuple(range(start, start + size)) for size in sizes for start in range(0, n - size + 1, size)]


def mcmc_search(
    model: CostModel,
    *,
    seed: int = 0,
    steps: int = 2000,
    time_budget_s: float | None = None,
    beta: float = 10.0,
    top_k: int = 5,
    seeds: list[PlacementPlan] | None = None,
    report: list[str] | None = None,
) -> list[Candidate]:
    """ReaLHF's search: a state gives every call of the workload a device group and a tensor-parallel degree, every
    trainable role a wrapper and every frozen role a wrapper or none (:class:`_StateLayout`); each state is priced
    with its better unshard choice (:func:`evaluate`).

    It starts from a plan that fits: the better of each call's individually fastest group and ``seeds`` (e.g. the
    APP grid's best), or when neither fits the first of a list of whole-cluster plans that does
    (:func:`_valid_start`). Each of its ``steps`` proposals changes one call's group, one call's degree, one wrapper,
    or (a third of the time) moves a trainable role's train group together with every call of that role that runs
    on it (a sharded role must run a call on all of its train ranks or none, so single-call moves cannot relocate
    it); a plan ``d`` slower (relative; one that does not fit counts its overflow as a penalty) is accepted with
    probability ``exp(-beta * d)``. The chain reads no clock: its answer depends on ``seed`` and ``steps`` only.

    Args:
        model: The cost model.
        seed: Seeds the proposals.
        steps: Proposals to make: the budget.
        time_budget_s: An outer safety (None: none): the chain stops after this many seconds of wall time even
            before ``steps``, and says so in ``report``.
        beta: Inverse temperature.
        top_k: Plans returned.
        seeds: Plans to start from where they are expressible in the chain's groups and better than its own start.
        report: Lines for the result's rules: where the chain started, and a stop by ``time_budget_s``.

    Returns:
        The ``top_k`` best plans that fit, fastest first, then the start (source ``mcmc start``).

    Raises:
        PlannerError: No start plan fits (the message names the closest).
    """
    rng = random.Random(seed)
    groups = device_groups(model.cluster)
    wrappers = _wrappers(model)
    degrees = [(t, p) for p in pp_degrees(model) for t in tp_degrees(model)]
    layout = _StateLayout.of(model.workload, _frozen_choices(model), degrees)
    n = model.cluster.world_size
    cache: dict[tuple, Estimate | None] = {}

    def estimate(state: tuple) -> Estimate | None:
        if state not in cache:
            cache[state] = _evaluate_state(model, layout, state, groups, wrappers, n)
        return cache[state]

    def cost(state: tuple) -> float:
        e = estimate(state)
        return math.inf if e is None else _penalised(e)

    current, how = _valid_start(model, layout, groups, wrappers, estimate, seeds or [])
    current_cost = cost(current)
    start_state = current
    if report is not None:
        report.append(f"mcmc: {steps} steps from {how} ({current_cost:.3g} s/iteration), seed {seed}")
    calls, trainable = layout.calls, layout.trainable
    deadline = None if time_budget_s is None else time.perf_counter() + time_budget_s
    made = accepted = 0
    for _ in range(steps):
        if deadline is not None and time.perf_counter() > deadline:
            if report is not None:
                report.append(f"mcmc: stopped by its {time_budget_s:g} s time limit after {made} of {steps} steps, so "
                              "this answer depends on the machine's speed: give it fewer steps or more time")
            break
        made += 1
        proposal = list(current)
        slot = rng.randrange(layout.size)
        if rng.random() < 1 / 3:  # move a trainable role's train group and the calls that share it
            role = rng.choice(trainable)
            train = calls.index(f"{role}.train")
            target = rng.randrange(len(groups))
            for i, call in enumerate(calls):
                if i != train and role_of(call) == role and current[i] == current[train]:
                    proposal[i] = target
            proposal[train] = target
        elif slot < len(calls):
            proposal[slot] = rng.randrange(len(groups))
        elif slot < len(calls) + len(trainable):
            proposal[slot] = rng.randrange(len(wrappers))
        elif slot < len(calls) + len(trainable) + len(layout.frozen):
            proposal[slot] = rng.randrange(len(layout.frozen_choices))
        else:  # one of the call's two degrees: a neighbour of the layout, not a jump across both
            t, p = layout.degrees[current[slot]]
            if rng.random() < 0.5:
                t = rng.choice(sorted({d[0] for d in layout.degrees}))
            else:
                p = rng.choice(sorted({d[1] for d in layout.degrees}))
            proposal[slot] = layout.degrees.index((t, p))
        proposal = tuple(proposal)
        new_cost = cost(proposal)
        if math.isinf(new_cost):
            continue
        delta = (new_cost - current_cost) / current_cost
        if delta <= 0 or rng.random() < math.exp(-beta * delta):
            current, current_cost = proposal, new_cost
            accepted += 1
    if report is not None:
        report.append(f"mcmc: {made} proposals made, {accepted} accepted, {len(cache)} distinct plans priced")
    ranked = sorted((s for s, e in cache.items() if e is not None and e.fits), key=lambda s: (cost(s), s))
    best = [Candidate(cache[s], "mcmc") for s in ranked[:top_k]]
    return [*best, Candidate(cache[start_state], "mcmc start")]


def _valid_start(
    model: CostModel, layout: _StateLayout, groups: list, wrappers: list[str], estimate: Any,
    seeds: list[PlacementPlan],
) -> tuple[tuple, str]:
    """A start state that fits, and how it was found: each call's fastest group (:func:`_fastest_start`) when it
    fits and no seed is faster; else the fastest seed that fits; else the first whole-cluster plan that fits, every
    call on every rank with each wrapper, frozen choice and degree in turn."""
    def fitting(state: tuple | None) -> Estimate | None:
        e = estimate(state) if state is not None else None
        return e if e is not None and e.fits else None

    options = [(_fastest_start(model, layout, groups, wrappers, estimate), "each call's fastest group")]
    options += [(_state_of(p, layout, groups, wrappers), f"the seed {p.name}") for p in seeds]
    valid = [(fitting(state).iteration_s, i, state, how) for i, (state, how) in enumerate(options) if fitting(state)]
    if valid:
        _, _, state, how = min(valid)
        return state, how
    everyone = groups.index(tuple(range(model.cluster.world_size)))
    for degree in range(len(layout.degrees)):
        for frozen in range(len(layout.frozen_choices)):
            for wrapper in range(len(wrappers)):
                state = (*[everyone] * len(layout.calls), *[wrapper] * len(layout.trainable),
                         *[frozen] * len(layout.frozen), *[degree] * len(layout.calls))
                if fitting(state):
                    return state, "every call on every rank"
    raise PlannerError(
        f"The MCMC search found no plan of {model.workload.name} that fits on {model.cluster.name} to start from: "
        "neither each call's fastest group, nor the seeds, nor every call on every rank with any wrapper and "
        "tensor-parallel degree. Use more or larger devices, smaller models, or shorter sequences."
    )


@dataclass(frozen=True)
class _StateLayout:
    """What the entries of an MCMC state index: a device group per call, then a wrapper per trainable role, then a
    frozen choice (an index into :attr:`frozen_choices`) per frozen role, each in the workload's role-table order."""

    calls: tuple[str, ...]
    """The workload's calls (no ``critic.*`` for a critic-free algorithm)."""
    trainable: tuple[str, ...]
    """The workload's trainable roles."""
    frozen: tuple[str, ...]
    """The workload's frozen roles."""
    frozen_choices: tuple[str | None, ...] = (None,)
    """A frozen role's options (:func:`_frozen_choices`): held whole, or a wrapper that shards it."""
    degrees: tuple[tuple[int, int], ...] = ((1, 1),)
    """A call's (tensor-, pipeline-parallel) degrees (:func:`tp_degrees` x :func:`pp_degrees`), (1, 1) first; the
    state's last entries index them, one per call."""

    @classmethod
    def of(cls, workload: Workload, frozen_choices: list[str | None],
           degrees: list[tuple[int, int]]) -> _StateLayout:
        return cls(workload.calls, workload.trainable, _frozen_roles(workload), tuple(frozen_choices), tuple(degrees))

    @property
    def size(self) -> int:
        return 2 * len(self.calls) + len(self.trainable) + len(self.frozen)


def _evaluate_state(
    model: CostModel, layout: _StateLayout, state: tuple, groups: list, wrappers: list[str], n: int
) -> Estimate | None:
    calls = {c: groups[state[i]] for i, c in enumerate(layout.calls)}
    offset = len(layout.calls)
    roles = {r: wrappers[state[offset + i]] for i, r in enumerate(layout.trainable)}
    offset += len(layout.trainable)
    for i, role in enumerate(layout.frozen):
        frozen = layout.frozen_choices[state[offset + i]]
        if frozen is not None:
            if model.workload.shape(role) is None:
                return None
            if role == REFERENCE.name and model.workload.reference_is_actor_base:
                return None
            roles[role] = frozen
    offset += len(layout.frozen)
    tp = {c: layout.degrees[state[offset + i]][0] for i, c in enumerate(layout.calls)}
    pp = {c: layout.degrees[state[offset + i]][1] for i, c in enumerate(layout.calls)}
    try:
        plan = PlacementPlan(n, calls, roles, name="mcmc", tp=tp, pp=pp)
        model.check_plan(plan)
    except ValueError:
        return None  # ranks left idle, a sharded role split across its own group, a degree that does not fit
    return evaluate(model, plan)


def _state_of(plan: PlacementPlan, layout: _StateLayout, groups: list, wrappers: list[str]) -> tuple | None:
    """The MCMC state of ``plan``, or None when a call's ranks are not one of ``groups`` (or a wrapper is off)."""
    index = {group: i for i, group in enumerate(groups)}
    try:
        calls = [index[plan.ranks(c)] for c in layout.calls]
        trained = [wrappers.index(plan.wrappers[r]) for r in layout.trainable]
        frozen = [layout.frozen_choices.index(plan.wrappers.get(r)) for r in layout.frozen]
        degrees = [layout.degrees.index((plan.tp_degree(c), plan.pp_degree(c))) for c in layout.calls]
    except (KeyError, ValueError):
        return None
    return (*calls, *trained, *frozen, *degrees)


def _fastest_start(
    model: CostModel, layout: _StateLayout, groups: list, wrappers: list[str], estimate: Any
) -> tuple:
    """Each call on the group where it alone runs fastest, with the first wrapper in registry order that fits
    there (the reference held whole before the reward model is sharded)."""
    n = model.cluster.world_size
    everyone = flattening_plan(n, wrappers[0], roles=model.workload.roles)
    state = []
    for call in layout.calls:
        times = []
        for i, group in enumerate(groups):
            calls = {c: everyone.ranks(c) for c in layout.calls}
            calls[call] = group
            try:
                plan = PlacementPlan(n, calls, everyone.wrappers, name="probe")
            except ValueError:  # a sharded role's call on part of its train group: no plan can run it there
                continue
            compute, comm = model.call_time(choose_batches(model, plan), call)
            times.append((compute + comm, -len(group), i))
        state.append(min(times)[2])
    degrees = [0] * len(layout.calls)
    for frozen in range(len(layout.frozen_choices)):
        for wrapper_index in range(len(wrappers)):
            for ref in (0, frozen):
                choices = tuple(ref if r == REFERENCE.name else frozen for r in layout.frozen)
                candidate = (*state, *[wrapper_index] * len(layout.trainable), *choices, *degrees)
                e = estimate(candidate)
                if e is not None and e.fits:
                    return candidate
    return (*state, *[len(wrappers) - 1] * len(layout.trainable), *[0] * len(layout.frozen), *degrees)
