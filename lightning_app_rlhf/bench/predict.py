"""The planner's prediction of a bench run: the cost model's samples per second (and the training side's idle share)
for exactly the workload and placement a :class:`~lightning_app_rlhf.bench.presets.RunSettings` runs, to put beside
what the harness measures (``python -m lightning_app_rlhf.bench placements --predict true``).

The workload is the bench's: its preset for every role (fp32), its batch, response budget and ``mean_length``
(geometric lengths: :attr:`~lightning_app_rlhf.planner.workload.Workload.mean_response_length`), the demo's prompts
padded per batch; the plan is its placement's (:data:`~lightning_app_rlhf.bench.presets.PLACEMENTS`). The machine is
measured as ``plan --profile auto`` measures it (:func:`~lightning_app_rlhf.planner.profiler.profile_machine`: op
times and wrapper costs from the cache that ``plan`` fills, measured on a miss; the collectives and the cores' shares
now, a few seconds), without the engine's calibration (``plan``'s 40 iterations of the config): the engine's own
Python per call is not priced, so the prediction runs faster than the measurement.
"""

from __future__ import annotations

import functools
from typing import Any

from lightning_app_rlhf.bench.presets import DECODERS, PLACEMENTS, TOKENIZER_VOCAB, RunSettings
from lightning_app_rlhf.core.role_table import ROLE_NAMES
from lightning_app_rlhf.parallel.plan import PlacementPlan, flattening_plan, interleaving_plan, separation_plan
from lightning_app_rlhf.planner.cluster import Cluster
from lightning_app_rlhf.planner.cost_model import CostModel, PlanChoice
from lightning_app_rlhf.planner.profiler import Profile, profile_machine
from lightning_app_rlhf.planner.workload import Workload, padded_prompt_length, role_shape


@functools.cache
def demo_prompt_lengths(vocab: int) -> tuple[int, ...]:
    """Tokens of each of the demo's prompts (``lightning_app_rlhf.demo:prompts``), as the data module tokenises them."""
    from lightning_app_rlhf.demo import build_tokenizer, prompts  # the tokenizer's packages: only when predicting

    tokenizer = build_tokenizer(vocab)
    return tuple(len(ids) for ids in tokenizer(prompts(), add_special_tokens=False)["input_ids"])


def bench_workload(settings: RunSettings) -> Workload:
    """The workload a bench run computes (module docstring)."""
    config = settings.model_config()
    grpo = settings.algorithm == "grpo"
    return Workload(
        actor=role_shape(config, "causal_lm", 4),
        critic=None if grpo else role_shape(config, "value", 4),
        reference=role_shape(config, "causal_lm", 4) if not grpo or settings.beta else None,
        reward=None if grpo else role_shape(config, "classifier", 4),
        batch_size=settings.batch_size,
        prompt_length=padded_prompt_length(list(demo_prompt_lengths(TOKENIZER_VOCAB)), settings.batch_size),
        generation_length=settings.new_tokens,
        ppo_epochs=settings.ppo_epochs,
        num_minibatches=settings.num_minibatches,
        num_samples=settings.num_samples,
        algorithm=settings.algorithm,
        wrappers=("ddp",),
        generation_backend=DECODERS[settings.decoder].get("backend", "eager"),
        mean_response_length=settings.mean_length,
        name=f"bench {settings.preset} {settings.algorithm}",
    )


def bench_plan(settings: RunSettings, roles: tuple[str, ...] = ROLE_NAMES) -> PlacementPlan:
    """The plan the bench's placement runs on ``settings.processes`` ranks (``roles``: the algorithm's)."""
    strategy, args = PLACEMENTS[settings.placement]
    name = strategy.rsplit(".", 1)[1]
    if settings.processes == 1 or name == "FlatteningStrategy":
        return flattening_plan(settings.processes, roles=roles)
    if name == "InterleavingStrategy":
        return interleaving_plan(settings.processes, roles=roles)
    args = dict(args)
    if args.pop("overlap", False):
        args["max_staleness"] = 1
    return separation_plan(settings.processes, roles=roles, **args)


def measure_machine(settings: RunSettings) -> tuple[Profile, Cluster]:
    """This machine's profile and cluster for the bench's workload on ``settings.processes`` processes (module
    docstring)."""
    return profile_machine(bench_workload(settings), settings.processes)


def predict(settings: RunSettings, profile: Profile | None, cluster: Cluster) -> dict[str, Any]:
    """The cost model's prediction of the bench run ``settings`` on ``cluster`` with ``profile``:
    ``samples_per_s``, ``iteration_s``, ``trainer_idle_share`` (free-running: the last rank's share of the steady
    state without a task), the phases' seconds per call (``call_s``) and the plan's label."""
    workload = bench_workload(settings)
    estimate = CostModel(cluster, workload, profile).evaluate(PlanChoice(bench_plan(settings, workload.roles)))
    return {"samples_per_s": estimate.samples_per_s, "iteration_s": estimate.iteration_s,
            "trainer_idle_share": estimate.trainer_idle_share, "call_s": estimate.call_s,
            "label": estimate.choice.label, "engine_calibrated": False}
