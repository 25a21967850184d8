"""Predicted vs measured iteration time and memory per rank, on this CPU: three presets and the planner's choice.

    OMP_NUM_THREADS=1 PYTHONPATH=$PWD python benchmarks/planner_calibration.py --models tiny small --devices 2 4

For each model (``tiny``: the demo's GPT-2, 2 layers x 64; ``small``: GPT-2 6 layers x 256, 8 heads, vocab 8192, the
benchmark's preset) and each process count the script first profiles the model calls afresh (no cache: close in time
to the runs; the median CPU time of 7 repeats per point, batch 1 to 32)
and measures the gloo collectives of that many fresh processes and the time DDP adds to a train step on groups of
2..n of them (``measure_ddp_steps``). Then, for each preset and for
the planner's chosen plan when it is not a preset, it

1. measures the share of a core each of k = 1..n concurrently computing processes gets on this machine now
   (``measure_compute_shares``: the other jobs' load and our own processes together), and how many cores the other
   jobs keep busy (``/proc/stat``, reported only),
   and the gloo all-gather latency of n fresh processes (``measure_collectives_in_processes``; the bandwidths of
   its 1 MB all-gather and 25 MiB all-reduce are measured once, before the planner decides),
2. trains the demo config with the CLI for ``--steps`` iterations (one thread per process),
3. measures both again, and predicts with their means (the cluster's ``compute_shares``, the device's
   ``collective_latency_s``),
4. reads the CSV logger's metrics.csv: seconds per iteration (median over the iterations after ``--skip`` of
   ``batch / perf/samples_per_sec``, the time inside ``training_step`` on rank 0, where the rollout batch ends) and
   ``memory/param_bytes_rank{r}`` / ``memory/state_bytes_rank{r}`` (the placement summary's counts).

A case whose two share measurements differ by more than ``--max-share-change`` (relative, for any k) is measured
again (up to ``--retries`` times): the machine's load moved while it ran. Prints a markdown table (docs/planner.md shows one)
and, with ``--json``, writes every figure.

``--plot-from FILE.json --replay --plot FILE.png`` predicts every recorded row again with today's cost model from the
inputs recorded with it (no training), prints the table and draws it.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import yaml

from lightning_app_rlhf.demo import build_tokenizer, prompts, topic_reward
from lightning_app_rlhf.parallel.plan import (
    PlacementPlan,
    flattening_plan,
    interleaving_plan,
    separation_plan,
)
from lightning_app_rlhf.planner import (
    CostModel,
    DeviceType,
    PlanChoice,
    Workload,
    cluster_from_environment,
    measure_background_cores,
    measure_compute_shares,
    plan_placement,
    role_shape,
)
from lightning_app_rlhf.planner.cluster import DEVICE_TYPES
from lightning_app_rlhf.planner.cost_model import PHASES, predicted_phases
from lightning_app_rlhf.planner.profiler import (
    Profile,
    measure_collectives_in_processes,
    measure_wrapper_steps,
    model_work,
    profile_workload,
)

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples/configs/demo_cpu.yaml"
PRESETS = {
    "flattening": flattening_plan,
    "interleaving": interleaving_plan,
    "separation": separation_plan,
    # Bounded staleness on the fixed schedule (SeparationStrategy(max_staleness=k)): k=1 is overlap=True.
    **{f"separation_k{k}": partial(separation_plan, max_staleness=k) for k in (1, 2, 4)},
    # Free-running (SeparationStrategy(max_staleness=k, free_running=True)): two sides, each at its own pace.
    **{f"separation_free_k{k}": partial(separation_plan, max_staleness=k, free_running=True) for k in (0, 1, 2, 4)},
}
DEFAULT_PRESETS = ("flattening", "interleaving", "separation")
MODELS = {
    "tiny": {},  # the demo config's own model
    "small": {
        "n_layer": 6,
        "n_embd": 256,
        "n_head": 8,
        "vocab_size": 8192,
    },  # lightning_app_rlhf.bench "small"
}


def run_cli(
    plan: PlacementPlan, model: dict[str, int], steps: int, workdir: Path, name: str
) -> list[dict[str, float]]:
    """Train the demo config under ``plan`` for ``steps`` iterations; the rows of its metrics.csv."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    strategy = {
        "class_path": "lightning_app_rlhf.strategies.PlacementStrategy",
        "init_args": {"plan": plan.to_dict()},
    }
    strategy_file = workdir / f"{name}.strategy.yaml"
    strategy_file.write_text(yaml.safe_dump({"trainer": {"strategy": strategy}}))
    extra = [x for field, value in model.items() for x in (f"--model.actor.config.{field}", str(value))]
    subprocess.run(
        [
            sys.executable, "-m", "lightning_app_rlhf", "fit", "--config", str(CONFIG), "--config", str(strategy_file),
            "--trainer.max_steps", str(steps), "--trainer.devices", str(plan.world_size),
            "--trainer.enable_checkpointing", "false", "--trainer.callbacks", "[]",
            "--trainer.enable_progress_bar", "false", "--trainer.logger.init_args.save_dir", str(workdir),
            "--trainer.logger.init_args.name", name, *extra,
        ],
        cwd=workdir, env=env, check=True, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    (metrics,) = (workdir / name).rglob("metrics.csv")
    return [{k: float(v) for k, v in row.items() if v} for row in csv.DictReader(metrics.open())]


def demo_workload(model: dict[str, int]) -> Workload:
    """The demo config's workload, with ``model`` overriding fields of its GPT-2 config."""
    config = yaml.safe_load(CONFIG.read_text())
    actor_config = {**config["model"]["actor"]["config"], **model}
    tokenizer = build_tokenizer()
    batch = config["data"]["batch_size"]
    lengths = [len(tokenizer.encode(t, add_special_tokens=False)) for t in prompts()]
    # Batches pad to their longest prompt: the mean of per-batch maxima.
    prompt_length = round(statistics.mean(max(lengths[i : i + batch]) for i in range(0, len(lengths), batch)))
    return Workload(
        actor=role_shape(actor_config),
        critic=role_shape(actor_config, "value"),
        reference=role_shape(actor_config),
        reward=None,
        batch_size=batch,
        prompt_length=prompt_length,
        generation_length=config["model"]["generation"]["max_new_tokens"],
        ppo_epochs=config["model"]["ppo"]["ppo_epochs"],
        num_minibatches=config["model"]["ppo"]["num_minibatches"],
        # FSDP2 on the CPU adds hook and per-unit costs the cost model does not measure yet: search DDP only.
        wrappers=("ddp",),
        name="demo",
    )


def full_speed_profile(workload: Workload) -> Profile:
    """A fresh profile (no cache) of CPU seconds per op: the median process CPU time of 7 repeats per point, on one
    thread, is what the op costs at full speed however busy the machine is; the measured compute shares then say how
    fast the runs get that CPU."""
    return profile_workload(
        workload, batches=(1, 4, 16, 32), repeats=7, cache_dir=None, statistic="cpu",
        reward_fn=topic_reward, tokenizer=build_tokenizer(), prompts=prompts(),
    )  # fmt: skip


def settled_shares(n: int, args: argparse.Namespace, work: Any) -> tuple[float, ...]:
    """The compute shares the planner decides with, measured as around the runs: after ``--load-sample-s`` of idle,
    twice, again while the two differ by more than ``--max-share-change``; the mean of the last two. (Measured
    right after the profile, 2 busy processes on 2 idle cores read 0.66-0.75 in 3 of 8 cases, against 0.96-1.00
    around every run.)"""
    previous: tuple[float, ...] | None = None
    for _ in range(args.retries + 2):
        # Idle first: let the profile's and the collectives' processes settle.
        measure_background_cores(args.load_sample_s)
        shares = measure_compute_shares(n, args.load_sample_s, work)
        if previous is not None and shares_agree(previous, shares, args):
            break
        previous = shares
    return tuple((a + b) / 2 for a, b in zip(previous, shares))


def shares_agree(first: tuple[float, ...], second: tuple[float, ...], args: argparse.Namespace) -> bool:
    """Whether two share measurements differ by at most ``--max-share-change`` (relative) for every k."""
    return all(abs(a - b) <= args.max_share_change * max(a, b) for a, b in zip(first, second))


def measure_case(
    plan: PlacementPlan,
    model: dict[str, int],
    args: argparse.Namespace,
    workdir: Path,
    name: str,
    device: DeviceType,
    work: Any,
) -> dict[str, Any]:
    """Train once (again while the machine's compute shares moved by more than ``--max-share-change``)."""
    n = plan.world_size
    for attempt in range(args.retries + 1):
        background = measure_background_cores(args.load_sample_s)
        before = measure_compute_shares(n, args.load_sample_s, work)
        latency_before = measure_collectives_in_processes(device, n).collective_latency_s
        rows = run_cli(plan, model, args.steps, workdir, f"{name}_{attempt}")
        latency_after = measure_collectives_in_processes(device, n).collective_latency_s
        after = measure_compute_shares(n, args.load_sample_s, work)
        if shares_agree(before, after, args):
            break
    steps = [r for r in rows if "perf/samples_per_sec" in r][args.skip :]
    seconds = [32 / r["perf/samples_per_sec"] for r in steps]  # the demo's rollout batch is 32 prompts
    memory = next(r for r in rows if "memory/param_bytes_rank0" in r)
    trained = [r for r in rows if "perf/samples_per_sec" in r]
    return {
        # Every iteration's reward against the training_step seconds so far (the reward-vs-time curves).
        "curve": [[int(r["step"]), r["reward/mean"], 32 / r["perf/samples_per_sec"]] for r in trained],
        "measured_s": statistics.median(seconds),  # robust to spikes of the other jobs
        "measured_phases_s": {p: statistics.median(r[f"time/{p}_s"] for r in steps) for p in PHASES},
        "measured_spread_s": statistics.stdev(seconds) if len(seconds) > 1 else 0.0,
        "compute_shares": tuple((a + b) / 2 for a, b in zip(before, after)),
        "shares_before_after": [before, after],
        "background_cores": background,
        "collective_latency_s": (latency_before + latency_after) / 2,
        "attempts": attempt + 1,
        "param_bytes": [int(memory[f"memory/param_bytes_rank{r}"]) for r in range(n)],
        "state_bytes": [int(memory[f"memory/state_bytes_rank{r}"]) for r in range(n)],
    }


SHORT_CALLS = {"act.gen": "actor.generate", "ref.for": "reference.forward", "rew.for": "reward.forward",
               "cri.for": "critic.forward", "act.tra": "actor.train", "cri.tra": "critic.train"}
"""The call names of older labels (``act.gen=0-1``)."""


def recorded_plan(row: dict[str, Any]) -> PlacementPlan:
    """The plan a recorded row measured: its preset, or the plan its label names (the planner's choice, DDP)."""
    n = row["processes"]
    if row["plan"] in PRESETS:
        return PRESETS[row["plan"]](n)
    tokens = row["plan_label"].split()
    calls: dict[str, tuple[int, ...]] = {}
    for i, token in enumerate(tokens):
        short, _, ranks = token.partition("=")
        if short in SHORT_CALLS:  # act.gen=0-1
            calls[SHORT_CALLS[short]] = _ranks(ranks)
        elif token.endswith((".generate", ".forward", ".train")):  # actor.generate 0-1
            calls[token] = _ranks(tokens[i + 1])
    return PlacementPlan(n, calls, {"actor": "ddp", "critic": "ddp"}, name=tokens[0])


def _ranks(text: str) -> tuple[int, ...]:
    """``0-2,5`` -> ``(0, 1, 2, 5)``."""
    out: list[int] = []
    for part in text.split(","):
        first, _, last = part.partition("-")
        out += range(int(first), int(last or first) + 1)
    return tuple(out)


def replayed_prediction(row: dict[str, Any], results: dict[str, Any]) -> float:
    """Seconds per iteration the current cost model predicts for a recorded row, given what was measured with it
    (the profile, the gloo bandwidths, each run's all-gather latency and compute shares): the mean over its runs.
    A change of the cost model shows here without training again.

    Args:
        row: One of ``results["rows"]``.
        results: What ``--json`` wrote (its ``profiles`` and ``profiled_on`` too).
    """
    n, workload = row["processes"], demo_workload(MODELS[row["model"]])
    ops = results["profiles"][f"{row['model']} x{n}"]
    used = row["planned_with"]
    device = replace(DEVICE_TYPES["cpu"], intra_node_bandwidth=used["all_gather_bandwidth"],
                     all_reduce_bandwidth=used["all_reduce_bandwidth"])
    choice = PlanChoice(recorded_plan(row))
    predictions = []
    for run in row["runs"]:
        at_run = replace(device, collective_latency_s=run["collective_latency_s"])
        cluster = cluster_from_environment(n, at_run, cores=2, compute_shares=tuple(run["compute_shares"]))
        model = CostModel(cluster, workload, Profile(results["profiled_on"], at_run, ops))
        predictions.append(model.evaluate(choice).iteration_s)
    return statistics.mean(predictions)


def replay(results: dict[str, Any]) -> dict[str, Any]:
    """``results`` with every row's prediction (and error) made again by the current cost model
    (:func:`replayed_prediction`); prints the rows as a markdown table."""
    rows = []
    print("| model | processes | plan | measured s/iter | predicted s/iter | error | was predicted |")
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: |")
    for row in results["rows"]:
        predicted = replayed_prediction(row, results)
        error = (predicted - row["measured_s"]) / row["measured_s"]
        rows.append({**row, "predicted_s": predicted, "error": error})
        print(f"| {row['model']} | {row['processes']} | {row['plan']} | {row['measured_s']:.3f} | {predicted:.3f} | "
              f"{error:+.0%} | {row['predicted_s']:.3f} |")
    return {**results, "rows": rows}


def _mean_phases(runs: Any) -> dict[str, float]:
    runs = list(runs)
    return {p: statistics.mean(r[p] for r in runs) for p in PHASES}


def plot(results: dict[str, Any], path: Path) -> None:
    """Predicted against measured seconds per iteration, one panel per model, the 20% band shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({row["model"] for row in results["rows"]}, key=list(MODELS).index)
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 4.5), squeeze=False)
    for ax, model in zip(axes[0], models):
        rows = [row for row in results["rows"] if row["model"] == model]
        top = 1.15 * max(max(r["measured_s"], r["predicted_s"]) for r in rows)
        ax.fill_between([0, top], [0, 0.8 * top], [0, 1.2 * top], color="0.9", label="within 20%")
        ax.plot([0, top], [0, top], color="0.5", linewidth=0.8)
        colors = {"flattening": "C0", "interleaving": "C1", "separation": "C2", "chosen": "C3",
                  "separation_k1": "C5", "separation_k2": "C6", "separation_k4": "C7",
                  "separation_free_k0": "C8", "separation_free_k1": "C9", "separation_free_k2": "C8",
                  "separation_free_k4": "C9"}
        for row in rows:
            marker = "o" if row["processes"] == 2 else "s"
            ax.scatter(
                row["measured_s"],
                row["predicted_s"],
                marker=marker,
                s=40,
                color=colors.get(row["plan"], "C4"),
                label=f"{row['plan']}, {row['processes']} processes",
            )
        ax.set_xlim(0, top)
        ax.set_ylim(0, top)
        ax.set_xlabel("measured s / iteration")
        ax.set_ylabel("predicted s / iteration")
        ax.set_title(f"{model} (o: 2 processes, s: 4 processes)")
        ax.legend(fontsize=7)
    _save_figure(fig, path)


def _save_figure(fig: Any, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_curves(results: dict[str, Any], path: Path, window: int = 50) -> None:
    """Reward against the seconds spent in ``training_step`` (rank 0), one line per plan of each model and process
    count: the mean reward of the last ``window`` iterations, from each plan's first round."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = sorted({(row["model"], row["processes"]) for row in results["rows"]})
    fig, axes = plt.subplots(1, len(cases), figsize=(6 * len(cases), 4.5), squeeze=False)
    for ax, (model, processes) in zip(axes[0], cases):
        for row in (r for r in results["rows"] if (r["model"], r["processes"]) == (model, processes)):
            curve = row["runs"][0].get("curve")
            if not curve:
                continue
            seconds, rewards, elapsed = [], [], 0.0
            for i, (_, reward, iteration_s) in enumerate(curve):
                elapsed += iteration_s
                seconds.append(elapsed)
                recent = curve[max(0, i + 1 - window) : i + 1]
                rewards.append(statistics.mean(r for _, r, _ in recent))
            ax.plot(seconds, rewards, label=row["plan"], linewidth=1.2)
        ax.set_xlabel("seconds in training_step (rank 0)")
        ax.set_ylabel(f"reward/mean, last {window} iterations")
        ax.set_title(f"{model}, {processes} processes")
        ax.legend(fontsize=7)
    _save_figure(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=["tiny", "small"])
    parser.add_argument("--presets", nargs="+", choices=sorted(PRESETS), default=list(DEFAULT_PRESETS),
                        help="the plans measured beside the planner's choice (separation_kN: max_staleness=N)")
    parser.add_argument("--devices", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--skip", type=int, default=5, help="first iterations left out of the measured mean")
    parser.add_argument(
        "--load-sample-s", type=float, default=1.0, help="seconds of each load measurement (3 per share)"
    )
    parser.add_argument("--max-share-change", type=float, default=0.2, help="relative; more: measure again")
    parser.add_argument("--retries", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2, help="round-robin repeats of every case; their mean")
    parser.add_argument("--json", type=Path, default=None, help="write every figure here")
    parser.add_argument("--plot", type=Path, default=None, help="draw predicted vs measured here (a .png)")
    parser.add_argument("--plot-from", type=Path, default=None, help="only draw --plot from this --json file")
    parser.add_argument("--replay", action="store_true",
                        help="with --plot-from: predict every row again with the current cost model first")
    parser.add_argument("--curves", type=Path, default=None,
                        help="draw reward against training time per plan here (a .png)")
    args = parser.parse_args()
    if args.plot_from is not None:
        figures = json.loads(args.plot_from.read_text())
        if args.replay:
            figures = replay(figures)
        plot(figures, args.plot or args.plot_from.with_suffix(".png"))
        if args.curves is not None:
            plot_curves(figures, args.curves)
        return
    results = []
    profiles: dict[str, Any] = {}
    print(
        "| model | processes | plan | other jobs' cores | share of a core, 1..n busy | measured s/iter | predicted s/iter | error | "
        "param bytes per rank measured | predicted | state bytes measured | predicted |"
    )
    print("| --- | ---: | --- | ---: | --- | ---: | ---: | ---: | --- | --- | --- | --- |", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for model_name in args.models:
            model = MODELS[model_name]
            workload = demo_workload(model)
            work = model_work(workload)  # what the shares are measured with: an engine-like iteration
            for devices in args.devices:
                profile = full_speed_profile(workload).merge(measure_wrapper_steps(workload, devices, workload.wrappers))
                profiles[f"{model_name} x{devices}"] = profile.ops
                device = measure_collectives_in_processes(profile.device, devices)
                profiled = type(profile)(profile.hardware, device, profile.ops)
                cases = {name: PRESETS[name](devices) for name in args.presets}
                # The planner decides with the machine's shares as they are now; its choice is measured too.
                cluster = cluster_from_environment(
                    devices, device, compute_shares=settled_shares(devices, args, work)
                )
                best = plan_placement(cluster, workload, profile=profiled, seed=0, time_budget_s=5).best
                chosen = next((k for k, p in cases.items() if PlanChoice(p).key == best.choice.key), "chosen")
                if chosen == "chosen":
                    cases["chosen"] = best.plan
                runs: dict[str, list[dict[str, Any]]] = {label: [] for label in cases}
                for round_ in range(args.rounds):  # round-robin, so slow spells of the machine hit every case
                    for label, plan in cases.items():
                        name = f"{model_name}_{devices}_{label}_{round_}"
                        m = measure_case(plan, model, args, Path(tmp), name, device, work)
                        at_run = replace(device, collective_latency_s=m["collective_latency_s"])
                        estimate = CostModel(
                            cluster_from_environment(devices, at_run, compute_shares=m["compute_shares"]),
                            workload,
                            Profile(profile.hardware, at_run, profile.ops),
                        ).evaluate(PlanChoice(plan))
                        runs[label].append({
                            **m, "predicted_s": estimate.iteration_s,
                            "predicted_phases_s": predicted_phases(estimate), "estimate": estimate,
                        })  # fmt: skip
                for label, plan in cases.items():
                    done = runs[label]
                    measured = statistics.mean(r["measured_s"] for r in done)
                    predicted = statistics.mean(r["predicted_s"] for r in done)
                    estimate = done[-1]["estimate"]
                    row = {
                        "model": model_name,
                        "processes": devices,
                        "plan": label,
                        "chosen": label == chosen,
                        "plan_label": PlanChoice(plan).label,
                        "measured_s": measured,
                        "predicted_s": predicted,
                        "error": (predicted - measured) / measured,
                        "runs": [{k: v for k, v in r.items() if k != "estimate"} for r in done],
                        "measured_phases_s": _mean_phases(r["measured_phases_s"] for r in done),
                        "predicted_phases_s": _mean_phases(r["predicted_phases_s"] for r in done),
                        "planned_with": {  # what the planner decided with, before the runs
                            "compute_shares": cluster.compute_shares,
                            "collective_latency_s": device.collective_latency_s,
                            "all_gather_bandwidth": device.intra_node_bandwidth,
                            "all_reduce_bandwidth": device.all_reduce_bandwidth,
                            "predicted_s": CostModel(cluster, workload, profiled)
                            .evaluate(PlanChoice(plan))
                            .iteration_s,
                        },
                        "param_bytes": done[-1]["param_bytes"],
                        "state_bytes": done[-1]["state_bytes"],
                        "predicted_param_bytes": [r.param_bytes for r in estimate.memory],
                        "predicted_state_bytes": [r.state_bytes for r in estimate.memory],
                    }
                    results.append(row)
                    shares = tuple(map(statistics.mean, zip(*(r["compute_shares"] for r in done))))
                    background = statistics.mean(r["background_cores"] for r in done)
                    star = " (chosen)" if row["chosen"] else ""
                    print(
                        f"| {model_name} | {devices} | {label}{star} | {background:.1f} | "
                        f"{' '.join(f'{x:.2f}' for x in shares)} | "
                        f"{measured:.3f} | {predicted:.3f} | {row['error']:+.0%} | "
                        f"{row['param_bytes']} | {row['predicted_param_bytes']} | {row['state_bytes']} | "
                        f"{row['predicted_state_bytes']} |",
                        flush=True,
                    )
                fastest = min(results[-len(cases) :], key=lambda r: r["measured_s"])
                mine = next(r for r in results[-len(cases) :] if r["chosen"])
                print(
                    f"<!-- {model_name} x{devices}: chosen {chosen} = {PlanChoice(cases[chosen]).label}: measured "
                    f"{mine['measured_s']:.3f} s; fastest measured {fastest['plan']} {fastest['measured_s']:.3f} s "
                    f"({mine['measured_s'] / fastest['measured_s'] - 1:+.1%}) -->",
                    flush=True,
                )
    figures = {"profiled_on": profile.hardware, "time": time.ctime(), "rows": results, "profiles": profiles}
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=1))
    if args.plot is not None:
        plot(figures, args.plot)
    if args.curves is not None:
        plot_curves(figures, args.curves)


if __name__ == "__main__":
    main()
