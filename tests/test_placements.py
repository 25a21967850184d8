"""The three placements on 2 and 4 CPU processes (gloo), launched from the CLI as a user would."""

from __future__ import annotations

import subprocess

import pytest
from helpers import (
    ROOT,
    approx_or_none,
    cli_command,
    fit_demo,
    free_port,
    make_module,
    metrics_rows,
    one_thread_env,
    run_cli,
    run_python,
)

from lightning_app_rlhf.parallel.plan import flattening_plan, interleaving_plan, separation_plan

GRPO_CONFIG = ROOT / "examples/configs/demo_grpo_cpu.yaml"
STRATEGIES = ("rlhf_flattening", "rlhf_interleaving", "rlhf_separation")
COMPARED = ("reward/mean", "reward/std", "kl/mean", "policy/loss", "policy/clipfrac", "policy/approx_kl",
            "policy/entropy", "value/loss", "value/clipfrac", "response/length_mean")


# The default run covers PPO placements through tests/test_wrappers.py and GRPO ones below, on 2 and 4 processes.
@pytest.mark.parametrize("devices", [pytest.param(2, marks=pytest.mark.slow), pytest.param(4, marks=pytest.mark.slow)])
def test_placements_give_the_same_trajectory(tmp_path, devices):
    """Same seed and global batch: Flattening, Interleaving and Separation log the same values step by step."""
    logged = {s: fit_demo(tmp_path, f"{s}_{devices}", "--trainer.devices", str(devices), "--trainer.strategy", s)
              for s in STRATEGIES}
    runs = {s: [r for r in rows if "reward/mean" in r] for s, rows in logged.items()}
    reference = runs["rlhf_flattening"]
    assert [r["step"] for r in reference] == [0, 1, 2]
    for strategy, rows in runs.items():
        for step, (got, want) in enumerate(zip(rows, reference, strict=True)):
            for metric in COMPARED:
                assert got[metric] == pytest.approx(want[metric], rel=1e-4, abs=1e-6), (strategy, step, metric)
    # Only Separation has shadow copies to refresh: actor + critic trainable parameters, fp32.
    assert all(r["reallocate/bytes"] == 0 for r in runs["rlhf_flattening"] + runs["rlhf_interleaving"])
    assert all(r["reallocate/bytes"] > 1_000_000 for r in runs["rlhf_separation"])
    if devices == 4:  # (FSDP2 and ZeRO: tests/test_wrappers.py)
        check_memory_figures({s: next(r for r in rows if "memory/param_bytes_rank0" in r) for s, rows in logged.items()})


GRPO_COMPARED = ("reward/mean", "reward/std", "kl/mean", "policy/loss", "policy/clipfrac", "policy/approx_kl",
                 "policy/entropy", "policy/kl_loss", "response/length_mean")


GRPO_BATCH = ("--data.batch_size", "3", "--model.generation.num_samples", "4")


@pytest.fixture(scope="module")
def grpo_one_process(tmp_path_factory):
    """The GRPO demo on one process: the trajectory every placement must log."""
    return fit_demo(tmp_path_factory.mktemp("grpo"), "single", *GRPO_BATCH, config=GRPO_CONFIG)


@pytest.mark.parametrize("devices", [2, pytest.param(4, marks=pytest.mark.slow)])  # PPO covers 4 by default
def test_grpo_placements_give_the_same_trajectory_as_one_process(tmp_path, devices, grpo_one_process):
    """GRPO (G=4, no critic): 3 prompts x 4 samples, so on 2 and 4 ranks a prompt's group spans shards. Every
    placement logs the values of a single process step by step; under Separation only the actor's bytes move;
    no rank holds or prints a critic."""
    import yaml

    from lightning_app_rlhf.models.roles import as_model_spec, build_causal_lm

    common = GRPO_BATCH
    reference = [r for r in grpo_one_process if "reward/mean" in r]
    assert [r["step"] for r in reference] == [0, 1, 2]
    assert len({r["reward/mean"] for r in reference}) > 1 and all(r["policy/kl_loss"] > 0 for r in reference[1:])
    config = yaml.safe_load((ROOT / "examples/configs/demo_grpo_cpu.yaml").read_text())
    actor = sum(p.numel() for p in build_causal_lm(as_model_spec(config["model"]["actor"])).parameters()) * 4
    for strategy in STRATEGIES:
        rows = fit_demo(tmp_path, f"{strategy}_{devices}", *common, "--trainer.devices", str(devices),
                        "--trainer.strategy", strategy, config=GRPO_CONFIG)
        for step, (got, want) in enumerate(zip([r for r in rows if "reward/mean" in r], reference, strict=True)):
            for metric in GRPO_COMPARED:
                assert got[metric] == pytest.approx(want[metric], rel=1e-4, abs=1e-6), (strategy, step, metric)
            assert not any(key.startswith("value/") for key in got)
            # The train leader broadcasts the actor's fp32 weights to each shadow group once per update.
            assert got["reallocate/bytes"] == (actor if strategy == "rlhf_separation" else 0), (strategy, step)
        memory = next(r for r in rows if "memory/param_bytes_rank0" in r)
        holds_reference = {"rlhf_flattening": [1] * devices, "rlhf_separation": [1] * (devices // 2) + [0] * (devices // 2),
                           "rlhf_interleaving": [1] * (devices // 2) + [0] * (devices // 2)}[strategy]
        trains = [1] * devices if strategy != "rlhf_separation" else [0] * (devices // 2) + [1] * (devices // 2)
        for rank in range(devices):  # actor (trained copy or shadow) + reference; AdamW state only where it trains
            assert memory[f"memory/param_bytes_rank{rank}"] == actor * (1 + holds_reference[rank]), (strategy, rank)
            assert memory[f"memory/state_bytes_rank{rank}"] == 3 * actor * trains[rank], (strategy, rank)
        printed = (tmp_path / f"{strategy}_{devices}.out").read_text()
        assert "actor.train" in printed and "critic" not in printed


def check_memory_figures(memory_rows: dict[str, dict[str, float]]) -> None:
    """The logged per-rank bytes show each role only where the plan puts it (4 ranks, fp32, AdamW)."""
    import yaml

    from lightning_app_rlhf.models.roles import as_model_spec, build_causal_lm, build_critic

    config = yaml.safe_load((ROOT / "examples/configs/demo_cpu.yaml").read_text())
    spec = as_model_spec(config["model"]["actor"])
    actor = sum(p.numel() for p in build_causal_lm(spec).parameters()) * 4
    critic = sum(p.numel() for p in build_critic(spec).parameters()) * 4
    reference = actor  # the demo's reward is a function: no reward model bytes
    adam = 3  # gradient + two AdamW moments per trainable byte
    expected = {
        "rlhf_flattening": [(actor + critic + reference, adam * (actor + critic))] * 4,
        # reference on ranks 0-1, reward (a function) on ranks 2-3
        "rlhf_interleaving": [(actor + critic + reference, adam * (actor + critic))] * 2
        + [(actor + critic, adam * (actor + critic))] * 2,
        # generation ranks 0-1: shadows + reference, no optimizer state; training ranks 2-3: no reference
        "rlhf_separation": [(actor + critic + reference, 0)] * 2 + [(actor + critic, adam * (actor + critic))] * 2,
    }
    for strategy, memory in memory_rows.items():
        got = [(memory[f"memory/param_bytes_rank{r}"], memory[f"memory/state_bytes_rank{r}"]) for r in range(4)]
        assert got == expected[strategy], strategy


def test_plan_presets_assign_the_documented_ranks():
    """The presets put each call on the ranks the docs describe."""
    flat = flattening_plan(4)
    assert all(ranks == (0, 1, 2, 3) for ranks in flat.calls.values())
    inter = interleaving_plan(4, reference_ratio=0.25, reward_ratio=0.75)
    assert inter.ranks("reference.forward") == (0,) and inter.ranks("reward.forward") == (1, 2, 3)
    assert inter.ranks("actor.train") == (0, 1, 2, 3) and inter.shadow_ranks("actor") == ()
    sep = separation_plan(4, generation_ranks=[0, 1, 2], training_ranks=[3])
    assert sep.ranks("actor.generate") == (0, 1, 2) and sep.ranks("critic.train") == (3,)
    assert sep.shadow_ranks("actor") == (0, 1, 2) and not sep.holds("reference", 3)


@pytest.mark.parametrize("devices", [pytest.param(1, marks=pytest.mark.slow), 2])  # 2: shares and their sum too
def test_the_trainers_recomputed_logprobs_match_the_rollouts_in_fp32(tmp_path, devices):
    """ppo.recompute_old_logprobs with rollout_is tis: on one process, and on two under Flattening (each rank
    recomputes half the rollout, the group sums them), the trainer's log-probabilities equal the behaviour ones to
    float32 rounding (a row put back in the wrong place would differ by whole nats), so TIS weighs every token 1."""
    rows = fit_demo(tmp_path, "recompute", "--trainer.devices", str(devices), "--trainer.strategy",
                    "rlhf_flattening" if devices > 1 else "auto", "--model.ppo.recompute_old_logprobs", "true",
                    "--model.ppo.rollout_is", "tis")
    logged = [r for r in rows if "rollout/logprob_abs_diff_max" in r]
    assert len(logged) == 3
    for row in logged:
        assert row["rollout/logprob_abs_diff_max"] < 1e-5 and row["rollout/logprob_abs_diff_mean"] < 1e-6, row
        assert row["rollout/is_weight_mean"] == pytest.approx(1.0, abs=1e-5) and row["rollout/is_masked_frac"] == 0

def test_without_kl_no_reference_is_built_placed_or_run(tmp_path):
    """DAPO with both KL coefficients 0 on two processes under Interleaving: the plan has no reference call (the
    reward takes the first block of ranks), and the model summary, the placement summary and the memory rows that
    rank 0 prints name no reference: no rank builds or holds one. No kl/mean is logged (there is no KL to measure)."""
    rows = fit_demo(tmp_path, "noref", "--trainer.devices", "2", "--trainer.strategy", "rlhf_interleaving",
                    "--model.algorithm", "dapo", "--model.ppo.kl_loss_coef", "0",
                    config=ROOT / "examples/configs/demo_grpo_cpu.yaml", steps=2)
    printed = (tmp_path / "noref.out").read_text()
    assert "reward.forward" in printed and "Memory per rank" in printed and "reference" not in printed, printed
    logged = [r for r in rows if "reward/mean" in r]
    assert len(logged) == 2 and not any("kl/mean" in r for r in rows)
    memory = next(r for r in rows if "memory/param_bytes_rank1" in r)
    assert memory["memory/param_bytes_rank0"] == memory["memory/param_bytes_rank1"]  # the actor alone on each


def test_a_registered_preset_is_a_strategy_name_for_the_trainer_and_fabric():
    """``register_preset`` makes a plan builder a strategy name under both, and a placement preset the planner prices:
    each builds the builder's plan for the world size and the algorithm's roles (no critic calls for GRPO); the
    built-in names keep their typed classes."""
    from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_STRATEGY_REGISTRY
    from lightning.pytorch.strategies import StrategyRegistry

    from lightning_app_rlhf.core.role_table import ROLE_NAMES
    from lightning_app_rlhf.parallel.placement_presets import PLACEMENT_PRESETS, placement_preset
    from lightning_app_rlhf.strategies import (
        FabricPlacementStrategy,
        InterleavingStrategy,
        PlacementStrategy,
        register_preset,
    )

    def reference_apart(world_size: int, roles: tuple[str, ...] = ROLE_NAMES):
        return interleaving_plan(world_size, reference_ratio=0.25, reward_ratio=0.75, roles=roles)

    register_preset("rlhf_reference_apart", reference_apart, "reference on the first quarter of the ranks")
    try:
        trainer_side = StrategyRegistry.get("rlhf_reference_apart")
        fabric_side = FABRIC_STRATEGY_REGISTRY.get("rlhf_reference_apart")
        assert type(trainer_side) is PlacementStrategy and type(fabric_side) is FabricPlacementStrategy
        critic_free = ("actor", "reference", "reward")
        for plan in (trainer_side.build_plan(4), trainer_side.build_plan(4, roles=critic_free)):
            assert plan.ranks("reference.forward") == (0,) and plan.ranks("reward.forward") == (1, 2, 3)
        assert "critic.train" in trainer_side.build_plan(4).calls
        assert not any(call.startswith("critic") for call in trainer_side.build_plan(4, roles=critic_free).calls)
        assert fabric_side._plan(4, roles=critic_free) == reference_apart(4, roles=critic_free)
        assert placement_preset("reference_apart").build_plan is reference_apart
    finally:
        StrategyRegistry.remove("rlhf_reference_apart")
        FABRIC_STRATEGY_REGISTRY.remove("rlhf_reference_apart")
        PLACEMENT_PRESETS.unregister("reference_apart")
    assert type(StrategyRegistry.get("rlhf_interleaving")) is InterleavingStrategy
    with pytest.raises(ValueError, match="Name it 'rlhf_mine'"):
        register_preset("mine", reference_apart, "")


@pytest.mark.slow  # tests/test_faults.py kills a rank in every phase under every placement (2 cells by default)
def test_dead_rank_stops_the_others_with_a_clear_error(tmp_path):
    """Killing rank 2 of 4 ends every other rank with an error naming the failed call and its role, not a hang.

    The ranks are launched as torchrun or SLURM would, one process each with ``LOCAL_RANK`` set. Under Lightning's
    own launcher a watcher thread SIGKILLs all ranks within 5 s of a child's death, racing the ranks' own errors.
    """
    env = one_thread_env(tests=True, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="4",
                         NODE_RANK="0")
    command = cli_command("fit", "--config", ROOT / "examples/configs/demo_cpu.yaml", "--trainer.devices", "4",
                          "--trainer.strategy", "rlhf_separation", "--trainer.max_steps", "4",
                          "--trainer.enable_checkpointing", "false", "--trainer.logger.init_args.save_dir", tmp_path,
                          "--trainer.callbacks+=killrank_callback.KillRank", "--model.generation.max_new_tokens", "8")
    logs = [tmp_path / f"rank{rank}.err" for rank in range(4)]
    files = [log.open("w") for log in logs]
    ranks = [subprocess.Popen(command, cwd=tmp_path, env={**env, "LOCAL_RANK": str(rank)},
                              stdout=subprocess.DEVNULL, stderr=file) for rank, file in enumerate(files)]
    try:
        for proc in ranks:
            proc.wait(timeout=240)
    finally:
        for proc, file in zip(ranks, files):
            proc.kill()
            file.close()
    errors = [log.read_text() for log in logs]
    assert [proc.returncode for proc in ranks][2] == 17  # KillRank's exit code
    for rank in (0, 1, 3):
        assert ranks[rank].returncode != 0, errors[rank]
        expected = f"PlacementError: Rank {rank}: the gather of results of call 'actor.generate' (role 'actor'"
        assert expected in errors[rank], errors[rank][-3000:]
        assert "another rank died" in errors[rank]


def test_batches_too_small_for_the_groups_are_rejected():
    """Every rank of a call needs a sample, and every rank of a train call one per minibatch; errors name the fix."""
    from lightning_app_rlhf import PPOConfig
    from lightning_app_rlhf.parallel.placed_roles import PlacedRoles
    from lightning_app_rlhf.parallel.placement import Placement

    module = make_module(reward_fn=lambda p, r: [0.0] * len(p), ppo=PPOConfig(num_minibatches=2))
    module.placed_roles = PlacedRoles(Placement(flattening_plan(4)))
    module.engine.check_batch(8)  # 4 samples per minibatch: one per rank
    with pytest.raises(ValueError, match=r"batch_size / num_minibatches >= 4"):
        module.engine.check_batch(6)
    with pytest.raises(ValueError, match=r"raise data.batch_size to at least that"):
        module.engine.check_batch(2)


# Slow: the default run checks shadow digests after every update in test_wrappers.py (zero3-separation-4) and
# test_tensor_parallel.py (FSDP2 -> TP copies).
@pytest.mark.parametrize("wrapper", [pytest.param("ddp", marks=pytest.mark.slow),
                                     pytest.param("fsdp2", marks=pytest.mark.slow)])
def test_separation_shadows_equal_trained_weights_bit_for_bit(tmp_path, wrapper):
    """Under Separation (DDP or FSDP2 training on ranks 2-3), after every update the shadows on ranks 0-1 hold the
    trained actor and critic bytes exactly, and the weights change from one iteration to the next."""
    import json

    digests = tmp_path / "digests.json"
    run_cli("fit", "--config", ROOT / "examples/configs/demo_cpu.yaml",
            "--trainer.devices", "4", "--trainer.strategy", "lightning_app_rlhf.strategies.SeparationStrategy",
            "--trainer.strategy.wrapper", wrapper, "--trainer.max_steps", "3",
            "--trainer.enable_checkpointing", "false", "--trainer.logger.init_args.save_dir", tmp_path,
            "--trainer.callbacks+=weight_check_callback.WeightCopiesEqual",
            f"--trainer.callbacks.path={digests}", "--model.generation.max_new_tokens", "8",
            cwd=tmp_path, timeout=240, env=one_thread_env(tests=True))
    records = json.loads(digests.read_text())
    assert len(records) == 3
    for ranks in records:
        for role in ("actor", "critic"):
            assert len({r[role] for r in ranks}) == 1, role  # generation shadows == trained copies
    assert len({ranks[0]["actor"] for ranks in records}) == 3  # the weights moved every iteration


OVERLAP = ("lightning_app_rlhf.strategies.SeparationStrategy", "--trainer.strategy.overlap", "true")
STALENESS_2 = ("lightning_app_rlhf.strategies.SeparationStrategy", "--trainer.strategy.max_staleness", "2")
FREE_RUNNING = ("lightning_app_rlhf.strategies.SeparationStrategy", "--trainer.strategy.free_running", "true")


@pytest.mark.parametrize("strategy,devices", [
    pytest.param(("auto",), 1, marks=pytest.mark.slow),  # one process: tests/test_checkpoint_safety.py resumes too
    *(pytest.param((s,), 2, marks=pytest.mark.slow) for s in STRATEGIES[:2]),  # Separation restores the most
    (("rlhf_separation",), 2),
    pytest.param(OVERLAP, 2, marks=pytest.mark.slow),  # overlap: test_separation_overlap_trains_one_step_behind
    # The step-2 checkpoint holds a queue of two rollouts, the first trained on at step 2 (SIGTERM mid-queue: slow too).
    pytest.param(STALENESS_2, 2, marks=pytest.mark.slow),
    # Free-running without staleness is deterministic: the version and the update it logs with the next rollout.
    (FREE_RUNNING, 2),
])
def test_resumed_run_logs_what_the_uninterrupted_run_logged(tmp_path, strategy, devices):
    """Kill-and-resume: a run resumed from its step-2 checkpoint logs the same values at steps 2 and 3 as the
    uninterrupted run (weights, optimizers, adaptive KL, reward statistics, data position and, with a staleness
    bound, the queue of pending rollouts and the policy version all restored; free-running, the version and the
    statistics of the update that made the saved weights)."""
    common = ["--trainer.devices", str(devices), "--trainer.strategy", *strategy, "--trainer.enable_checkpointing", "true",
              "--model.ppo.kl_target", "1.0", "--model.ppo.kl_horizon", "100", "--model.ppo.reward_norm", "true",
              "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
              f"--trainer.callbacks.dirpath={tmp_path / 'ckpt'}", "--trainer.callbacks.every_n_train_steps=2",
              "--trainer.callbacks.save_top_k=-1", "--trainer.callbacks.filename={step}"]
    full = [r for r in fit_demo(tmp_path, "full", *common, steps=4) if "reward/mean" in r]
    (checkpoint,) = (tmp_path / "ckpt").glob("step=2*.ckpt")
    resumed = [r for r in fit_demo(tmp_path, "resumed", *common, "--ckpt_path", str(checkpoint), steps=4)
               if "reward/mean" in r]
    assert [r["step"] for r in resumed] == [2, 3]
    for got, want in zip(resumed, full[2:], strict=True):
        for metric in (*COMPARED, "kl/coef", "rollout/staleness_max", "rollout/policy_version"):
            assert got.get(metric) == approx_or_none(want.get(metric), rel=1e-5, abs=1e-7), (metric, got["step"])


@pytest.mark.slow  # each placement's own resume is in the default run
def test_a_one_process_checkpoint_resumes_under_separation_on_2_processes(tmp_path):
    """A checkpoint saved without a placement strategy (every role whole, one optimizer list) resumes under
    Separation, whose ranks each hold a share of the roles: it logs what the uninterrupted one-process run logged."""
    save = ["--trainer.enable_checkpointing", "true", "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
            f"--trainer.callbacks.dirpath={tmp_path / 'ckpt'}", "--trainer.callbacks.every_n_train_steps=2",
            "--trainer.callbacks.save_top_k=-1", "--trainer.callbacks.filename={step}"]
    full = [r for r in fit_demo(tmp_path, "full", *save, steps=4) if "reward/mean" in r]
    (checkpoint,) = (tmp_path / "ckpt").glob("step=2*.ckpt")
    resumed = [r for r in fit_demo(tmp_path, "resumed", "--trainer.devices", "2", "--trainer.strategy",
                                   "rlhf_separation", "--ckpt_path", str(checkpoint), steps=4) if "reward/mean" in r]
    assert [r["step"] for r in resumed] == [2, 3]
    for got, want in zip(resumed, full[2:], strict=True):
        for metric in COMPARED:
            assert got.get(metric) == approx_or_none(want.get(metric), rel=1e-4, abs=1e-6), (metric, got["step"])


@pytest.mark.slow  # Fabric runs Separation and resumes exactly in test_fabric_checkpoint (default run)
def test_fabric_example_matches_the_trainer(tmp_path):
    """examples/fabric_demo.py under Fabric's rlhf_* strategies logs what the Trainer logs for the same settings."""
    trainer_rows = [r for r in fit_demo(tmp_path, "trainer", "--trainer.devices", "2", "--trainer.strategy",
                                        "rlhf_flattening") if "reward/mean" in r]
    for strategy in ("rlhf_separation", "rlhf_interleaving"):
        result = run_python(ROOT / "examples/fabric_demo.py", "--strategy", strategy, "--devices", "2",
                            "--steps", "3", "--max-new-tokens", "12", "--log-dir", tmp_path / "fabric", cwd=tmp_path)
        assert f"{strategy} on 2 processes, 3 PPO iterations" in result.stdout
        rows = metrics_rows(tmp_path / "fabric" / f"fabric_{strategy}")
        assert [r["step"] for r in rows] == [0, 1, 2]
        for got, want in zip(rows, trainer_rows, strict=True):
            for metric in COMPARED:
                assert got[metric] == pytest.approx(want[metric], rel=1e-4, abs=1e-6), (strategy, metric)


@pytest.mark.parametrize("steps,flush_every", [
    (3, 2),  # the default run: past a flush of the CSV log, which empties its list of metrics
    pytest.param(101, 100, marks=pytest.mark.slow),  # the example's defaults, past its 100th iteration
])
def test_fabric_example_runs_past_a_flush_of_its_log(tmp_path, steps, flush_every):
    """examples/fabric_demo.py reads each iteration's reward from the module, not from the CSV logger's list of
    metrics, which the logger empties whenever it writes to disk: it crashed after 100 iterations."""
    result = run_python(ROOT / "examples/fabric_demo.py", "--devices", "1", "--steps", str(steps), "--batch-size", "4",
                        "--max-new-tokens", "2", "--flush-logs-every", str(flush_every), "--log-dir", tmp_path,
                        cwd=tmp_path, timeout=900)
    assert f"rlhf_flattening on 1 processes, {steps} PPO iterations: reward/mean" in result.stdout
    rows = metrics_rows(tmp_path / "fabric_rlhf_flattening")
    assert [r["step"] for r in rows] == list(range(steps))
    first = sum(r["reward/mean"] for r in rows[:min(10, steps // 2 or 1)]) / min(10, steps // 2 or 1)
    assert f"reward/mean {first:.3f} ->" in result.stdout  # the summary's figures are the logged ones


def test_separation_overlap_trains_one_step_behind(tmp_path):
    """overlap=True: iteration k trains on the rollout of k-1 (staleness 1), generated with the weights on-policy
    training had then; the first rollout and the first update equal the on-policy run's."""
    on_policy = [r for r in fit_demo(tmp_path, "onpolicy", "--trainer.devices", "2", "--trainer.strategy",
                                     "rlhf_separation") if "reward/mean" in r]
    overlap = [r for r in fit_demo(tmp_path, "overlap", "--trainer.devices", "2", "--trainer.strategy",
                                   "lightning_app_rlhf.strategies.SeparationStrategy",
                                   "--trainer.strategy.overlap", "true") if "reward/mean" in r]
    # The first iteration trains nothing; the first update trains on weights of version 0 too; then 1 version old.
    assert [r.get("rollout/staleness_max") for r in overlap] == [None, 0, 1]
    assert "policy/loss" not in overlap[0]  # nothing to train on yet
    assert overlap[0]["reward/mean"] == pytest.approx(on_policy[0]["reward/mean"])
    # Iteration 1 updates on iteration 0's rollout, exactly as the on-policy run did at iteration 0.
    for metric in ("policy/loss", "policy/entropy", "value/loss"):
        assert overlap[1][metric] == pytest.approx(on_policy[0][metric], rel=1e-5), metric


ONE_RANK_CALLS = "{" + ", ".join(f"{call}: [0]" for call in ("actor.generate", "reference.forward", "reward.forward",
                                                             "critic.forward", "actor.train", "critic.train")) + "}"
"""Every call of the PPO demo on rank 0: the single-process simulation of any schedule."""


@pytest.mark.slow  # the default run: staleness 1 (overlap) and free-running resumes above, 4 processes elsewhere
def test_a_staleness_bound_of_2_on_4_processes_logs_the_single_process_simulation(tmp_path):
    """``max_staleness=2``: iterations 0-1 only generate; from iteration 2 on each update trains on the rollout of two
    iterations earlier, generated by weights two versions old once two updates have happened. Separation on 4 processes (generation and
    training on disjoint groups, side by side) logs what one process running the same schedule step after step
    logs, and its first update is the on-policy run's first update."""
    steps = ("--trainer.max_steps", "5")
    separation = [r for r in fit_demo(tmp_path, "separation_k2", "--trainer.devices", "4", "--trainer.strategy",
                                      "lightning_app_rlhf.strategies.SeparationStrategy",
                                      "--trainer.strategy.max_staleness", "2", *steps) if "reward/mean" in r]
    simulation = [r for r in fit_demo(tmp_path, "one_process_k2", "--trainer.strategy",
                                      "lightning_app_rlhf.PlacementStrategy", "--trainer.strategy.plan.world_size", "1",
                                      "--trainer.strategy.plan.calls", ONE_RANK_CALLS,
                                      "--trainer.strategy.plan.max_staleness", "2", *steps) if "reward/mean" in r]
    on_policy = [r for r in fit_demo(tmp_path, "on_policy", steps=1) if "reward/mean" in r]
    # Versions behind: the first updates train on rollouts of version 0 (no update had happened), then exactly 2.
    assert [r.get("rollout/staleness_max") for r in separation] == [None, None, 0, 1, 2]
    assert [r.get("rollout/staleness_mean") for r in simulation] == [None, None, 0, 1, 2]
    for step, (got, want) in enumerate(zip(separation, simulation, strict=True)):
        for metric in COMPARED:
            assert got.get(metric) == approx_or_none(want.get(metric), rel=1e-4, abs=1e-6), (step, metric)
    for metric in ("reward/mean", "policy/loss", "policy/entropy", "value/loss"):
        want = on_policy[0][metric]
        got = separation[0 if metric == "reward/mean" else 2][metric]  # rollout 0, and the update on it
        assert got == pytest.approx(want, rel=1e-5), metric


def test_a_queue_of_stale_rollouts_longer_than_the_bound_is_refused_on_resume():
    """A checkpoint saved with ``max_staleness`` 2 holds two rollouts not trained on yet: resumed on-policy they
    would be dropped (or trained on beyond the bound), so the resume stops naming the setting that fits."""
    from lightning_app_rlhf.checkpoint.format import CheckpointError
    from lightning_app_rlhf.module_checkpoint import RLHF_STATE_KEY, load_rlhf_state

    module = make_module()
    module.configure_model()
    state = {"pending_experiences": [{}, {}], "policy_version": 0, **module.shaping.state_dict(),
             "seed": module.seed, "algorithm": module.algorithm.name}
    with pytest.raises(CheckpointError, match=r"holds 2 scored rollouts not trained on yet .* this run's plan allows "
                                              r"\(0\)\. Resume with SeparationStrategy\(max_staleness=2\)"):
        load_rlhf_state(module, {RLHF_STATE_KEY: state}, "step=2.ckpt")
