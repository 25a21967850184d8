"""The planner's pricing of uneven response lengths and partial rollouts (issue 61): the expected longest of capped
geometric lengths against hand computations, the simulated pool, and the predictions they lead to."""

from __future__ import annotations

from dataclasses import replace

import pytest

from lightning_app_rlhf.parallel.plan import flattening_plan, separation_plan
from lightning_app_rlhf.planner.cluster import parse_cluster
from lightning_app_rlhf.planner.cost_model import CostModel, PlanChoice
from lightning_app_rlhf.planner.lengths import (
    decode_steps,
    expected_max_length,
    max_survival,
    simulate_partial,
    survival,
)
from lightning_app_rlhf.planner.search import plan_placement
from lightning_app_rlhf.planner.workload import Workload, role_shape

TINY = {"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 512, "n_positions": 256}


def tiny_workload(**fields) -> Workload:
    return Workload(actor=role_shape(TINY), critic=role_shape(TINY, "value"), reference=role_shape(TINY),
                    reward=role_shape(TINY, "classifier"), batch_size=32, prompt_length=16, generation_length=128,
                    wrappers=("ddp",), **fields)


def test_expected_max_of_capped_geometric_by_hand():
    # p = 1/2, cap 3. One row: E[L] = P(L>0) + P(L>1) + P(L>2) = 1 + 1/2 + 1/4.
    assert expected_max_length(2, 3, 1) == pytest.approx(1.75)
    # Two rows: P(M > t) = 1 - (1 - 2^-t)^2: 1 + 3/4 + 7/16 = 2.1875.
    assert expected_max_length(2, 3, 2) == pytest.approx(2.1875)
    # Enumerated: each row's capped length is 1, 2, 3 with probability 1/2, 1/4, 1/4.
    probs = {1: 0.5, 2: 0.25, 3: 0.25}
    enumerated = sum(pa * pb * max(a, b) for a, pa in probs.items() for b, pb in probs.items())
    assert expected_max_length(2, 3, 2) == pytest.approx(enumerated)
    # Mean 1: every row stops at its first token. Equal to the cap when the mean is huge.
    assert expected_max_length(1, 10, 8) == pytest.approx(1.0)
    assert expected_max_length(1e12, 10, 8) == pytest.approx(10.0)
    assert survival(4, 2) == pytest.approx(0.5625) and max_survival(4, 0, 3) == pytest.approx(1.0)


def test_decode_steps_by_hand():
    # p = 1/2, cap 3, 2 rows on one replica: decode step t (after the prefill's first token) runs while the longest
    # row has more than t tokens: P(M > 1) = 3/4, P(M > 2) = 7/16; a static batch runs both rows every step.
    (weight, rows, offset), = decode_steps(2, 3, 2)
    assert rows == 2 and weight == pytest.approx(0.75 + 0.4375)
    assert offset == pytest.approx((0.75 * 1 + 0.4375 * 2) / (0.75 + 0.4375))
    assert weight == pytest.approx(expected_max_length(2, 3, 2) - 1)  # E[M] - 1 decode steps
    # The slowest of 2 replicas of 2 rows: the longest of 4 rows.
    assert sum(w for w, _, _ in decode_steps(2, 3, 2, slowest_of=2)) == pytest.approx(expected_max_length(2, 3, 4) - 1)
    # A backend that drops finished rows runs step t at round(rows x P(L > t)) rows, at least one.
    dropped = {rows: w for w, rows, _ in decode_steps(2, 3, 4, drops=True)}
    assert dropped == pytest.approx({2: max_survival(2, 1, 4), 1: max_survival(2, 2, 4)})


def test_simulated_pool_equal_lengths():
    # Every row runs to the cap: the pool of 2 x 4 groups decodes 4 rounds of 32 tokens, hands on 4 groups and
    # carries 4 complete ones, which the next call hands on with no round: 2 rounds per call on average.
    calls = simulate_partial(4, 1, 1, None, 128, 32, None)
    assert [len(c) for c in calls] == [4, 0] * 8
    first = calls[0]
    assert [(r.max_new, r.carried, r.rows) for r in first] == [(32, 0, 8), (32, 32, 8), (32, 64, 8), (32, 96, 8)]
    assert all(r.replicas == (((32,) * 8,),) for r in first)
    # Two replicas split a round's rows contiguously, chunks of 3 split each replica's.
    split = simulate_partial(4, 1, 2, 3, 128, 32, None)[0][0].replicas
    assert [list(map(len, replica)) for replica in split] == [[3, 1], [3, 1]]


def test_simulated_pool_is_deterministic_and_ends_early_on_uneven_lengths():
    calls = simulate_partial(32, 1, 2, None, 128, 32, 16.0)
    simulate_partial.cache_clear()
    assert simulate_partial(32, 1, 2, None, 128, 32, 16.0) == calls
    rounds = sum(map(len, calls)) / len(calls)
    assert rounds < 2  # most calls end after their first round: a batch of groups is complete by then
    assert all(r.max_new <= 32 for c in calls for r in c)


def test_uneven_lengths_none_leaves_predictions_unchanged():
    cluster, w = parse_cluster("1x4xcpu"), tiny_workload()
    plan = separation_plan(4, max_staleness=1, free_running=True)
    base = CostModel(cluster, w).evaluate(PlanChoice(plan))
    again = CostModel(cluster, replace(w, mean_response_length=None, segment_tokens=None)).evaluate(PlanChoice(plan))
    assert again.iteration_s == base.iteration_s and again.call_s == base.call_s


def test_uneven_lengths_price_the_longest_row():
    cluster, w = parse_cluster("1x4xcpu"), tiny_workload()
    plan = flattening_plan(4, roles=w.roles)
    full = CostModel(cluster, w).evaluate(PlanChoice(plan)).call_s["actor.generate"]
    uneven = CostModel(cluster, replace(w, mean_response_length=16)).evaluate(PlanChoice(plan)).call_s
    # 4 replicas of 8 rows: about E[longest of 32] - 1 = 62 decode steps of 127.
    assert expected_max_length(16, 128, 32) == pytest.approx(63.25, abs=0.01)
    assert 0.35 * full < uneven["actor.generate"] < 0.65 * full
    # A mean at the cap is still uneven (geometric), so shorter than every row at the cap.
    assert CostModel(cluster, replace(w, mean_response_length=128)).evaluate(
        PlanChoice(plan)).call_s["actor.generate"] < full


def test_partial_rollouts_pay_on_uneven_lengths_only():
    cluster = parse_cluster("1x4xcpu")
    normal = separation_plan(4, max_staleness=2, free_running=True)
    partial = separation_plan(4, max_staleness=2, free_running=True, partial_rollout=True)
    uneven = CostModel(cluster, tiny_workload(mean_response_length=16))
    gen = {p.partial_rollout: uneven.evaluate(PlanChoice(p)).call_s["actor.generate"] for p in (normal, partial)}
    assert gen[True] < gen[False]  # fewer decode steps per call: the call ends once a batch of groups is complete
    equal = CostModel(cluster, tiny_workload())
    gen = {p.partial_rollout: equal.evaluate(PlanChoice(p)).call_s["actor.generate"] for p in (normal, partial)}
    assert gen[True] >= gen[False]  # no gain, and extra prefills: a small loss
    estimate = uneven.evaluate(PlanChoice(partial))
    assert estimate.samples_per_s > 0 and 0 <= estimate.trainer_idle_share < 1
    assert "partial" in PlanChoice(partial).label and PlanChoice(partial).key != PlanChoice(normal).key


def test_search_prices_partial_variants():
    result = plan_placement(parse_cluster("1x4xcpu"), tiny_workload(mean_response_length=16), search="presets",
                            max_staleness=2, partial_rollout=True)
    partial = [c for c in result.candidates if c.plan.partial_rollout]
    assert partial and all(c.plan.max_staleness >= 1 for c in partial)
    assert all(c.to_dict()["partial_rollout"] for c in partial)


def test_validation_names_the_fix():
    with pytest.raises(ValueError, match="mean_response_length must lie in"):
        tiny_workload(mean_response_length=0)
    with pytest.raises(ValueError, match="mean_response_length must lie in"):
        tiny_workload(mean_response_length=200)
    with pytest.raises(ValueError, match="single-turn"):
        tiny_workload(mean_response_length=16, turns=2)
    with pytest.raises(ValueError, match="segment_tokens must be an integer"):
        tiny_workload(segment_tokens=0)
    assert tiny_workload().partial_segment == 32 and tiny_workload(segment_tokens=8).partial_segment == 8
    cluster = parse_cluster("1x4xcpu")
    with pytest.raises(ValueError, match="max_staleness >= 1"):
        plan_placement(cluster, tiny_workload(), search="presets", partial_rollout=True)
    with pytest.raises(ValueError, match="generation_rounds 1"):
        plan_placement(cluster, tiny_workload(generation_rounds=2), search="presets", max_staleness=1,
                       partial_rollout=True)
    with pytest.raises(ValueError, match="--turns 1"):
        plan_placement(cluster, tiny_workload(turns=2), search="presets", max_staleness=1, partial_rollout=True)
