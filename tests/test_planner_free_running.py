"""The cost model prices a free-running plan by its own schedule: two sides that meet only through the handoff of
each rollout and the published weights (task dependencies in the discrete-event schedule), a pipeline whose steady
state is the slower side's pace (k above 0) or both sides one after the other (k = 0)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from lightning_app_rlhf.parallel.plan import separation_plan
from lightning_app_rlhf.planner import CostModel, PlanChoice, llama_workload, parse_cluster
from lightning_app_rlhf.planner.cost_model import Task, simulate, steady_iterations, unrolled_iterations


def test_a_task_waits_for_the_tasks_it_comes_after():
    """``Task.after``: a task starts when its ranks reach it and the tasks it names have ended, on any ranks."""
    gpus = parse_cluster("1x2xA100-80GB")
    tasks = [Task("a", (0,), 2.0), Task("b", (1,), 1.0, after=("a",)), Task("c", (1,), 1.0)]
    assert simulate(tasks, gpus) == [(0.0, 2.0), (2.0, 3.0), (3.0, 4.0)]
    assert simulate([Task("b", (1,), 1.0, after=("a",)), Task("a", (0,), 2.0)], gpus) == [(2.0, 3.0), (0.0, 2.0)]
    with pytest.raises(ValueError, match="waits for 'x', which is no task"):
        simulate([Task("b", (1,), 1.0, after=("x",))], gpus)
    with pytest.raises(ValueError, match="waits for 'a', which names several tasks"):
        simulate([Task("a", (0,), 1.0), Task("a", (0,), 1.0), Task("b", (1,), 1.0, after=("a",))], gpus)
    with pytest.raises(RuntimeError, match="deadlocked"):  # b waits for a, which comes after b on rank 1
        simulate([Task("b", (1,), 1.0, after=("a",)), Task("a", (0, 1), 1.0)], gpus)


@pytest.mark.parametrize("k", [0, 1, 2, 4])
def test_free_running_is_priced_as_a_pipeline_of_its_two_sides(k):
    """On GPUs (no shared cores) the steady state of free-running is exactly the slower side's iteration for
    k >= 1, and both sides' iterations one after the other for k = 0 (each rollout waits for the update before);
    the receipt of rollout i waits for its send, the take at iteration i for the publishing of version i - k."""
    model = CostModel(parse_cluster("1x8xA100-80GB"), llama_workload("llama-7b"))
    plan = separation_plan(8, max_staleness=k, free_running=True)
    tasks = model.tasks(PlanChoice(plan))
    assert unrolled_iterations(plan) == 4 + 2 * (k + 1) and steady_iterations(plan) == (k + 2, k + 4)
    after = {t.name: t.after for t in tasks if t.after}
    assert after["experience.receive#3"] == ("experience.send#3",)
    assert after[f"weights.take#{k + 3}"] == ("actor.publish#2", "critic.publish#2")
    assert "weights.take#0" not in after  # version 0: the weights the run starts with
    one = [t for t in tasks if t.name.endswith("#2")]
    generation = sum(t.seconds for t in one if set(t.ranks) <= set(plan.generation_ranks))
    training = sum(t.seconds for t in one if set(t.ranks) <= set(plan.training_ranks))
    assert generation + training == pytest.approx(sum(t.seconds for t in one))  # nothing spans both sides
    expected = generation + training if k == 0 else max(generation, training)
    assert model.evaluate(PlanChoice(plan)).iteration_s == pytest.approx(expected, rel=1e-9)
    if k:  # the fixed schedule with the same bound meets in world gathers and a blocking reallocation
        fixed = model.evaluate(PlanChoice(separation_plan(8, max_staleness=k))).iteration_s
        assert model.evaluate(PlanChoice(plan)).iteration_s < fixed


def test_free_running_steps_are_collectives_of_their_side():
    """Gathers reach the generation ranks only, statistics and learning rates the train group only; the take is
    the shadows' part of the reallocation; the train leaders hold the published versions in flight."""
    model = CostModel(parse_cluster("1x8xA100-80GB"), llama_workload("llama-7b"))
    plan = separation_plan(8, max_staleness=1, free_running=True)
    fixed = replace(plan, free_running=False)
    tasks = {t.name: t for t in model.tasks(PlanChoice(plan)) if t.name.endswith("#2")}
    assert tasks["gather.rollout#2"].ranks == plan.generation_ranks
    assert tasks["actor.stats#2"].ranks == tasks["actor.lr#2"].ranks == plan.ranks("actor.train")
    assert tasks["experience.send#2"].ranks == (0,)
    assert tasks["experience.receive#2"].ranks == plan.training_ranks
    assert tasks["actor.publish#2"].ranks == plan.ranks("actor.train")
    group, w = plan.generation_ranks, model.workload
    rows = -(-w.samples // len(plan.ranks("critic.forward")))
    assert model.world_gather_s(plan, "critic.forward", 4, among="actor.generate") == pytest.approx(
        model.all_gather_s(group, len(group) * rows * 4) + model.all_gather_s(group, 0))
    realloc = sum(model.reallocate_time(fixed, role)[1] for role in ("actor", "critic"))
    assert model.take_time(plan) == pytest.approx(realloc)  # DDP training: no gather before the broadcast
    held = [a.activations - b.activations for a, b in zip(model.memory(PlanChoice(plan)),
                                                           model.memory(PlanChoice(fixed)))]
    trained = sum(w.trainable_params(r) * w.shape(r).dtype_bytes for r in ("actor", "critic"))
    assert held[plan.training_ranks[0]] == 3 * trained  # run_ahead + 1 = k + 2 versions, both roles
    assert held[0] == 2 * len(plan.training_ranks) * model.experience_bytes()  # rollouts sent, not yet received
    assert PlanChoice(plan).key != PlanChoice(fixed).key


def test_the_search_prices_free_running_separation_when_staleness_is_allowed():
    """``max_staleness`` above 0: beside the fixed schedule at staleness 1, a plan whose generation ranks hold every
    generate and forward call is priced free-running too (no faster than the slower side allows, and here faster
    than the fixed schedule: its generation side gathers among its own ranks)."""
    from lightning_app_rlhf.planner import plan_placement
    from lightning_app_rlhf.planner.search import staleness_variants

    cluster, workload = parse_cluster("1x8xA100-80GB"), llama_workload("llama-7b")
    on_policy = plan_placement(cluster, workload, search="presets")
    assert not any(c.plan.free_running for c in on_policy.candidates)
    variants = staleness_variants(CostModel(cluster, workload), list(on_policy.presets.values()))
    free = [c for c in variants if c.plan.free_running]
    assert [c.plan.name for c in free] == ["separation"] and free[0].plan.max_staleness == 1
    fixed = next(c for c in variants if c.plan.name == "separation" and not c.plan.free_running)
    assert free[0].estimate.iteration_s < fixed.estimate.iteration_s
