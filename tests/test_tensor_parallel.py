"""Tensor parallelism per call (``PlacementPlan.tp``) and reallocation between layouts, on 4 CPU processes (gloo).

A call with degree 2 on 4 ranks runs as 2 replicas of a 2-way DTensor tensor-parallel copy (the Llama family's own
``tp_plan``); the trained weights are redistributed into that copy after every update.
"""

from __future__ import annotations

import csv
import hashlib
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import ROOT, fit_demo, one_thread_env, run_python, run_ranks
from lightning.pytorch.callbacks import Callback

from lightning_app_rlhf.parallel.placed_roles import PlacedRoles
from lightning_app_rlhf.parallel.plan import PlacementPlan, flattening_plan
from lightning_app_rlhf.parallel.tensor_parallel import check_tensor_parallel

CONFIG = ROOT / "examples/configs/demo_tp_cpu.yaml"
COMPARED = ("reward/mean", "reward/std", "kl/mean", "policy/loss", "policy/clipfrac", "policy/approx_kl",
            "policy/entropy", "value/loss", "value/clipfrac", "response/length_mean")
TINY_LLAMA = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 64,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 64,
              "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}


def tp_plan(world_size: int = 4, wrapper: str = "ddp", **tp: int) -> PlacementPlan:
    """Flattening's calls with tensor-parallel degrees (``actor_generate=2`` -> ``{"actor.generate": 2}``)."""
    flat = flattening_plan(world_size, wrapper)
    return PlacementPlan(world_size, flat.calls, flat.wrappers, name="tp",
                         tp={call.replace("_", "."): degree for call, degree in tp.items()})


# ---- validation ----


def test_unsupported_degrees_are_refused_naming_the_fix():
    with pytest.raises(ValueError, match=r"'actor.train' has tensor-parallel degree 2 with wrapper 'ddp': .* Set "
                                         r"wrappers: \{actor: fsdp2\}"):
        check_tensor_parallel(tp_plan(actor_train=2))
    with pytest.raises(ValueError, match=r"'actor.train' trains tensor-parallel .* 'actor.generate' runs there without "
                                         r"a degree. Give 'actor.generate' a tensor-parallel degree too"):
        check_tensor_parallel(tp_plan(wrapper="fsdp2", actor_train=2))
    check_tensor_parallel(tp_plan(wrapper="fsdp2", actor_train=2, actor_generate=2, critic_train=4,
                                  critic_forward=2))
    with pytest.raises(ValueError, match=r"degree must divide the call's group size \(\[1, 2, 4\]\)"):
        tp_plan(actor_generate=3)
    check_tensor_parallel(tp_plan(actor_generate=2, critic_forward=4, reference_forward=2))


def test_the_plan_names_the_calls_that_take_a_layout_reallocation():
    """A call of a trainable role with a degree, on its train ranks, runs on a copy refreshed after every update;
    frozen roles' copies never change, and calls without a degree run on the role's own module."""
    plan = tp_plan(actor_generate=2, reference_forward=2)
    assert plan.layout_reallocations() == ("actor.generate",)
    assert flattening_plan(4).layout_reallocations() == ()
    trained = tp_plan(wrapper="fsdp2", actor_train=2, actor_generate=2, critic_forward=4)
    assert trained.layout_reallocations() == ("actor.generate", "critic.forward")


def test_families_without_a_tp_plan_and_uneven_heads_are_refused(tiny_gpt2_config):
    from lightning_app_rlhf.models.roles import as_model_spec, build_causal_lm
    from lightning_app_rlhf.parallel.tensor_parallel import family_tp_plan

    gpt2 = build_causal_lm(as_model_spec({"config": tiny_gpt2_config}))
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel \(gpt2\) has no tp_plan in transformers: use a family"):
        family_tp_plan(gpt2, 2, "actor.generate")
    llama = build_causal_lm(as_model_spec({"config": {**TINY_LLAMA, "num_key_value_heads": 1}}))
    with pytest.raises(ValueError, match=r"does not divide the model's num_key_value_heads=1"):
        family_tp_plan(llama, 2, "actor.generate")


# ---- the engine's pieces on 4 processes: TP copies against whole models ----


def _four_ranks(rank: int, port: int, out: str) -> None:
    from lightning_app_rlhf.core.config import GenerationConfig
    from lightning_app_rlhf.engine.engine import RLHFEngine
    from lightning_app_rlhf.generation import generate, sample_keys
    from lightning_app_rlhf.models.calls import critic_forward, reference_forward, reward_forward
    from lightning_app_rlhf.models.roles import (
        as_model_spec,
        build_causal_lm,
        build_critic,
        build_reference,
        build_reward_model,
    )
    from lightning_app_rlhf.parallel.placement import TensorSpec, create_placement
    from lightning_app_rlhf.parallel.tensor_parallel import TensorParallelCopy

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=4)
    plan = tp_plan(actor_generate=2, reference_forward=2, critic_forward=2, reward_forward=2)
    placement = create_placement(plan, rank, torch.device("cpu"))
    spec = as_model_spec({"config": TINY_LLAMA})
    actor, critic = build_causal_lm(spec), build_critic(spec)
    reference = build_reference(actor, None)
    roles = {"actor": actor, "reference": reference, "critic": critic, "reward": build_reward_model(spec, 0)}
    placed = PlacedRoles(placement)
    copies = placed.tp_copies
    for call in plan.tp:
        copies[call] = TensorParallelCopy.build(call, roles[call.split(".")[0]], placement.tp_group(call), 2,
                                                torch.device("cpu"))
    # Train actor and critic "one step" (noise; the critic's value head starts at zero), so the copies must take
    # the new weights: bit for bit, each rank its slice.
    with torch.no_grad():
        generator = torch.Generator().manual_seed(1)
        for p in (*actor.parameters(), *critic.parameters()):
            p.add_(0.02 * torch.randn(p.shape, generator=generator))
    written = copies["actor.generate"].load([p for p in actor.parameters()])
    exact = all(torch.equal(a, b) for a, b in zip(copies["actor.generate"].full_parameters(), actor.parameters()))
    copies["critic.forward"].load([p for p in critic.parameters() if p.requires_grad])

    generator = torch.Generator().manual_seed(2)
    batch = 8
    input_ids = torch.randint(3, 512, (batch, 6), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[::3, :2] = 0  # some left padding
    input_ids[attention_mask == 0] = 0
    config = GenerationConfig(max_new_tokens=10)
    keys = sample_keys(7, 0, torch.arange(batch))
    whole = generate(actor, input_ids, attention_mask, config, keys, eos_token_id=2, pad_token_id=0)
    rows = placement.shard("actor.generate", batch)
    part = generate(copies["actor.generate"].module, input_ids[rows], attention_mask[rows], config, keys[rows],
                    eos_token_id=2, pad_token_id=0, lockstep_group=placement.tp_group("actor.generate"))
    specs = {"responses": TensorSpec(torch.long, 2), "logprobs": TensorSpec(torch.float32, 2)}
    gathered = placement.gather_to_world("actor.generate", {"responses": part.responses, "logprobs": part.logprobs},
                                         specs)
    # The static backend on the same copy: its cache is laid out for the rank's local heads.
    part = generate(copies["actor.generate"].module, input_ids[rows], attention_mask[rows],
                    replace(config, backend="static"), keys[rows], eos_token_id=2, pad_token_id=0,
                    lockstep_group=placement.tp_group("actor.generate"))
    static = placement.gather_to_world("actor.generate", {"responses": part.responses, "logprobs": part.logprobs},
                                       specs)
    width = whole.responses.shape[1]
    scored = {}
    for role, forward in (("reference", reference_forward), ("critic", critic_forward), ("reward", reward_forward)):
        call = role + ".forward"
        args = {"reference": (1.0,), "critic": (), "reward": (None,)}[role]
        full = forward(roles[role], whole, *args)
        mine = forward(copies[call].module, whole.select(placement.shard(call, batch)), *args,
                       lockstep_group=placement.tp_group(call))
        got = placement.gather_to_world(call, {"out": mine}, {"out": TensorSpec(torch.float32, full.dim())})["out"]
        scored[role] = (got[..., : full.shape[-1]] - full).abs().max().item()
    # The engine picks the copy for the call (and its replica's group as the lockstep group).
    engine = RLHFEngine(placed, None, config, None, None, None, roles.get, None, seed=7)  # type: ignore[arg-type]
    picked = engine.calls.call_module("actor") is copies["actor.generate"].module
    lockstep = engine.calls.lockstep_group("actor") is placement.tp_group("actor.generate")
    result = {
        "rows": [rows.start, rows.stop],
        "leaders": list(placement.replica_leaders("actor.generate")),
        "tokens_equal": torch.equal(gathered["responses"][:, :width], whole.responses),
        "logprob_diff": (gathered["logprobs"][:, :width] - whole.logprobs).abs().max().item(),
        "static_tokens_equal": torch.equal(static["responses"][:, :width], whole.responses),
        "static_logprob_diff": (static["logprobs"][:, :width] - whole.logprobs).abs().max().item(),
        "reference_diff": scored["reference"], "critic_diff": scored["critic"], "reward_diff": scored["reward"],
        "exact": exact, "written": written, "actor_bytes": sum(p.numel() * 4 for p in actor.parameters()),
        "picked": picked, "lockstep": lockstep,
    }
    dist.destroy_process_group()
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))


DIFFERENCES = ("logprob_diff", "static_logprob_diff", "reference_diff", "critic_diff", "reward_diff")


def test_tp_copies_generate_and_score_like_whole_models(tmp_path):
    """4 ranks, degree 2: ranks 0-1 and 2-3 each generate rows 0-3 / 4-7 together; gathered once per replica, the
    tokens (``eager`` and ``static`` backends) equal the whole actor's and the log-probabilities, reference log-probabilities and critic values agree to
    float tolerance, and so do the reward model's scores. A copy takes new trained weights bit for bit, each rank
    writing only its slice."""
    run_ranks(_four_ranks, 4, str(tmp_path), timeout=180)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    assert [r["rows"] for r in ranks] == [[0, 4], [0, 4], [4, 8], [4, 8]]
    assert all(r["leaders"] == [0, 2] for r in ranks)
    for r in ranks:
        assert r["tokens_equal"] and r["static_tokens_equal"] and r["exact"] and r["picked"] and r["lockstep"], r
        assert max(r[key] for key in DIFFERENCES) < 1e-5, r
        # Embedding, projections and head are split in two; only the norms are whole on both ranks.
        assert 0.5 * r["actor_bytes"] < r["written"] < 0.52 * r["actor_bytes"], r
    print({key: max(r[key] for r in ranks) for key in DIFFERENCES})


# ---- the demo through the CLI: TP generation with DP training against Flattening ----


def run_demo(tmp_path: Path, name: str, *args: str, steps: int = 3) -> list[dict[str, float]]:
    """The TP demo config for a few iterations (the logged rows that carry ``reward/mean``)."""
    rows = fit_demo(tmp_path, name, "--trainer.check_val_every_n_epoch", "1000", *args, config=CONFIG, steps=steps,
                    timeout=400, env=one_thread_env(tests=True))
    return [r for r in rows if "reward/mean" in r]


@pytest.fixture(scope="module")
def flattening(tmp_path_factory):
    """The TP demo's model under Flattening (DDP, every call on every rank, no tensor parallelism)."""
    return run_demo(tmp_path_factory.mktemp("flat"), "flat", "--trainer.strategy", "rlhf_flattening")


def assert_same_trajectory(rows: list[dict[str, float]], reference: list[dict[str, float]]) -> float:
    """Every compared metric of every step within float tolerance; returns the largest absolute difference."""
    assert [r["step"] for r in reference] == [0, 1, 2]
    largest = 0.0
    for step, (got, want) in enumerate(zip(rows, reference, strict=True)):
        for metric in COMPARED:
            assert got[metric] == pytest.approx(want[metric], rel=1e-4, abs=1e-6), (step, metric)
            largest = max(largest, abs(got[metric] - want[metric]))
    return largest


def test_tp2_generation_with_ddp_training_follows_flattening(tmp_path, flattening):
    """Done when: the demo (Llama-style, random init) with TP=2 generation and DDP training on 4 CPU processes logs
    Flattening's trajectory within float tolerance. DDP ranks hold the whole actor, so each cuts its slice locally:
    no byte crosses ranks."""
    rows = run_demo(tmp_path, "tp")
    print("max abs difference vs flattening:", assert_same_trajectory(rows, flattening))
    assert all(r["reallocate/bytes"] == 0 for r in rows)
    # The logged parameter bytes count the copy: actor, reference and critic whole, plus half the actor (its
    # projections, embedding and head cut in two) and its norms whole.
    import yaml

    from lightning_app_rlhf.models.roles import as_model_spec, build_causal_lm, build_critic

    spec = as_model_spec(yaml.safe_load(CONFIG.read_text())["model"]["actor"])
    actor, critic = (sum(p.numel() * 4 for p in m.parameters()) for m in (build_causal_lm(spec), build_critic(spec)))
    (metrics,) = (tmp_path / "tp").rglob("metrics.csv")
    logged = next(float(r["memory/param_bytes_rank0"]) for r in csv.DictReader(metrics.open())
                  if r.get("memory/param_bytes_rank0"))
    assert 0.5 * actor < logged - (2 * actor + critic) < 0.52 * actor, (logged, actor, critic)


def _digest(tensors) -> str:
    sha = hashlib.sha256()
    for t in tensors:
        sha.update(t.detach().contiguous().numpy().tobytes())
    return sha.hexdigest()


class LayoutCheck(Callback):
    """After every iteration: a SHA-256 of each trained role's full weights in its training layout (gathered
    through its wrapper) and in each tensor-parallel copy (gathered over the replica), per rank; rank 0 writes them
    to ``path``. Frozen roles' copies are checked against their whole module."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.records: list = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        mine = {}
        for call, copy in pl_module.placed_roles.tp_copies.items():
            role = call.split(".")[0]
            wrapper = pl_module.placed_roles.wrappers.get(role)
            if wrapper is not None:
                trained = _digest(p for bucket in wrapper.full_parameter_buckets() for p in bucket)
                tp = _digest(copy.full_parameters())
            else:
                trained = _digest(pl_module.role_module(role).parameters())
                tp = _digest(p.full_tensor() if hasattr(p, "full_tensor") else p for p in copy.module.parameters())
            mine[call] = [trained, tp]
        everyone = [None] * trainer.world_size
        dist.all_gather_object(everyone, mine)
        self.records.append(everyone)

    def on_fit_end(self, trainer, pl_module) -> None:
        if trainer.is_global_zero:
            Path(self.path).write_text(json.dumps(self.records))


def test_fsdp2_training_layout_reallocates_bit_exactly_into_tp_layouts(tmp_path, flattening):
    """Done when: reallocation from an FSDP2 training layout (4 ranks) into TP=2 layouts (actor.generate, and the
    critic's and reference's scoring forwards) is bit-exact after every update; the bytes each rank receives (the
    all-gather of the 3/4 of each role it does not keep) are logged in ``reallocate/bytes``; the trajectory is
    Flattening's."""
    from lightning_app_rlhf.models.roles import as_model_spec, build_causal_lm, build_critic
    from lightning_app_rlhf.parallel.wrappers import FSDP2Wrapper

    digests = tmp_path / "digests.json"
    plan = "{actor.generate: 2, critic.forward: 2, reference.forward: 2}"
    rows = run_demo(tmp_path, "fsdp2", "--trainer.strategy.plan.wrappers", "{actor: fsdp2, critic: fsdp2}",
                    "--trainer.strategy.plan.tp", plan, "--trainer.callbacks+=test_tensor_parallel.LayoutCheck",
                    f"--trainer.callbacks.path={digests}")
    print("max abs difference vs flattening:", assert_same_trajectory(rows, flattening))
    records = json.loads(digests.read_text())
    assert len(records) == 3
    for ranks in records:
        for call in ("actor.generate", "critic.forward", "reference.forward"):
            assert len({digest for rank in ranks for digest in rank[call]}) == 1, call  # every copy, every rank
    assert len({ranks[0]["actor.generate"][0] for ranks in records}) == 3  # the weights moved every iteration
    import yaml

    spec = as_model_spec(yaml.safe_load(CONFIG.read_text())["model"]["actor"])
    received = sum((p.numel() - FSDP2Wrapper.local_numel(tuple(p.shape), 4, 0)) * 4
                   for model in (build_causal_lm(spec), build_critic(spec)) for p in model.parameters())
    assert all(r["reallocate/bytes"] == received for r in rows), (received, [r["reallocate/bytes"] for r in rows])


@pytest.mark.slow  # DP x TP training; the default run covers TP generation and the FSDP2 -> TP reallocation
def test_tp2_training_on_a_data_by_tensor_mesh_follows_flattening(tmp_path, flattening):
    """Actor and critic train on a 2 x 2 mesh (FSDP2 over the 2 replicas, each a 2-way tensor-parallel cut); their
    generate / forward calls run on TP=2 copies refreshed bit for bit after every update; the trajectory is
    Flattening's within float tolerance. Each rank keeps a quarter of each role, so it receives 3/4 of it."""
    from torch.distributed.fsdp import fully_shard  # noqa: F401  (FSDP2 present)

    from lightning_app_rlhf.models.roles import as_model_spec, build_causal_lm, build_critic

    digests = tmp_path / "digests.json"
    plan = "{actor.train: 2, critic.train: 2, actor.generate: 2, critic.forward: 2}"
    rows = run_demo(tmp_path, "tp_train", "--trainer.strategy.plan.wrappers", "{actor: fsdp2, critic: fsdp2}",
                    "--trainer.strategy.plan.tp", plan, "--trainer.callbacks+=test_tensor_parallel.LayoutCheck",
                    f"--trainer.callbacks.path={digests}")
    print("max abs difference vs flattening:", assert_same_trajectory(rows, flattening))
    for ranks in json.loads(digests.read_text()):
        assert all(set(rank) == {"actor.generate", "critic.forward"} for rank in ranks)  # train calls: no copy
        for call in ("actor.generate", "critic.forward"):
            assert len({digest for rank in ranks for digest in rank[call]}) == 1, call
    import yaml

    spec = as_model_spec(yaml.safe_load(CONFIG.read_text())["model"]["actor"])
    whole = sum(p.numel() * 4 for model in (build_causal_lm(spec), build_critic(spec)) for p in model.parameters())
    assert all(0.70 * whole < r["reallocate/bytes"] < 0.75 * whole for r in rows), whole


@pytest.mark.slow  # 2 x 4 iterations on 4 processes; the default run resumes sharded (FSDP2, ZeRO-3) roles
def test_a_data_by_tensor_mesh_run_resumes_exactly_from_its_checkpoint(tmp_path):
    """Actor and critic train on the 2 x 2 mesh and generate / score on TP=2 copies; the step-2 checkpoint (each rank
    writing its DCP shards of the 2-D DTensors) resumes a run that logs what the uninterrupted run logged at steps 2
    and 3, and the resumed copies take the restored weights."""
    common = ("--trainer.strategy.plan.wrappers", "{actor: fsdp2, critic: fsdp2}", "--trainer.strategy.plan.tp",
              "{actor.train: 2, critic.train: 2, actor.generate: 2, critic.forward: 2}",
              "--trainer.enable_checkpointing", "true",
              "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
              f"--trainer.callbacks.dirpath={tmp_path / 'ckpt'}", "--trainer.callbacks.every_n_train_steps=2",
              "--trainer.callbacks.save_top_k=-1", "--trainer.callbacks.filename={step}")
    full = run_demo(tmp_path, "full", *common, steps=4)
    (checkpoint,) = (tmp_path / "ckpt").glob("step=2*")
    resumed = run_demo(tmp_path, "resumed", *common, "--ckpt_path", str(checkpoint), steps=4)
    assert [r["step"] for r in full] == [0, 1, 2, 3] and [r["step"] for r in resumed] == [2, 3]
    for got, want in zip(resumed, full[2:], strict=True):
        for metric in COMPARED:
            assert got[metric] == pytest.approx(want[metric], rel=1e-5, abs=1e-7), (metric, got["step"])


@pytest.mark.slow  # the Trainer runs the same set-up code in the default run
def test_fabric_with_tp_copies_follows_fabric_flattening(tmp_path):
    """Fabric's placement strategy builds and refreshes TP=2 copies (actor.generate, critic.forward) as the Trainer's
    does: 3 iterations log Flattening's values."""
    runs = {}
    for mode in ("flat", "tp"):
        result = run_python(ROOT / "tests/fabric_tp_run.py", mode, tmp_path, cwd=tmp_path, timeout=400)
        runs[mode] = json.loads(next(line for line in result.stdout.splitlines() if line.startswith("ROWS "))[5:])
    assert len(runs["tp"]) == len(runs["flat"]) == 3
    for got, want in zip(runs["tp"], runs["flat"], strict=True):
        assert got.keys() == want.keys()
        for metric in got:
            assert got[metric] == pytest.approx(want[metric], rel=1e-4, abs=1e-6), metric


@pytest.mark.slow
def test_tp2_generation_on_separations_shadows_follows_flattening(tmp_path, flattening):
    """Separation: ranks 0-1 generate and score on shadows cut TP=2 (actor and critic), ranks 2-3 train with FSDP2.
    After every update the train leader broadcasts the weights to the shadows, which refresh their copies locally;
    the trajectory is Flattening's."""
    calls = ("{actor.generate: [0, 1], reference.forward: [0, 1], reward.forward: [0, 1], critic.forward: [0, 1], "
             "actor.train: [2, 3], critic.train: [2, 3]}")
    rows = run_demo(tmp_path, "sep", "--trainer.strategy.plan.calls", calls, "--trainer.strategy.plan.wrappers",
                    "{actor: fsdp2, critic: fsdp2}", "--trainer.strategy.plan.tp",
                    "{actor.generate: 2, critic.forward: 2}")
    print("max abs difference vs flattening:", assert_same_trajectory(rows, flattening))
    assert all(r["reallocate/bytes"] > 0 for r in rows)  # rank 0 is a shadow: it receives both roles

