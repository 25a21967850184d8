"""Predicted vs measured iteration time and memory per rank, on this CPU, for the three presets.

    OMP_NUM_THREADS=1 PYTHONPATH=$PWD python benchmarks/planner_calibration.py --devices 2 4 --steps 20

Each case trains the demo config (examples/configs/demo_cpu.yaml) with the CLI for a few iterations, reads the CSV
logger's metrics.csv (time per iteration from perf/samples_per_sec, memory/param_bytes_rank{r},
memory/state_bytes_rank{r}), and sets them beside the planner's prediction from a profile of the demo model
(measured here first, a few seconds, cached). Prints a markdown table (docs/planner.md shows one).
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from lightning_app_rlhf.demo import build_tokenizer, prompts, topic_reward
from lightning_app_rlhf.plan import flattening_plan, interleaving_plan, separation_plan
from lightning_app_rlhf.planner import CostModel, PlanChoice, Workload, cluster_from_environment, role_shape
from lightning_app_rlhf.planner.profiler import profile_workload

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples/configs/demo_cpu.yaml"
PRESETS = {
    "rlhf_flattening": flattening_plan,
    "rlhf_interleaving": interleaving_plan,
    "rlhf_separation": separation_plan,
}


def measure(
    strategy: str, devices: int, steps: int, extra: list[str], workdir: Path
) -> list[dict[str, float]]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    name = f"{strategy}_{devices}"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "lightning_app_rlhf",
            "fit",
            "--config",
            str(CONFIG),
            "--trainer.max_steps",
            str(steps),
            "--trainer.devices",
            str(devices),
            "--trainer.strategy",
            strategy,
            "--trainer.enable_checkpointing",
            "false",
            "--trainer.callbacks",
            "[]",
            "--trainer.enable_progress_bar",
            "false",
            "--trainer.logger.init_args.save_dir",
            str(workdir),
            "--trainer.logger.init_args.name",
            name,
            *extra,
        ],
        cwd=workdir,
        env=env,
        check=True,
        capture_output=True,
        text=True,
        timeout=600,
    )
    (metrics,) = (workdir / name).rglob("metrics.csv")
    return [{k: float(v) for k, v in row.items() if v} for row in csv.DictReader(metrics.open())]


def demo_workload(config: dict, overrides: dict) -> Workload:
    model = config["model"]
    actor_config = {**model["actor"]["config"], **overrides.get("actor", {})}
    generation = (
        model["generation"]["max_new_tokens"]
        if "max_new_tokens" not in overrides
        else overrides["max_new_tokens"]
    )
    tokenizer = build_tokenizer()
    batch = config["data"]["batch_size"]
    texts = prompts()
    lengths = [len(tokenizer.encode(t, add_special_tokens=False)) for t in texts]
    # Batches pad to their longest prompt: the mean of per-batch maxima.
    prompt_length = round(statistics.mean(max(lengths[i : i + batch]) for i in range(0, len(lengths), batch)))
    return Workload(
        actor=role_shape(actor_config),
        critic=role_shape(actor_config, "value"),
        reference=role_shape(actor_config),
        reward=None,
        batch_size=batch,
        prompt_length=prompt_length,
        generation_length=generation,
        ppo_epochs=model["ppo"]["ppo_epochs"],
        num_minibatches=model["ppo"]["num_minibatches"],
        wrappers=("ddp", "fsdp2"),
        name="demo",
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--skip", type=int, default=5, help="first iterations left out of the measured mean")
    parser.add_argument(
        "--n-embd", type=int, default=None, help="a larger model: hidden size (n_head stays 4)"
    )
    parser.add_argument("--n-layer", type=int, default=None)
    args = parser.parse_args()
    config = yaml.safe_load(CONFIG.read_text())
    overrides: dict = {"actor": {}}
    extra: list[str] = []
    for field, value in (("n_embd", args.n_embd), ("n_layer", args.n_layer)):
        if value is not None:
            overrides["actor"][field] = value
            extra += [f"--model.actor.config.{field}", str(value)]
    workload = demo_workload(config, overrides)
    profile = profile_workload(
        workload, batches=(1, 4, 16), reward_fn=topic_reward, tokenizer=build_tokenizer(), prompts=prompts()
    )
    print(
        f"profiled on {profile.hardware}; prompt length {workload.prompt_length}, "
        f"{workload.actor.params} parameters per model"
    )
    print(
        "| processes | preset | measured s/iter | predicted s/iter | error | param bytes rank0..n measured | "
        "predicted | state bytes measured | predicted |"
    )
    print("| ---: | --- | ---: | ---: | ---: | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        for devices in args.devices:
            model = CostModel(cluster_from_environment(devices), workload, profile)
            for strategy, preset in PRESETS.items():
                rows = measure(strategy, devices, args.steps, extra, Path(tmp))
                steps = [r for r in rows if "perf/samples_per_sec" in r][args.skip :]
                measured = statistics.mean(workload.batch_size / r["perf/samples_per_sec"] for r in steps)
                memory_row = next(r for r in rows if "memory/param_bytes_rank0" in r)
                estimate = model.evaluate(PlanChoice(preset(devices)))
                params = [int(memory_row[f"memory/param_bytes_rank{r}"]) for r in range(devices)]
                states = [int(memory_row[f"memory/state_bytes_rank{r}"]) for r in range(devices)]
                print(
                    f"| {devices} | {strategy.removeprefix('rlhf_')} | {measured:.3f} | {estimate.iteration_s:.3f} | "
                    f"{(estimate.iteration_s - measured) / measured:+.0%} | {params} | "
                    f"{[m.param_bytes for m in estimate.memory]} | {states} | "
                    f"{[m.state_bytes for m in estimate.memory]} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
