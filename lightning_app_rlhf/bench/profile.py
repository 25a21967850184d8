"""Where one of our iterations (PPO or GRPO) spends its time: torch.profiler over each phase, grouped by op.

Runs in this process, one rank, so it profiles the single-process settings of the TRL comparison.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.profiler import ProfilerActivity, profile

from lightning_app_rlhf.bench.ours import fit_config
from lightning_app_rlhf.bench.presets import RunSettings
from lightning_app_rlhf.core.role_table import ACTOR
from lightning_app_rlhf.data import PromptDataModule
from lightning_app_rlhf.demo import build_tokenizer, prompts
from lightning_app_rlhf.engine.engine import RLHFEngine
from lightning_app_rlhf.engine.iteration import Step
from lightning_app_rlhf.engine.iteration_state import IterationState
from lightning_app_rlhf.module import RLHFModule

MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::linear", "aten::matmul")
MODEL_ARITHMETIC: dict[str, tuple[str, ...]] = {
    "matmul": (*MATMUL_OPS, "aten::addmm_"),
    "attention": ("aten::_scaled_dot_product_flash_attention_for_cpu",
                  "aten::_scaled_dot_product_flash_attention_for_cpu_backward"),
    # GELU: one fused op (ours) or GPT-2's gelu_new formula (tanh, pow and muls; the muls are left out, see below).
    "activation": ("aten::gelu", "aten::gelu_backward", "aten::tanh", "aten::tanh_backward", "aten::pow"),
    "layer norm": ("aten::native_layer_norm", "aten::native_layer_norm_backward"),
    "log-softmax": ("aten::_log_softmax", "aten::_log_softmax_backward_data", "aten::_softmax", "aten::exp"),
    "embedding": ("aten::embedding_dense_backward",),
}
"""A transformer's own arithmetic, by kind, forward and backward: what both sides of a comparison on the same model
and data must run, whichever ops each writes it with. Elementwise ``mul``/``add`` are left out: samplers and
optimizers use them too, so the sums are a lower bound."""


def step_phase(step: Step) -> str | None:
    """The phase a step of the iteration belongs to: ``generate`` (the actor's call), ``score`` (the forward calls
    and their gathers; the advantages, made between the steps, are cheap and left out), ``train`` (the train calls and
    their statistics); None for the rest (the rollout's gather, reallocations, learning rates)."""
    if step.name == ACTOR.call("generate"):
        return "generate" if step.kind == "call" else None
    if step.name.endswith(".forward"):
        return "score"
    if step.name.endswith(".train") and (step.kind == "call" or step.what == "stats"):
        return "train"
    return None


def profile_iteration(settings: RunSettings, top: int = 8) -> dict[str, Any]:
    """Profile the iteration after warm-up; returns per phase its wall seconds, matmul share and top ops."""
    torch.set_num_threads(settings.threads)
    tokenizer = build_tokenizer()
    # The module the comparison's runs build (bench/ours.py), with the tokenizer object rather than its import path.
    module = RLHFModule(**{**fit_config(settings, Path(tempfile.gettempdir()))["model"], "tokenizer": tokenizer})
    phases: dict[str, tuple[dict[str, list[float]], float]] = {}
    run_step = RLHFEngine.run_step

    def profiled(engine: RLHFEngine, step: Step, state: IterationState) -> None:
        phase = step_phase(step)
        if phase is None or state.iteration != settings.warmup:
            return run_step(engine, step, state)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            run_step(engine, step, state)
            wall = time.perf_counter() - start
        ops, total = phases.get(phase, ({}, 0.0))
        add_events(ops, prof.key_averages())
        phases[phase] = (ops, total + wall)
        return None

    RLHFEngine.run_step = profiled
    try:
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=settings.warmup + 1,
                             precision=settings.precision, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(module, PromptDataModule(prompts(), tokenizer, batch_size=settings.batch_size))
    finally:
        RLHFEngine.run_step = run_step
    return {phase: _summarize(ops, wall, top) for phase, (ops, wall) in phases.items()}


def add_events(ops: dict[str, list[float]], events: Any) -> None:
    """Add a profile's ``key_averages()`` to ``op -> [self us, calls]``."""
    for event in events:
        op = ops.setdefault(event.key, [0.0, 0])
        op[0] += event.self_cpu_time_total
        op[1] += event.count


def summarize_ops(events: Any, wall: float, top: int = 8) -> dict[str, Any]:
    """One profiled span (a peer's whole step): its wall time, matmul share and heaviest ops."""
    ops: dict[str, list[float]] = {}
    add_events(ops, events)
    return _summarize(ops, wall, top)


def _summarize(ops: dict[str, list[float]], wall: float, top: int) -> dict[str, Any]:
    """A phase's wall time, its matmul share of op time and its heaviest ops, from ``op -> [self us, calls]``."""
    rows = sorted(ops.items(), key=lambda item: -item[1][0])
    total_us = sum(us for us, _ in ops.values())
    matmul_us = sum(us for op, (us, _) in rows if op in MATMUL_OPS)
    return {
        "wall_s": wall,
        "profiled_cpu_s": total_us / 1e6,
        "matmul_share": matmul_us / total_us if total_us else 0.0,
        "top_ops": [{"op": op, "self_s": us / 1e6, "calls": int(calls)} for op, (us, calls) in rows[:top]],
        "ops": {op: {"self_s": us / 1e6, "calls": int(calls)} for op, (us, calls) in rows},
    }


def shared_arithmetic_s(ours: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> float:
    """Seconds of model arithmetic (:data:`MODEL_ARITHMETIC`) that both sides spend: per kind, the smaller of the
    two sides' self times, summed. Ours cannot go below it without doing less of that arithmetic, or doing it
    faster than either side does now. Each argument is a list of phase summaries (with ``ops``)."""

    def per_kind(summaries: list[dict[str, Any]]) -> dict[str, float]:
        ops: dict[str, float] = {}
        for summary in summaries:
            for op, value in summary.get("ops", {}).items():
                ops[op] = ops.get(op, 0.0) + value["self_s"]
        return {kind: sum(ops.get(op, 0.0) for op in names) for kind, names in MODEL_ARITHMETIC.items()}

    mine, peer = per_kind(ours), per_kind(theirs)
    return sum(min(mine[kind], peer[kind]) for kind in MODEL_ARITHMETIC)


def profile_table(record: dict[str, Any]) -> str:
    """A markdown table: per phase its wall time, matmul share and heaviest ops."""
    settings, result = RunSettings(**record["settings"]), record["phases"]
    lines = [
        (f"Profile of one {settings.algorithm.upper()} iteration, `{settings.preset}` preset, batch "
         f"{settings.batch_size}{f' x G={settings.num_samples}' if settings.num_samples > 1 else ''}"
         f"{f', beta {settings.beta:g}' if settings.algorithm == 'grpo' else ''}, {settings.new_tokens} new tokens, "
         f"{settings.threads} thread, {settings.precision} (`python -m lightning_app_rlhf.bench profile`):"),
        "",
        "| phase | wall ms | matmul share of op time | heaviest ops (self ms, calls) |",
        "| --- | ---: | ---: | --- |",
    ]
    for phase, summary in result.items():
        ops = ", ".join(f"`{o['op'].removeprefix('aten::')}` {o['self_s'] * 1000:.0f} ({o['calls']})"
                        for o in summary["top_ops"][:5])
        lines.append(f"| {phase} | {summary['wall_s'] * 1000:.0f} | {summary['matmul_share']:.0%} | {ops} |")
    return "\n".join(lines)
