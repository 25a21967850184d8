"""The agent race's pure parts (lightning_app_rlhf/bench/agent_race.py): its settings are the calculator example's,
its table, and its section of the page. No model is trained; the race itself is run by ``python -m
lightning_app_rlhf.bench agent run`` (docs/benchmarks.md)."""

from __future__ import annotations

import dataclasses
from typing import Any

from lightning_app_rlhf.bench import smollm2_race
from lightning_app_rlhf.bench.agent_race import (
    AFTER,
    BEGIN,
    END,
    agent_race_table,
    load_example,
    with_section,
)
from lightning_app_rlhf.bench.trl_agent_peer import AgentPeerSettings


def test_race_settings_are_the_calculator_examples_defaults_and_its_lora_is_the_peers():
    """Both sides train with AgentPeerSettings: its defaults must be what ``examples/smollm2_calculator/train.py``
    runs with (the README's numbers), and the peer builds its LoRA from the arithmetic example's config."""
    example = load_example()
    defaults = vars(example.arguments().parse_args([]))
    settings = dataclasses.asdict(AgentPeerSettings())
    shared = (set(defaults) & set(settings)) - {"eval_every"}  # the example's curve spacing, the race's own
    assert shared >= {"iterations", "batch_size", "num_samples", "max_new_tokens", "max_turns", "max_episode_tokens",
                      "temperature", "lr", "minibatches", "kl_loss_coef", "train_size", "test_size", "seed"}
    assert {name: defaults[name] for name in shared} == {name: settings[name] for name in shared}
    assert not AgentPeerSettings().describe_tools and not example.environment().tools  # neither describes the tool
    assert example.ACTOR_LORA == smollm2_race.load_example().ACTOR_LORA


def _race(same_start: bool) -> dict[str, Any]:
    def side(seconds: float, version: dict[str, str], held_out: dict | None = None) -> dict[str, Any]:
        its = [{"iteration": i, "train_s": seconds * i, "iteration_s": seconds, "reward_mean": 0.1 * i,
                "completions": 32, "completions_per_s": 32 / seconds, "turns_mean": 1.5, "tool_calls_mean": 0.5}
               for i in (1, 2, 3)]
        success = {str(i): {"success": i / 10, "correct": i, "questions": 10, "tool_call_rate": 0.5,
                            "tool_errors": 0.0, "turns": 1.5} for i in (0, 1, 3)}
        return {"iterations": its, "peak_rss_bytes": 2**30, "versions": version, "completions_per_s": 32 / seconds,
                "success": success, **({"held_out": held_out} if held_out else {})}

    return {
        "settings": dataclasses.asdict(AgentPeerSettings(iterations=3, test_size=10)),
        "model": {"gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf",
                  "lora": {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"],
                           "layers_to_transform": [18, 19, 20]}},
        "eval_every": 0,
        "commands": {"race": "python -m lightning_app_rlhf.bench agent run --iterations 3",
                     "report": "python -m lightning_app_rlhf.bench agent report"},
        "same_initial_adapter": same_start,
        "equal_time": {"budget_s": 6.0, "ours": 3, "trl": 1},
        "sides": {"ours": side(2.0, {"torch": "2.13.0"}),
                  "trl": side(6.0, {"trl": "1.16.0"}, {"0": {"correct": 0, "questions": 10},
                                                       "3": {"correct": 2, "questions": 10}})},
    }


def test_table_shows_success_at_equal_iterations_and_equal_time_speed_episodes_and_the_commands():
    table = agent_race_table(_race(same_start=True))
    assert "| before training | both (the same initial adapter) | 0 | 0 | 0% (0/10), tool called 50% |" in table
    assert "| equal iterations (3) | ours | 3 | 6 | 30% (3/10), tool called 50% |" in table
    assert "| equal iterations (3) | TRL 1.16.0 | 3 | 18 | 30% (3/10), tool called 50% |" in table
    assert "| equal time (6 s) | ours | 3 | 6 | 30% (3/10), tool called 50% |" in table
    assert "| equal time (6 s) | TRL 1.16.0 | 1 | 6 | 10% (1/10), tool called 50% |" in table
    assert "| ours | 16.000 | 2 | 1.50 | 0.50 | 0.10, 0.20, 0.30 | 1024 |" in table  # 32 episodes in 2 s each
    assert "| TRL 1.16.0 | 5.333 | 6 | 1.50 | 0.50 | 0.10, 0.20, 0.30 | 1024 |" in table
    assert "TRL's own parse of its snapshots, for comparison: after 0: 0/10, after 3: 2/10" in table
    assert "4 prompts x G=8 episodes per iteration, at most 2 turns of 40 tokens and 128 tokens per episode" in table
    assert "python -m lightning_app_rlhf.bench agent run --iterations 3" in table
    separate = agent_race_table(_race(same_start=False))
    assert "| before training | ours | 0 | 0 |" in separate and "| before training | TRL 1.16.0 | 0 | 0 |" in separate


def test_section_goes_after_the_smollm2_race_then_is_replaced_in_place():
    page = f"# Benchmarks\n\n{smollm2_race.BEGIN}\nrace\n{AFTER}\n\n## Reading the results\n"
    first = with_section(page, "agents one", BEGIN, END, AFTER)
    assert first.index(AFTER) < first.index(BEGIN) < first.index("agents one") < first.index(END)
    assert first.index(END) < first.index("## Reading the results")
    second = with_section(first, "agents two", BEGIN, END, AFTER)
    assert second == first.replace("agents one", "agents two") and second.count(BEGIN) == 1
    assert with_section(second, "race two") == second.replace("\nrace\n", "\n\nrace two\n\n")  # the other section
