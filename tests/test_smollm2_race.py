"""The SmolLM2 race's pure parts (lightning_app_rlhf/bench/smollm2_race.py): the equal-time choice of snapshots, the
prompt order the peer is given, the table and its section of the page. No model is loaded; the race itself is run
by ``python -m lightning_app_rlhf.bench smollm2 run`` (docs/benchmarks.md)."""

from __future__ import annotations

from typing import Any

import pytest

from lightning_app_rlhf.bench.smollm2_race import (
    AFTER,
    BEGIN,
    END,
    RaceSettings,
    _race_command,
    equal_time,
    generation_record,
    last_within,
    prompt_order,
    race_table,
    scored_iterations,
    with_section,
)
from lightning_app_rlhf.data import PromptDataModule


def test_equal_time_gives_both_sides_the_smaller_total_and_scores_each_at_its_last_snapshot_within_it():
    ours, trl = [10.0, 20.0, 30.0], [25.0, 50.0, 75.0]
    assert equal_time(ours, trl) == {"budget_s": 30.0, "ours": 3, "trl": 1}
    assert equal_time(trl, ours) == {"budget_s": 30.0, "ours": 1, "trl": 3}
    assert last_within(trl, 30.0) == 1
    assert last_within(trl, 25.0) == 1  # an iteration that ends exactly at the budget counts
    assert last_within(trl, 24.9) == 0  # none within: scored before training


def test_scored_iterations_are_the_start_the_equal_time_point_the_end_and_the_curve():
    assert scored_iterations(30, 13, 10) == [0, 10, 13, 20, 30]
    assert scored_iterations(30, 30, 0) == [0, 30]
    assert scored_iterations(2, 0, 0) == [0, 2]


def test_settings_count_completions_per_optimizer_step_and_refuse_uneven_minibatches():
    assert RaceSettings().completions_per_step == 8  # 8 prompts x G=4 over 4 optimizer steps
    with pytest.raises(ValueError, match="minibatches dividing"):
        RaceSettings(minibatches=3)
    with pytest.raises(ValueError, match="backend is one of"):
        RaceSettings(backend="static")


def test_each_sides_generation_is_recorded_named_in_the_tables_and_in_the_command():
    from lightning_app_rlhf.bench.trl_grpo_smollm2_peer import grpo_config, peer_generation_record

    vllm = RaceSettings(iterations=3, backend="vllm", peer_use_vllm=True)
    assert generation_record(vllm)["vllm_engine_args"] == {"enforce_eager": True}
    assert generation_record(RaceSettings())["backend"] == "eager"
    assert peer_generation_record(vllm)["vllm_mode"] == "colocate"
    assert not peer_generation_record(RaceSettings())["use_vllm"]
    race = _race(same_start=True)
    race["sides"]["ours"]["generation"] = generation_record(vllm)
    race["sides"]["trl"]["generation"] = peer_generation_record(vllm)
    table = race_table(race)
    assert "| equal iterations (3) | ours (vLLM, enforce_eager) | 3 | 6 |" in table
    assert "| TRL 1.16.0 (use_vllm colocate) | 6.0 |" in table
    command = _race_command(vllm, 1, "runs/r", "out.json", "page.md")
    assert command.endswith("--docs page.md --backend vllm --peer_use_vllm True")
    assert "--backend" not in _race_command(RaceSettings(), 1, "runs/r", "out.json", "page.md")
    pytest.importorskip("trl")
    for settings, use_vllm in ((RaceSettings(), False), (vllm, True)):
        config = grpo_config(settings, "/tmp/unused")
        assert config.use_vllm is use_vllm and not config.vllm_enable_sleep_mode


def test_prompt_order_is_the_order_our_datamodule_trains_in(tokenizer):
    """The peer's dataset order: iteration i must read the rows our PromptDataModule gives iteration i, across
    epochs (11 rows, batch 4: two batches an epoch, the odd rows of each epoch's permutation dropped)."""
    rows = [{"prompt": f"question {i}", "row": str(i)} for i in range(11)]
    settings = RaceSettings(iterations=5, batch_size=4, seed=3)
    data = PromptDataModule(rows, tokenizer, batch_size=4, seed=3)
    data.setup("fit")
    loader = data.train_dataloader()
    seen: list[int] = []
    while len(seen) < 5 * 4:
        seen += [int(i) for batch in loader for i in batch["fields"]["row"]]  # one epoch per pass
    assert prompt_order(len(rows), settings) == seen[: 5 * 4]


def _race(same_start: bool) -> dict[str, Any]:
    def side(seconds: float, version: dict[str, str]) -> dict[str, Any]:
        return {
            "iterations": [{"iteration": i, "train_s": seconds * i, "reward_mean": 0.1 * i} for i in (1, 2, 3)],
            "peak_rss_bytes": 2**30, "versions": version,
            "accuracy": {str(i): {"accuracy": i / 10, "correct": i, "questions": 10} for i in (0, 1, 2, 3)},
        }

    return {
        "settings": {**RaceSettings(iterations=3, test_size=10).__dict__},
        "model": {"gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf",
                  "lora": {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"],
                           "layers_to_transform": [18, 19, 20]}},
        "eval_every": 1,
        "commands": {"race": "python -m lightning_app_rlhf.bench smollm2 run --iterations 3",
                     "report": "python -m lightning_app_rlhf.bench smollm2 report"},
        "same_initial_adapter": same_start,
        "equal_time": {"budget_s": 6.0, "ours": 3, "trl": 1},
        "sides": {"ours": side(2.0, {"torch": "2.13.0"}), "trl": side(6.0, {"trl": "1.16.0"})},
    }


def test_race_table_shows_both_sides_at_equal_iterations_and_equal_time_and_the_commands():
    table = race_table(_race(same_start=True))
    assert "| before training | both (the same initial adapter) | 0 | 0 | 0% (0/10) |" in table
    assert "| equal iterations (3) | ours | 3 | 6 | 30% (3/10) |" in table
    assert "| equal iterations (3) | TRL 1.16.0 | 3 | 18 | 30% (3/10) |" in table
    assert "| equal time (6 s) | ours | 3 | 6 | 30% (3/10) |" in table
    assert "| equal time (6 s) | TRL 1.16.0 | 1 | 6 | 10% (1/10) |" in table
    assert "| ours | 2.0 | 6 | 0.200 -> 0.200 | 1024 |" in table
    assert "| 2 | 20% (2/10) | 20% (2/10) |" in table
    assert "python -m lightning_app_rlhf.bench smollm2 run --iterations 3" in table
    assert "LoRA r=8 alpha 16 on q_proj/v_proj of layers 18-20" in table
    separate = race_table(_race(same_start=False))
    assert "| before training | ours | 0 | 0 |" in separate and "| before training | TRL 1.16.0 | 0 | 0 |" in separate


def test_section_goes_after_the_generated_benchmarks_then_is_replaced_in_place():
    page = f"# Benchmarks\n\n{AFTER.replace('end', 'begin')}\ntables\n{AFTER}\n\n## Reading the results\n"
    first = with_section(page, "race one")
    assert first.index(AFTER) < first.index(BEGIN) < first.index("race one") < first.index(END)
    assert first.index(END) < first.index("## Reading the results")
    second = with_section(first, "race two")
    assert "race one" not in second and second.count(BEGIN) == 1 and second.count(END) == 1
    assert second == first.replace("race one", "race two")
    assert with_section("# Benchmarks\n", "race").endswith(f"{BEGIN}\n\nrace\n\n{END}\n")
