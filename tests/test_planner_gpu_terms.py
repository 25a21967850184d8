"""The cited GPU efficiencies (planner/gpu_efficiency.py) in the cost model, by hand: a GPU cluster at datasheet peaks
prices FLOPs at the cited MFU of the op's shape, a decode step's bytes at the cited share of the bytes one GPU reads,
and every collective at the cited bus bandwidth of its size with no latency on top; CPU clusters and measured
ceilings keep the constants, a measured op wins; the plan's output carries each call's predicted efficiency."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from lightning_app_rlhf.parallel.plan import flattening_plan
from lightning_app_rlhf.planner import CostModel, PlanChoice, llama_workload, parse_cluster
from lightning_app_rlhf.planner.cluster import DEVICE_TYPES
from lightning_app_rlhf.planner.command import PlanOptions, plan_named_sizes, summary_lines
from lightning_app_rlhf.planner.cost_model import BANDWIDTH_EFFICIENCY, COMPUTE_EFFICIENCY, forward_flops
from lightning_app_rlhf.planner.profiler import Profile

H100, A100 = DEVICE_TYPES["h100-80gb"], DEVICE_TYPES["a100-80gb"]
MiB, GiB = 2**20, 2**30


@pytest.fixture(scope="module")
def seven_b() -> CostModel:
    """LLaMA-2 7B actor and critic, batch 64 of 128 + 128 tokens, 4 minibatches, on one node of 8 H100s."""
    workload = llama_workload("llama2-7b", "llama2-7b", batch_size=64, prompt_length=128, generation_length=128,
                              num_minibatches=4)
    return CostModel(parse_cluster("1x8xH100-80GB"), workload)


def _log_between(x: float, x0: float, y0: float, x1: float, y1: float) -> float:
    return y0 + (y1 - y0) * math.log(x / x0) / math.log(x1 / x0)


def test_a_train_op_runs_at_the_cited_training_mfu_of_its_size_and_micro_batch(seven_b):
    """LLaMA-2 7B (6.74B parameters) lies between Table 1's 3.6B (44%) and 7.5B (46%) rows; a micro-batch of 4 x 256
    = 1,024 tokens is under llm-foundry's smallest (6,144 tokens: 50.82 / 58.57 of the largest's HFU). Gradient
    checkpointing: 4 forwards' FLOPs (the recomputed one counted, as Table 1 counts it), no per-layer overhead."""
    shape = seven_b.workload.actor
    mfu = _log_between(shape.params, 3.6e9, 0.44, 7.5e9, 0.46) * 50.82 / 58.57
    assert 0.38 < mfu < 0.40
    assert seven_b.compute_share(shape, "train", 4, 256) == pytest.approx(mfu, rel=1e-12)
    by_hand = 4 * forward_flops(shape, 4, 256) / (989e12 * mfu)
    assert seven_b.analytic_time(shape, "train", 4, 256) == pytest.approx(by_hand, rel=1e-12)
    # A forward runs at Korthikanti's forward share of the training rate: (1 / 7.7) / (3 / 19.6).
    forward_mfu = mfu * (1 / 7.7) / (3 / 19.6)
    assert seven_b.analytic_time(shape, "forward", 4, 256) == pytest.approx(
        forward_flops(shape, 4, 256) / (989e12 * forward_mfu), rel=1e-12)


def test_a_decode_step_reads_at_the_cited_share_of_the_bytes_one_gpu_reads(seven_b):
    """TP=4, 64 sequences at 192 tokens of context: 1/4 of the weights and of the KV cache per GPU, between our
    llama-1b point (2.88 GB a step, 15.5%) and gpt-fast's Llama-2-7B (13.5 GB, 68.5%)."""
    shape = seven_b.workload.actor
    moved = shape.param_bytes + shape.kv_bytes_per_token * 192 * 64
    share = _log_between(moved / 4, 743.4e9 * 3.87e-3, 0.155, 6.74e9 * 2, 1397.31 / 2039)
    assert seven_b.memory_share(shape, 64, 192, tp=4) == pytest.approx(share, rel=1e-12)
    assert seven_b.analytic_time(shape, "decode", 64, 192, tp=4) == pytest.approx(moved / (3.35e12 * share),
                                                                                 rel=1e-12)


def test_collectives_run_at_the_cited_bus_bandwidth_of_their_size():
    """All-reduce of 2 MiB over 8 H100s: NVLS, 64.53 GB/s busbw (Bekman's 8x H200 sweep), time 2 x 7/8 x size over
    it (56.9 us, its latency included: no hop latency added). A100 (no NVLS) at 16 GiB: capped at the ring's 81.7%
    of its 300 GB/s NVLink. Across two nodes, 1 GiB: 18.65 GB/s (the NDmv4 figure) as a share of the 25 GB/s NIC,
    times the H100's 50 GB/s."""
    h100 = CostModel(parse_cluster("2x8xH100-80GB"), llama_workload("llama2-7b"))
    assert h100.all_reduce_s(tuple(range(8)), 2 * MiB) == pytest.approx(1.75 * 2 * MiB / 64.53e9, rel=1e-9)
    assert h100.all_reduce_s(tuple(range(8)), 2 * MiB) == pytest.approx(56.9e-6, rel=1e-3)
    assert h100.all_reduce_s((0, 8), GiB) == pytest.approx(GiB / (50e9 * 18.65 / 25), rel=1e-9)
    # A gather or a send is capped at the link's peak: NVLS only speeds up reductions.
    assert h100.all_gather_s(tuple(range(8)), 16 * GiB) == pytest.approx(7 / 8 * 16 * GiB / 450e9, rel=1e-9)
    a100 = CostModel(parse_cluster("1x8xA100-80GB"), llama_workload("llama2-7b"))
    assert not a100.nvls and h100.nvls
    assert a100.all_reduce_s(tuple(range(8)), 16 * GiB) == pytest.approx(
        1.75 * 16 * GiB / (300e9 * 367.61 / 450), rel=1e-9)
    # An empty message still costs the latency: the time of one byte.
    assert a100.all_gather_s(tuple(range(8)), 0) == a100.all_gather_s(tuple(range(8)), 1) > 0


def test_cpu_clusters_and_measured_ceilings_keep_the_constants(seven_b):
    """CPU processes (calibrated against measured runs) and ceilings a profile measured (already what the device
    reaches) keep COMPUTE_EFFICIENCY, BANDWIDTH_EFFICIENCY, the per-layer overhead and the hop latencies."""
    cpu = CostModel(parse_cluster("1x2xcpu"), seven_b.workload)
    assert not cpu.cited_gpu
    shape, device = seven_b.workload.actor, cpu.device
    passes = 4  # gradient checkpointing
    assert cpu.analytic_time(shape, "train", 2, 64) == pytest.approx(
        passes * forward_flops(shape, 2, 64) / (device.flops * COMPUTE_EFFICIENCY)
        + passes * shape.layers * device.kernel_overhead_s, rel=1e-12)
    assert cpu.memory_share(shape, 8, 64) == BANDWIDTH_EFFICIENCY
    assert cpu.all_gather_s((0, 1), 1e6) == pytest.approx(
        0.5 * 1e6 / device.intra_node_bandwidth + device.collective_latency_s, rel=1e-12)
    measured = CostModel(seven_b.cluster, seven_b.workload, Profile("h100 measured", H100))
    assert not measured.cited_gpu and measured.compute_share(shape, "train", 4, 256) == COMPUTE_EFFICIENCY
    assert measured.efficiencies(PlanChoice(flattening_plan(8, "ddp"))) == {}


def test_a_measured_op_still_wins(seven_b):
    shape = seven_b.workload.actor
    profile = Profile("h100", None, {shape.key: {"train": [[4, 256, 0.123]]}})
    model = CostModel(seven_b.cluster, seven_b.workload, profile)
    assert model.cited_gpu  # the ceilings are the datasheet's: the cited shares price what the profile lacks
    assert model.op_time(shape, "train", 4, 256) == pytest.approx(0.123)
    assert model.op_time(shape, "forward", 4, 256) == seven_b.op_time(shape, "forward", 4, 256)


def test_each_call_reports_its_priced_and_achieved_efficiency(seven_b):
    """Flattening with DDP on 8 ranks, micro-batches of 2: each train call is priced at the training MFU of 2 x 256
    tokens and achieves far less (at 2 samples per rank and minibatch, its optimizer step and gradient all-reduce of
    the whole 7B take longer than its forwards and backwards, and compute nothing); generation
    without TP is bandwidth-bound, so its decode steps achieve exactly the share they are priced at."""
    w = seven_b.workload
    choice = PlanChoice(flattening_plan(8, "ddp"), generation_batch=None, micro_batch=2)
    efficiency = seven_b.efficiencies(choice)
    assert set(efficiency) == set(w.calls)
    train = efficiency["actor.train"]
    assert train["mfu"] == pytest.approx(seven_b.compute_share(w.actor, "train", 2, 256), rel=1e-12)
    # By hand: 16 samples per minibatch over 8 ranks = 1 micro-batch of 2, 4 minibatches, 4 passes (checkpointing).
    flops = 4 * 4 * forward_flops(w.actor, 2, 256)
    seconds = sum(seven_b.call_time(choice, "actor.train"))
    assert train["achieved_mfu"] == pytest.approx(flops / (seconds * 989e12), rel=1e-12)
    assert 0.25 * train["mfu"] < train["achieved_mfu"] < 0.5 * train["mfu"]
    generate = efficiency["actor.generate"]
    # 8 samples per rank at a mean context of 128 + 64 tokens: weights + KV cache a step.
    step_bytes = w.actor.param_bytes + w.actor.kv_bytes_per_token * 8 * 192
    assert generate["decode_bandwidth_share"] == pytest.approx(seven_b.memory_share(w.actor, 8, 192), rel=1e-12)
    assert generate["achieved_decode_share"] == pytest.approx(generate["decode_bandwidth_share"], rel=1e-9)
    assert 0.68 < seven_b.memory_share(w.actor, 8, 192) < 0.69 and step_bytes > 13.5e9
    forward = efficiency["reference.forward"]
    assert forward["mfu"] == pytest.approx(seven_b.compute_share(w.actor, "forward", 2, 256), rel=1e-12)
    assert CostModel(parse_cluster("1x2xcpu"), w).efficiencies(PlanChoice(flattening_plan(2, "ddp"))) == {}


def test_the_plan_output_carries_the_efficiencies():
    report = plan_named_sizes(PlanOptions(cluster="1x8xH100-80GB", actor="llama-7b", search="presets"))
    best = report.to_dict()["best"]
    assert set(best["efficiency"]) == set(report.result.workload.calls)
    assert 0.3 < best["efficiency"]["actor.train"]["mfu"] < 0.5
    lines = summary_lines(report, report.result.candidates)
    assert any(line.startswith("efficiency of #") and "actor.generate decode" in line and "actor.train MFU" in line
               for line in lines)
    cpu = plan_named_sizes(PlanOptions(cluster="1x2xcpu", actor="gpt2-tiny", batch_size=8, prompt_length=16,
                                       generation_length=16, search="presets"))
    assert cpu.to_dict()["best"]["efficiency"] == {}
    assert not any(line.startswith("efficiency of #") for line in summary_lines(cpu, cpu.result.candidates))


def test_the_bubble_is_priced_once(seven_b):
    """The training figure is bubble-free (Table 1's pipelined rows with their bubble taken out), so a pipelined call
    pays the cost model's bubble on top of ops priced at the same MFU as unpipelined ones."""
    shape = seven_b.workload.actor
    assert seven_b.analytic_time(shape, "train", 1, 256, pp=4) == seven_b.analytic_time(shape, "train", 1, 256)
    plan = replace(flattening_plan(8, "ddp"), pp={"actor.train": 4})
    bubble, _, _ = seven_b.pipelined(plan, "actor.train", shape, [256] * 4, passes=2)
    assert bubble == (4 + 3) / 4
