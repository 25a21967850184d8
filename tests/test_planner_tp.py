"""Tensor parallelism, reallocation between layouts and unshard-once generation in the cost model; the searches over
them; the MCMC chain's start, budget and independence from the machine's load; LLaMA-2 plans on H100s."""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest

from lightning_app_rlhf.engine.iteration import iteration_steps, relayout_calls
from lightning_app_rlhf.parallel.plan import PlacementPlan, flattening_plan, separation_plan
from lightning_app_rlhf.planner import (
    CostModel,
    PlanChoice,
    llama_workload,
    mcmc_search,
    parse_cluster,
    plan_placement,
)
from lightning_app_rlhf.planner import search as search_module
from lightning_app_rlhf.planner.cluster import DEVICE_TYPES
from lightning_app_rlhf.planner.cost_model import TP_ALL_REDUCES_PER_LAYER
from lightning_app_rlhf.planner.gpu_efficiency import bus_bandwidth_share
from lightning_app_rlhf.planner.search import (
    PlannerError,
    _best_of,
    _preset_plans,
    app_search,
    evaluate,
    role_block_plans,
    tp_degrees,
    with_tp,
)

H100 = DEVICE_TYPES["h100-80gb"]


def seventy_b(**kwargs) -> CostModel:
    """LLaMA-2 70B actor and critic, ReaLHF's short setting (batch 512, prompt 128 + 128), on 4x8 H100."""
    workload = llama_workload("llama2-70b", "llama2-70b", batch_size=512, prompt_length=128, generation_length=128,
                              num_minibatches=4, **kwargs)
    return CostModel(parse_cluster("4x8xH100-80GB"), workload)


# ---- the cost model prices TP


def test_tp_divides_weights_kv_cache_and_compute_and_adds_two_all_reduces_per_layer():
    """A call 8-way tensor parallel runs on a copy holding 1/8 of the weights (beside the role's own module, as the
    engine keeps it), 1/8 of the KV cache per rank, computes 1/8 of each op, and pays 2 activation all-reduces per
    layer and forward, at the intra-node bandwidth."""
    model = seventy_b(wrappers=("fsdp2",))
    w, shape = model.workload, model.workload.actor
    base = separation_plan(32, generation_ratio=0.5, wrapper="fsdp2")
    tp8 = replace(base, tp={c: 8 for c in base.calls if not c.endswith(".train")})
    rows1, rows8 = model.static_memory(base), model.static_memory(tp8)
    whole = w.held_params("actor") * 2
    assert rows1[0].weights == sum(w.held_params(r) * 2 for r in w.roles)
    assert rows8[0].weights == rows1[0].weights + sum(w.held_params(r) * 2 // 8 for r in w.roles)  # + every 1/8 copy
    assert rows8[0].roles["actor"] == "shadow +tp8 copy" and whole == 2 * shape.params
    assert rows8[20] == rows1[20]  # the training ranks are the same
    kv1 = model.transient(PlanChoice(base, 16), "actor.generate")[1]
    kv8 = model.transient(PlanChoice(tp8, 16), "actor.generate")[1]
    assert kv8 * 8 == kv1 == shape.kv_bytes_per_token * 16 * w.sequence_length
    compute1, comm1 = model.call_time(PlanChoice(base), "actor.generate")
    compute8, comm8 = model.call_time(PlanChoice(tp8), "actor.generate")
    assert comm1 == 0.0
    # 16 generating ranks: 16 replicas of 32 samples (tp1) or 2 replicas of 256 samples (tp8).
    prefill = model.op_time(shape, "prefill", 256, 128, tp=8) / 8
    decode = 127 * model.op_time(shape, "decode", 256, 128 + 64, tp=8) / 8
    assert compute8 == pytest.approx(prefill + decode)
    # Each all-reduce at the cited NVLS bus bandwidth of its size (8x H200 sweep; its latency included, none added).
    one = lambda tokens: (2 * 7 / 8 * tokens * 8192 * 2
                          / (H100.intra_node_bandwidth * bus_bandwidth_share(tokens * 8192 * 2, intra_node=True)))
    assert TP_ALL_REDUCES_PER_LAYER == 2
    assert comm8 == pytest.approx(80 * 2 * (one(256 * 128) + 127 * one(256)))
    assert compute1 == pytest.approx(model.op_time(shape, "prefill", 32, 128)
                                     + 127 * model.op_time(shape, "decode", 32, 192))


def test_tp_replicas_stay_within_a_node():
    model = seventy_b()
    plan = replace(flattening_plan(32, "ddp"), tp={"actor.generate": 8})
    model.check_plan(plan)
    shifted = PlacementPlan(32, {**plan.calls, "actor.generate": tuple(range(4, 28))}, plan.wrappers,
                            tp={"actor.generate": 8})
    with pytest.raises(ValueError, match="span nodes: keep tensor parallelism within a node"):
        model.check_plan(shifted)
    assert tp_degrees(model) == [1, 2, 4, 8]


def test_unshard_once_gathers_once_per_rollout_and_holds_the_whole_weights():
    """An FSDP2 actor generating on its own 8 ranks: once per rollout = one gather of the weights and the whole
    weights in memory; per step = one gather per generated token."""
    workload = llama_workload("llama2-13b", "llama2-13b", batch_size=64, prompt_length=128, generation_length=128,
                              num_minibatches=4, wrappers=("fsdp2",))
    model = CostModel(parse_cluster("1x8xH100-80GB"), workload)
    once = flattening_plan(8, "fsdp2")
    per_step = replace(once, unshard_for_generation=False)
    ranks, shape = once.ranks("actor.generate"), workload.actor
    gather = model.sharded_gather_s(ranks, shape)
    assert model.call_time(PlanChoice(once), "actor.generate")[1] == pytest.approx(gather)
    assert model.call_time(PlanChoice(per_step), "actor.generate")[1] == pytest.approx(128 * gather)
    whole = workload.held_params("actor") * 2
    shard = model.role_bytes("actor", "fsdp2", 8, 0)[0]
    gathered_once = model.transient(PlanChoice(once, 8), "actor.generate")[0]
    gathered_step = model.transient(PlanChoice(per_step, 8), "actor.generate")[0]
    assert gathered_once - gathered_step == whole - shard - 2 * shape.param_bytes // shape.layers
    # The search prices both and keeps the faster that fits: with 13B full fine-tuning the whole weights do not fit
    # beside the training state (per step, with the largest batch that fits), with LoRA they do (once).
    assert not evaluate(model, once).choice.plan.unshard_for_generation
    lora = CostModel(model.cluster, replace(workload, lora_rank=128))
    chosen = evaluate(lora, per_step)
    assert chosen.choice.plan.unshard_for_generation
    assert chosen.iteration_s < lora.evaluate(PlanChoice(per_step, chosen.choice.generation_batch)).iteration_s


def test_relayout_from_fsdp2_training_to_tp_generation_is_priced_after_every_update():
    """Training FSDP2 over 8 ranks and generating TP=8 on the same ranks: a reallocation step after the update
    (all-gather of the trained weights), the generation copy's 1/8 in memory, and no per-token gathers."""
    workload = llama_workload("llama2-13b", "llama2-13b", batch_size=64, prompt_length=128, generation_length=128,
                              num_minibatches=4, wrappers=("fsdp2",))
    model = CostModel(parse_cluster("1x8xH100-80GB"), workload)
    plan = replace(flattening_plan(8, "fsdp2"), tp={"actor.generate": 8})
    assert relayout_calls(plan, "actor") == ("actor.generate",)
    assert [s.label for s in iteration_steps(plan) if s.kind == "reallocate"] == ["reallocate actor"]
    ranks, seconds = model.reallocate_time(plan, "actor")
    moved = workload.trainable_params("actor") * 2
    slice_copy = moved / 8 / (H100.memory_bandwidth * 0.7)  # each rank keeps its 1/8, at 70% of memory bandwidth
    assert ranks == tuple(range(8)) and seconds == pytest.approx(model.all_gather_s(ranks, moved) + slice_copy)
    assert not model.unshards_once(plan)  # generation runs on the TP copy, not on gathered shards
    assert model.call_time(PlanChoice(plan), "actor.generate")[1] > 0  # TP all-reduces only: no weight gathers
    copies = model.static_memory(plan)[0].weights - model.static_memory(flattening_plan(8, "fsdp2"))[0].weights
    assert copies == workload.held_params("actor") * 2 // 8  # the TP copy, beside the FSDP2 shards


# ---- the searches consider TP and the unshard choice


def test_seventy_b_on_32_h100s_generates_with_tp():
    """LLaMA-2 70B actor + critic on 4x8 H100 (full fine-tuning, FSDP2 or DDP): the chosen plan generates with TP
    (no whole 70B replica fits a GPU) and pipelines the other calls over the 32 ranks (each holds 1/32 of every
    model, so DDP fits), and is far faster than any plan with neither."""
    model_workload = seventy_b().workload
    result = plan_placement(parse_cluster("4x8xH100-80GB"), model_workload, search="app")
    best = result.best
    assert best.plan.tp_degree("actor.generate") == 8
    assert best.plan.pp_degree("actor.train") == 32 and best.plan.wrappers["actor"] == "ddp"
    flat = [c for c in result.candidates if not c.plan.tp and not c.plan.pp and c.estimate.fits]
    assert all(c.iteration_s > 2 * best.iteration_s for c in flat)
    # 84.4 s before pipelines (TP=8 everywhere); 38.0 s with them at the old 50% / 70% constants, the pipelined
    # scoring calls priced as one micro-batch (a 32x bubble, not the engine's one per stage at least); 47.9 s at the
    # cited GPU efficiencies (training at 40-45% of peak, not 50%; the all-reduces at the measured bus bandwidth of
    # their size) with that bubble; 39.4 s with the engine's micro-batches.
    assert best.iteration_s == pytest.approx(39.4, rel=0.05)


def test_seven_b_on_8_h100s():
    """LLaMA-2 7B actor + critic on one 8-H100 node, ReaLHF's short setting: generation with TP=2.

    At the old constants (70% of peak bandwidth whatever the step) TP=4 won (6.6 s). At the cited figures a decode
    step's share of the bandwidth falls with the bytes one GPU reads (gpt-fast: Llama-2-7B at 68.5% on one GPU, 47%
    per GPU at tp 4), and each all-reduce costs what the 8x H200 sweep measured at its size (49 us for the 2 MiB of
    256 sequences): TP=4's step (3.4 GB of weights + 6.3 GB of KV cache per GPU, at 57%, plus 64 all-reduces) comes
    out 1% slower than TP=2's (6.7 + 6.3 GB at 66%, plus 64 all-reduces of half the size)."""
    workload = llama_workload("llama2-7b", "llama2-7b", batch_size=512, prompt_length=128, generation_length=128,
                              num_minibatches=4)
    result = plan_placement(parse_cluster("1x8xH100-80GB"), workload, search="app")
    assert result.best.plan.tp_degree("actor.generate") == 2
    assert result.best.iteration_s == pytest.approx(7.88, rel=0.05)


# ---- MCMC: a valid start, its whole budget, the planted better plan, no clock


def planted() -> tuple[CostModel, PlacementPlan]:
    """LLaMA-2 13B actor and critic on 2x8 H100, ReaLHF's short setting. The known plan gives each call its own
    degree (generation TP=4, the scoring forwards TP=2, DP x TP=8 training over FSDP2, the reference ZeRO-3-sharded)
    on every rank, a mix that no preset or grid variant expresses (theirs give every call, or generation and scoring,
    one degree)."""
    workload = llama_workload("llama2-13b", "llama2-13b", batch_size=512, prompt_length=128, generation_length=128,
                              num_minibatches=4)
    known = replace(flattening_plan(16, "fsdp2"),
                    wrappers={"actor": "fsdp2", "critic": "fsdp2", "reference": "zero3", "reward": "fsdp2"},
                    tp={"actor.generate": 4, "reference.forward": 2, "reward.forward": 2, "critic.forward": 2,
                        "actor.train": 8, "critic.train": 8})
    return CostModel(parse_cluster("2x8xH100-80GB"), workload), known


def test_the_search_finds_the_planted_better_plan():
    model, known = planted()
    known_s = evaluate(model, known).iteration_s
    presets = [_best_of(model, plans, "preset") for plans in _preset_plans(model).values()]
    grid = with_tp(model, [*app_search(model, []), *role_block_plans(model)])
    best_grid = min(c.iteration_s for c in [*presets, *grid] if c.estimate.fits)
    # 9.04 and 9.58 s at the old 50% / 70% constants; at the cited GPU efficiencies the planted plan's lead shrinks
    # from 5.6% to 5.0% (its TP=2 / TP=4 all-reduces cost more at their measured small-message bandwidth).
    assert known_s == pytest.approx(11.13, rel=0.01) and best_grid == pytest.approx(11.71, rel=0.01)
    assert known_s < 0.96 * best_grid  # clearly better than anything the presets and the grid reach
    result = plan_placement(model.cluster, model.workload, seed=0, mcmc_steps=300)
    assert result.best.source == "mcmc" and result.best.iteration_s < 0.98 * best_grid
    # Since the chain also picks a pipeline degree per call (5 x the degree space), 300 steps end 3% short of the
    # planted plan (11.43 s; 9.34 s at the old constants): a local optimum the tp-only chain did not have.
    assert result.best.iteration_s <= known_s * 1.04
    assert "mcmc: 300 proposals made" in " ".join(result.rules)  # the whole budget, no cap


def test_the_chain_runs_its_whole_budget():
    model, _ = planted()
    for steps in (10, 3000):
        report: list[str] = []
        mcmc_search(model, seed=0, steps=steps, report=report)
        assert f"mcmc: {steps} proposals made" in report[-1]


def test_the_answer_does_not_depend_on_the_machines_load(monkeypatch):
    """Same seed and steps: the same plans, whether the machine is idle or busy and whatever the clock says; the
    chain never reads the clock unless it is given a time limit, which is reported when it stops the chain."""
    model, _ = planted()
    idle = [(c.choice.label, c.iteration_s) for c in mcmc_search(model, seed=3, steps=400)]

    class NoClock:
        @staticmethod
        def perf_counter() -> float:
            raise AssertionError("the MCMC chain read the clock")

    stop = threading.Event()
    busy = threading.Thread(target=lambda: [sum(range(10_000)) for _ in iter(stop.is_set, True)], daemon=True)
    busy.start()
    try:
        monkeypatch.setattr(search_module, "time", NoClock)
        loaded = [(c.choice.label, c.iteration_s) for c in mcmc_search(model, seed=3, steps=400)]
    finally:
        stop.set()
        busy.join()
    assert loaded == idle

    ticks = iter(range(0, 10**6, 10))  # a clock that jumps 10 s per reading: the 25 s limit stops the chain early

    class FastClock:
        @staticmethod
        def perf_counter() -> float:
            return float(next(ticks))

    monkeypatch.setattr(search_module, "time", FastClock)
    report: list[str] = []
    mcmc_search(model, seed=3, steps=400, time_budget_s=25, report=report)
    assert "stopped by its 25 s time limit after 2 of 400 steps" in " ".join(report)


def test_the_chain_starts_from_a_plan_that_fits():
    """70B: each call's fastest group alone (whole models on small groups) does not fit; the chain starts from a
    fitting plan anyway, without seeds, and returns fitting plans."""
    model = seventy_b()
    report: list[str] = []
    found = mcmc_search(model, seed=0, steps=30, report=report)
    start = found[-1]
    assert start.source == "mcmc start" and start.estimate.fits
    assert "from every call on every rank" in report[0]
    assert all(c.estimate.fits for c in found)


def test_the_chain_says_when_nothing_fits():
    workload = llama_workload("llama2-70b", "llama2-70b", wrappers=("ddp",))
    with pytest.raises(PlannerError, match="found no plan of .* that fits on 1x8xH100-80GB to start from"):
        mcmc_search(CostModel(parse_cluster("1x8xH100-80GB"), workload), steps=5)
