"""Where one of our PPO iterations spends its time: torch.profiler over each phase, grouped by op.

Runs in this process, one rank, so it profiles the single-process settings of the TRL comparison.
"""

from __future__ import annotations

import time
from typing import Any

import lightning.pytorch as pl
import torch
from torch.profiler import ProfilerActivity, profile

from lightning_app_rlhf.bench.presets import RunSettings
from lightning_app_rlhf.core.config import GenerationConfig, PPOConfig
from lightning_app_rlhf.data import PromptDataModule
from lightning_app_rlhf.demo import build_tokenizer, prompts
from lightning_app_rlhf.engine.engine import RLHFEngine
from lightning_app_rlhf.module import RLHFModule

ENGINE_PHASES = {"generate": "generate_shard", "score": "score_rollout"}
"""Phase -> the RLHFEngine method that runs it; the train phase is RLHFModule._train (every train call)."""
MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::linear", "aten::matmul")


def profile_iteration(settings: RunSettings, top: int = 8) -> dict[str, Any]:
    """Profile the iteration after warm-up; returns per phase its wall seconds, matmul share and top ops."""
    torch.set_num_threads(settings.threads)
    tokenizer = build_tokenizer()
    module = RLHFModule(
        actor={"config": settings.model_config(), "init_seed": 0},
        tokenizer=tokenizer,
        reward_model={"config": settings.model_config(), "init_seed": 1},
        generation=GenerationConfig(max_new_tokens=settings.new_tokens),
        ppo=PPOConfig(ppo_epochs=settings.ppo_epochs, num_minibatches=settings.num_minibatches),
    )
    recorder = _PhaseProfiler(at_iteration=settings.warmup)
    module._train = recorder.wrap("train", module._train)
    originals = {method: getattr(RLHFEngine, method) for method in ENGINE_PHASES.values()}
    for phase, method in ENGINE_PHASES.items():
        setattr(RLHFEngine, method, recorder.wrap(phase, originals[method]))
    try:
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=settings.warmup + 1,
                             precision=settings.precision, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(module, PromptDataModule(prompts(), tokenizer, batch_size=settings.batch_size))
    finally:
        for method, original in originals.items():
            setattr(RLHFEngine, method, original)
    return {phase: _summarize(events, wall, top) for phase, (events, wall) in recorder.phases.items()}


class _PhaseProfiler:
    def __init__(self, at_iteration: int) -> None:
        self.at_iteration = at_iteration
        self.iteration = 0
        self.phases: dict[str, tuple[Any, float]] = {}

    def wrap(self, phase: str, method: Any) -> Any:
        def profiled(*args: Any, **kwargs: Any) -> Any:
            if self.iteration != self.at_iteration:
                if phase == "train":
                    self.iteration += 1
                return method(*args, **kwargs)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                start = time.perf_counter()
                out = method(*args, **kwargs)
                wall = time.perf_counter() - start
            self.phases[phase] = (prof.key_averages(), wall)
            if phase == "train":
                self.iteration += 1
            return out

        return profiled


def _summarize(events: Any, wall: float, top: int) -> dict[str, Any]:
    rows = sorted(events, key=lambda e: -e.self_cpu_time_total)
    total_us = sum(e.self_cpu_time_total for e in rows)
    matmul_us = sum(e.self_cpu_time_total for e in rows if e.key in MATMUL_OPS)
    return {
        "wall_s": wall,
        "profiled_cpu_s": total_us / 1e6,
        "matmul_share": matmul_us / total_us if total_us else 0.0,
        "top_ops": [{"op": e.key, "self_s": e.self_cpu_time_total / 1e6, "calls": e.count} for e in rows[:top]],
    }


def profile_table(record: dict[str, Any]) -> str:
    """A markdown table: per phase its wall time, matmul share and heaviest ops."""
    settings, result = RunSettings(**record["settings"]), record["phases"]
    lines = [
        (f"Profile of one iteration, `{settings.preset}` preset, batch {settings.batch_size}, {settings.new_tokens} "
        f"new tokens, {settings.threads} thread, {settings.precision} (`python -m lightning_app_rlhf.bench profile`):"),
        "",
        "| phase | wall ms | matmul share of op time | heaviest ops (self ms, calls) |",
        "| --- | ---: | ---: | --- |",
    ]
    for phase, summary in result.items():
        ops = ", ".join(f"`{o['op'].removeprefix('aten::')}` {o['self_s'] * 1000:.0f} ({o['calls']})"
                        for o in summary["top_ops"][:5])
        lines.append(f"| {phase} | {summary['wall_s'] * 1000:.0f} | {summary['matmul_share']:.0%} | {ops} |")
    return "\n".join(lines)
