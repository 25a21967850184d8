"""Every plan that ``plan`` ranks for the demo on this CPU, and pipelined plans, predicted against measured.

    OMP_NUM_THREADS=1 PYTHONPATH=$PWD python benchmarks/plan_candidates.py --devices 2 4 --json out.json

For each process count it runs, as a new user would, ``python -m lightning_app_rlhf plan --config
examples/configs/demo_cpu.yaml --cluster 1xNxcpu --json`` (``--profile auto``: it measures this machine first), then
trains the demo config under every plan the command ranked (its tables' rows: presets with their wrappers, and the
searched plans) and under the pipelined plans of :data:`PIPELINED` (priced with the same measurements, which the
command's JSON carries), ``--steps`` iterations each, ``--rounds`` times round-robin. Measured time per iteration is
the median over the iterations after ``--skip`` of ``batch / perf/samples_per_sec`` on rank 0, averaged over the
rounds. Prints a markdown table (docs/planner.md, "Calibration on this CPU", shows one) and, with ``--json``, writes
every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from planner_calibration import CONFIG, demo_workload, run_cli

from lightning_app_rlhf.parallel.plan import PlacementPlan, flattening_plan
from lightning_app_rlhf.planner import CostModel, DeviceType, PlanChoice, cluster_from_environment
from lightning_app_rlhf.planner.profiler import Profile

ROOT = Path(__file__).resolve().parents[1]
PLAN_FIELDS = ("calls", "wrappers", "tp", "pp", "pipeline_schedule", "max_staleness", "free_running",
               "unshard_for_generation", "name")


def pipelined(n: int) -> dict[str, PlacementPlan]:
    """Flattening with both train calls pipelined over 2 stages (DDP over the n / 2 pipelines), and with the scoring
    calls of the reference and the critic pipelined on the same stages."""
    base = flattening_plan(n, "ddp")
    trains = {"actor.train": 2, "critic.train": 2}
    return {
        f"flattening, train calls pp2 (dp{n // 2})": PlacementPlan(n, base.calls, base.wrappers, name="pp2", pp=trains),
        f"flattening, train and scoring pp2 (dp{n // 2})": PlacementPlan(
            n, base.calls, base.wrappers, name="pp2-scoring",
            pp={**trains, "reference.forward": 2, "critic.forward": 2}),
    }


def plan_command(n: int) -> dict[str, Any]:
    """``plan --config demo_cpu.yaml --cluster 1xNxcpu --json``, as a new user runs it."""
    out = subprocess.run(
        [sys.executable, "-m", "lightning_app_rlhf", "plan", "--config", str(CONFIG), "--cluster", f"1x{n}xcpu",
         "--json"],
        capture_output=True, text=True, check=True, timeout=1800,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    return json.loads(out.stdout)


def priced_alike(planned: dict[str, Any], plan: PlacementPlan) -> float:
    """Seconds per iteration of ``plan`` with what the plan command measured (its JSON's ``measured``)."""
    measured = planned["measured"]
    device = DeviceType(**measured["device"])
    cluster = cluster_from_environment(plan.world_size, device, compute_shares=tuple(measured["compute_shares"]))
    profile = Profile(measured["hardware"], device, measured["ops"])
    return CostModel(cluster, demo_workload({}), profile).evaluate(PlanChoice(plan)).iteration_s


def measure(plan: PlacementPlan, steps: int, skip: int, workdir: Path, name: str) -> dict[str, Any]:
    rows = run_cli(plan, {}, steps, workdir, name)
    seconds = [32 / r["perf/samples_per_sec"] for r in rows if "perf/samples_per_sec" in r][skip:]
    return {"median_s": statistics.median(seconds), "quartiles_s": statistics.quantiles(seconds, n=4)}


def plot(results: list[dict[str, Any]], path: Path) -> None:
    """Predicted against measured seconds per iteration, one panel per process count, the 20% band shaded; the
    plan the command picked circled."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counts = sorted({r["processes"] for r in results if "plan" in r})
    fig, axes = plt.subplots(1, len(counts), figsize=(5.5 * len(counts), 4.8), squeeze=False)
    for ax, n in zip(axes[0], counts):
        rows = [r for r in results if r.get("processes") == n and "plan" in r]
        top = 1.15 * max(max(r["measured_s"], r["predicted_s"]) for r in rows)
        ax.fill_between([0, top], [0, 0.8 * top], [0, 1.2 * top], color="0.9", label="within 20%")
        ax.plot([0, top], [0, top], color="0.5", linewidth=0.8)
        for source, color in (("preset", "C0"), ("mcmc", "C1"), ("app", "C2"), ("blocks", "C2"), ("pp", "C3")):
            mine = [r for r in rows if r["source"] == source]
            if mine:
                ax.scatter([r["measured_s"] for r in mine], [r["predicted_s"] for r in mine], s=30, color=color,
                           label={"pp": "pipelined (pp2)", "preset": "preset"}.get(source, f"searched ({source})"))
        chosen = [r for r in rows if r.get("chosen")]
        ax.scatter([r["measured_s"] for r in chosen], [r["predicted_s"] for r in chosen], s=160, facecolors="none",
                   edgecolors="k", label="picked")
        ax.set_xlim(0, top)
        ax.set_ylim(0, top)
        ax.set_xlabel("measured s / iteration")
        ax.set_ylabel("predicted s / iteration")
        ax.set_title(f"demo on {n} processes of 2 cores: every plan `plan` ranks")
        ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--skip", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None, help="draw predicted against measured here (a .png)")
    parser.add_argument("--plot-from", type=Path, default=None, help="only draw --plot from this --json file")
    args = parser.parse_args()
    if args.plot_from is not None:
        plot(json.loads(args.plot_from.read_text()), args.plot or args.plot_from.with_suffix(".png"))
        return
    results = []
    print("| processes | plan | source | wrappers | predicted s/iter | measured s/iter | error |")
    print("| ---: | --- | --- | --- | ---: | ---: | ---: |", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.devices:
            planned = plan_command(n)
            cases: list[tuple[str, str, PlacementPlan, float]] = []
            for i, c in enumerate(planned["candidates"]):
                if c["iteration_s"] is None:
                    continue  # does not fit: not run
                plan = PlacementPlan.from_dict({"world_size": n, **{k: c[k] for k in PLAN_FIELDS if k in c}})
                cases.append((f"#{i + 1} {c['label']}", c["source"], plan, c["iteration_s"]))
            cases += [(label, "pp", plan, priced_alike(planned, plan)) for label, plan in pipelined(n).items()]
            runs: dict[str, list[float]] = {label: [] for label, *_ in cases}
            for round_ in range(args.rounds):
                for j, (label, _, plan, _) in enumerate(cases):
                    runs[label].append(measure(plan, args.steps, args.skip, Path(tmp), f"x{n}_{j}_{round_}")["median_s"])
            best_label = planned["best"]["label"]
            for label, source, plan, predicted in cases:
                measured = statistics.mean(runs[label])
                row = {"processes": n, "plan": label, "source": source, "wrappers": dict(plan.wrappers),
                       "predicted_s": predicted, "measured_s": measured, "runs_s": runs[label],
                       "error": predicted / measured - 1, "chosen": label.endswith(best_label) and label.startswith("#1 ")}
                results.append(row)
                print(f"| {n} | {label}{' (chosen)' if row['chosen'] else ''} | {source} | "
                      f"{' '.join(f'{r}:{w}' for r, w in plan.wrappers.items())} | {predicted:.3f} | {measured:.3f} | "
                      f"{row['error']:+.0%} |", flush=True)
            mine = [r for r in results if r["processes"] == n]
            chosen, fastest = mine[0], min(mine, key=lambda r: r["measured_s"])
            print(f"<!-- x{n}: chosen {chosen['plan']} measured {chosen['measured_s']:.3f} s; fastest {fastest['plan']} "
                  f"{fastest['measured_s']:.3f} s ({chosen['measured_s'] / fastest['measured_s'] - 1:+.1%}) -->",
                  flush=True)
            results.append({"processes": n, "measured_with": planned["measured"], "notes": planned["notes"]})
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))
    if args.plot is not None:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
