"""Bad placement plans fail up front, before any model is built, with errors that name the fix."""

from __future__ import annotations

import json
import sys

import pytest
from helpers import ROOT, forked_ranks, make_module, run_cli

from lightning_app_rlhf.parallel.plan import (
    CALLS,
    PlacementPlan,
    flattening_plan,
    interleaving_plan,
    separation_plan,
)
from lightning_app_rlhf.strategies import SeparationStrategy


def _calls(**overrides):
    calls = {call: (0, 1) for call in CALLS}
    calls.update({k.replace("__", "."): v for k, v in overrides.items()})
    return calls


@pytest.mark.parametrize(
    "calls,match",
    [
        (_calls(actor__generate=(0,), reference__forward=(0,), reward__forward=(0,), critic__forward=(0,),
                actor__train=(0,), critic__train=(0,)), r"Ranks \[1\] run no call.*cover the world of 2"),
        (_calls(reward__forward=()), r"'reward.forward' has an empty group: give it at least one rank"),
        (_calls(critic__train=(0, 5)), r"ranks \[5\] outside the world of 2"),
        ({c: (0, 1) for c in CALLS if c != "reward.forward"}, r"missing \['reward.forward'\]"),
    ],
)
def test_invalid_plans_name_the_fix(calls, match):
    """Uncovered ranks, an empty group, out-of-range ranks and a role with no call are rejected."""
    with pytest.raises(ValueError, match=match):
        PlacementPlan(2, calls)


def test_impossible_ratios_and_groups_name_the_fix():
    """Ratios must give whole, disjoint groups; separation groups must not overlap; presets need enough ranks."""
    with pytest.raises(ValueError, match=r"reference ratio 0.3 on 4 ranks gives 1.2 ranks.*multiple of 1/4"):
        interleaving_plan(4, reference_ratio=0.3)
    with pytest.raises(ValueError, match=r"sum to more than 1.*at most 1"):
        interleaving_plan(4, reference_ratio=0.75, reward_ratio=0.5)
    with pytest.raises(ValueError, match=r"Ranks \[1\] are in both the generation and the training group"):
        separation_plan(4, generation_ranks=[0, 1], training_ranks=[1, 2, 3])
    with pytest.raises(ValueError, match=r"Separation needs at least 2 ranks"):
        separation_plan(1)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match=r"max_staleness=.*: give a whole number of weight versions"):
            PlacementPlan(2, _calls(), max_staleness=bad)


def test_a_staleness_bound_and_plans_saved_with_overlap():
    """``max_staleness`` runs on any ranks (on shared ranks one step after the other: the single-process simulation
    of a schedule); a plan saved before it, with ``overlap``, reads as staleness 1 or 0."""
    assert PlacementPlan(2, _calls(), max_staleness=2).overlap  # shared ranks: allowed
    plan = separation_plan(4, max_staleness=2)
    assert PlacementPlan.from_dict(plan.to_dict()) == plan and plan.to_dict()["max_staleness"] == 2
    legacy = {k: v for k, v in separation_plan(4).to_dict().items() if k != "max_staleness"}
    assert PlacementPlan.from_dict({**legacy, "overlap": True}).max_staleness == 1
    assert PlacementPlan.from_dict({**legacy, "overlap": False}).max_staleness == 0
    with pytest.raises(ValueError, match=r"overlap=True trains one step off-policy, max_staleness=0 on-policy"):
        SeparationStrategy(overlap=True, max_staleness=0)
    assert SeparationStrategy(overlap=True).build_plan(4).max_staleness == 1


def test_wrapper_errors_name_the_fix():
    """Unknown wrappers, DeepSpeed without deepspeed, and a sharded role split across a call are rejected."""
    with pytest.raises(ValueError, match=r"choose one of \['ddp', 'fsdp2'"):
        flattening_plan(2, wrapper="fsdp")
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        with pytest.raises(ValueError, match=r"deepspeed is not installed.*lightning-app-rlhf\[deepspeed\]"):
            flattening_plan(2, wrapper="zero3")
    with pytest.raises(ValueError, match=r"a sharded role can only run a call on all of its train ranks"):
        PlacementPlan(2, _calls(actor__generate=(0,)), {"actor": "fsdp2", "critic": "ddp"})


def test_bad_plan_fails_before_any_model_is_built(tmp_path):
    """From the CLI, an impossible ratio stops the run in the strategy's setup, before the model summary."""
    args = forked_ranks(["--config", ROOT / "examples/configs/demo_cpu.yaml", "--trainer.devices", "2",
                         "--trainer.strategy", "lightning_app_rlhf.strategies.InterleavingStrategy",
                         "--trainer.strategy.reference_ratio", "0.25", "--trainer.logger.init_args.save_dir",
                         tmp_path])
    result = run_cli("fit", *args, cwd=tmp_path, timeout=120, check=False)
    assert result.returncode != 0
    assert "reference ratio 0.25 on 2 ranks gives 0.5 ranks" in result.stderr
    assert "Trainable params" not in result.stdout  # no model was built


@pytest.mark.parametrize("plan,holdings", [
    (interleaving_plan(4), ["actor critic reference", "actor critic reference", "actor critic reward",
                            "actor critic reward"]),
    (separation_plan(4), ["actor critic reference reward", "actor critic reference reward", "actor critic",
                          "actor critic"]),
])
def test_each_rank_builds_only_the_roles_its_calls_need(plan, holdings, tiny_gpt2_config):
    """With a reward *model*: Interleaving keeps reference and reward on their own ranks; Separation keeps both
    off the training ranks."""
    from lightning_app_rlhf.parallel.placed_roles import PlacedRoles
    from lightning_app_rlhf.parallel.placement import Placement

    for rank, expected in enumerate(holdings):
        module = make_module(reward_model={"config": tiny_gpt2_config})
        module.placed_roles = PlacedRoles(Placement(plan, rank))
        module.configure_model()
        held = [name for name, attr in (("actor", "actor"), ("critic", "critic"), ("reference", "reference"),
                                        ("reward", "reward_model")) if getattr(module, attr) is not None]
        assert " ".join(held) == expected, rank


CRITIC_FREE = ("actor", "reference", "reward")


@pytest.mark.parametrize("preset", [flattening_plan, interleaving_plan, separation_plan])
def test_critic_free_presets_place_no_critic(preset):
    """A critic-free algorithm's plan gives ranks only to its own calls, and wraps only the actor."""
    plan = preset(4, roles=CRITIC_FREE)
    assert plan.roles == CRITIC_FREE and plan.trainable_roles == ("actor",)
    assert sorted(plan.calls) == ["actor.generate", "actor.train", "reference.forward", "reward.forward"]
    assert plan.wrappers == {"actor": "ddp"} and plan.shadow_ranks("critic") == ()
    assert PlacementPlan.from_dict(plan.to_dict()) == plan


def test_plan_roles_must_match_the_algorithm():
    """A PPO plan under GRPO (or the reverse) is refused with the calls to remove or add."""
    with pytest.raises(ValueError, match=r"algorithm 'grpo' uses \['actor', 'reference', 'reward'\]: remove the calls "
                                         r"of \['critic'\]"):
        flattening_plan(2).check_roles(CRITIC_FREE, "grpo")
    with pytest.raises(ValueError, match=r"give ranks to the calls of \['critic'\]"):
        flattening_plan(2, roles=CRITIC_FREE).check_roles(("actor", "reference", "reward", "critic"), "ppo")


def test_a_plan_needs_every_call_of_its_roles():
    """Half a critic (a forward without a train call) or no reward call is refused, naming the missing calls."""
    calls = {c: (0,) for c in flattening_plan(1).calls if c != "critic.train"}
    with pytest.raises(ValueError, match=r"missing \['critic.train'\]"):
        PlacementPlan(1, calls)
    calls = {c: (0,) for c in flattening_plan(1, roles=CRITIC_FREE).calls if c != "reward.forward"}
    with pytest.raises(ValueError, match=r"missing \['reward.forward'\]"):
        PlacementPlan(1, calls)
    with pytest.raises(ValueError, match=r"Wrappers name unknown roles \['critic'\], which the plan does not place"):
        PlacementPlan(1, flattening_plan(1, roles=CRITIC_FREE).calls, {"actor": "ddp", "critic": "ddp"})


# ---------------------------------------------------------------- the `plan` command (a dry run of the planner)

DEMO_CONFIG = str(ROOT / "examples/configs/demo_cpu.yaml")


def cli_exit_code(args: list[str]) -> int:
    """``python -m lightning_app_rlhf ARGS`` in this process: its exit status (0 unless it exits)."""
    from unittest import mock

    from lightning_app_rlhf.cli import main

    try:
        with mock.patch.object(sys, "argv", ["lightning-app-rlhf"]):  # LightningCLI reads args, not pytest's argv
            main(args)
    except SystemExit as exit:
        return exit.code
    return 0


def test_plan_prints_the_plan_of_the_training_config(capsys):
    """`plan --config examples/configs/demo_cpu.yaml --cluster 1x4xcpu` plans what fit would run: the config's
    PPO workload (batch 32, 24 new tokens, 2 epochs x 2 minibatches) on the cluster's 4 devices, every call by its
    full name."""
    assert cli_exit_code(["plan", "--config", DEMO_CONFIG, "--cluster", "1x4xcpu", "--profile", "none"]) == 0
    out = capsys.readouterr().out
    assert "(ppo: actor, reference, reward, critic) on 1x4xcpu: batch 32, prompt" in out
    assert "+ generation 24 tokens, 2 epoch(s) x 2 minibatches" in out
    for call in ("actor.generate", "reference.forward", "reward.forward", "critic.forward", "actor.train",
                 "critic.train"):
        assert call in out
    assert "0-3" in out and "best: #1 " in out  # flattening's calls span the 4 devices
    assert "gen:" not in out and "trainA" not in out and "act.gen" not in out
    assert "The config launches 1 process(es)" in out and "--trainer.devices 4" in out  # demo_cpu.yaml: devices 1


def test_plan_measures_this_machine_before_it_prices(capsys):
    """`plan --config ... --cluster 1x2xcpu` (--profile auto, the default, as a new user runs it) profiles this
    machine first: the note names what it measured, the engine's own work included, and the plans are priced with
    it (the calibration's rows in docs/planner.md, "Calibration on this CPU", check them against measured runs)."""
    assert cli_exit_code(["plan", "--config", DEMO_CONFIG, "--cluster", "1x2xcpu", "--search", "presets",
                          "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    (note,) = [note for note in result["notes"] if note.startswith("Profiled this machine")]
    for measured in ("what each wrapper (ddp, fsdp2", "a pipeline add on 2..2 processes", "gloo latency",
                     "busy processes", "per generate call", "per rollout", "per optimizer step"):
        assert measured in note
    best = result["best"]
    assert 0.01 < best["iteration_s"] < 5.0 and best["wrappers"]["actor"] in ("ddp", "fsdp2", "zero1", "zero2",
                                                                              "zero3")


def test_plan_json_of_the_config_beside_its_strategy(capsys):
    """Without --cluster the trainer's cpu devices are the cluster; the configured strategy's plan is priced beside
    the planner's choice."""
    args = ["plan", "--config", DEMO_CONFIG, "--trainer.devices", "2", "--trainer.strategy", "rlhf_separation",
            "--search", "presets", "--profile", "none", "--json"]
    assert cli_exit_code(args) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["cluster"] == "1x2xcpu" and result["world_size"] == 2 and result["batch_size"] == 32
    assert result["algorithm"] == "ppo" and result["num_samples"] == 1
    assert result["configured_strategy"] == "rlhf_separation"
    configured = result["configured"]
    assert configured["source"] == "config" and configured["name"] == "separation"
    assert configured["calls"] == {call: list(ranks) for call, ranks in separation_plan(2).calls.items()}
    assert configured["wrappers"] == {"actor": "ddp", "critic": "ddp"}
    assert set(result["best"]["calls"]) == set(CALLS)
    assert any("from trainer.num_nodes 1 x trainer.devices 2 on the cpu" in note for note in result["notes"])


def test_plan_reads_the_config_s_algorithm_and_callbacks(capsys):
    """A critic-free algorithm from the config is planned without critic calls; a configured PlacementTuner is
    named; a strategy that cannot run on the cluster says why."""
    args = ["plan", "--config", DEMO_CONFIG, "--cluster", "1x4xcpu", "--model.algorithm", "grpo",
            "--model.critic_optimizer", "null", "--model.generation.num_samples", "4", "--search", "presets",
            "--trainer.strategy", "lightning_app_rlhf.strategies.InterleavingStrategy",
            "--trainer.strategy.reference_ratio", "0.3",
            "--trainer.callbacks+=lightning_app_rlhf.callbacks.PlacementTuner", "--profile", "none", "--json"]
    assert cli_exit_code(args) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["algorithm"] == "grpo" and result["num_samples"] == 4 and "critic" not in result["roles"]
    assert not [call for call in result["best"]["calls"] if call.startswith("critic.")]
    assert result["best"]["samples_per_s"] == pytest.approx(32 * 4 / result["best"]["iteration_s"])
    assert result["configured"] is None
    notes = " ".join(result["notes"])
    assert "reference ratio 0.3 on 4 ranks gives 1.2 ranks" in notes and "PlacementTuner" in notes


@pytest.mark.parametrize("args,message", [
    (["--batch_size", "8"], "--batch_size describes a named-size workload, but a training config"),
    (["--batch_size", "8"], "set --data.batch_size instead"),
    (["--sweep"], "drop --config"),
    (["--trainer.accelerator", "gpu", "--trainer.devices", "4"], "pass --cluster 1x4xTYPE"),
    (["--cluster", "1x8xTPU-v9"], "Unknown device type 'TPU-v9'"),
    (["--data.prompts", "missing.jsonl"], "Prompt file 'missing.jsonl' does not exist"),
    (["--model.algorithm", "grpo", "--model.generation.num_samples", "1"],  # RLHFModule's own check, unwrapped
     "error: Algorithm 'grpo'"),
    (["--cluster", "1x4xcpu", "--data.batch_size", "31"], "is not divisible by num_minibatches"),
])
def test_plan_errors_name_the_fix(capsys, args, message):
    """Bad input stops `plan` with exit status 2 and one line that says what to change, no traceback."""
    assert cli_exit_code(["plan", "--config", DEMO_CONFIG, "--search", "presets", "--profile", "none", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_plan_named_sizes_still_work(capsys, monkeypatch):
    """Without a training config the named-size flags describe the workload, as in docs/planner.md."""
    args = ["plan", "--cluster", "1x8xA100-80GB", "--actor", "llama-7b", "--critic", "llama-7b", "--search",
            "presets"]
    assert cli_exit_code([*args, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["workload"] == "llama-7b+llama-7b" and result["world_size"] == 8 and result["batch_size"] == 512
    assert set(result["presets"]) == {"flattening", "interleaving", "separation"}
    assert result["configured"] is None and set(result["best"]["calls"]) == set(CALLS)
    assert cli_exit_code(args) == 0
    table = capsys.readouterr().out
    assert "llama-7b+llama-7b (ppo: actor, reference, reward, critic) on 1x8xA100-80GB: batch 512" in table
    assert "actor.generate" in table and "critic.train" in table and "0-7" in table

    from lightning_app_rlhf.planner import command

    monkeypatch.setattr(command, "SWEEP_MODELS", ("llama-7b",))
    monkeypatch.setattr(command, "SWEEP_CLUSTERS", ("1x8xA100-80GB",))
    assert cli_exit_code(["plan", "--sweep", "--search", "presets"]) == 0
    row = capsys.readouterr().out.splitlines()[2]
    assert row.startswith("| llama-7b | 1x8xA100-80GB | ") and "actor.generate 0-7" in row and "actor:" in row


def test_help_lists_every_subcommand(capsys):
    """The top-level `--help` lists the Trainer's subcommands and `plan`, each with a one-sentence summary."""
    assert cli_exit_code(["--help"]) == 0
    out = capsys.readouterr().out
    assert "{fit,validate,test,predict,plan}" in out
    assert "plan                Predict and search placements for the configured run" in out
    assert "test                Perform one evaluation epoch over the test set.\n" in out


def test_plan_help_shows_its_flags_beside_fit_s(capsys):
    """`plan --help` has fit's --config, --trainer.*, --model and --data, and the planner's flags in the same
    style."""
    assert cli_exit_code(["plan", "--help"]) == 0
    out = capsys.readouterr().out
    for flag in ("--config", "--trainer.devices", "--model ", "--data ", "--cluster CLUSTER", "--time_budget",
                 "--top_k", "--num_samples", "--json", "--sweep"):
        assert flag in out, flag
    assert "--time-budget" not in out and "--num-samples" not in out
