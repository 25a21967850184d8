"""The benchmark harness on a minimal setting: the output has every field the docs table and plot need.

Speed is never asserted here; the harness measures it side by side (docs/benchmarks.md).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from helpers import run_python

from lightning_app_rlhf.bench.presets import RunSettings
from lightning_app_rlhf.bench.report import BEGIN, END
from lightning_app_rlhf.bench.trl_peer import peer_models
from lightning_app_rlhf.models.roles import ModelSpec, build_causal_lm, build_reward_model

SPREAD = {"median", "min", "max"}


def bench(tmp_path: Path, *args: str) -> None:
    run_python("-m", "lightning_app_rlhf.bench", *args, cwd=tmp_path, timeout=600)


@pytest.mark.slow  # 100 s: the harness end to end against TRL; scripts/bench.sh runs the real thing
def test_trl_comparison_placements_and_report(tmp_path):
    pytest.importorskip("trl")
    small = ["--run.batch_size", "8", "--run.warmup", "1", "--run.iterations", "2"]
    bench(tmp_path, "trl", "--presets", "[tiny]", "--precisions", "[32-true]", "--run.new_tokens", "4", "--repeats",
          "2", "--out", "trl.json", *small)
    bench(tmp_path, "placements", "--run.preset", "tiny", "--processes", "[2]", "--workloads", "[training-heavy]",
          "--placements", "[flattening, separation]", "--out", "placements.json", *small)
    bench(tmp_path, "profile", "--presets", "[tiny]", "--batch_size", "8", "--new_tokens", "4", "--out",
          "profile.json")
    trl = json.loads((tmp_path / "trl.json").read_text())
    assert {"cpu", "cores", "torch", "python"} <= set(trl["machine"])
    (row,) = trl["trl"]
    assert row["settings"]["threads"] == 1 and row["settings"]["batch_size"] == 8
    for side in ("ours", "trl"):
        summary = row[side]
        assert set(summary["samples_per_s"]) == SPREAD and set(summary["iteration_s"]) == SPREAD
        assert summary["samples_per_s"]["min"] <= summary["samples_per_s"]["median"] <= summary["samples_per_s"]["max"]
        assert 8 / summary["iteration_s"]["max"] == pytest.approx(summary["samples_per_s"]["min"])
        assert 8 / summary["iteration_s"]["min"] == pytest.approx(summary["samples_per_s"]["max"])
        assert len(summary["peak_rss_bytes"]) == 1 and summary["peak_rss_bytes"][0] > 2**20
        assert summary["generate_s"] > 0
    assert {"score_s", "train_s", "reallocate_s", "gen_tokens_per_s", "train_tflops"} <= set(row["ours"])
    assert row["samples_per_s_ratio"] == pytest.approx(
        row["ours"]["samples_per_s"]["median"] / row["trl"]["samples_per_s"]["median"])

    rows = json.loads((tmp_path / "placements.json").read_text())["placements"]
    assert [r["settings"]["placement"] for r in rows] == ["flattening", "separation"]
    for r in rows:
        assert r["workload"] == "training-heavy" and r["settings"]["processes"] == 2
        assert r["settings"]["ppo_epochs"] == 4 and len(r["ours"]["peak_rss_bytes"]) == 2
    assert rows[0]["ours"]["reallocate_s"] < rows[1]["ours"]["reallocate_s"]  # only Separation moves weights

    (profiled,) = json.loads((tmp_path / "profile.json").read_text())["profile"]
    assert set(profiled["phases"]) == {"generate", "score", "train"}
    for phase in profiled["phases"].values():
        assert phase["wall_s"] > 0 and 0 < phase["matmul_share"] < 1 and phase["top_ops"][0]["calls"] >= 1

    docs = tmp_path / "docs" / "benchmarks.md"
    docs.parent.mkdir()
    docs.write_text(f"# Benchmarks\n\nHand-written intro.\n\n{BEGIN}\nold\n{END}\n\nHand-written tail.\n")
    bench(tmp_path, "report", "--results", "[trl.json, placements.json, profile.json]", "--docs", str(docs))
    text = docs.read_text()
    assert "Hand-written intro." in text and "Hand-written tail." in text and "old" not in text
    assert "| tiny |" in text and "| training-heavy | 2 | separation |" in text and "Winners:" in text
    assert "| train |" in text  # the profile table
    assert (docs.parent / "images" / "benchmarks.png").stat().st_size > 10_000


@pytest.mark.slow  # builds (once, about a minute, cached) and runs TRL 1.16 in its own environment
def test_grpo_comparison_against_trl_grpotrainer_and_report(tmp_path):
    bench(tmp_path, "grpo", "--presets", "[tiny]", "--betas", "[0.0, 0.04]", "--decoders", "[eager, static]",
          "--padding_free", "[false, true]", "--repeats", "1", "--run.new_tokens", "8", "--run.warmup", "1",
          "--run.iterations", "2",
          "--profile_preset", "tiny", "--out", "grpo.json", "--docs", "page.md")
    assert "| tiny | 0.04 | 32-true | `static`, padding-free |" in (tmp_path / "page.md").read_text()  # written
    results = json.loads((tmp_path / "grpo.json").read_text())
    rows, profiled = results["grpo"], results["grpo_profile"]
    assert set(profiled["ours"]) == {"generate", "score", "train"} and profiled["trl"]["step"]["wall_s"] > 0
    assert "aten::addmm" in profiled["trl"]["step"]["ops"]
    cells = [(r["settings"]["beta"], r["settings"]["decoder"], r["settings"]["padding_free"]) for r in rows]
    assert cells == [(beta, decoder, free) for beta in (0.0, 0.04) for decoder in ("eager", "static")
                     for free in (False, True)]
    assert rows[0]["trl"] == rows[3]["trl"] and rows[0]["versions"]["trl"] == "1.16.0"  # one peer run per cell
    assert all(row["interleaved"] and set(row["paired_ratio"]) == SPREAD for row in rows)  # took turns by default
    for row in rows:
        completions = row["settings"]["batch_size"] * row["settings"]["num_samples"]
        for side in ("ours", "trl"):
            summary = row[side]
            assert completions / summary["iteration_s"]["max"] == pytest.approx(summary["samples_per_s"]["min"])
            assert summary["generate_s"] > 0
    docs = tmp_path / "benchmarks.md"
    bench(tmp_path, "report", "--results", "[grpo.json]", "--docs", str(docs))
    text = docs.read_text()
    assert "GRPOTrainer" in text and "| tiny | 0.04 | 32-true | `static`, padded |" in text
    assert "| TRL | whole step |" in text and "| ours | train |" in text
    assert "The model arithmetic both sides run" in text


def test_grpo_runs_the_same_update_on_both_sides(tmp_path):
    """Ours: the actor alone (a reference only with beta), the demo's reward function, G samples per prompt, the KL
    as a k3 term in the loss; the peer's settings are the same dataclass."""
    from lightning_app_rlhf.bench.ours import fit_config

    settings = RunSettings(algorithm="grpo", batch_size=8, num_samples=4, beta=0.04)
    model = fit_config(settings, tmp_path)["model"]
    assert model["algorithm"] == "grpo" and model["reward_fn"] == "lightning_app_rlhf.demo.topic_reward"
    assert "reward_model" not in model and model["generation"]["num_samples"] == 4
    assert model["ppo"] == {"ppo_epochs": 1, "num_minibatches": 1, "kl_coef": 0.0, "kl_loss_coef": 0.04,
                            "kl_loss_estimator": "k3"}
    assert settings.completions == 32 and RunSettings().completions == 32  # PPO: one completion per prompt
    assert "reward_model" in fit_config(RunSettings(), tmp_path)["model"]
    assert "backend" not in model["generation"]  # the default decoder
    free = fit_config(replace(settings, padding_free=True), tmp_path)["model"]
    assert free["ppo"] == {**model["ppo"], "padding_free": True}
    compiled = fit_config(RunSettings(algorithm="grpo", num_samples=4, decoder="static_compiled"), tmp_path)
    assert compiled["model"]["generation"] | {"max_new_tokens": 0} == {
        "max_new_tokens": 0, "temperature": 1.0, "num_samples": 4, "backend": "static", "compile": True}


def test_shared_arithmetic_is_the_smaller_side_per_model_op():
    """Per kind of model arithmetic (matmuls, the activation however it is written, ...) the smaller self time of
    the two sides, summed over phases; ops outside it (a sampler's ``exponential_``, an optimizer's ``mul``, copies)
    do not count."""
    from lightning_app_rlhf.bench.profile import shared_arithmetic_s

    def phase(**ops: float) -> dict:
        return {"ops": {f"aten::{op}": {"self_s": s, "calls": 1} for op, s in ops.items()}}

    ours = [phase(mm=0.3, addmm=0.2, copy_=0.05), phase(mm=0.5, gelu=0.02)]  # matmul 1.0, activation 0.02
    trl = [phase(mm=0.6, addmm=0.1, tanh=0.03, pow=0.01, mul=0.3, exponential_=0.16)]  # matmul 0.7, activation 0.04
    assert shared_arithmetic_s(ours, trl) == pytest.approx(0.7 + 0.02)


def test_report_names_each_sections_software_when_the_results_files_differ(tmp_path):
    """Results files measured with different software get one "Measured on" line per group of sections; files
    measured alike share one line."""
    from lightning_app_rlhf.bench.__main__ import report

    machine = {"cpu": "EPYC", "cores": 2, "memory_gib": 23.5, "python": "3.11.7", "torch": "2.13.0+cpu",
               "lightning": "2.6.6", "transformers": "5.23.0"}
    for name, section in (("trl.json", "trl"), ("placements.json", "placements"), ("grpo.json", "grpo")):
        software = {**machine, "transformers": "5.24.0"} if section == "grpo" else machine
        (tmp_path / name).write_text(json.dumps({"machine": software, section: []}))
    docs = tmp_path / "benchmarks.md"
    report(results=[str(tmp_path / n) for n in ("trl.json", "placements.json")], docs=str(docs))
    assert docs.read_text().count("Measured on") == 1 and "Measured on: EPYC, 2 cores" in docs.read_text()
    report(results=[str(tmp_path / n) for n in ("trl.json", "placements.json", "grpo.json")], docs=str(docs))
    text = docs.read_text()
    assert "Measured on (PPO vs TRL, placements): EPYC" in text and "transformers 5.23.0." in text
    assert "Measured on (GRPO vs TRL): EPYC" in text and "transformers 5.24.0." in text


def test_peer_gets_our_weights_with_stock_modules():
    """Same configs and seeds as our roles, but the stock GPT-2 activation a TRL user gets."""
    settings = RunSettings()
    policy, reference, value, reward = peer_models(settings, pad_token_id=0)
    ours = build_causal_lm(ModelSpec(config=settings.model_config(), init_seed=0))
    our_reward = build_reward_model(ModelSpec(config=settings.model_config(), init_seed=1), 0)
    for theirs, mine in ((policy, ours), (reference, ours), (reward, our_reward)):
        assert all(torch.equal(a, b) for a, b in zip(theirs.state_dict().values(), mine.state_dict().values()))
    assert type(policy.transformer.h[0].mlp.act).__name__ == "NewGELUActivation"
    assert value.score.weight.requires_grad and not reward.score.weight.requires_grad


@pytest.mark.parametrize(("fields", "message"), [
    ({"preset": "huge"}, "choose one of"),
    ({"placement": "separation", "processes": 1}, "at least 2 processes"),
    ({"batch_size": 30, "num_minibatches": 4}, "multiple of 4"),
    ({"precision": "16-mixed"}, "bf16-mixed"),
    ({"algorithm": "grpo"}, "num_samples must be >= 2"),
    ({"beta": 0.04}, "leave them at 1 and 0 for algorithm 'ppo'"),
    ({"algorithm": "dapo"}, "'ppo' or 'grpo'"),
    ({"decoder": "vllm"}, "Unknown decoder 'vllm'"),
])
def test_bad_settings_name_the_fix(fields, message):
    with pytest.raises(ValueError, match=message):
        RunSettings(**fields)


def test_soak_trend_is_the_least_squares_slope_after_warmup():
    """The soak harness reports RSS after warm-up, at the end, and the fitted growth per 100 iterations."""
    from lightning_app_rlhf.bench.soak import rss_trend

    mib = 2**20
    samples = [[0, 900 * mib], [10, 100 * mib], [20, 100 * mib], [30, 101 * mib], [40, 102 * mib]]
    trend = rss_trend(samples, warmup=10)  # the spike at iteration 0 is warm-up
    # Points (10, 100), (20, 100), (30, 101), (40, 102): slope = sum(dx*dy)/sum(dx^2) = 35/500 MiB per iteration.
    assert trend == pytest.approx({"after_warmup_mib": 100, "end_mib": 102, "growth_mib": 2,
                                   "slope_mib_per_100": 7.0})
    with pytest.raises(ValueError, match="at least 2 samples after warm-up"):
        rss_trend(samples, warmup=40)
