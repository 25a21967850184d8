"""Turn per-rank timing records into the numbers we report: medians with min and max, and the machine."""

from __future__ import annotations

import os
import platform
import statistics
from typing import Any

import torch

from lightning_app_rlhf.bench.presets import PLACEMENTS, RunSettings

GPU_PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0, "L4": 121.0}
"""Dense bf16 tensor-core peaks (TFLOP/s) by GPU name, for model-FLOPs utilisation."""


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarize(ranks: list[dict[str, Any]], settings: RunSettings, params: int) -> dict[str, Any]:
    """Median/min/max over the measured iterations (warm-up dropped) of rank 0's view of each iteration.

    Every rank meets every iteration in a collective, so rank 0's wall time is the iteration's time. Phase times
    are each rank's own; we report rank 0's (a generating rank under every placement). A free-running placement's
    sides meet in no iteration: its pace is the training side's (the last rank's), whose iterations consume the
    rollouts one by one, so its times (train and publish; no generation there) are reported.
    """
    free_running = PLACEMENTS[settings.placement][1].get("free_running", False)
    measured = ranks[-1 if free_running else 0]["iterations"][settings.warmup :]
    if len(measured) < settings.iterations:
        raise RuntimeError(f"Only {len(measured)} measured iterations recorded; expected {settings.iterations}.")
    wall = [row["wall_s"] for row in measured]
    out: dict[str, Any] = {
        "iteration_s": spread(wall),
        "samples_per_s": spread([settings.completions / w for w in wall]),  # completions (G per prompt)
        "peak_rss_bytes": [rank["peak_rss_bytes"] for rank in ranks],
    }
    if all("gen_tokens" in row for row in measured):
        out["gen_tokens_per_s"] = spread([row["gen_tokens"] / row["wall_s"] for row in measured])
    for phase in ("generate", "score", "train", "reallocate"):
        key = f"time/{phase}_s"
        if all(key in row for row in measured):
            out[f"{phase}_s"] = statistics.median(row[key] for row in measured)
    if free_running and all("time/wait_for_rollout_s" in row for row in measured):
        # The training side's idle share: its wait for the next rollout over its iterations' time.
        out["trainer_idle_share"] = sum(row["time/wait_for_rollout_s"] for row in measured) / sum(wall)
    if "peak_cuda_bytes" in ranks[0]:
        out["peak_cuda_bytes"] = [rank["peak_cuda_bytes"] for rank in ranks]
    if out.get("train_s") and all("prompt_tokens" in row and "gen_tokens" in row for row in measured):
        out.update(train_flops(measured, settings, params, out["train_s"]))
    return out


def summarize_checkpoint(ranks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per rank, the save that grew resident memory most (its steady and peak RSS), and the save times.

    Args:
        ranks: The per-rank records of :class:`~lightning_app_rlhf.bench.checkpoint_memory.CheckpointMemory`.

    Returns:
        One row per rank: ``steady_rss_bytes`` and ``peak_rss_bytes`` of the save with the highest
        ``peak_over_steady`` (so the three agree), ``save_s`` (median over saves) and ``save_s_max``, and on rank 0
        ``file_bytes`` (the newest checkpoint's size).
    """
    rows = []
    for record in ranks:
        saves = record["saves"]
        if not saves:
            raise RuntimeError(f"Rank {record['rank']} recorded no checkpoint save: is `every` above the steps?")
        worst = max(saves, key=lambda save: save["peak_rss_bytes"] / save["steady_rss_bytes"])
        row = {
            "rank": record["rank"],
            "method": record["method"],
            "saves": len(saves),
            "steady_rss_bytes": worst["steady_rss_bytes"],
            "peak_rss_bytes": worst["peak_rss_bytes"],
            "peak_over_steady": worst["peak_rss_bytes"] / worst["steady_rss_bytes"],
            "save_s": statistics.median(save["seconds"] for save in saves),
            "save_s_max": max(save["seconds"] for save in saves),
        }
        if saves[-1].get("file_bytes") is not None:
            row["file_bytes"] = saves[-1]["file_bytes"]
        rows.append(row)
    return rows


def train_flops(measured: list[dict[str, float]], settings: RunSettings, params: int, train_s: float) -> dict:
    """Achieved training FLOP/s (actor + critic, 6 FLOPs per parameter per token) and MFU on a known GPU."""
    tokens = statistics.median(row["prompt_tokens"] + row["gen_tokens"] for row in measured)
    flops = 2 * 6 * params * tokens * settings.ppo_epochs
    out = {"train_tflops": flops / train_s / 1e12}
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        peak = next((tflops for key, tflops in GPU_PEAK_TFLOPS.items() if key in name), None)
        if peak is not None:
            out["train_mfu"] = out["train_tflops"] / peak
    return out


def count_parameters(settings: RunSettings) -> int:
    """Parameters of one causal LM of the preset (built on the meta device: no memory, no time)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = settings.model_config()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(fields.pop("model_type"), **fields))
    return sum(p.numel() for p in model.parameters())


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    import lightning
    import transformers

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        memory_gib = None
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": round(memory_gib, 1) if memory_gib else None,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "transformers": transformers.__version__,
    }
