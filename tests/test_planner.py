"""The placement planner: shapes, memory, FLOPs, the schedule, both searches, the ``plan`` command, errors."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from helpers import ROOT, run_cli, run_ranks

from lightning_app_rlhf.core.role_table import ROLE_NAMES
from lightning_app_rlhf.parallel.placement_presets import (
    PLACEMENT_PRESETS,
    placement_preset,
    register_placement_preset,
)
from lightning_app_rlhf.parallel.plan import (
    PlacementPlan,
    flattening_plan,
    interleaving_plan,
    separation_plan,
)
from lightning_app_rlhf.parallel.wrappers import is_available
from lightning_app_rlhf.planner import (
    CostModel,
    PlanChoice,
    PlannerError,
    Task,
    Workload,
    cluster_from_environment,
    llama_workload,
    mcmc_search,
    measure_compute_shares,
    parse_cluster,
    plan_placement,
    profile_workload,
    role_shape,
    simulate,
    workload_from_module,
)
from lightning_app_rlhf.planner.cost_model import (
    ENGINE_OPS,
    calibrate_engine,
    forward_flops,
    predicted_phases,
)
from lightning_app_rlhf.planner.profiler import (
    PIPELINE_OPS,
    Profile,
    measure_collectives_in_processes,
    measure_wrapper_steps,
    model_work,
)

DEMO = {
    "model_type": "gpt2",
    "n_layer": 2,
    "n_embd": 64,
    "n_head": 4,
    "vocab_size": 512,
    "n_positions": 64,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}
# GPT-2, 2 layers, h=64, vocab 512, 64 positions. Block: 12h^2 + 13h = 49_984. Embeddings: 512*64 + 64*64.
ACTOR_PARAMS = 512 * 64 + 64 * 64 + 2 * (12 * 64 * 64 + 13 * 64) + 2 * 64  # 136_960, LM head tied
CRITIC_PARAMS = ACTOR_PARAMS + 64 + 1  # value head with bias


def demo_workload(**overrides) -> Workload:
    fields = {
        "actor": role_shape(DEMO),
        "critic": role_shape(DEMO, "value"),
        "reference": role_shape(DEMO),
        "reward": None,
        "batch_size": 32,
        "prompt_length": 8,
        "generation_length": 24,
        "ppo_epochs": 2,
        "num_minibatches": 2,
        "wrappers": ("ddp", "fsdp2"),
    }
    return Workload(**{**fields, **overrides})


def test_shapes_count_what_the_built_models_hold():
    from lightning_app_rlhf.models.roles import ModelSpec, build_causal_lm, build_critic, build_reward_model

    spec = ModelSpec(config=DEMO)
    assert (
        role_shape(DEMO).params == ACTOR_PARAMS == sum(p.numel() for p in build_causal_lm(spec).parameters())
    )
    assert (
        role_shape(DEMO, "value").params
        == CRITIC_PARAMS
        == sum(p.numel() for p in build_critic(spec).parameters())
    )
    assert role_shape(DEMO, "classifier").params == sum(
        p.numel() for p in build_reward_model(spec, 0).parameters()
    )
    assert role_shape("gpt2-tiny").params == ACTOR_PARAMS
    assert role_shape("llama-7b").params == 6_738_415_616  # LLaMA-7B's published count


def test_forward_flops_of_a_known_shape():
    shape = role_shape("gpt2-tiny")
    # Matmul weights: 2 x (4h^2 + 2h*4h) + the tied head h*V = 131_072; attention adds 2*L*h*s^2 per sequence.
    assert shape.matmul_params == 2 * (4 * 64 * 64 + 2 * 64 * 256) + 64 * 512 == 131_072
    assert forward_flops(shape, 1, 10) == 2 * 131_072 * 10 + 2 * 2 * 64 * 10 * 10
    assert forward_flops(shape, 3, 10) == 3 * forward_flops(shape, 1, 10)


def test_memory_per_rank_counts_like_memory_py():
    """Weights and (grads + two AdamW slots) per rank, as RLHFModule logs them for the three presets on 4 ranks."""
    model = CostModel(parse_cluster("1x4xcpu"), demo_workload())
    actor, critic, reference = 4 * ACTOR_PARAMS, 4 * CRITIC_PARAMS, 4 * ACTOR_PARAMS
    adam = 3  # gradient + two moments per trainable byte (fp32)
    expected = {
        "flattening": [(actor + critic + reference, adam * (actor + critic))] * 4,
        "interleaving": [(actor + critic + reference, adam * (actor + critic))] * 2
        + [(actor + critic, adam * (actor + critic))] * 2,
        "separation": [(actor + critic + reference, 0)] * 2 + [(actor + critic, adam * (actor + critic))] * 2,
    }
    for plan in (flattening_plan(4), interleaving_plan(4), separation_plan(4)):
        rows = model.memory(PlanChoice(plan))
        assert [(m.param_bytes, m.state_bytes) for m in rows] == expected[plan.name], plan.name
    # FSDP2 chunks every parameter along dim 0 (torch.chunk): 4 ranks split each of the demo's matrices and vectors
    # evenly, and the critic's value head (one row of 64, and its bias) lives on rank 0 alone.
    shard, head = actor // 4, 4 * (64 + 1)
    assert actor == 4 * shard and critic == actor + head
    rows = model.memory(PlanChoice(flattening_plan(4, "fsdp2")))
    assert [(m.param_bytes, m.state_bytes) for m in rows] == [
        (2 * shard + head + reference, adam * (2 * shard + head))
    ] + [(2 * shard + reference, adam * 2 * shard)] * 3


def _demo_and_small_specs() -> dict[str, dict]:
    """The demo's actor spec (examples/configs/demo_cpu.yaml) and the ``small`` bench preset's, as spec fields."""
    import yaml

    from lightning_app_rlhf.bench.presets import RunSettings

    config = yaml.safe_load((ROOT / "examples/configs/demo_cpu.yaml").read_text())
    return {"demo": config["model"]["actor"], "small": {"config": RunSettings(preset="small").model_config()}}


def _measure_wrapped_roles(rank: int, port: int, world: int, out: str, small: bool) -> None:
    """One rank: every available wrapper around a fresh demo actor and critic (and with ``small`` the small preset's
    actor), one AdamW step through the wrapper, then what ``memory_bytes`` measures, in ``out/rank{rank}.json``."""
    os.environ.update(DS_ACCELERATOR="cpu", LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world))
    import torch
    import torch.distributed as dist

    from lightning_app_rlhf.models.roles import as_model_spec, build_causal_lm, build_critic
    from lightning_app_rlhf.parallel.wrappers import WRAPPERS, available_wrappers

    if "deepspeed" in sys.modules:  # imported by the parent for another device: DeepSpeed on this CPU instead
        from deepspeed.accelerator import set_accelerator
        from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

        set_accelerator(CPU_Accelerator())
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    group = dist.new_group(list(range(world)))
    ids = torch.randint(3, 512, (2, 8), generator=torch.Generator().manual_seed(0))
    cases = [("demo", "actor"), ("demo", "critic"), *[("small", "actor")] * small]
    measured = {}
    for name in available_wrappers():
        for model, role in cases:
            spec = as_model_spec(_demo_and_small_specs()[model])
            module = build_causal_lm(spec) if role == "actor" else build_critic(spec)
            wrapper = WRAPPERS[name](module, group, world, rank, torch.device("cpu"))
            wrapper.wrap()
            optimizer = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-3)
            wrapper.attach_optimizer(optimizer, 1.0)
            with wrapper.running():
                if role == "actor":
                    loss = wrapper.train_module(input_ids=ids).logits.float().mean()
                else:
                    loss = wrapper.train_module(ids, torch.ones_like(ids), torch.arange(8).expand(2, 8)).mean()
            wrapper.backward(loss)
            wrapper.step()
            measured[f"{name} {model} {role}"] = list(wrapper.memory_bytes())
    dist.destroy_process_group()
    Path(out, f"rank{rank}.json").write_text(json.dumps(measured))


def _run_ranks(world: int, out: Path, small: bool, timeout_s: float = 240.0) -> list[dict[str, list[int]]]:
    """:func:`_measure_wrapped_roles` on ``world`` forked gloo processes; each rank's measurements."""
    out.mkdir(parents=True, exist_ok=True)
    run_ranks(_measure_wrapped_roles, world, world, str(out), small, timeout=timeout_s)
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(world)]


def test_planner_memory_equals_what_each_wrapper_measures(tmp_path):
    """On 2 gloo processes (and 4, the demo only), every installed wrapper (DDP, FSDP2, and DeepSpeed's ZeRO-1/2/3
    where deepspeed is installed) wraps the demo's actor and critic and the small preset's actor, and takes one AdamW
    step; each rank's measured weights, gradients and optimizer state (``memory_bytes``) equal the cost model's rows,
    byte for byte: FSDP2's uneven dim-0 chunks (the critic's one-row value head on rank 0), ZeRO-1/2's flat parameter
    buffer padded to a multiple of 2 x ranks, ZeRO-3's per-parameter padding, and ZeRO's fp32 master copy next to
    its moments."""
    from lightning_app_rlhf.models.roles import as_model_spec
    from lightning_app_rlhf.parallel.wrappers import available_wrappers

    specs = {model: as_model_spec(fields) for model, fields in _demo_and_small_specs().items()}
    shapes = {model: spec.load_config().to_dict() for model, spec in specs.items()}
    for world, models in ((2, ("demo", "small")), (4, ("demo",))):
        measured = _run_ranks(world, tmp_path / f"world{world}", small="small" in models)
        assert {key.split()[0] for key in measured[0]} == set(available_wrappers()) >= {"ddp", "fsdp2"}
        cluster = parse_cluster(f"1x{world}xcpu")
        for name in available_wrappers():
            workloads = {
                # PPO on the demo: actor and critic trained with `name` on every rank, the reference held whole.
                "demo": demo_workload(actor=role_shape(shapes["demo"]), critic=role_shape(shapes["demo"], "value"),
                                      reference=role_shape(shapes["demo"]), wrappers=(name,)),
                # A critic-free run of the small preset: its actor trained with `name`, the reference whole.
                "small": demo_workload(actor=role_shape(shapes["small"]), critic=None,
                                       reference=role_shape(shapes["small"]), algorithm="grpo", num_samples=2,
                                       wrappers=(name,)),
            }
            for model_name in models:
                workload = workloads[model_name]
                model = CostModel(cluster, workload)
                rows = model.static_memory(flattening_plan(world, name, roles=workload.roles))
                reference = workload.actor.params * 4
                for rank, row in enumerate(rows):
                    got = {role: measured[rank][f"{name} {model_name} {role}"] for role in workload.trainable}
                    for role, role_bytes in got.items():
                        assert list(model.role_bytes(role, name, world, rank)) == role_bytes, (
                            name, model_name, role, world, rank)
                    weights, grads, optimizer = (sum(column) for column in zip(*got.values()))
                    assert (row.weights, row.grads, row.optimizer) == (weights + reference, grads, optimizer), (
                        name, model_name, world, rank)
        # The uneven cases the exact model covers. FSDP2: the critic's value head (a row of 64, a bias) on rank 0.
        fsdp2 = [measured[r]["fsdp2 demo critic"][0] - measured[r]["fsdp2 demo actor"][0] for r in range(world)]
        assert fsdp2 == [4 * 65] + [0] * (world - 1)
        if "zero1" in available_wrappers():
            # ZeRO-1/2: the critic's 137_025 trainable elements live in a flat buffer padded to a multiple of
            # 2 x ranks, split into the fp32 master partitions; ZeRO-3 pads each parameter (the bias of 1 to a
            # multiple of the ranks).
            assert CRITIC_PARAMS == 137_025
            padded = -(-CRITIC_PARAMS // (2 * world)) * 2 * world
            for rank in range(world):
                assert measured[rank]["zero1 demo critic"] == [4 * padded, 4 * CRITIC_PARAMS, 12 * padded // world]
                assert measured[rank]["zero2 demo critic"] == [4 * padded, 4 * padded // world, 12 * padded // world]
                assert measured[rank]["zero3 demo critic"][0] == 4 * (ACTOR_PARAMS // world + 64 // world + 1)

def test_schedule_overlaps_disjoint_groups_and_serialises_shared_ranks():
    gpus = parse_cluster("1x4xA100-80GB")
    tasks = [
        Task("a", (0, 1), 2.0),
        Task("b", (2, 3), 3.0),
        Task("c", (0, 1, 2, 3), 1.0),
        Task("d", (1, 2), 1.0),
    ]
    assert simulate(tasks, gpus) == [(0.0, 2.0), (0.0, 3.0), (3.0, 4.0), (4.0, 5.0)]
    # Four processes on two cores: two 2-second calls that overlap each run at half speed.
    cpus = replace(parse_cluster("1x4xcpu"), cores_per_node=2)
    assert simulate([Task("a", (0, 1), 2.0), Task("b", (2, 3), 2.0)], cpus) == [(0.0, 4.0), (0.0, 4.0)]
    # A collective's time is measured with its own ranks busy: alone it runs at full speed, however many ranks it
    # has; beside a computing group its ranks share the cores too, and both slow down.
    assert simulate([Task("c", (0, 1, 2, 3), 2.0, compute=False)], cpus) == [(0.0, 2.0)]
    assert simulate([Task("a", (0, 1), 2.0), Task("b", (2, 3), 2.0, compute=False)], cpus) == [
        (0.0, 4.0),
        (0.0, 4.0),
    ]
    assert simulate([Task("a", (0, 1), 2.0), Task("b", (2, 3), 2.0, compute=False)], gpus) == [
        (0.0, 2.0),
        (0.0, 2.0),
    ]


def test_separation_overlaps_reference_and_train_calls_by_group():
    """In the schedule, interleaving runs reference and reward forwards at the same time on disjoint halves."""
    model = CostModel(parse_cluster("1x8xA100-80GB"), llama_workload("llama-7b"))
    timeline = {
        name: (start, end)
        for name, _, start, end in model.evaluate(PlanChoice(interleaving_plan(8))).timeline
    }
    ref, rew = timeline["reference.forward"], timeline["reward.forward"]
    assert ref[0] == rew[0] and ref[1] > ref[0]


@pytest.mark.parametrize("plan", [flattening_plan(8), flattening_plan(8, wrapper="fsdp2")], ids=["ddp", "fsdp2"])
def test_recomputing_old_logprobs_prices_one_more_forward_of_the_rollout_share(plan):
    """ppo.recompute_old_logprobs adds to actor.train the forward of its rank's share of the rollout (in the train
    call's micro-batches) and the all-reduce of the log-probabilities; no other call changes."""
    cluster, workload = parse_cluster("1x8xA100-80GB"), llama_workload("llama-7b")
    choice = PlanChoice(plan)
    plain, recomputing = CostModel(cluster, workload), CostModel(cluster, replace(workload, recompute_old_logprobs=True))
    compute, comm = plain.call_time(choice, "actor.train")
    more_compute, more_comm = recomputing.call_time(choice, "actor.train")
    share = workload.samples // 8
    micro = plain._micro(choice, share // workload.num_minibatches)
    forward = sum(plain.op_time(workload.actor, "forward", min(micro, share - i), workload.sequence_length)
                  for i in range(0, share, micro))
    assert more_compute == pytest.approx(compute + forward)
    assert more_comm > comm
    assert recomputing.call_time(choice, "critic.train") == plain.call_time(choice, "critic.train")

def test_generation_rounds_price_each_update_with_more_generation_and_scoring():
    """Dynamic sampling's rounds: an update generates and scores ``generation_rounds`` batches, then trains once."""
    cluster, workload = parse_cluster("1x8xA100-80GB"), replace(llama_workload("llama-7b"), critic=None,
                                                                algorithm="dapo")
    choice = PlanChoice(flattening_plan(8, roles=workload.roles))
    one, two = CostModel(cluster, workload), CostModel(cluster, replace(workload, generation_rounds=2))
    names = [t.name for t in two.tasks(choice) if t.name.endswith("#1")]
    assert names.count("actor.generate#1") == 2 and names.count("reward.forward#1") == 2
    assert names.count("actor.train#1") == 1
    first, second = one.evaluate(choice), two.evaluate(choice)
    generate_and_score = sum(first.call_s[c] for c in ("actor.generate", "reference.forward", "reward.forward"))
    assert second.iteration_s - first.iteration_s == pytest.approx(generate_and_score, rel=0.05)  # + gathers
    assert second.samples_per_s < first.samples_per_s


def test_search_is_deterministic_and_beats_or_matches_presets():
    cluster, workload = parse_cluster("2x8xA100-80GB"), llama_workload("llama-7b")
    first = plan_placement(cluster, workload, seed=3, time_budget_s=60, mcmc_steps=300)
    second = plan_placement(cluster, workload, seed=3, time_budget_s=60, mcmc_steps=300)
    assert [c.choice.key for c in first.candidates] == [c.choice.key for c in second.candidates]
    assert first.best.iteration_s == second.best.iteration_s
    fitting = [c.iteration_s for c in first.presets.values() if c.estimate.fits]
    assert first.best.iteration_s <= min(fitting)
    assert first.best.estimate.fits and first.speedup_over("flattening") >= 1.0


def test_mcmc_never_ends_worse_than_its_start():
    model = CostModel(parse_cluster("1x8xA100-80GB"), llama_workload("llama-7b"))
    *found, start = mcmc_search(model, seed=0, steps=200, time_budget_s=60)
    assert start.source == "mcmc start" and all(c.source == "mcmc" for c in found)
    assert found[0].iteration_s <= (start.iteration_s if start.estimate.fits else float("inf"))
    assert all(c.estimate.fits for c in found)
    assert [c.iteration_s for c in found] == sorted(c.iteration_s for c in found)


def test_plan_command_json(tmp_path):
    out = run_cli("plan", "--cluster", "1x8xA100-80GB", "--actor", "llama-7b", "--critic", "llama-7b", "--json",
                  "--time_budget", "1", cwd=tmp_path, timeout=120)
    result = json.loads(out.stdout)
    assert set(result["presets"]) == {"flattening", "interleaving", "separation"}
    best = result["best"]
    assert best["iteration_s"] > 0 and best["samples_per_s"] == pytest.approx(512 / best["iteration_s"])
    assert set(best["calls"]) == {
        "actor.generate",
        "reference.forward",
        "reward.forward",
        "critic.forward",
        "actor.train",
        "critic.train",
    }
    assert len(best["memory"]) == 8 and best["peak_memory_bytes"] <= best["capacity_bytes"]
    assert all("rejected" in c and "iteration_s" in c for c in result["candidates"])


def plan_main(args: list[str]) -> int:
    """``python -m lightning_app_rlhf plan ARGS`` in this process: its exit status."""
    from unittest import mock

    from lightning_app_rlhf.cli import main

    try:
        with mock.patch.object(sys, "argv", ["lightning-app-rlhf"]):  # LightningCLI reads args, not pytest's argv
            main(["plan", *args])
    except SystemExit as exit:
        return exit.code
    return 0


def plan_help() -> str:
    """``plan --help``."""
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert plan_main(["--help"]) == 0
    return out.getvalue()


def test_plan_command_table_and_errors(capsys):
    args = ["--cluster", "1x4xcpu", "--actor", "gpt2-tiny", "--reward", "function", "--batch_size", "32",
            "--prompt_length", "8", "--generation_length", "24", "--num_minibatches", "2", "--time_budget", "1"]
    assert plan_main(args) == 0
    table = capsys.readouterr().out
    assert "flattening" in table and "separation" in table and "samples/s" in table
    assert plan_main(["--cluster", "1x8xTPU-v9", "--actor", "llama-7b"]) == 2
    err = capsys.readouterr().err
    assert "Unknown device type 'TPU-v9'" in err and "A100-80GB" in err and "cpu" in err



def test_the_search_space_is_the_registry_less_what_is_not_installed(monkeypatch, capsys):
    """The planner searches the registry's wrappers, in its order, that are installed and the workload allows;
    frozen roles get only wrappers that can shard them. Without DeepSpeed the ZeRO wrappers are neither searched nor
    accepted: ``--wrappers`` naming one fails with the install command."""
    import lightning_app_rlhf.parallel.wrappers as registry
    from lightning_app_rlhf.planner import installed_wrappers
    from lightning_app_rlhf.planner.search import _frozen_choices, _wrappers

    assert installed_wrappers() == registry.available_wrappers()
    assert all(name in plan_help() for name in registry.WRAPPERS)
    everything = demo_workload(wrappers=installed_wrappers())
    model = CostModel(parse_cluster("1x2xcpu"), everything)
    assert _wrappers(model) == list(installed_wrappers())
    assert _frozen_choices(model) == [None, *[w for w in installed_wrappers() if w in registry.FROZEN_WRAPPERS]]
    result = plan_placement(parse_cluster("1x2xcpu"), everything, time_budget_s=5, mcmc_steps=100)
    for candidate in result.candidates:
        plan = candidate.plan
        assert all(plan.wrappers[r] in installed_wrappers() for r in plan.trainable_roles)
        frozen = [plan.wrappers[r] for r in plan.wrappers if r not in plan.trainable_roles]
        assert all(w in registry.FROZEN_WRAPPERS for w in frozen)

    # A machine without DeepSpeed.
    monkeypatch.setattr(registry, "is_available", lambda name: registry.WRAPPERS[name].package is None)
    assert installed_wrappers() == ("ddp", "fsdp2") and _wrappers(model) == ["ddp", "fsdp2"]
    assert _frozen_choices(model) == [None, "fsdp2"]
    result = plan_placement(parse_cluster("1x2xcpu"), everything, time_budget_s=5, mcmc_steps=100)
    assert {w for c in result.candidates for w in c.plan.wrappers.values()} <= {"ddp", "fsdp2"}
    with pytest.raises(ValueError, match=r"needs deepspeed.*pip install 'lightning-app-rlhf\[deepspeed\]'"):
        demo_workload(wrappers=("ddp", "zero2"))
    args = ["--cluster", "1x2xcpu", "--actor", "gpt2-tiny", "--reward", "function", "--batch_size", "8",
            "--prompt_length", "8", "--generation_length", "8", "--num_minibatches", "2"]
    assert plan_main([*args, "--wrappers", "ddp,zero3"]) == 2
    assert "pip install 'lightning-app-rlhf[deepspeed]'" in capsys.readouterr().err
    assert plan_main([*args, "--wrappers", "ddp,zero0"]) == 2
    err = capsys.readouterr().err
    assert "Unknown wrapper 'zero0'; choose one of ['ddp', 'fsdp2', 'zero1', 'zero2', 'zero3']" in err

def test_impossible_requests_show_the_memory_breakdown():
    with pytest.raises(ValueError, match="Known device types: .*H100-80GB"):
        parse_cluster("1x8xB300")
    with pytest.raises(
        PlannerError,
        match=r"actor \(llama-65b, 121.6 GiB of weights\) does not fit on one A100-80GB .* no sharding",
    ):
        plan_placement(parse_cluster("1x8xA100-80GB"), llama_workload("llama-65b", wrappers=("ddp",)))
    # Full fine-tuning of 65B: bf16 weights + grads + AdamW's two bf16 moments (what DDP and FSDP2 keep; ZeRO would
    # add an fp32 master copy and fp32 moments), 8 bytes per parameter, over 8 x 72 GiB.
    with pytest.raises(PlannerError, match=r"cannot fit on 1x8xA100-80GB: .* = actor 486.4 GiB \+ critic 484.5"):
        plan_placement(parse_cluster("1x8xA100-80GB"), llama_workload("llama-65b"))
    with pytest.raises(PlannerError, match=r"cannot fit on 1x1xA100-80GB: .* = actor .* GiB \+ critic"):
        plan_placement(parse_cluster("1x1xA100-80GB"), llama_workload("llama-7b"))
    # Sharded over 32 devices 65B fits, but not with 128k-token prompts: even split 8 ways by tensor parallelism, one
    # sequence's activations in training (or its 41 GiB share of the KV cache) overflow a device.
    with pytest.raises(
        PlannerError, match=r"out of memory: rank \d+: .* GiB = weights .* GiB \+ grads .*optimizer .*activations"
    ):
        plan_placement(parse_cluster("4x8xA100-80GB"), llama_workload("llama-65b", prompt_length=131072),
                       search="presets")


def test_workload_and_cluster_from_a_module_and_the_environment():
    from lightning_app_rlhf.module import RLHFModule

    module = RLHFModule(
        actor={"config": DEMO},
        tokenizer="lightning_app_rlhf.demo:build_tokenizer",
        reward_fn="lightning_app_rlhf.demo.topic_reward",
    )
    workload = workload_from_module(module, batch_size=32, prompt_length=8)
    assert workload.reward is None and workload.reference == workload.actor
    assert workload.critic.params == CRITIC_PARAMS and workload.generation_length == 32
    cluster = cluster_from_environment(4, cores=2)
    assert cluster.world_size == 4 and cluster.compute_share(4) == 0.5
    result = plan_placement(cluster, workload, time_budget_s=60, mcmc_steps=100)
    assert result.best.plan.world_size == 4 and result.best.estimate.fits


def test_profile_measures_caches_and_interpolates(tmp_path):
    workload = demo_workload(prompt_length=4, generation_length=4)
    profile = profile_workload(workload, batches=(1, 2), repeats=1, cache_dir=tmp_path)
    actor, critic = workload.actor, workload.critic
    assert set(profile.ops[actor.key]) == {"forward", "train", "prefill", "decode", "optimizer"}
    assert set(profile.ops[critic.key]) == {"forward", "train", "optimizer"}
    one, two = profile.time(actor, "forward", 1, 8), profile.time(actor, "forward", 2, 8)
    assert 0 < one and 0 < two
    assert min(one, two) <= profile.time(actor, "forward", 1.5, 8) <= max(one, two)
    assert profile.time(role_shape("llama-7b"), "forward", 1, 8) is None  # unprofiled: analytic fallback
    assert len(list(tmp_path.rglob("*.json"))) == 2
    again = profile_workload(workload, batches=(1, 2), repeats=1, cache_dir=tmp_path)
    assert again.ops[actor.key] == profile.ops[actor.key]  # read back from the cache
    # Generation costs its measured prefill (last position's logits only) plus the decode steps.
    model = CostModel(parse_cluster("1x1xcpu"), workload, profile)
    prefill = profile.time(actor, "prefill", 32, workload.prompt_length)
    decode = profile.time(actor, "decode", 32, workload.prompt_length + 2)
    assert prefill > 0 and decode > 0
    assert model.call_time(PlanChoice(flattening_plan(1)), "actor.generate")[0] == pytest.approx(prefill + 3 * decode)
    model = CostModel(parse_cluster("1x2xcpu"), workload, profile)
    assert model.evaluate(PlanChoice(flattening_plan(2))).iteration_s > 0


def test_compute_shares_measure_the_core_a_busy_process_gets():
    """k spinning processes each get min(1, cores / k) of a core on an otherwise idle machine: CPU time over wall
    time, so a lone process counts as a whole core (no biased "full speed" reference)."""
    cores = len(os.sched_getaffinity(0))
    shares = measure_compute_shares(cores + 1, seconds=0.3)
    assert len(shares) == cores + 1 and all(0 < s <= 1 for s in shares)
    assert list(shares) == sorted(shares, reverse=True)  # one more busy process never makes the others faster
    assert shares[-1] < shares[0]  # one more busy process than cores: each gets less
    # At most cores / (cores + 1) each, whatever else runs; how much less depends on the other jobs (CI measured
    # 0.40 once on 2 cores), so no lower bound.
    assert shares[-1] <= cores / (cores + 1) + 0.05


def test_compute_shares_on_model_work_count_what_time_slicing_costs():
    """With a unit of model work, a share is CPU time / wall time times the work's efficiency (median CPU time of a
    unit alone over the same with k busy), so it is never more than the CPU share a spinning process gets."""
    workload = demo_workload(prompt_length=4, generation_length=4)
    work = model_work(workload, batch=2)
    work()  # it runs: a generate, the reference's and critic's forwards, actor and critic train steps
    cores = len(os.sched_getaffinity(0))
    shares = measure_compute_shares(cores + 1, seconds=0.3, work=work)
    assert len(shares) == cores + 1 and all(0 < s <= 1 for s in shares)
    assert list(shares) == sorted(shares, reverse=True) and shares[-1] < shares[0]
    assert shares[-1] <= cores / (cores + 1) + 0.05  # the CPU share times an efficiency of at most about 1


def test_measured_compute_shares_replace_processor_sharing():
    """On a shared machine each busy process gets the measured share of a core, not cores / busy."""
    shared = cluster_from_environment(4, cores=2, compute_shares=(0.9, 0.45, 0.3))
    assert [shared.compute_share(k) for k in (1, 2, 3, 4)] == [0.9, 0.45, 0.3, 0.5]  # 4: beyond the measured
    # Two 0.9-second calls on disjoint ranks at once: each runs at 0.45 of a core, so both end at 2 s.
    assert simulate([Task("a", (0,), 0.9), Task("b", (1,), 0.9)], shared) == [(0.0, 2.0), (0.0, 2.0)]
    assert simulate([Task("a", (0,), 0.9)], shared) == [(0.0, 1.0)]
    with pytest.raises(ValueError, match="compute_shares must lie in"):
        cluster_from_environment(2, cores=2, compute_shares=(1.5,))


def test_world_gathers_count_one_collective_per_tensor_plus_the_shapes():
    """gather_to_world all-gathers the shapes, then each tensor: the rollout (3 tensors) pays 4 latencies."""
    device = replace(parse_cluster("1x2xcpu").device, collective_latency_s=1e-3, intra_node_bandwidth=1e30)
    model = CostModel(cluster_from_environment(2, device, cores=2), demo_workload())
    plan = flattening_plan(2)
    assert model.world_gather_s(plan, "actor.generate", 0, tensors=3) == pytest.approx(4e-3)
    assert model.world_gather_s(plan, "reference.forward", 0) == pytest.approx(2e-3)


def test_gradient_all_reduce_and_broadcast_use_the_measured_bucket_bandwidth():
    """gloo's all-reduce of DDP buckets is faster than its all-gathers: the ring all-reduce of 1 MB over 2 ranks
    moves 2 x 0.5 MB at 1 GB/s and pays 2 latencies; the all-gather keeps its own (slower) bandwidth."""
    device = replace(
        parse_cluster("1x2xcpu").device,
        collective_latency_s=1e-3,
        intra_node_bandwidth=1e8,
        inter_node_bandwidth=1e8,
        all_reduce_bandwidth=1e9,
    )
    model = CostModel(cluster_from_environment(2, device, cores=2), demo_workload())
    assert model.all_reduce_s((0, 1), 1e6) == pytest.approx(2 * (0.5e6 / 1e9 + 1e-3))
    assert model.broadcast_s((0, 1), 1e6) == pytest.approx(1e6 / 1e9 + 1e-3)
    assert model.all_gather_s((0, 1), 1e6) == pytest.approx(0.5e6 / 1e8 + 1e-3)
    unmeasured = CostModel(
        cluster_from_environment(2, replace(device, all_reduce_bandwidth=None), cores=2), demo_workload()
    )
    assert unmeasured.all_reduce_s((0, 1), 1e6) == pytest.approx(2 * (0.5e6 / 1e8 + 1e-3))


def test_collectives_measured_in_two_gloo_processes():
    """Real gloo processes: a per-hop latency, the all-gather bandwidth and the bucket all-reduce bandwidth."""
    device = measure_collectives_in_processes(parse_cluster("1x2xcpu").device, 2)
    assert 1e-6 < device.collective_latency_s < 0.1
    assert device.intra_node_bandwidth == device.inter_node_bandwidth > 1e6
    assert device.all_reduce_bandwidth > 1e6


def test_wrapper_steps_measured_in_gloo_processes_price_the_train_and_sharded_forward_calls():
    """measure_wrapper_steps times a real train step through each wrapper (DDP, FSDP2, and ZeRO-1 when DeepSpeed is
    installed) against a bare one in 2 gloo processes, a forward through the sharding ones, and a 2-stage pipeline's
    train and forward stage steps and whole-weight gather; the cost model then
    charges that per optimizer step of a train call, and per forward of a sharded scoring call, instead of the
    analytic collectives."""
    wrappers = ("ddp", "fsdp2", *(("zero1",) if is_available("zero1") else ()))
    workload = demo_workload(generation_length=4, wrappers=wrappers)
    measured = measure_wrapper_steps(workload, 2, wrappers, repeats=3)
    keys = {workload.actor.key, workload.critic.key}  # the reference has the actor's shape
    assert set(measured.ops) == keys
    trained = {f"{w}_step" for w in wrappers} | {"fsdp2_forward", *PIPELINE_OPS}  # a 2-stage pipeline too
    assert set(measured.ops[workload.critic.key]) == trained
    for key in keys:
        for op, points in measured.ops[key].items():
            ((group, length, seconds),) = points
            assert (group, length) == (2, 1) and 0.0 <= seconds < 1.0, (key, op)
    # Priced by hand: 0.01 s a step, 2 epochs x 2 minibatches, plus the statistics' all-reduce.
    ops = {key: {"ddp_step": [[2, 1, 0.01]], "fsdp2_step": [[2, 1, 0.03]], "fsdp2_forward": [[2, 1, 0.002]]}
           for key in keys}
    device = replace(parse_cluster("1x2xcpu").device, collective_latency_s=1e-3)
    model = CostModel(cluster_from_environment(2, device, cores=2), workload, Profile("here", device, ops))
    choice = PlanChoice(flattening_plan(2))
    _, comm = model.call_time(choice, "actor.train")
    assert comm == pytest.approx(4 * 0.01 + model.all_reduce_s((0, 1), 64))
    sharded = PlanChoice(flattening_plan(2, "fsdp2"))
    assert model.call_time(sharded, "actor.train")[1] == pytest.approx(4 * 0.03 + model.all_reduce_s((0, 1), 64))
    assert model.call_time(sharded, "critic.forward")[1] == pytest.approx(0.002)  # one forward of its 16 rows
    bare = CostModel(cluster_from_environment(2, device, cores=2), workload)
    trained_bytes = workload.trainable_params("actor") * workload.actor.dtype_bytes
    assert bare.call_time(choice, "actor.train")[1] == pytest.approx(
        4 * bare.all_reduce_s((0, 1), trained_bytes) + bare.all_reduce_s((0, 1), 64)
    )


@pytest.mark.parametrize(("plan", "shares"), [(flattening_plan(1), (1.0,)), (flattening_plan(2), (1.0, 1.0)),
                                              (separation_plan(2), (1.0, 1.0)), (flattening_plan(4), (1.0, 1.0, 0.6, 0.5))],
                         ids=["one-process", "flattening-2", "separation-2", "flattening-4-on-2-cores"])
def test_the_engine_s_own_work_calibrated_on_a_plan_prices_that_plan_as_measured(plan, shares):
    """calibrate_engine: what the reference plan's phases measured beyond their price becomes the engine's own work
    per generate call, per rollout and per optimizer step, at full speed (hand-computed: 10 ms, 20 ms, 16 ms over 2
    roles x 2 epochs x 2 minibatches = 2 ms a step, times the share of a core each of the reference's busy ranks got:
    half of one with 4 processes on 2 cores); priced again with it, the reference plan's phases are the measured
    ones, and a phase measured below its price adds nothing."""
    workload = demo_workload()
    device = replace(parse_cluster("1x2xcpu").device, collective_latency_s=1e-4)
    cluster = cluster_from_environment(plan.world_size, device, cores=2, compute_shares=shares)
    profile = Profile("here", device, {})
    predicted = predicted_phases(CostModel(cluster, workload, profile).evaluate(PlanChoice(plan)))
    measured = {"generate": predicted["generate"] + 0.010, "score": predicted["score"] + 0.020,
                "train": predicted["train"] + 0.016}
    calibrated = calibrate_engine(profile, cluster, workload, plan, measured)
    engine = {phase: points[0][2] for phase, points in calibrated.ops[ENGINE_OPS].items()}
    busy = shares[-1]
    assert engine == pytest.approx({"generate": 0.010 * busy, "score": 0.020 * busy, "train_step": 0.002 * busy})
    again = predicted_phases(CostModel(cluster, workload, calibrated).evaluate(PlanChoice(plan)))
    assert {p: again[p] for p in measured} == pytest.approx(measured)
    slower = calibrate_engine(profile, cluster, workload, plan, {**measured, "score": predicted["score"] / 2})
    assert slower.ops[ENGINE_OPS]["score"] == [[1, 1, 0.0]]


def test_profiles_merge_ops_per_shape():
    first = Profile("here", None, {"a": {"train": [[1, 1, 1.0]]}})
    merged = first.merge(Profile("here", None, {"a": {"ddp_step": [[2, 1, 0.1]]}, "b": {"forward": [[1, 1, 2.0]]}}))
    assert merged.ops == {
        "a": {"train": [[1, 1, 1.0]], "ddp_step": [[2, 1, 0.1]]},
        "b": {"forward": [[1, 1, 2.0]]},
    }


LLAMA_TINY = {
    "model_type": "llama",
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 160,
    "vocab_size": 128,
}


def test_lora_workload_trains_adapters_and_the_reference_is_the_actor_base():
    """LoRA rank 8 on a 2-layer LLaMA (h=64, kv=32, MLP 160): adapters r*(in+out) on q,k,v,o,gate,up,down."""
    from lightning_app_rlhf.planner.workload import lora_params

    shape = role_shape(LLAMA_TINY)
    per_layer = 8 * ((64 + 64) + (64 + 32) + (64 + 32) + (64 + 64) + 2 * (64 + 160) + (160 + 64))
    assert lora_params(shape, 8) == 2 * per_layer == 2 * 8 * 1120
    workload = Workload(
        actor=shape,
        critic=role_shape(LLAMA_TINY, "value"),
        reference=shape,
        reward=role_shape(LLAMA_TINY, "classifier"),
        batch_size=8,
        prompt_length=4,
        generation_length=4,
        lora_rank=8,
    )
    adapters = 2 * 8 * 1120
    assert workload.trainable_params("actor") == adapters
    assert workload.trainable_params("critic") == adapters + 64 + 1  # plus the value head
    rows = CostModel(parse_cluster("1x2xcpu"), workload).memory(PlanChoice(flattening_plan(2)))
    actor, critic = shape.params + adapters, workload.critic.params + adapters
    reward = workload.reward.params
    for row in rows:  # fp32: 4 bytes; the reference adds nothing; grads + two AdamW slots on adapters only
        assert row.param_bytes == 4 * (actor + critic + reward)
        assert row.grads == 4 * (2 * adapters + 65) and row.optimizer == 8 * (2 * adapters + 65)
        assert row.roles["reference"] == "actor base, adapters off"
    # Separation reallocates only the adapters (and the value head) to the shadow copies.
    model = CostModel(parse_cluster("1x2xcpu"), workload)
    _, seconds = model.reallocate_time(separation_plan(2), "actor")
    full = replace(workload, lora_rank=None)
    _, full_seconds = CostModel(parse_cluster("1x2xcpu"), full).reallocate_time(separation_plan(2), "actor")
    assert seconds < full_seconds


def test_frozen_roles_sharded_with_fsdp2_hold_a_shard_per_rank():
    """A frozen role with an fsdp2 wrapper holds its dim-0 chunk of every parameter on each rank of its forward group:
    a quarter of the demo's matrices and vectors on 4 ranks, and the reward model's one-row score on rank 0."""
    from lightning_app_rlhf.parallel.plan import PlacementPlan

    workload = demo_workload(reward=role_shape(DEMO, "classifier"))
    flat = flattening_plan(4)
    sharded = PlacementPlan(4, flat.calls, {**flat.wrappers, "reference": "fsdp2", "reward": "fsdp2"})
    model = CostModel(parse_cluster("1x4xcpu"), workload)
    reference, reward, score = 4 * ACTOR_PARAMS, 4 * workload.reward.params, 4 * 64
    assert reward == reference + score
    for rank, (whole, split) in enumerate(zip(model.memory(PlanChoice(flat)), model.memory(PlanChoice(sharded)))):
        held = 2 * (reference // 4) + (score if rank == 0 else 0)  # reference and reward bodies, the score
        assert whole.param_bytes - split.param_bytes == reference + reward - held, rank
        assert split.state_bytes == whole.state_bytes
    split = model.memory(PlanChoice(sharded))[0]
    assert split.roles["reference"] == "frozen shard 1/4 fsdp2"
    assert "reference:fsdp2 reward:fsdp2" in PlanChoice(sharded).label


def test_llama_33b_and_65b_with_lora_are_plannable_on_one_node():
    """APP's setting (LoRA 128): sharding the actor/critic bases, and the frozen reward model or pipelining the calls
    (each rank a stage), makes 65B fit 1x8."""
    for size in ("llama-33b", "llama-65b"):
        result = plan_placement(
            parse_cluster("1x8xA100-80GB"),
            llama_workload(size, prompt_length=256, lora_rank=128, wrappers=("ddp", "fsdp2")),
            search="presets",
        )
        best = result.best
        assert best.estimate.fits and best.estimate.peak_bytes <= 0.9 * 80 * 2**30
        assert best.plan.wrappers["actor"] == "fsdp2"
        assert best.plan.wrappers.get("reward") == "fsdp2" or best.plan.pp_degree("reward.forward") > 1


# ---------------------------------------------------------------- critic-free workloads (GRPO and friends)


def grpo_workload(**overrides) -> Workload:
    """The demo workload without a critic: GRPO with 2 responses per prompt."""
    return demo_workload(**{"critic": None, "algorithm": "grpo", "num_samples": 2, **overrides})


def test_a_critic_free_workload_places_no_critic():
    workload = grpo_workload()
    assert workload.roles == ("actor", "reference", "reward") and workload.trainable == ("actor",)
    assert workload.calls == ("actor.generate", "reference.forward", "reward.forward", "actor.train")
    assert workload.samples == 32 * 2 and not workload.has_critic
    assert demo_workload().roles == ("actor", "reference", "reward", "critic")
    with pytest.raises(ValueError, match=r"3 prompts x 2 samples = 6 sequences is not divisible by num_minibatches 4"):
        grpo_workload(batch_size=3, num_minibatches=4)
    # A plan must place exactly the workload's roles: PPO's plan has the critic a GRPO workload lacks.
    with pytest.raises(ValueError, match=r"algorithm 'grpo' uses .*remove the calls of \['critic'\]"):
        CostModel(parse_cluster("1x4xcpu"), workload).evaluate(PlanChoice(flattening_plan(4)))


def test_a_workload_without_kl_places_no_reference_and_holds_none():
    """No KL (DAPO's default): the workload has no reference role, no preset places one, and each rank's memory is
    the GRPO workload's less the reference's weights; the named-size `plan --algorithm dapo` builds such a one."""
    from lightning_app_rlhf.planner.command import PlanOptions, named_size_workload

    cluster, with_kl = parse_cluster("1x4xcpu"), grpo_workload()
    without = grpo_workload(reference=None, algorithm="dapo")
    assert without.roles == ("actor", "reward") and without.calls == ("actor.generate", "reward.forward", "actor.train")
    for plan in (flattening_plan(4, roles=without.roles), interleaving_plan(4, roles=without.roles)):
        assert "reference.forward" not in plan.calls
        estimate = CostModel(cluster, without).evaluate(PlanChoice(plan))
        assert estimate.fits and all(m.total > 0 for m in estimate.memory)
    flat_kl = CostModel(cluster, with_kl).evaluate(PlanChoice(flattening_plan(4, roles=with_kl.roles)))
    flat_none = CostModel(cluster, without).evaluate(PlanChoice(flattening_plan(4, roles=without.roles)))
    assert [a.total - b.total for a, b in zip(flat_kl.memory, flat_none.memory)] == [4 * ACTOR_PARAMS] * 4
    named = named_size_workload(PlanOptions(algorithm="dapo", num_samples=4, actor="gpt2-tiny", reward="function"),
                                gpu=False)
    assert named.reference is None and named.roles == ("actor", "reward")

def test_samples_not_prompts_set_the_cost_of_a_rollout():
    """G responses per prompt cost what G times the prompts cost: 16 prompts x 2 samples = 32 prompts x 1."""
    cluster = parse_cluster("1x4xcpu")
    grouped, flat = CostModel(cluster, demo_workload(batch_size=16, num_samples=2)), CostModel(cluster, demo_workload())
    for plan in (flattening_plan(4), interleaving_plan(4), separation_plan(4)):
        a, b = grouped.evaluate(PlanChoice(plan)), flat.evaluate(PlanChoice(plan))
        assert a.iteration_s == pytest.approx(b.iteration_s) and a.samples_per_s == pytest.approx(b.samples_per_s)
        assert [m.total for m in a.memory] == [m.total for m in b.memory]


def test_critic_free_memory_per_rank_has_no_critic_share():
    """The presets of a GRPO workload hold PPO's rows less the critic's weights, gradients and AdamW slots."""
    cluster = parse_cluster("1x4xcpu")
    with_critic, without = CostModel(cluster, demo_workload(num_samples=2)), CostModel(cluster, grpo_workload())
    actor, critic, reference = 4 * ACTOR_PARAMS, 4 * CRITIC_PARAMS, 4 * ACTOR_PARAMS
    adam = 3  # gradient + two moments per trainable byte (fp32)
    expected = {
        "flattening": [(actor + reference, adam * actor)] * 4,
        "interleaving": [(actor + reference, adam * actor)] * 2 + [(actor, adam * actor)] * 2,
        "separation": [(actor + reference, 0)] * 2 + [(actor, adam * actor)] * 2,
    }
    for preset in (flattening_plan, interleaving_plan, separation_plan):
        plan = preset(4, roles=without.workload.roles)
        assert not any(call.startswith("critic.") for call in plan.calls) and "critic" not in plan.wrappers
        rows = without.memory(PlanChoice(plan))
        assert [(m.param_bytes, m.state_bytes) for m in rows] == expected[plan.name], plan.name
        assert all("critic" not in m.roles for m in rows)
        ppo_rows = with_critic.memory(PlanChoice(preset(4)))
        for grpo_row, ppo_row in zip(rows, ppo_rows, strict=True):
            assert grpo_row.total < ppo_row.total
            # The critic's whole weights on every rank that holds it; its grads and AdamW slots on its train ranks.
            assert ppo_row.param_bytes - grpo_row.param_bytes == critic
            assert ppo_row.state_bytes - grpo_row.state_bytes == (adam * critic if ppo_row.state_bytes else 0)


def test_searches_plan_a_critic_free_workload_without_critic_calls():
    """Presets, the APP grid, the role blocks and the MCMC chain: no plan has a critic call, wrapper or memory."""
    result = plan_placement(cluster_from_environment(4, cores=2), grpo_workload(), time_budget_s=60, mcmc_steps=100)
    model = CostModel(result.cluster, result.workload)
    *found, start = mcmc_search(model, seed=0, steps=100, time_budget_s=60)
    assert found and start.source == "mcmc start"
    for candidate in [*result.candidates, *found, start]:
        plan = candidate.plan
        assert plan.roles == ("actor", "reference", "reward"), candidate.choice.label
        assert set(plan.wrappers) <= {"actor", "reference", "reward"}
        assert all("critic" not in m.roles for m in candidate.estimate.memory)
        assert not [c for c in [*candidate.to_dict()["calls"], *candidate.estimate.call_s] if c.startswith("critic")]
        assert not any(name.startswith(("critic", "gather.critic")) for name, *_ in candidate.estimate.timeline)
    assert result.best.estimate.fits and result.to_dict()["roles"] == ["actor", "reference", "reward"]


def test_a_critic_free_llama_workload_needs_less_memory_than_ppo():
    """LLaMA-7B on 1x8 A100, bf16: under the same plan and batches each device holds the critic's weights, gradients
    and optimizer state less (DDP: 2 + 2 + 4 bytes per parameter, AdamW's two moments in bf16; FSDP2: its dim-0
    chunk of each parameter, the value head on rank 0), and the searched plans have no critic call."""
    from lightning_app_rlhf.parallel.wrappers import WRAPPERS

    cluster = parse_cluster("1x8xA100-80GB")
    ppo_workload = llama_workload("llama-7b", num_samples=4)
    grpo_workload = llama_workload("llama-7b", has_critic=False, algorithm="grpo", num_samples=4)
    assert grpo_workload.critic is None and grpo_workload.reward == ppo_workload.reward
    ppo, grpo = CostModel(cluster, ppo_workload), CostModel(cluster, grpo_workload)
    critic = ppo_workload.critic.params
    for wrapper in ("ddp", "fsdp2"):
        ppo_rows = ppo.memory(PlanChoice(flattening_plan(8, wrapper), 64, 8))
        grpo_rows = grpo.memory(PlanChoice(flattening_plan(8, wrapper, roles=grpo_workload.roles), 64, 8))
        for rank, (ppo_row, grpo_row) in enumerate(zip(ppo_rows, grpo_rows, strict=True)):
            share = sum(WRAPPERS[wrapper].predicted_bytes(*ppo_workload.parameters("critic"), 2, 8, rank, 2, True))
            assert ppo_row.total - grpo_row.total == share, wrapper
            if wrapper == "ddp":
                assert share == (2 + 2 + 4) * critic
            else:  # every LLaMA-7B matrix and vector splits 8 ways; the value head (4096 + 1) stays on rank 0
                assert share == (2 + 2 + 4) * ((critic - 4097) // 8 + (4097 if rank == 0 else 0))
    result = plan_placement(cluster, grpo_workload, search="presets")
    for candidate in result.candidates:
        assert not any(c.startswith("critic.") for c in candidate.plan.calls)
    assert result.best.iteration_s < plan_placement(cluster, ppo_workload, search="presets").best.iteration_s
    with pytest.raises(PlannerError, match=r"= actor .* GiB \+ reference .* GiB \+ reward .* GiB, more than") as err:
        plan_placement(parse_cluster("1x1xA100-80GB"), grpo_workload)
    assert "critic" not in str(err.value)


def test_plan_command_plans_critic_free_algorithms(capsys):
    args = ["--cluster", "1x4xcpu", "--actor", "gpt2-tiny", "--reward", "function", "--batch_size", "16",
            "--prompt_length", "8", "--generation_length", "24", "--num_minibatches", "2", "--time_budget", "1"]
    assert plan_main([*args, "--algorithm", "grpo", "--num_samples", "4", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["algorithm"] == "grpo" and result["num_samples"] == 4 and "critic" not in result["roles"]
    for candidate in [result["best"], *result["presets"].values(), *result["candidates"]]:
        assert not [call for call in candidate["calls"] if call.startswith("critic.")]
        assert "critic" not in candidate["wrappers"]
    best = result["best"]
    assert best["samples_per_s"] == pytest.approx(16 * 4 / best["iteration_s"])  # sequences, not prompts
    assert plan_main([*args, "--algorithm", "grpo", "--num_samples", "4"]) == 0
    table = capsys.readouterr().out
    assert "actor.train" in table and "critic." not in table
    assert plan_main([*args, "--algorithm", "grpo", "--num_samples", "4", "--critic", "gpt2-tiny"]) == 2
    assert "algorithm 'grpo' has no critic. Remove --critic" in capsys.readouterr().err
    assert plan_main([*args, "--algorithm", "grpo"]) == 2
    assert "Pass --num_samples 4" in capsys.readouterr().err


def test_workload_from_a_critic_free_module_and_its_profile(tmp_path):
    from lightning_app_rlhf.core.config import GenerationConfig, PPOConfig
    from lightning_app_rlhf.module import RLHFModule

    module = RLHFModule(
        actor={"config": DEMO},
        tokenizer="lightning_app_rlhf.demo:build_tokenizer",
        reward_fn="lightning_app_rlhf.demo.topic_reward",
        algorithm="grpo",
        generation=GenerationConfig(max_new_tokens=4, num_samples=2),
        ppo=PPOConfig(kl_coef=0.0, kl_loss_coef=0.04),
    )
    workload = workload_from_module(module, batch_size=8, prompt_length=4)
    assert workload.critic is None and workload.algorithm == "grpo" and workload.num_samples == 2
    assert workload.roles == module.algorithm.roles and workload.samples == 16
    profile = profile_workload(workload, batches=(1, 2), repeats=1, cache_dir=tmp_path)
    assert set(profile.ops) == {workload.actor.key}  # the reference has the actor's shape; no critic to measure
    assert set(profile.ops[workload.actor.key]) == {"forward", "train", "prefill", "decode", "optimizer"}
    result = plan_placement(cluster_from_environment(2, cores=2), workload, profile=profile, mcmc_steps=50)
    assert result.best.plan.roles == ("actor", "reference", "reward")


def test_the_search_prices_a_staleness_bound_only_when_allowed():
    """``max_staleness`` 0: on-policy plans only. Above 0: every plan whose training can run beside its generation
    (Separation's disjoint groups) is also priced at staleness 1, no slower than on-policy (the train calls leave
    the critical path); plans sharing ranks between generation and training are not. ``plan`` shows the column."""
    cluster = parse_cluster("1x4xcpu")
    on_policy = plan_placement(cluster, demo_workload(), search="presets")
    assert {c.plan.max_staleness for c in on_policy.candidates} == {0}
    allowed = plan_placement(cluster, demo_workload(), search="presets", max_staleness=2)
    stale = [c for c in allowed.candidates if c.plan.max_staleness]
    assert stale and {c.plan.max_staleness for c in stale} == {1}
    for candidate in stale:
        assert candidate.plan.name == "separation"
        fresh = on_policy.presets["separation"]
        assert candidate.estimate.iteration_s <= fresh.estimate.iteration_s
    result = run_cli("plan", "--cluster", "1x4xcpu", "--actor", "gpt2-tiny", "--search", "presets",
                     "--max_staleness", "1", timeout=120)
    assert "stale" in result.stdout


def reward_on_half_plan(world_size: int, wrapper: str = "ddp", roles: tuple[str, ...] = ROLE_NAMES) -> PlacementPlan:
    """A Flattening variant: every call on every rank but the reward model's forward, on the first half of the ranks
    (the reward model held by half the ranks, its forward not beside the other forwards' ranks)."""
    plan = flattening_plan(world_size, wrapper, roles=roles)
    calls = {**plan.calls, "reward.forward": tuple(range(world_size // 2))}
    return PlacementPlan(world_size, calls, plan.wrappers, name="reward_on_half")


def test_a_registered_preset_is_priced_by_the_planner_without_a_planner_edit():
    """One ``register_placement_preset`` call: ``plan_placement`` evaluates the new preset (its best wrapper and
    batches, as for the built-in ones) beside the built-in presets, whose prices do not change; below its
    ``min_world_size`` it is left out; an unknown preset name lists the registered ones."""
    cluster, workload = parse_cluster("1x8xA100-80GB"), llama_workload("llama-7b", wrappers=("ddp", "fsdp2"))
    before = plan_placement(cluster, workload, search="presets")
    register_placement_preset("reward_on_half", reward_on_half_plan, "reward on half the ranks", min_world_size=2)
    try:
        after = plan_placement(cluster, workload, search="presets")
        assert list(after.presets) == ["flattening", "interleaving", "separation", "reward_on_half"]
        mine = after.presets["reward_on_half"]
        assert mine.source == "preset" and mine.plan.name == "reward_on_half" and mine.estimate.fits
        assert mine.plan.ranks("reward.forward") == (0, 1, 2, 3) and mine.plan.ranks("actor.train") == tuple(range(8))
        assert mine.plan.wrappers["actor"] in ("ddp", "fsdp2") and mine.iteration_s > 0
        assert mine.plan.name in {c.plan.name for c in after.candidates}
        for name, candidate in before.presets.items():
            assert after.presets[name].to_dict() == candidate.to_dict()
        one_device = plan_placement(parse_cluster("1x1xcpu"), demo_workload(), search="presets")
        assert list(one_device.presets) == ["flattening"]
    finally:
        PLACEMENT_PRESETS.unregister("reward_on_half")
    assert list(plan_placement(cluster, workload, search="presets").presets) == list(before.presets)
    with pytest.raises(ValueError, match=r"must be one of \['flattening', 'interleaving', 'separation'\], got "
                                         r"'interleave'\. Did you mean 'interleaving'\?.*register_placement_preset"):
        placement_preset("interleave")
