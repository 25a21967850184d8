"""Run our RL loop (PPO or GRPO) for one :class:`RunSettings` through the CLI, as a user would, and collect its
timings."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from lightning_app_rlhf.bench.presets import DECODERS, PLACEMENTS, TOKENIZER_VOCAB, RunSettings, stop_ids


def fit_config(settings: RunSettings, out_dir: Path) -> dict[str, Any]:
    """The LightningCLI config. PPO: four roles from one preset (the reward is a sequence classifier, as TRL's
    PPOTrainer needs). GRPO: the actor, a reference only with ``beta > 0`` (a k3 term in the loss, as TRL's
    GRPOTrainer), and the demo's reward function on decoded text (the peer's too)."""
    strategy, strategy_args = PLACEMENTS[settings.placement]
    model = {"config": settings.model_config(), "init_seed": 0}
    ppo = {"ppo_epochs": settings.ppo_epochs, "num_minibatches": settings.num_minibatches}
    roles: dict[str, Any] = {"reward_model": {"config": settings.model_config(), "init_seed": 1}}
    if settings.algorithm == "grpo":
        roles = {"algorithm": "grpo", "reward_fn": "lightning_app_rlhf.demo.topic_reward"}
        ppo.update(kl_coef=0.0, kl_loss_coef=settings.beta, kl_loss_estimator="k3")
    if settings.padding_free:
        ppo["padding_free"] = True
    return {
        "seed_everything": 0,
        "trainer": {
            "accelerator": "auto",
            "devices": settings.processes,
            "strategy": {"class_path": strategy, "init_args": {"threads_per_process": settings.threads,
                                                                 **strategy_args}}
            if settings.processes > 1 else "auto",
            "max_steps": settings.warmup + settings.iterations,
            "precision": settings.precision,
            "logger": False,
            "enable_checkpointing": False,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "callbacks": [{"class_path": "lightning_app_rlhf.bench.timer.IterationTimer",
                           "init_args": {"out_dir": str(out_dir)}}],
        },
        "model": {
            "tokenizer": "lightning_app_rlhf.demo:build_tokenizer",
            "actor": model,
            **roles,
            "generation": {"max_new_tokens": settings.new_tokens, "temperature": 1.0,
                           "num_samples": settings.num_samples, **DECODERS[settings.decoder],
                           **({"stop_token_ids": stop_ids(settings.model_config()["vocab_size"], settings.mean_length)}
                              if settings.mean_length else {})},
            "ppo": ppo,
        },
        "data": {"prompts": "lightning_app_rlhf.demo:prompts", "batch_size": settings.batch_size},
    }


def run_ours(settings: RunSettings, work_dir: Path, timeout_s: float = 900) -> dict[str, Any]:
    """Run one measurement in a fresh process group; returns the per-rank records of :class:`IterationTimer`."""
    launch_fit(settings, work_dir, [], timeout_s)
    return read_timings(settings, work_dir)


def run_ours_checkpointing(
    settings: RunSettings, work_dir: Path, every: int, timeout_s: float = 900
) -> dict[str, Any]:
    """Run with checkpointing on, as a user adds it on the command line, and measure every save on every rank.

    A ``ModelCheckpoint`` keeps a file every ``every`` iterations (``save_top_k=-1``: all of them) in
    ``{work_dir}/ckpt``; :class:`~lightning_app_rlhf.bench.checkpoint_memory.CheckpointMemory` writes its
    records into ``{work_dir}/memory``.

    Args:
        settings: The run; its ``warmup + iterations`` is the number of iterations.
        work_dir: Folder of the run (config, checkpoints, records).
        every: Iterations between checkpoints.
        timeout_s: Limit of the whole run.

    Returns:
        ``ranks``: the per-rank records of ``CheckpointMemory`` (rank 0 first); ``checkpoints``: the files written,
        oldest first.
    """
    from lightning_app_rlhf.bench.checkpoint_memory import read_records  # imports Lightning: only when needed

    checkpoint = {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                  "init_args": {"dirpath": str(work_dir / "ckpt"), "every_n_train_steps": every, "save_top_k": -1}}
    memory = {"class_path": "lightning_app_rlhf.bench.checkpoint_memory.CheckpointMemory",
              "init_args": {"path": str(work_dir / "memory")}}
    launch_fit(settings, work_dir, ["--trainer.enable_checkpointing", "true",
                                 f"--trainer.callbacks+={json.dumps(checkpoint)}",
                                 f"--trainer.callbacks+={json.dumps(memory)}"], timeout_s)
    ranks = read_records(work_dir / "memory")
    if len(ranks) != settings.processes:
        raise RuntimeError(f"Expected save records from {settings.processes} ranks, found {len(ranks)} in "
                           f"{work_dir}.")
    files = sorted((work_dir / "ckpt").glob("*.ckpt"), key=lambda p: p.stat().st_mtime)
    return {"ranks": ranks, "checkpoints": [{"path": str(p), "bytes": p.stat().st_size} for p in files]}


def read_timings(settings: RunSettings, work_dir: Path) -> dict[str, Any]:
    """The per-rank records of :class:`IterationTimer` of a run in ``work_dir`` (:func:`fit_job`)."""
    ranks = [json.loads(p.read_text()) for p in sorted((work_dir / "timings").glob("rank*.json"))]
    if len(ranks) != settings.processes:
        raise RuntimeError(f"Expected timings from {settings.processes} ranks, found {len(ranks)} in {work_dir}.")
    return {"ranks": ranks}


def fit_job(
    settings: RunSettings, work_dir: Path, extra_args: Sequence[str] = ()
) -> tuple[list[str], dict[str, str]]:
    """The command and environment of ``python -m lightning_app_rlhf fit`` with the settings' config (written to
    ``work_dir``) and ``extra_args``, one thread per rank; its timings go to ``work_dir/timings``."""
    assert TOKENIZER_VOCAB <= settings.model_config()["vocab_size"]
    work_dir.mkdir(parents=True, exist_ok=True)
    config_path = work_dir / "config.yaml"
    config_path.write_text(yaml.safe_dump(fit_config(settings, work_dir / "timings")))
    env = {**os.environ, "OMP_NUM_THREADS": str(settings.threads), "MKL_NUM_THREADS": str(settings.threads)}
    return [sys.executable, "-m", "lightning_app_rlhf", "fit", "--config", str(config_path), *extra_args], env


def launch_fit(settings: RunSettings, work_dir: Path, extra_args: list[str], timeout_s: float) -> None:
    """Run :func:`fit_job` to the end."""
    command, env = fit_job(settings, work_dir, extra_args)
    result = subprocess.run(command, check=False, cwd=work_dir, env=env, capture_output=True, text=True, timeout=timeout_s)
    if result.returncode != 0:
        raise RuntimeError(f"Our run failed ({' '.join(command)}):\n{result.stderr[-3000:]}")
