"""Pipeline parallelism in the cost model and the searches: stages hold 1/p of a role, a pipelined call pays its
bubble and its activation sends, and the search pipelines a call where tensor parallelism would cross nodes."""

from __future__ import annotations

from dataclasses import replace

import pytest

from lightning_app_rlhf.parallel.plan import flattening_plan
from lightning_app_rlhf.planner import CostModel, PlanChoice, llama_workload, parse_cluster
from lightning_app_rlhf.planner.cluster import DEVICE_TYPES
from lightning_app_rlhf.planner.gpu_efficiency import bus_bandwidth_share
from lightning_app_rlhf.planner.search import pp_degrees, tp_degrees, tp_variants

H100 = DEVICE_TYPES["h100-80gb"]


def sent(nbytes: float, intra_node: bool) -> float:
    """Seconds of one send of ``nbytes`` between two H100s: at the link's peak times the cited bus bandwidth share of
    that size (its latency included; a send is capped at the link's peak)."""
    peak = H100.intra_node_bandwidth if intra_node else H100.inter_node_bandwidth
    return nbytes / (peak * min(1.0, bus_bandwidth_share(nbytes, intra_node)))


@pytest.fixture(scope="module")
def seven_b() -> CostModel:
    """LLaMA-2 7B actor and critic, batch 64 of 128 + 128 tokens, 4 minibatches, on 2 nodes of 8 H100s."""
    workload = llama_workload("llama2-7b", "llama2-7b", batch_size=64, prompt_length=128, generation_length=128,
                              num_minibatches=4)
    return CostModel(parse_cluster("2x8xH100-80GB"), workload)


def test_a_pipelined_train_call_pays_its_bubble_and_its_sends(seven_b):
    """actor.train over 16 ranks, pp=4: 4 replicas of 4 stages, each replica 4 samples of a 16-sample minibatch in
    micro-batches of 1. By hand: compute = (m + p - 1) / m x the replica's train ops / p + the optimizer of 1/p of
    the weights, with m = 4, p = 4; sends = (m + p - 1) x 2 (activations forward, gradients back) x one micro-batch's
    activations (256 tokens x 4096 x 2 bytes) over the slowest stage boundary (a replica is 4 consecutive ranks, one
    per stage: within a node)."""
    model, w = seven_b, seven_b.workload
    base = flattening_plan(16, "ddp", roles=w.roles)
    piped = replace(base, pp={"actor.train": 4})
    choice = PlanChoice(piped, micro_batch=1)
    compute, comm = model.call_time(choice, "actor.train")
    shape, steps = w.actor, w.ppo_epochs * w.num_minibatches
    train = model.op_time(shape, "train", 1, 256, pp=4)
    optimizer = model.op_time(shape, "optimizer", -(-w.trainable_params("actor") // 4), 0)
    assert compute == pytest.approx(steps * ((4 + 3) / 4 * 4 * train / 4 + optimizer))
    send = sent(256 * 4096 * 2, intra_node=True)
    assert model.pipeline_send_s(piped, "actor.train", shape, 256) == pytest.approx(send)
    across = replace(base, tp={"actor.train": 8}, pp={"actor.train": 2})  # stages 0-7 and 8-15: the network
    crossing = sent(256 * 4096 * 2 / 8, intra_node=False)
    assert model.pipeline_send_s(across, "actor.train", shape, 256) == pytest.approx(crossing)
    unpiped_compute, _ = model.call_time(PlanChoice(base, micro_batch=1), "actor.train")
    # The same gradient all-reduce volume, now over 4 replicas of 1/4 of the weights: less; plus the sends.
    assert comm > steps * 7 * 2 * send
    assert compute < unpiped_compute  # 4 stages share the work (bubble 7/4 < 4)


def test_stages_hold_a_share_of_the_weights_gradients_and_optimizer(seven_b):
    """A rank of a 2-stage DDP actor holds half of what an unpipelined DDP rank holds, and says so."""
    model, w = seven_b, seven_b.workload
    base = flattening_plan(16, "ddp", roles=w.roles)
    whole, piped = model.static_memory(base)[0], model.static_memory(replace(base, pp={"actor.train": 2}))[0]
    assert piped.roles["actor"] == "trained ddp stage 1/2"
    actor_whole = model.role_bytes("actor", "ddp", 16, 0)
    actor_piped = model.role_bytes("actor", "ddp", 8, 0)
    assert actor_piped == actor_whole  # DDP replicates: the stage split alone halves it
    assert whole.grads - piped.grads == actor_whole[1] - actor_whole[1] // 2
    assert whole.optimizer - piped.optimizer == actor_whole[2] - actor_whole[2] // 2
    frozen = model.static_memory(replace(base, pp={"reference.forward": 4}))[0]
    assert frozen.roles["reference"] == "frozen stage 1/4"
    assert whole.weights - frozen.weights == w.held_params("reference") * 2 - w.held_params("reference") * 2 // 4


def test_1f1b_keeps_p_micro_batches_alive_and_gpipe_all(seven_b):
    """Training activations of a stage: 1/p of the layers for min(m, p) micro-batches under 1F1B, for all m under
    GPipe; with m = 4 micro-batches and p = 2, 1F1B holds what the unpipelined call holds, GPipe twice that."""
    model, w = seven_b, seven_b.workload
    base = flattening_plan(16, "ddp", roles=w.roles)
    unpiped = model.transient(PlanChoice(base, micro_batch=1), "actor.train")[0]
    one_f = model.transient(PlanChoice(replace(base, pp={"actor.train": 2}), micro_batch=1), "actor.train")[0]
    gpipe_plan = replace(base, pp={"actor.train": 2}, pipeline_schedule="gpipe")
    gpipe = model.transient(PlanChoice(gpipe_plan, micro_batch=1), "actor.train")[0]
    # 16 samples per minibatch over 8 replicas of 2 stages: 2 micro-batches of 1 (m = 2 = p).
    assert one_f == pytest.approx(unpiped, rel=0.01)
    assert gpipe == pytest.approx(one_f, rel=0.01)
    base8 = flattening_plan(8, "ddp", roles=w.roles)
    choice = lambda plan: PlanChoice(plan, micro_batch=1)
    # 16 samples over 4 replicas: m = 4 micro-batches of 1; 1F1B holds 2 of them over 16 layers (as unpipelined: 1
    # over 32), GPipe 4: twice the layers' activations, the same head.
    unpiped8 = model.transient(choice(base8), "actor.train")[0]
    one_f8 = model.transient(choice(replace(base8, pp={"actor.train": 2})), "actor.train")[0]
    gpipe8 = model.transient(choice(replace(base8, pp={"actor.train": 2}, pipeline_schedule="gpipe")), "actor.train")[0]
    assert one_f8 == pytest.approx(unpiped8, rel=0.01)
    assert gpipe8 > 1.4 * one_f8


def test_pipelined_scoring_pays_its_bubble_sends_and_the_result_broadcast(seven_b):
    """reference.forward on 16 ranks, pp=2: 8 replicas of 8 samples, micro-batches of a generation batch, 2 (m = 4, as
    the engine cuts a pipelined scoring call): compute = 5/4 x the
    replica's forwards / 2; communication = 5 sends of one micro-batch's activations (stages 0-1 are ranks 0 and 1:
    intra-node) plus the broadcast of the 8 x 128 log-probabilities from the last stage."""
    model, w = seven_b, seven_b.workload
    plan = replace(flattening_plan(16, "ddp", roles=w.roles), pp={"reference.forward": 2})
    compute, comm = model.call_time(PlanChoice(plan, generation_batch=2), "reference.forward")
    forward = model.op_time(w.shape("reference"), "forward", 2, 256, pp=2)
    assert compute == pytest.approx(5 / 4 * 4 * forward / 2)
    send = sent(2 * 256 * 4096 * 2, intra_node=True)
    assert comm == pytest.approx(5 * send + model.broadcast_s((0, 1), 4 * 8 * 128))


def test_the_cost_model_refuses_more_stages_than_layers_and_a_python_reward():
    workload = llama_workload("llama2-7b", "llama2-7b", batch_size=64, prompt_length=128, generation_length=128)
    model = CostModel(parse_cluster("8x8xH100-80GB"), workload)
    plan = replace(flattening_plan(64, "ddp", roles=workload.roles), pp={"actor.train": 64})
    with pytest.raises(ValueError, match="more than the 32 decoder layers.*pp <= the number of layers"):
        model.check_plan(plan)


def test_the_search_offers_pipelines_across_nodes(seven_b):
    """Degrees: tensor parallelism up to a node (8), pipelines up to the cluster (16) and the layers (32); the
    variants of a DDP flattening plan include generation 8-way TP within a node with the train calls pipelined 2-way
    across the two nodes; none pipelines generation, none gives one call both degrees, and none pipelines a train
    call over FSDP2 (what the engine runs: pipeline_checks)."""
    assert tp_degrees(seven_b) == [1, 2, 4, 8]
    assert pp_degrees(seven_b) == [1, 2, 4, 8, 16]
    variants = tp_variants(seven_b, flattening_plan(16, "ddp", roles=seven_b.workload.roles))
    assert all("actor.generate" not in v.pp for v in variants)
    assert all(v.tp_degree(c) == 1 for v in variants for c in v.pp)
    across = [v for v in variants if v.tp_degree("actor.generate") == 8 and v.pp_degree("actor.train") == 2]
    assert across and across[0].layout_text("actor.train") == " pp2 1f1b"
    sharded = tp_variants(seven_b, flattening_plan(16, "fsdp2", roles=seven_b.workload.roles))
    assert not any(c.endswith(".train") for v in sharded for c in v.pp)
