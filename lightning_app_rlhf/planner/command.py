"""``python -m lightning_app_rlhf plan``: a dry run of the planner, no training.

python -m lightning_app_rlhf plan --cluster 1x8xA100-80GB --actor llama-7b --critic llama-7b
python -m lightning_app_rlhf plan --cluster 1x8xA100-80GB --actor llama-7b --algorithm grpo --num-samples 4
python -m lightning_app_rlhf plan --cluster 1x4xcpu --actor gpt2-tiny --batch-size 32 --json
python -m lightning_app_rlhf plan --sweep   # the LLaMA table of docs/planner.md
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from lightning_app_rlhf.algorithms import ALGORITHMS
from lightning_app_rlhf.planner.cluster import parse_cluster
from lightning_app_rlhf.planner.cost_model import gib
from lightning_app_rlhf.planner.search import SEARCHES, PlannerError, PlannerResult, plan_placement
from lightning_app_rlhf.planner.workload import Workload, installed_wrappers, role_shape
from lightning_app_rlhf.role_table import ACTOR, CRITIC, REFERENCE, REWARD, calls_of
from lightning_app_rlhf.wrappers import WRAPPERS, wrapper_class

SWEEP_MODELS = ("llama-7b", "llama-13b", "llama-33b", "llama-65b")
SWEEP_CLUSTERS = ("1x8xA100-80GB", "2x8xA100-80GB", "4x8xA100-80GB", "8x8xA100-80GB")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_app_rlhf plan",
        description="Predict and search RLHF placements for a cluster (dry run).",
    )
    parser.add_argument(
        "--cluster", default="1x8xA100-80GB", help="NODESxDEVICESxTYPE, e.g. 1x8xA100-80GB, 1x4xcpu"
    )
    parser.add_argument(
        "--actor", default="llama-7b", help="named size, local model directory or config.json"
    )
    parser.add_argument(
        "--algorithm",
        choices=sorted(ALGORITHMS),
        default="ppo",
        help="the RL algorithm (RLHFModule(algorithm=...)); only ppo has a critic, the others are planned "
        "without critic calls",
    )
    parser.add_argument(
        "--num-samples",
        type=int,
        default=1,
        help="responses sampled per prompt (generation.num_samples, the group size G of grpo/rloo): each "
        "iteration generates, scores and trains on batch-size x num-samples sequences",
    )
    parser.add_argument("--critic", default=None, help="default: the actor's size (--algorithm ppo only)")
    parser.add_argument("--reference", default=None, help="default: the actor's size")
    parser.add_argument(
        "--reward",
        default=None,
        help="default: the critic's size (the actor's without a critic); 'function' for a Python reward",
    )
    parser.add_argument(
        "--dtype",
        choices=("bf16", "fp32"),
        default=None,
        help="default: bf16 on GPUs (mixed-precision AdamW), fp32 on cpu",
    )
    parser.add_argument(
        "--batch-size", type=int, default=512, help="prompts per iteration (each sampled --num-samples times)"
    )
    parser.add_argument("--prompt-length", type=int, default=256)
    parser.add_argument("--generation-length", type=int, default=480)
    parser.add_argument("--ppo-epochs", type=int, default=1)
    parser.add_argument("--num-minibatches", type=int, default=8)
    parser.add_argument(
        "--wrappers",
        default=",".join(installed_wrappers()),
        help=f"comma-separated subset of the wrappers {','.join(WRAPPERS)}{_packages_note()}; default: those "
        "installed here",
    )
    parser.add_argument(
        "--lora-rank",
        type=int,
        default=None,
        help="train LoRA adapters of this rank (reference = the actor's base); 0 = full fine-tuning. "
        "Default: full fine-tuning, and 128 with --sweep (as APP)",
    )
    parser.add_argument("--search", choices=SEARCHES, default="both")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--time-budget", type=float, default=5.0, help="seconds for the MCMC chain")
    parser.add_argument("--top-k", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="LLaMA 7B-65B actor+critic (or actor alone for a critic-free --algorithm) on 1x8..8x8 A100-80GB: a "
        "markdown table (docs/planner.md)",
    )
    return parser


def _packages_note() -> str:
    """`` (zero1, zero2, zero3 need deepspeed)``: the registry's wrappers that need a package beyond torch."""
    needs: dict[str, list[str]] = {}
    for name, cls in WRAPPERS.items():
        if cls.package:
            needs.setdefault(cls.package, []).append(name)
    return "".join(
        f" ({', '.join(names)} need{'s' * (len(names) == 1)} {package})" for package, names in needs.items()
    )


def check_algorithm_args(args: argparse.Namespace) -> None:
    """Raise a ``ValueError`` naming the fix when the flags do not fit ``--algorithm``."""
    algorithm = ALGORITHMS[args.algorithm]
    if args.critic is not None and CRITIC.name not in algorithm.roles:
        raise ValueError(
            f"--critic {args.critic} sets the critic's size, but algorithm {args.algorithm!r} has no critic. "
            "Remove --critic (use --reward to size the reward model), or use --algorithm ppo."
        )
    if algorithm.min_group_size > 1 and args.num_samples < algorithm.min_group_size:
        raise ValueError(
            f"Algorithm {args.algorithm!r} compares the responses of one prompt with each other and needs at least "
            f"{algorithm.min_group_size} per prompt; --num-samples is {args.num_samples}. Pass --num-samples "
            f"{max(algorithm.min_group_size, 4)} (or more)."
        )


def workload_from_args(args: argparse.Namespace, gpu: bool) -> Workload:
    """The workload the flags describe: the roles of ``--algorithm`` (no critic for a critic-free one)."""
    check_algorithm_args(args)
    dtype_bytes = {"bf16": 2, "fp32": 4}[args.dtype or ("bf16" if gpu else "fp32")]
    has_critic = CRITIC.name in ALGORITHMS[args.algorithm].roles
    critic = (args.critic or args.actor) if has_critic else None
    reward = (
        None
        if args.reward == "function"
        else role_shape(args.reward or critic or args.actor, "classifier", dtype_bytes)
    )
    wrappers = tuple(w.strip() for w in args.wrappers.split(",") if w.strip())
    for wrapper in wrappers:
        wrapper_class(wrapper)  # unknown, or its package missing: a ValueError with the choices or the install
    name = f"{args.actor}+{critic}" if has_critic else f"{args.actor} {args.algorithm}"
    if args.num_samples > 1:
        name += f" G={args.num_samples}"
    return Workload(
        actor=role_shape(args.actor, "causal_lm", dtype_bytes),
        critic=role_shape(critic, "value", dtype_bytes) if critic is not None else None,
        reference=role_shape(args.reference or args.actor, "causal_lm", dtype_bytes),
        reward=reward,
        batch_size=args.batch_size,
        prompt_length=args.prompt_length,
        generation_length=args.generation_length,
        ppo_epochs=args.ppo_epochs,
        num_minibatches=args.num_minibatches,
        num_samples=args.num_samples,
        algorithm=args.algorithm,
        wrappers=wrappers,
        # AdamW: two state tensors per element (the wrappers count them in memory); the analytic step time reads
        # 12 bytes per parameter at bf16 (fp32 master weights and moments), 8 at fp32.
        optimizer_bytes_per_param=12.0 if dtype_bytes == 2 else 8.0,
        optimizer_slots=2,
        gradient_checkpointing=gpu,
        flash_attention=gpu,
        lora_rank=args.lora_rank or None,
        name=name + (f" LoRA {args.lora_rank}" if args.lora_rank else ""),
    )


def run(args: argparse.Namespace) -> PlannerResult:
    cluster = parse_cluster(args.cluster)
    workload = workload_from_args(args, gpu=cluster.cores_per_node is None)
    return plan_placement(
        cluster,
        workload,
        search=args.search,
        seed=args.seed,
        time_budget_s=args.time_budget,
        top_k=args.top_k,
    )


def print_result(result: PlannerResult) -> None:
    from rich.console import Console
    from rich.table import Table

    w = result.workload
    batch = f"batch {w.batch_size}" if w.num_samples == 1 else f"batch {w.batch_size} prompts x {w.num_samples} samples"
    table = Table(
        title=f"{w.name} ({w.algorithm}: {', '.join(w.roles)}) on {result.cluster.name}: {batch}, prompt "
        f"{w.prompt_length} + generation {w.generation_length} tokens, {w.ppo_epochs} epoch(s) x "
        f"{w.num_minibatches} minibatches ({result.search_s:.1f} s search)"
    )
    for column in (
        "",
        "source",
        "placement",
        "wrappers",
        "gen batch",
        "micro",
        "iter s",
        "samples/s",
        "peak/device",
        "vs flattening",
        "note",
    ):
        table.add_column(
            column, justify="right" if column in ("iter s", "samples/s", "vs flattening") else "left"
        )
    flat = result.presets.get("flattening")
    for c in result.candidates:
        e = c.estimate
        speedup = (
            f"{flat.iteration_s / e.iteration_s:.2f}x"
            if e.fits and flat is not None and flat.estimate.fits
            else "-"
        )
        table.add_row(
            "*" if c is result.best else "",
            c.source,
            _groups(c),
            _wrappers_text(c.plan.wrappers),
            str(c.choice.generation_batch or "all"),
            str(c.choice.micro_batch or "all"),
            f"{e.iteration_s:.2f}" if e.fits else "-",
            f"{e.samples_per_s:.2f}" if e.fits else "-",
            f"{gib(e.peak_bytes)} / {gib(e.capacity_bytes)}",
            speedup,
            e.rejected or "",
        )
    console = Console(width=200)
    console.print(table)
    for rule in result.rules:
        console.print(f"rule: {rule}")


SHORT_CALLS = {
    ACTOR.call("generate"): "gen",
    REFERENCE.call("forward"): "ref",
    REWARD.call("forward"): "rew",
    CRITIC.call("forward"): "val",
    ACTOR.call("train"): "trainA",
    CRITIC.call("train"): "trainC",
}
"""Column labels of the calls in the printed tables."""


def _wrappers_text(wrappers: dict[str, str]) -> str:
    """``act:ddp cri:fsdp2 rew:fsdp2``: each wrapped role's wrapper, by the role's first three letters."""
    return " ".join(f"{role[:3]}:{wrapper}" for role, wrapper in wrappers.items())


def _groups(candidate: Any) -> str:
    plan = candidate.plan
    parts = []
    for call in calls_of(plan.roles):
        ranks = plan.ranks(call)
        text = (
            f"{ranks[0]}-{ranks[-1]}"
            if ranks == tuple(range(ranks[0], ranks[-1] + 1))
            else ",".join(map(str, ranks))
        )
        parts.append(f"{SHORT_CALLS.get(call, call)}:{text}")
    return f"{plan.name} " + " ".join(parts)


def sweep(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every LLaMA size on every cluster of the docs table; one row each (errors included)."""
    rows = []
    lora_rank = 128 if args.lora_rank is None else args.lora_rank
    check_algorithm_args(args)
    has_critic = CRITIC.name in ALGORITHMS[args.algorithm].roles
    for model in SWEEP_MODELS:
        for cluster in SWEEP_CLUSTERS:
            sizes = {"actor": model, "critic": model if has_critic else None}
            case = argparse.Namespace(**{**vars(args), "cluster": cluster, **sizes, "lora_rank": lora_rank})
            try:
                result = run(case)
            except PlannerError as err:
                rows.append({"model": model, "cluster": cluster, "error": str(err)})
                continue
            best = result.best
            rows.append(
                {
                    "model": model,
                    "cluster": cluster,
                    "best": _groups(best),
                    "wrappers": "/".join(f"{r[:3]}:{w}" for r, w in best.plan.wrappers.items()),
                    "peak_memory_gib": best.estimate.peak_bytes / 2**30,
                    "source": best.source,
                    "iteration_s": best.iteration_s,
                    "samples_per_s": best.samples_per_s,
                    "speedup_over_flattening": result.speedup_over("flattening"),
                    "presets_s": {
                        n: (c.iteration_s if c.estimate.fits else None) for n, c in result.presets.items()
                    },
                    "search_s": result.search_s,
                }
            )
    return rows


def print_sweep(rows: list[dict[str, Any]]) -> None:
    print(
        "| model | cluster | chosen plan (ranks per call) | wrappers | iter s | peak GiB | flattening s | "
        "interleaving s | separation s | speedup vs flattening | search s |"
    )
    print("| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        if "error" in r:
            print(f"| {r['model']} | {r['cluster']} | does not fit: {r['error']} | | | | | | | | |")
            continue
        presets = r["presets_s"]
        fmt = lambda v: f"{v:.1f}" if v is not None else "OOM"
        speedup = r["speedup_over_flattening"]
        print(
            f"| {r['model']} | {r['cluster']} | {r['best']} ({r['source']}) | {r['wrappers']} | "
            f"{r['iteration_s']:.1f} | {r['peak_memory_gib']:.1f} | {fmt(presets.get('flattening'))} | {fmt(presets.get('interleaving'))} | "
            f"{fmt(presets.get('separation'))} | {f'{speedup:.2f}x' if speedup else 'flattening OOM'} | "
            f"{r['search_s']:.1f} |"
        )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.sweep:
            rows = sweep(args)
            print(json.dumps(rows, indent=1)) if args.json else print_sweep(rows)
            return 0
        result = run(args)
    except (PlannerError, ValueError) as err:
        if args.json:
            print(json.dumps({"error": str(err)}))
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result.to_dict(), indent=1, default=_json_default))
    else:
        print_result(result)
    return 0


def _json_default(value: Any) -> Any:
    if isinstance(value, float):
        return None
    return str(value)
