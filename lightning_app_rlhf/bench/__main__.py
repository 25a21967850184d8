"""``python -m lightning_app_rlhf.bench``: ours vs TRL 1.12's PPOTrainer and TRL 1.16's GRPOTrainer, and the
placements against each other.

``python -m lightning_app_rlhf.bench run`` does them all and rewrites ``docs/benchmarks.md``; ``trl``, ``grpo``
and ``placements`` do one part (``grpo`` runs its peer in a virtual environment of its own, made on first use); ``report`` redraws the doc from a results JSON. ``checkpoint`` measures resident memory
during checkpoint saves, ``soak`` each rank's resident memory over a long run (neither is part of ``run``).
``--help`` on each lists the settings.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

from jsonargparse import auto_cli
from rich.console import Console

from lightning_app_rlhf.bench.decode import decode
from lightning_app_rlhf.bench.ours import fit_job, read_timings, run_ours, run_ours_checkpointing
from lightning_app_rlhf.bench.predict import measure_machine
from lightning_app_rlhf.bench.predict import predict as predicted_run
from lightning_app_rlhf.bench.presets import PLACEMENTS, RunSettings
from lightning_app_rlhf.bench.profile import profile_iteration, profile_table
from lightning_app_rlhf.bench.report import checkpoint_table, write_report
from lightning_app_rlhf.bench.results import count_parameters, machine, spread, summarize, summarize_checkpoint
from lightning_app_rlhf.bench.agent_race import race_agent, report_agent_race
from lightning_app_rlhf.bench.smollm2_race import race_smollm2, report_race
from lightning_app_rlhf.bench.turns import TurnJob, run_in_turns

console = Console(stderr=True)
REPOSITORY = Path(__file__).resolve().parents[2]
"""The checkout this package runs from: put on a peer environment's ``PYTHONPATH``."""
PLACEMENT_SETTINGS = {
    "generation-heavy": {"new_tokens": 64, "ppo_epochs": 1, "num_minibatches": 1},
    "training-heavy": {"new_tokens": 16, "ppo_epochs": 4, "num_minibatches": 2},
    "uneven": {"new_tokens": 128, "mean_length": 16, "ppo_epochs": 1, "num_minibatches": 1},
}
"""The placement workloads: long responses and one short update; short responses and many updates; responses of
very uneven length (geometric stops, mean 16 of 128: where partial rollouts pay)."""


def compare_trl(
    presets: list[str] = ["tiny", "small"],  # noqa: B006 - jsonargparse reads the default
    precisions: list[str] = ["32-true", "bf16-mixed"],  # noqa: B006
    repeats: int = 2,
    interleave: bool = True,
    run: RunSettings = RunSettings(),  # noqa: B008 - replaced per cell, never changed
    out: str = "bench_results/trl.json",
) -> list[dict[str, Any]]:
    """Ours vs TRL 1.12.0's PPOTrainer: same models and weights, one PPO epoch, one minibatch, runs that take turns
    step by step.

    Args:
        presets: Model presets to compare (tiny, small, medium); each replaces ``run.preset``.
        precisions: Precisions to compare, each the same on both sides (``32-true``, ``bf16-mixed``); each replaces
            ``run.precision``.
        repeats: Runs per framework and preset, alternating ours / TRL; medians are over all measured iterations.
        interleave: Start ours and TRL's run together and let them take turns, one step each (see
            :mod:`~lightning_app_rlhf.bench.turns`); false: one run after the other.
        run: The settings of every run (:class:`~lightning_app_rlhf.bench.presets.RunSettings`:
            ``--run.batch_size``, ``--run.new_tokens``, ``--run.threads``, ``--run.warmup``, ``--run.iterations``).
        out: Where the JSON results go.
    """
    _check_trl()
    rows = [row for precision in precisions for preset in presets
            for row in _alternate(replace(run, preset=preset, precision=precision), repeats, "trl_peer",
                                  Path(sys.executable), interleave=interleave)]
    _save(out, "trl", rows)
    return rows


def _alternate(
    settings: RunSettings, repeats: int, peer: str, python: Path, decoders: list[str] | None = None,
    padding_free: list[bool] | None = None, interleave: bool = True,
) -> list[dict[str, Any]]:
    """``repeats`` rounds of one run of ours per variant (each of ``decoders`` with each of ``padding_free``; None:
    the settings' own) and one of the peer (the module ``bench.{peer}`` under ``python``): all started together,
    taking turns step by step (``interleave``), or one after the other. One row of the comparison per variant: both
    sides' medians over all measured iterations, and their ratio (the peer's runs are shared by the rows); taking
    turns, also the spread of the per-step ratios (``paired_ratio``: the peer's step time over ours in the same
    round)."""
    params = count_parameters(settings)
    variants = [replace(settings, decoder=decoder, padding_free=free) for decoder in (decoders or [settings.decoder])
                for free in (padding_free or [settings.padding_free])]
    ours_runs: list[list[Any]] = [[] for _ in variants]
    peer_runs = []
    how = "taking turns step by step" if interleave else "one after the other"
    for repeat in range(repeats):
        console.print(f"[bold]{settings.preset} {settings.algorithm} beta {settings.beta:g} {settings.precision}[/] "
                      f"repeat {repeat + 1}/{repeats}: ours ({', '.join(v.variant for v in variants)}) and the peer, "
                      f"{how}")
        with tempfile.TemporaryDirectory() as work:
            folders = [Path(work) / variant.variant for variant in variants]
            if interleave:
                jobs = [TurnJob(f"ours ({variant.variant})", *fit_job(variant, folder), cwd=folder, log_name="fit")
                        for variant, folder in zip(variants, folders)]
                jobs.append(TurnJob("the peer", *_peer_job(settings, Path(work), peer, python), cwd=Path(work),
                                    log_name=peer))
                run_in_turns(jobs, rounds=settings.warmup + settings.iterations)
                for variant, folder, runs in zip(variants, folders, ours_runs):
                    runs.append(read_timings(variant, folder)["ranks"])
                peer_runs.append([json.loads((Path(work) / f"{peer}.json").read_text())])
            else:
                for variant, folder, runs in zip(variants, folders, ours_runs):
                    runs.append(run_ours(variant, folder)["ranks"])
                peer_runs.append([_run_peer(settings, Path(work), peer, python)])
    measured = replace(settings, iterations=settings.iterations * repeats)
    peer_merged = _merge_repeats(peer_runs, settings)
    theirs = summarize(peer_merged, measured, params)
    rows = []
    for variant, runs in zip(variants, ours_runs):
        merged = _merge_repeats(runs, settings)
        ours = summarize(merged, measured, params)
        ratio = ours["samples_per_s"]["median"] / theirs["samples_per_s"]["median"]
        row = {"settings": variant.as_dict(), "params": params, "ours": ours, "trl": theirs,
               "samples_per_s_ratio": ratio, "interleaved": interleave,
               "versions": peer_runs[0][0].get("versions", {})}
        paired = ""
        if interleave:
            rounds = zip(merged[0]["iterations"][settings.warmup :], peer_merged[0]["iterations"][settings.warmup :])
            row["paired_ratio"] = spread([peer_step["wall_s"] / our_step["wall_s"] for our_step, peer_step in rounds])
            paired = f" (per-step pairs: median {row['paired_ratio']['median']:.2f}x)"
        console.print(f"  ours ({variant.variant}) {ours['samples_per_s']['median']:.1f} completions/s, the peer "
                      f"{theirs['samples_per_s']['median']:.1f}: {ratio:.2f}x{paired}")
        rows.append(row)
    return rows


def compare_grpo(
    presets: list[str] = ["tiny", "small"],  # noqa: B006 - jsonargparse reads the default
    betas: list[float] = [0.0, 0.04],  # noqa: B006
    precisions: list[str] = ["32-true"],  # noqa: B006
    decoders: list[str] = ["eager", "static_compiled"],  # noqa: B006
    padding_free: list[bool] = [False],  # noqa: B006
    repeats: int = 2,
    interleave: bool = True,
    run: RunSettings = RunSettings(algorithm="grpo", batch_size=8, num_samples=4),  # noqa: B008
    profile_preset: str | None = "small",
    out: str = "docs/bench_results/grpo.json",
    docs: str | None = "docs/benchmarks.md",
) -> list[dict[str, Any]]:
    """Ours vs TRL 1.16.0's GRPOTrainer: the same random-init policy, prompts, reward function and group size, one
    update per batch, runs that take turns step by step. TRL 1.16 cannot share this environment's TRL 1.12: it runs
    in a virtual environment of its own, made on first use (about a minute) and cached
    (:func:`~lightning_app_rlhf.bench.peer_env.peer_python`).

    Args:
        presets: Model presets to compare (tiny, small, medium); each replaces ``run.preset``.
        betas: KL coefficients (a k3 term in the loss on both sides); 0: no reference model on either side.
        precisions: Precisions, each the same on both sides (``32-true``, ``bf16-mixed``).
        decoders: Our generation backends to measure, each a row against the same peer runs: ``eager`` (the
            default), ``static``, ``static_compiled`` (opt-in: ``generation.backend: static``, ``compile: true``).
        padding_free: With each decoder, ours with the default padded forwards (false) and/or with the opt-in
            ``ppo.padding_free: true`` (packed real tokens in the actor's training and the reference's forwards;
            the presets' random-init responses mostly run to ``new_tokens``, so it packs little here).
        repeats: Runs per framework and cell, alternating ours / TRL; medians are over all measured iterations.
        interleave: Start a cell's runs (ours per variant, and TRL's) together and let them take turns, one step
            each, so that every step of ours has one of TRL's beside it in time (see
            :mod:`~lightning_app_rlhf.bench.turns`); false: one run after the other.
        run: The settings of every run (``--run.batch_size`` prompts x ``--run.num_samples`` completions,
            ``--run.new_tokens``, ``--run.threads``, ``--run.warmup``, ``--run.iterations``).
        profile_preset: Then profile one step of each side, op by op, at this preset, the largest beta and the first
            precision (``grpo_profile`` in ``out``); None: no profile.
        out: Where the JSON results go.
        docs: Then rewrite the generated section of this page from ``out`` and the other results beside it
            (``trl.json``, ``placements.json``, ``profile.json``: see ``report``); None: leave the page alone.
    """
    from lightning_app_rlhf.bench.peer_env import GRPO_PEER, GRPO_PEER_NAME, peer_python

    console.print(f"The peer's environment ({GRPO_PEER_NAME}: {', '.join(GRPO_PEER)}), made on first use ...")
    python = peer_python(GRPO_PEER_NAME, GRPO_PEER)
    rows = [row for precision in precisions for preset in presets for beta in betas
            for row in _alternate(replace(run, algorithm="grpo", preset=preset, beta=beta, precision=precision),
                                  repeats, "trl_grpo_peer", python, decoders, padding_free, interleave)]
    _save(out, "grpo", rows)
    if profile_preset is not None:
        settings = replace(run, algorithm="grpo", preset=profile_preset, beta=max(betas), precision=precisions[0],
                           padding_free=any(padding_free))
        results = json.loads(Path(out).read_text())
        results["grpo_profile"] = _profile_grpo(settings, python)
        Path(out).write_text(json.dumps(results, indent=2))
    if docs is not None:
        beside = Path(out).parent
        report(results=[str(beside / name) for name in ("trl.json", "placements.json", "profile.json")] + [out],
               docs=docs)
    return rows


def _profile_grpo(settings: RunSettings, python: Path) -> dict[str, Any]:
    """One profiled step of each side (after ``settings.warmup``), each in a fresh one-thread process: ours by
    phase (:func:`profile`), TRL's as one span (generation, reward, reference, update)."""
    settings = replace(settings, iterations=1)
    with tempfile.TemporaryDirectory() as work:
        ours_out = Path(work) / "ours_profile.json"
        _profile_in_subprocess(str(ours_out), "--presets", f"[{settings.preset}]", "--batch_size",
                               str(settings.batch_size), "--new_tokens", str(settings.new_tokens), "--algorithm",
                               "grpo", "--num_samples", str(settings.num_samples), "--beta", str(settings.beta),
                               "--precision", settings.precision, "--padding_free", str(settings.padding_free))
        trl_out = Path(work) / "trl_profile.json"
        _run_peer(settings, Path(work), "trl_grpo_peer", python, trl_out)
        ours = json.loads(ours_out.read_text())["profile"][0]["phases"]
        return {"settings": settings.as_dict(), "ours": ours, "trl": json.loads(trl_out.read_text())}


def compare_placements(
    processes: list[int] = [2, 4],  # noqa: B006
    workloads: list[str] = ["generation-heavy", "training-heavy"],  # noqa: B006
    placements: list[str] = ["flattening", "interleaving", "separation", "separation_overlap"],  # noqa: B006
    run: RunSettings = RunSettings(preset="small", warmup=1, iterations=3),  # noqa: B008
    out: str = "bench_results/placements.json",
    predict: bool = False,
) -> list[dict[str, Any]]:
    """Flattening vs Interleaving vs Separation (on-policy and overlapped), one thread per process.

    Args:
        processes: Process counts to measure; each replaces ``run.processes``.
        workloads: Names from ``PLACEMENT_SETTINGS`` (generation-heavy, training-heavy): each replaces the response
            length, the epochs and the minibatches of ``run``.
        placements: Which placements to measure (flattening, interleaving, separation, separation_overlap, and
            the staleness bounds separation_k2, separation_k4: give ``--run.warmup`` at least k, since the first k
            iterations train nothing).
        run: The settings of every run (:class:`~lightning_app_rlhf.bench.presets.RunSettings`: ``--run.preset``
            for all four roles, ``--run.batch_size`` (global), ``--run.warmup``, ``--run.iterations``).
        out: Where the JSON results go.
        predict: Also put the planner's prediction beside each measurement (``predicted`` in each row: samples/s,
            seconds per iteration, the training side's idle share; :mod:`~lightning_app_rlhf.bench.predict`), this
            machine measured first as ``plan --profile auto`` measures it (ops cached), without the engine's
            calibration.
    """
    rows = []
    machines: dict[tuple[str, int], Any] = {}
    for workload in workloads:
        if workload not in PLACEMENT_SETTINGS:
            raise ValueError(f"Unknown workload {workload!r}: choose from {sorted(PLACEMENT_SETTINGS)}.")
        for count in processes:
            for placement in placements:
                settings = replace(run, processes=count, placement=placement, **PLACEMENT_SETTINGS[workload])
                with tempfile.TemporaryDirectory() as work:
                    ranks = run_ours(settings, Path(work))["ranks"]
                summary = summarize(ranks, settings, count_parameters(settings))
                rows.append({"workload": workload, "settings": settings.as_dict(), "ours": summary})
                predicted = ""
                if predict:
                    if (workload, count) not in machines:  # measured after the run, not beside it
                        machines[workload, count] = measure_machine(settings)
                    rows[-1]["predicted"] = prediction = predicted_run(settings, *machines[workload, count])
                    idle = prediction["trainer_idle_share"]
                    predicted = (f" (predicted {prediction['samples_per_s']:.1f}"
                                 + (f", trainer idle {idle:.0%}" if idle is not None else "") + ")")
                measured_idle = summary.get("trainer_idle_share")
                console.print(f"{workload:>16} {count} processes {placement:>18}: "
                              f"{summary['samples_per_s']['median']:.1f} samples/s"
                              + (f", trainer idle {measured_idle:.0%}" if measured_idle is not None else "")
                              + predicted)
    _save(out, "placements", rows)
    return rows


def profile(
    presets: list[str] = ["tiny", "small"],  # noqa: B006
    batch_size: int = 32,
    new_tokens: int = 32,
    threads: int = 1,
    precision: str = "32-true",
    algorithm: str = "ppo",
    num_samples: int = 1,
    beta: float = 0.0,
    padding_free: bool = False,
    out: str = "bench_results/profile.json",
) -> list[dict[str, Any]]:
    """Profile one of our iterations per preset (after two warm-up iterations): per phase, op by op.

    Args:
        presets: Model presets to profile.
        batch_size: Prompts per iteration.
        new_tokens: Response length.
        threads: Torch threads.
        precision: ``32-true`` or ``bf16-mixed``.
        algorithm: ``ppo`` (the TRL 1.12 comparison's run) or ``grpo`` (the TRL 1.16 comparison's).
        num_samples: GRPO's completions per prompt (G).
        beta: GRPO's KL coefficient in the loss (0: no reference).
        padding_free: ``ppo.padding_free`` (packed real tokens in the actor's training and the reference's forwards).
        out: Where the JSON results go.
    """
    records = []
    for preset in presets:
        settings = RunSettings(preset=preset, batch_size=batch_size, new_tokens=new_tokens, threads=threads,
                               precision=precision, algorithm=algorithm, num_samples=num_samples, beta=beta,
                               padding_free=padding_free, warmup=2, iterations=1)
        records.append({"settings": settings.as_dict(), "phases": profile_iteration(settings)})
        print(profile_table(records[-1]), file=sys.stderr)
    _save(out, "profile", records)
    return records


def checkpoint_memory(
    presets: list[str] = ["small"],  # noqa: B006
    devices: list[int] = [2, 4],  # noqa: B006
    strategies: list[str] = ["rlhf_flattening", "rlhf_interleaving", "rlhf_separation"],  # noqa: B006
    steps: int = 4,
    every: int = 2,
    batch_size: int = 32,
    new_tokens: int = 32,
    keep_checkpoints: bool = False,
    out: str = "bench_results/checkpoint",
) -> list[dict[str, Any]]:
    """Resident memory per rank during checkpoint saves, against the steady RSS just before each save.

    Each (preset, devices, strategy) is one ``python -m lightning_app_rlhf fit`` run with
    ``--trainer.enable_checkpointing true`` and, through ``--trainer.callbacks+=``, a ``ModelCheckpoint`` every
    ``every`` steps and a :class:`~lightning_app_rlhf.bench.checkpoint_memory.CheckpointMemory`. Writes
    ``{out}/checkpoint.json`` and ``{out}/checkpoint.md``; each run's files are in ``{out}/ckpt_*``.

    Args:
        presets: Model presets of all four roles.
        devices: Process counts (one thread each).
        strategies: Registered strategy names (``rlhf_flattening``, ``rlhf_interleaving``, ``rlhf_separation``)
            or placement names (``flattening``, ...).
        steps: PPO iterations per run.
        every: Iterations between checkpoints (``steps // every`` saves).
        batch_size: Prompts per PPO iteration (global).
        new_tokens: Response length.
        keep_checkpoints: Keep the ``.ckpt`` files (by default deleted once measured: they are large).
        out: Folder for the results, the markdown table and the runs.
    """
    if not 1 <= every <= steps:
        raise ValueError(f"Need 1 <= every <= steps to save at least once; got every={every}, steps={steps}.")
    placements = [_placement_of(name) for name in strategies]
    rows = []
    for preset in presets:
        for count in devices:
            for name, placement in zip(strategies, placements):
                settings = RunSettings(preset=preset, batch_size=batch_size, new_tokens=new_tokens, processes=count,
                                       placement=placement, warmup=0, iterations=steps)
                work = Path(out) / f"ckpt_{preset}_{count}p_{placement}"
                shutil.rmtree(work, ignore_errors=True)  # stale records or files would mix into this run's
                run = run_ours_checkpointing(settings, work, every)
                if not keep_checkpoints:
                    shutil.rmtree(work / "ckpt", ignore_errors=True)
                ranks = summarize_checkpoint(run["ranks"])
                rows.append({"strategy": name, "settings": settings.as_dict(), "every": every, "ranks": ranks,
                             "checkpoints": run["checkpoints"], "records": run["ranks"]})
                worst = max(ranks, key=lambda rank: rank["peak_over_steady"])
                console.print(f"{preset} {count} processes {placement:>18}: peak/steady up to "
                              f"{worst['peak_over_steady']:.2f}x (rank {worst['rank']}), "
                              f"{worst['peak_rss_bytes'] / 2**20:.0f} MiB at save")
    _save(f"{out}/checkpoint.json", "checkpoint", rows)
    table = checkpoint_table(rows)
    Path(f"{out}/checkpoint.md").write_text(table + "\n")
    print(table, file=sys.stderr)
    return rows


def soak(
    strategies: list[str] = ["rlhf_flattening", "rlhf_interleaving", "rlhf_separation"],  # noqa: B006
    devices: int = 4,
    steps: int = 300,
    every: int = 10,
    warmup: int = 100,
    preset: str = "tiny",
    batch_size: int = 32,
    new_tokens: int = 24,
    out: str = "bench_results/soak",
) -> list[dict[str, Any]]:
    """Resident memory of every rank over a long run under each placement: flat after warm-up means no leak.

    Each strategy is one ``python -m lightning_app_rlhf fit`` run on ``devices`` processes with a
    :class:`~lightning_app_rlhf.bench.soak.RSSRecorder` (``VmRSS`` every ``every`` iterations). Writes
    ``{out}/soak.json``, ``{out}/soak.md`` and ``{out}/soak.png``.

    Args:
        strategies: Registered strategy names.
        devices: Processes per run (one thread each).
        steps: Iterations per run.
        every: Iterations between RSS samples.
        warmup: Iterations left out of the trend.
        preset: Model preset of all four roles.
        batch_size: Prompts per iteration (global).
        new_tokens: Response length.
        out: Folder for the results and the runs.
    """
    from lightning_app_rlhf.bench.ours import launch_fit
    from lightning_app_rlhf.bench.soak import plot_soak, rss_trend, soak_table

    rows = []
    for name in strategies:
        settings = RunSettings(preset=preset, batch_size=batch_size, new_tokens=new_tokens, processes=devices,
                               placement=_placement_of(name), warmup=0, iterations=steps)
        work = Path(out) / f"soak_{settings.placement}"
        shutil.rmtree(work, ignore_errors=True)
        recorder = {"class_path": "lightning_app_rlhf.bench.soak.RSSRecorder",
                    "init_args": {"path": str(work / "rss"), "every": every}}
        launch_fit(settings, work, [f"--trainer.callbacks+={json.dumps(recorder)}"], timeout_s=3600)
        records = sorted((json.loads(p.read_text()) for p in (work / "rss").glob("rank*.json")),
                         key=lambda record: record["rank"])
        ranks = [{"rank": r["rank"], "samples": r["samples"], "trend": rss_trend(r["samples"], warmup)}
                 for r in records]
        rows.append({"strategy": name, "settings": settings.as_dict(), "every": every, "warmup": warmup,
                     "ranks": ranks})
        worst = max(ranks, key=lambda rank: rank["trend"]["slope_mib_per_100"])
        console.print(f"{name} on {devices} processes, {steps} iterations: largest slope "
                      f"{worst['trend']['slope_mib_per_100']:+.2f} MiB per 100 iterations (rank {worst['rank']})")
    _save(f"{out}/soak.json", "soak", rows)
    table = soak_table(rows)
    Path(f"{out}/soak.md").write_text(table + "\n")
    plot_soak(rows, Path(f"{out}/soak.png"))
    print(table, file=sys.stderr)
    return rows


def run(out_dir: str = "docs/bench_results", docs: str = "docs/benchmarks.md", repeats: int = 2) -> None:
    """Both comparisons and the profile with their defaults, then rewrite the results section of ``docs``.

    Args:
        out_dir: Folder for ``trl.json`` and ``placements.json``.
        docs: The markdown page whose generated section is replaced (tables and plot).
        repeats: Alternating runs per framework in the TRL comparison.
    """
    compare_trl(out=f"{out_dir}/trl.json", repeats=repeats)
    compare_grpo(out=f"{out_dir}/grpo.json", docs=None, repeats=repeats)
    compare_placements(out=f"{out_dir}/placements.json")
    _profile_in_subprocess(f"{out_dir}/profile.json")
    report(results=[f"{out_dir}/trl.json", f"{out_dir}/grpo.json", f"{out_dir}/placements.json",
                    f"{out_dir}/profile.json"], docs=docs)


def report(
    results: list[str] = ["docs/bench_results/trl.json", "docs/bench_results/grpo.json",  # noqa: B006
                          "docs/bench_results/placements.json", "docs/bench_results/profile.json"],
    docs: str = "docs/benchmarks.md",
) -> None:
    """Rewrite the generated section of ``docs`` (tables, plot) from results JSON files.

    Args:
        results: JSON files written by ``trl``, ``grpo``, ``placements`` and ``profile`` (a missing one is
            skipped).
        docs: The markdown page to update.
    """
    merged: dict[str, Any] = {"machines": {}}
    for path in results:
        if Path(path).exists():
            loaded = json.loads(Path(path).read_text())
            machine = loaded.pop("machine", None)
            merged.update(loaded)
            if machine is not None:
                merged["machines"].update({section: machine for section in loaded})
    write_report(merged, Path(docs))
    console.print(f"Updated {docs}")


def _profile_in_subprocess(out: str, *args: str) -> None:
    """``bench profile ARGS`` with one thread, in a fresh process: the same conditions as the single-process
    measurements."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "lightning_app_rlhf.bench", "profile", "--out", out, *args]
    result = subprocess.run(command, check=False, env=env, capture_output=True, text=True, timeout=1800)
    if result.returncode != 0:
        raise RuntimeError(f"The profile failed:\n{result.stderr[-3000:]}")


def _run_peer(
    settings: RunSettings, work: Path, module: str, python: Path, profile_out: Path | None = None
) -> dict[str, Any]:
    """:func:`_peer_job` run to the end in ``work``; its record."""
    command, env = _peer_job(settings, work, module, python, profile_out)
    result = subprocess.run(command, check=False, cwd=work, env=env, capture_output=True, text=True, timeout=1800)
    if result.returncode != 0:
        raise RuntimeError(f"The peer run failed ({' '.join(command)}):\n{result.stderr[-3000:]}")
    return json.loads((work / f"{module}.json").read_text())


def _peer_job(
    settings: RunSettings, work: Path, module: str, python: Path, profile_out: Path | None = None
) -> tuple[list[str], dict[str, str]]:
    """The command and environment of ``python -m lightning_app_rlhf.bench.{module} SETTINGS OUT [PROFILE_OUT]``
    (this checkout on its ``PYTHONPATH``, for a peer environment where the package is not installed); it writes its
    record to ``work/{module}.json``."""
    out = work / f"{module}.json"
    env = {**os.environ, "OMP_NUM_THREADS": str(settings.threads), "MKL_NUM_THREADS": str(settings.threads),
           "TRL_EXPERIMENTAL_SILENCE": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPOSITORY), os.environ.get("PYTHONPATH")]))}
    command = [str(python), "-m", f"lightning_app_rlhf.bench.{module}", json.dumps(settings.as_dict()), str(out),
               *([str(profile_out)] if profile_out is not None else [])]
    return command, env


def _merge_repeats(runs: list[list[dict[str, Any]]], settings: RunSettings) -> list[dict[str, Any]]:
    """One rank-0 record whose measured iterations are every repeat's, warm-ups dropped per repeat."""
    iterations = [row for ranks in runs for row in ranks[0]["iterations"][settings.warmup :]]
    first = runs[0]
    ranks = [{**rank, "peak_rss_bytes": max(run[i]["peak_rss_bytes"] for run in runs)} for i, rank in enumerate(first)]
    ranks[0] = {**ranks[0], "iterations": [{}] * settings.warmup + iterations}
    return ranks


def _placement_of(strategy: str) -> str:
    """``rlhf_separation`` -> ``separation``: the bench's placement name for a registered strategy name."""
    placement = strategy.removeprefix("rlhf_")
    if placement not in PLACEMENTS:
        choices = ", ".join(f"rlhf_{name}" for name in PLACEMENTS)
        raise ValueError(f"Unknown strategy {strategy!r}: choose from {choices}.")
    return placement


def _check_trl() -> None:
    try:
        import trl
    except ImportError:
        raise SystemExit(
            "The peer, TRL 1.12.0, is not installed. Run `bash scripts/bench.sh` (it installs the `bench` extra), "
            "or `pip install -e '.[bench]'`."
        ) from None
    if trl.__version__ != "1.12.0":
        raise SystemExit(f"The peer is TRL 1.12.0 (the last TRL with PPO); found {trl.__version__}. "
                         "Run `pip install trl==1.12.0`.")


def _save(path: str, section: str, rows: list[dict[str, Any]]) -> None:
    """Write a results file: this machine's description and the ``section`` of the report the rows fill."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps({"machine": machine(), section: rows}, indent=2))


def main() -> None:
    auto_cli({"run": run, "trl": compare_trl, "grpo": compare_grpo, "placements": compare_placements,
              "profile": profile, "report": report, "checkpoint": checkpoint_memory, "soak": soak, "decode": decode,
              "smollm2": {"run": race_smollm2, "report": report_race},
              "agent": {"run": race_agent, "report": report_agent_race}})


if __name__ == "__main__":
    main()
