"""Decoder throughput: the ``eager``, ``static``, ``continuous`` and ``vllm`` generation backends against Hugging Face
``generate()``.

Every decoder samples the same left-padded random prompts from the same random-init model, with no stop token, so
each row generates exactly ``new_tokens`` tokens and tokens/s compare like for like. Plain PyTorch (no Lightning).
``python -m lightning_app_rlhf.bench decode --help`` lists the settings.

On a GPU each row also gets the decode step's memory traffic (weights + KV cache read per step, over the step time)
as a share of the device's peak HBM bandwidth (:data:`HBM_PEAK_GBS`, by ``torch.cuda.get_device_name()``).
``scripts/gpu_check.sh`` runs the GPU measurements and writes their section of ``docs/benchmarks.md``
(:func:`write_gpu_check_report`, also ``python -m lightning_app_rlhf.bench.decode report``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_app_rlhf.bench.presets import MODEL_PRESETS, SPECIAL_TOKENS, stop_ids
from lightning_app_rlhf.core.config import GenerationConfig
from lightning_app_rlhf.generation import generate, sample_keys

DECODE_MODELS: dict[str, dict[str, Any]] = {
    # The harness's GPT-2 presets (tiny: the demo's model; small: ~7M parameters).
    "tiny": {**MODEL_PRESETS["tiny"], "n_positions": 1024},
    "small": {**MODEL_PRESETS["small"], "n_positions": 1024},
    # A ~4M-parameter Llama (grouped-query attention, RoPE, SwiGLU): the CPU stand-in for the two below.
    "llama-small": {"model_type": "llama", "num_hidden_layers": 4, "hidden_size": 256, "num_attention_heads": 8,
                    "num_key_value_heads": 4, "intermediate_size": 688, "vocab_size": 8192,
                    "max_position_embeddings": 2048, "tie_word_embeddings": True},
    # SmolLM2-135M's architecture (a Llama), random-init.
    "smollm2-135m": {"model_type": "llama", "num_hidden_layers": 30, "hidden_size": 576, "num_attention_heads": 9,
                     "num_key_value_heads": 3, "intermediate_size": 1536, "vocab_size": 49152,
                     "max_position_embeddings": 8192, "rope_theta": 100000.0, "tie_word_embeddings": True},
    # Llama 3.2 1B's architecture, random-init (~1.2B parameters).
    "llama-1b": {"model_type": "llama", "num_hidden_layers": 16, "hidden_size": 2048, "num_attention_heads": 32,
                 "num_key_value_heads": 8, "intermediate_size": 8192, "vocab_size": 128256,
                 "max_position_embeddings": 8192, "rope_theta": 500000.0, "tie_word_embeddings": True},
}
"""Models by name: Hugging Face config fields (pad 0, bos 1, eos 2 are added)."""

DECODERS = ("eager", "static", "static_compiled", "continuous", "vllm", "hf", "hf_static")
"""``eager``/``static``/``continuous``: our backends (``static`` uncompiled on every device, ``static_compiled`` with
``generation.compile: true``: ``reduce-overhead``, a CUDA graph, on CUDA; ``continuous``: continuous batching);
``vllm``: the ``vllm`` backend, a vLLM engine built from the same model and given its weights once (in the warm-up
call; ``--vllm_engine_args`` for its options, e.g. ``{enforce_eager: true}``: vLLM compiles by default);
``hf``: ``model.generate()`` with its dynamic cache; ``hf_static``: ``generate(cache_implementation="static")``
(which compiles on CUDA)."""

VLLM_ENGINE_ARGS: dict[str, Any] = {}
"""``generation.vllm_engine_args`` of the ``vllm`` decoder (set by :func:`decode`'s ``vllm_engine_args``)."""

PEAK_BANDWIDTH_ENV = "LIGHTNING_APP_RLHF_PEAK_BANDWIDTH_GBS"
"""Environment variable that overrides the peak memory bandwidth (GB/s) looked up in :data:`HBM_PEAK_GBS`."""

HBM_PEAK_GBS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 2000.0),
    ("H100 NVL", 3900.0),
    ("H100", 3350.0),  # SXM5, "NVIDIA H100 80GB HBM3"
    ("H200", 4800.0),  # "NVIDIA H200" and "NVIDIA H200 NVL"; not GH200 (keys match whole words)
    ("A100-SXM4-80GB", 2039.0),
    ("A100 80GB PCIe", 1935.0),
    ("A100", 1555.0),  # the 40 GB cards
    ("L40S", 864.0),
    ("L40", 864.0),
    ("A10G", 600.0),
    ("L4", 300.0),
)
"""Peak memory bandwidth (GB/s, vendor figures) by a part of ``torch.cuda.get_device_name()``; the first key found
in the name as whole words (case and ``-`` ignored) wins, so the more specific keys come first."""


def build_model(name: str, device: str, dtype: torch.dtype) -> nn.Module:
    """A random-init causal LM of preset ``name`` on ``device`` in ``dtype`` (seeded: the same weights every run)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if name not in DECODE_MODELS:
        raise ValueError(f"Unknown decode model {name!r}: choose from {sorted(DECODE_MODELS)}.")
    fields = {**DECODE_MODELS[name], **SPECIAL_TOKENS}
    config = AutoConfig.for_model(**fields)
    torch.manual_seed(0)
    # On a GPU the weights are initialised there: a 1B model's random init takes ~25 s on the host, ~1 s on a GPU.
    where = torch.device(device) if device.startswith("cuda") else contextlib.nullcontext()
    with where:
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model = model.to(device).eval()
    model.generation_config.eos_token_id = None  # no stop: every row runs to new_tokens
    model.generation_config.pad_token_id = SPECIAL_TOKENS["pad_token_id"]
    return model


def prompts(batch_size: int, prompt_tokens: int, vocab: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, P] random prompt ids, left-padded: row lengths spread over P/2..P."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (batch_size, prompt_tokens), generator=generator)
    lengths = torch.randint(max(prompt_tokens // 2, 1), prompt_tokens + 1, (batch_size,), generator=generator)
    mask = (torch.arange(prompt_tokens) >= prompt_tokens - lengths[:, None]).long()
    return ids.masked_fill(mask == 0, SPECIAL_TOKENS["pad_token_id"]).to(device), mask.to(device)


def decode_once(decoder: str, model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, new_tokens: int,
                stops: Sequence[int] = (), slots: int | None = None) -> int:
    """Run one decoder on the prompts; return the number of generated tokens (the useful ones: up to each row's
    stop).

    Args:
        stops: Token ids that end a row (:func:`stop_ids`); none: every row generates ``new_tokens``.
        slots: Rows decoded at once (``generation.batch_size``: ``static``'s chunks, ``continuous``'s slots); None:
            all.
    """
    if decoder in ("hf", "hf_static"):
        extra = {"cache_implementation": "static"} if decoder == "hf_static" else {}
        length = {"eos_token_id": list(stops)} if stops else {"min_new_tokens": new_tokens}
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=True, top_k=0,
                             top_p=1.0, temperature=1.0, **length, **extra)
        if not stops:
            return (out.shape[1] - ids.shape[1]) * ids.shape[0]
        response = out[:, ids.shape[1]:]
        ended = torch.isin(response, torch.tensor(list(stops), device=response.device)).int()
        return int((ended.cumsum(1) - ended == 0).sum())  # up to and with each row's first stop
    backend = {"eager": "eager", "continuous": "continuous", "vllm": "vllm"}.get(decoder, "static")
    config = GenerationConfig(max_new_tokens=new_tokens, backend=backend, batch_size=slots,
                              compile=None if backend != "static" else decoder == "static_compiled",
                              vllm_engine_args=VLLM_ENGINE_ARGS if backend == "vllm" else None)
    keys = sample_keys(0, 0, torch.arange(ids.shape[0]))
    # weights_version 0: the vllm engine takes the model's weights in the warm-up call, never again (they are fixed).
    rollout = generate(model, ids, mask, config, keys, eos_token_id=list(stops),
                       pad_token_id=SPECIAL_TOKENS["pad_token_id"], weights_version=0)
    return int(rollout.response_mask.sum())


def device_name(device: str, info: dict[str, Any]) -> str:
    """The measured device in words: the GPU's name on CUDA, else the CPU's with its cores."""
    if device.startswith("cuda") and info.get("gpu"):
        return str(info["gpu"])
    return f"{info['cpu']}, {info['cores']} cores"


def resolve_peak_bandwidth(device_name: str | None, explicit: float | None = None) -> float | None:
    """The peak memory bandwidth (GB/s) to compare a decode step's traffic with.

    ``explicit`` (``--peak_bandwidth_gbs``) wins, then the environment variable :data:`PEAK_BANDWIDTH_ENV`, then
    :data:`HBM_PEAK_GBS` by ``device_name`` (``torch.cuda.get_device_name()``); None when none of them knows it.

    Raises:
        ValueError: the environment variable is set but is not a positive number.
    """
    if explicit is not None:
        return float(explicit)
    override = os.environ.get(PEAK_BANDWIDTH_ENV, "").strip()
    if override:
        try:
            value = float(override)
        except ValueError:
            value = -1.0
        if not value > 0:
            raise ValueError(f"{PEAK_BANDWIDTH_ENV}={override!r} is not a bandwidth: set it to the device's peak "
                             "memory bandwidth in GB/s (e.g. 3350 for an H100 SXM), or unset it.")
        return value
    if not device_name:
        return None
    words = f" {_words(device_name)} "
    for key, gbs in HBM_PEAK_GBS:
        if f" {_words(key)} " in words:
            return gbs
    return None


def _words(name: str) -> str:
    """``"NVIDIA A100-SXM4-80GB"`` -> ``"nvidia a100 sxm4 80gb"``: lower case, ``-`` and ``_`` as spaces."""
    return " ".join(name.lower().replace("-", " ").replace("_", " ").split())


def kv_geometry(config: Any) -> tuple[int, int, int]:
    """(layers, key/value heads, head dim) of a Hugging Face decoder config: what one cached position holds.

    Grouped-query models (Llama) cache ``num_key_value_heads`` heads; the others (GPT-2) one per attention head.
    """
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    return int(text.num_hidden_layers), kv_heads, head_dim


def kv_read_bytes_per_step(
    layers: int, kv_heads: int, head_dim: int, element_size: int, batch_size: int, prompt_tokens: int,
    new_tokens: int,
) -> float:
    """Bytes of keys and values one decode step reads, on average over a call that generates ``new_tokens``.

    The step that feeds generated token ``s`` (``s = 1 .. new_tokens - 1``; the prefill samples the first) attends to
    ``prompt_tokens + s`` cached positions (the left padding is cached and read too), so the mean context is
    ``prompt_tokens + new_tokens / 2`` positions, each holding a key and a value of ``kv_heads x head_dim`` elements
    per layer and row. Counted once per step: what attention must read, not what a kernel may read on top (the
    ``static`` backend's attention spans the whole preallocated length).
    """
    context = prompt_tokens + new_tokens / 2
    return 2.0 * layers * kv_heads * head_dim * element_size * batch_size * context


def weight_read_bytes(model: nn.Module) -> int:
    """Parameter bytes one decode step reads: every parameter once (a tied embedding counts once: the LM head reads
    it whole), less an untied input embedding, of which a step looks up only one row per sequence."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if embed is not None and (head is None or head.weight is not embed.weight):
        total -= embed.weight.numel() * embed.weight.element_size()
    return total


def decode_bandwidth(
    weight_bytes: float, kv_bytes: float, seconds: float, new_tokens: int, peak_gbs: float | None = None
) -> dict[str, float]:
    """The decode step's memory traffic over its time, and its share of the peak.

    The step time is the call's time over the tokens each row generated (the prefill is charged to the steps, so
    the GB/s and the share are lower bounds; with 256 new tokens the prefill is a few percent of the call).

    Returns:
        ``step_s``, ``weight_bytes_per_step``, ``kv_bytes_per_step``, ``decode_read_gbs`` ((weights + KV) / step
        time, GB/s) and, with a peak, ``peak_bandwidth_gbs`` and ``bandwidth_fraction`` (of the peak).
    """
    if seconds <= 0 or new_tokens < 1:
        raise ValueError(f"Need seconds > 0 and new_tokens >= 1 to get a step time; got {seconds} and {new_tokens}.")
    step_s = seconds / new_tokens
    out = {"step_s": step_s, "weight_bytes_per_step": float(weight_bytes), "kv_bytes_per_step": float(kv_bytes),
           "decode_read_gbs": (weight_bytes + kv_bytes) / step_s / 1e9}
    if peak_gbs:
        out["peak_bandwidth_gbs"] = float(peak_gbs)
        out["bandwidth_fraction"] = out["decode_read_gbs"] / peak_gbs
    return out


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def measure_decoders(
    decoders: list[str], model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, new_tokens: int, warmup: int,
    repeats: int, stops: Sequence[int] = (), slots: int | None = None,
) -> list[dict[str, Any]]:
    """Per decoder, the median wall time of ``repeats`` calls after ``warmup`` calls (compilation and CUDA-graph
    capture happen there), with tokens/s (useful tokens: up to each row's stop, :func:`decode_once`'s ``stops`` and
    ``slots``). The decoders take turns call by call, so a slow spell of a shared machine hits them alike."""
    device = str(ids.device)
    warmup_s = {}
    for decoder in decoders:
        start = time.perf_counter()
        for _ in range(warmup):
            decode_once(decoder, model, ids, mask, new_tokens, stops, slots)
        _sync(device)
        warmup_s[decoder] = time.perf_counter() - start
    times: dict[str, list[float]] = {decoder: [] for decoder in decoders}
    tokens: dict[str, int] = {}
    for _ in range(repeats):
        for decoder in decoders:
            _sync(device)
            start = time.perf_counter()
            tokens[decoder] = decode_once(decoder, model, ids, mask, new_tokens, stops, slots)
            _sync(device)
            times[decoder].append(time.perf_counter() - start)
    rows = []
    for decoder in decoders:
        seconds = statistics.median(times[decoder])
        rows.append({"decoder": decoder, "seconds": seconds, "seconds_min": min(times[decoder]),
                     "seconds_max": max(times[decoder]), "tokens": tokens[decoder],
                     "tokens_per_s": tokens[decoder] / seconds, "warmup_s": warmup_s[decoder]})
    return rows


def compare_decoders(
    models: list[str],
    batch_sizes: list[int],
    new_tokens: int,
    prompt_tokens: int,
    decoders: list[str],
    device: str,
    dtype: str,
    warmup: int,
    repeats: int,
    peak_bandwidth_gbs: float | None = None,
    mean_length: int | None = None,
    slots: int | None = None,
) -> list[dict[str, Any]]:
    """One row per (model, batch size, decoder): tokens/s, and the memory traffic of a decode step. With
    ``mean_length``, rows stop after geometric lengths of that mean (:func:`stop_ids`) and tokens/s counts the useful
    tokens; ``slots`` rows are decoded at once (:func:`decode_once`).

    ``weight_read_gbs`` is the parameter bytes once per generated token position over the whole call's time;
    ``decode_read_gbs`` adds the KV cache a step reads (:func:`decode_bandwidth`), and with ``peak_bandwidth_gbs``
    ``bandwidth_fraction`` is its share of that peak. Both are lower bounds: the call's time includes the prefill.
    """
    unknown = sorted(set(decoders) - set(DECODERS))
    if unknown:
        raise ValueError(f"Unknown decoders {unknown}: choose from {list(DECODERS)}.")
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    rows = []
    for name in models:
        model = build_model(name, device, torch_dtype)
        param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        step_weight_bytes = weight_read_bytes(model)
        layers, kv_heads, head_dim = kv_geometry(model.config)
        element_size = next(model.parameters()).element_size()
        for batch_size in batch_sizes:
            ids, mask = prompts(batch_size, prompt_tokens, model.config.vocab_size, device)
            kv_bytes = kv_read_bytes_per_step(layers, kv_heads, head_dim, element_size, batch_size, prompt_tokens,
                                              new_tokens)
            stops = stop_ids(model.config.vocab_size, mean_length)
            for row in measure_decoders(decoders, model, ids, mask, new_tokens, warmup, repeats, stops, slots):
                row.update({"model": name, "params": sum(p.numel() for p in model.parameters()),
                            "batch_size": batch_size, "new_tokens": new_tokens, "prompt_tokens": prompt_tokens,
                            "device": device, "dtype": dtype, "mean_length": mean_length, "slots": slots})
                row["weight_read_gbs"] = param_bytes * new_tokens / row["seconds"] / 1e9
                row.update(decode_bandwidth(step_weight_bytes, kv_bytes, row["seconds"], new_tokens,
                                            peak_bandwidth_gbs))
                rows.append(row)
        del model
    for row in rows:  # speed-ups over eager and static of the same model and batch
        for base in ("eager", "static"):
            other = next((r for r in rows if r["decoder"] == base and r["model"] == row["model"]
                          and r["batch_size"] == row["batch_size"]), None)
            if other is not None:
                row[f"speedup_vs_{base}"] = row["tokens_per_s"] / other["tokens_per_s"]
    return rows


def decode_table(rows: list[dict[str, Any]]) -> str:
    """The rows as a markdown table; with a known peak bandwidth (GPU rows), also the decode step's time, its
    weights + KV cache traffic and that traffic's share of the peak."""
    with_peak = any("bandwidth_fraction" in r for r in rows)
    header = "| model | params | batch | decoder | tokens/s | vs eager | vs static | call s (min-max) | weights GB/s |"
    rule = "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |"
    if with_peak:
        header += " step ms | weights + KV GB/s | of peak |"
        rule += " ---: | ---: | ---: |"
    lines = [header, rule]
    for r in rows:
        line = (f"| {r['model']} | {r['params'] / 1e6:.1f}M | {r['batch_size']} | `{r['decoder']}` | "
                f"{r['tokens_per_s']:,.0f} | {r.get('speedup_vs_eager', float('nan')):.2f}x | "
                f"{r.get('speedup_vs_static', float('nan')):.2f}x | "
                f"{r['seconds']:.3f} ({r['seconds_min']:.3f}-{r['seconds_max']:.3f}) | "
                f"{r['weight_read_gbs']:.2f} |")
        if with_peak:
            share = f"{r['bandwidth_fraction']:.1%}" if "bandwidth_fraction" in r else "-"
            line += f" {r['step_s'] * 1e3:.2f} | {r['decode_read_gbs']:,.1f} | {share} |"
        lines.append(line)
    return "\n".join(lines)


def draw_decode_plot(rows: list[dict[str, Any]], device_name: str, path: Path) -> None:
    """Tokens/s of every decoder, grouped by model and batch size (log scale), with the measured device named."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = list(dict.fromkeys((r["model"], r["batch_size"]) for r in rows))
    decoders = list(dict.fromkeys(r["decoder"] for r in rows))
    width = 0.8 / len(decoders)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(groups) + 2), 4))
    for k, decoder in enumerate(decoders):
        by_group = {(r["model"], r["batch_size"]): r for r in rows if r["decoder"] == decoder}
        present = [(i, by_group[g]) for i, g in enumerate(groups) if g in by_group]
        medians = [r["tokens_per_s"] for _, r in present]
        # Error bars: the slowest and the fastest timed call.
        low = [m - r["tokens"] / r["seconds_max"] for m, (_, r) in zip(medians, present)]
        high = [r["tokens"] / r["seconds_min"] - m for m, (_, r) in zip(medians, present)]
        ax.bar([i + k * width for i, _ in present], medians, width, yerr=[low, high], capsize=2, label=decoder)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(groups))], [f"{m}\nbatch {b}" for m, b in groups])
    ax.set_yscale("log")
    ax.set_ylabel("generated tokens/s (log)")
    dtype = rows[0]["dtype"]
    ax.set_title(f"Decoders, {rows[0]['new_tokens']} new tokens, {dtype}: {device_name}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def check_equal_tokens(model_name: str, batch_size: int, new_tokens: int, prompt_tokens: int, device: str) -> bool:
    """Whether ``static`` (uncompiled) samples ``eager``'s tokens on this model (the harness states it next to the
    speed; the compiled step's tokens on CUDA are checked by the ``gpu``-marked tests)."""
    model = build_model(model_name, device, torch.float32)
    ids, mask = prompts(batch_size, prompt_tokens, model.config.vocab_size, device)
    keys = sample_keys(0, 0, torch.arange(batch_size))
    config = GenerationConfig(max_new_tokens=new_tokens)
    pad = SPECIAL_TOKENS["pad_token_id"]
    eager = generate(model, ids, mask, config, keys, [], pad)
    static = generate(model, ids, mask, replace(config, backend="static", compile=False), keys, [], pad)
    return bool(torch.equal(eager.sequences, static.sequences))


def prepare_vllm(device: str, threads: int, engine_args: dict[str, Any] | None) -> None:
    """The ``vllm`` decoder's engine options; on the CPU its engine's threads bound to the first ``threads`` cores
    with none reserved (unless the environment sets them), as many as ours use: vLLM keeps one core back by default."""
    VLLM_ENGINE_ARGS.clear()
    VLLM_ENGINE_ARGS.update(engine_args or {})
    if device == "cpu":
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}" if threads > 1 else "0")
        os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")


def decode(
    models: list[str] = ["tiny", "small", "llama-small"],  # noqa: B006 - jsonargparse reads the default
    batch_sizes: list[int] = [8, 32],  # noqa: B006
    new_tokens: int = 64,
    prompt_tokens: int = 32,
    decoders: list[str] = ["eager", "static", "hf"],  # noqa: B006
    device: str = "cpu",
    dtype: str = "float32",
    threads: int = 1,
    warmup: int = 1,
    repeats: int = 3,
    peak_bandwidth_gbs: float | None = None,
    check_tokens: bool = True,
    out: str = "bench_results/decode.json",
    plot: str | None = None,
    mean_length: int | None = None,
    slots: int | None = None,
    vllm_engine_args: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """``eager`` vs ``static`` vs ``continuous`` vs ``vllm`` vs Hugging Face ``generate()``: tokens/s of one sampling call, every row generating
    ``new_tokens`` tokens (no stop token).

    On a GPU: ``--device cuda --dtype bfloat16 --models '[smollm2-135m, llama-1b]' --batch_sizes '[8, 64, 256]'
    --new_tokens 256 --decoders '[eager, static, static_compiled, hf, hf_static]'``; the peak bandwidth comes from
    the device's name (``HBM_PEAK_GBS``). ``scripts/gpu_check.sh`` runs a short version of this.

    Args:
        models: Names from ``DECODE_MODELS`` (tiny, small, llama-small, smollm2-135m, llama-1b), random-init.
        batch_sizes: Rows per call.
        new_tokens: Tokens generated per row.
        prompt_tokens: Padded prompt length (row lengths spread over half of it to all of it, left-padded).
        decoders: From ``DECODERS``: eager, static, static_compiled, hf, hf_static.
        device: ``cpu`` or ``cuda``.
        dtype: ``float32`` or ``bfloat16``.
        threads: Torch threads (CPU).
        warmup: Untimed calls first (compilation, CUDA-graph capture).
        repeats: Timed calls; the median is reported, with min and max.
        peak_bandwidth_gbs: The device's peak memory bandwidth (GB/s), to report the share of it a decode step
            reaches. Unset: the environment variable ``LIGHTNING_APP_RLHF_PEAK_BANDWIDTH_GBS``, else, on CUDA, the
            figure of the device's name in ``HBM_PEAK_GBS``.
        check_tokens: Also check that ``static`` samples ``eager``'s tokens (a float32 copy of the first model).
        out: Where the JSON results go (with the markdown table next to it, ``.md``).
        plot: Where to draw the tokens/s bar chart (PNG), if set.
        mean_length: Uneven rows: each stops after a geometric number of tokens of this mean (a stop id set of
            ``vocab / mean_length`` ids, :func:`stop_ids`), at most ``new_tokens``; tokens/s counts the useful tokens.
            Continuous batching against ``static`` on uneven rows: ``--decoders '[static, continuous]' --mean_length
            16 --new_tokens 128 --batch_sizes '[64]' --slots 16``. None: every row generates ``new_tokens``.
        slots: Rows decoded at once: ``static``'s and ``eager``'s chunks, ``continuous``'s slots
            (``generation.batch_size``); None: every row at once.
        vllm_engine_args: ``generation.vllm_engine_args`` of the ``vllm`` decoder (e.g. ``{enforce_eager: true}``;
            :func:`prepare_vllm`).
    """
    import sys

    from lightning_app_rlhf.bench.results import machine

    torch.set_num_threads(threads)
    if "vllm" in decoders:
        prepare_vllm(device, threads, vllm_engine_args)
    info = machine()
    gpu = info.get("gpu") if device.startswith("cuda") else None
    peak = resolve_peak_bandwidth(gpu, peak_bandwidth_gbs)
    rows = compare_decoders(models, batch_sizes, new_tokens, prompt_tokens, decoders, device, dtype, warmup, repeats,
                            peak, mean_length, slots)
    equal = (check_equal_tokens(models[0], batch_sizes[0], min(new_tokens, 32), prompt_tokens, device)
             if check_tokens else None)
    table = decode_table(rows)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps({"machine": info, "threads": threads, "static_tokens_equal_eager": equal,
                                     "peak_bandwidth_gbs": peak, "decode": rows}, indent=2))
    Path(out).with_suffix(".md").write_text(table + "\n")
    if plot:
        draw_decode_plot(rows, device_name(device, info), Path(plot))
    print(table, file=sys.stderr)
    if check_tokens:
        print(f"static gives eager's tokens on {models[0]}: {equal}", file=sys.stderr)
    return rows


# ---- The GPU check's section of docs/benchmarks.md (scripts/gpu_check.sh) ----

GPU_CHECK_BEGIN = "<!-- gpu-check:begin (generated by `bash scripts/gpu_check.sh`; edits inside are overwritten) -->"
GPU_CHECK_END = "<!-- gpu-check:end -->"
GPU_CHECK_RECORD = "gpu_check.json"
"""The run's record in the results folder: the machine, each step's outcome, and which result files it wrote."""
GPU_CHECK_KINDS = ("decode", "bandwidth", "trl", "placements")
"""Result kinds a step can write: the decoder comparison, the bandwidth run, ours vs TRL, the placements."""


def read_steps(path: Path) -> list[dict[str, str]]:
    """The steps file ``scripts/gpu_check.sh`` writes: one tab-separated line per step, ``step status detail
    result`` (``result``: ``kind=file.json`` the step wrote, or ``-``)."""
    steps = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        step, status, detail, result = (line.split("\t") + ["", "", "-"])[:4]
        steps.append({"step": step, "status": status, "detail": detail, "result": result or "-"})
    return steps


def gpu_check_record(steps: list[dict[str, str]], machine_info: dict[str, Any], seconds: float) -> dict[str, Any]:
    """The run's record: its machine, steps and the result file of each kind (only the files this run wrote)."""
    results = {}
    for step in steps:
        kind, _, name = step["result"].partition("=")
        if name and kind in GPU_CHECK_KINDS:
            results[kind] = name
    return {"machine": machine_info, "seconds": round(seconds, 1), "steps": steps, "results": results}


def gpu_check_section(record: dict[str, Any], results: dict[str, dict[str, Any]]) -> str:
    """The generated part of the GPU section: machine, step outcomes, and a table per result kind present.

    Args:
        record: From :func:`gpu_check_record`.
        results: Kind (``decode``, ``bandwidth``, ``trl``, ``placements``) -> that result file's JSON.
    """
    info = record["machine"]
    peak = next((r.get("peak_bandwidth_gbs") for r in results.values() if r.get("peak_bandwidth_gbs")), None)
    peak_words = f", peak memory bandwidth {peak:,.0f} GB/s" if peak else ""
    machine_line = (
        f"Measured on: {info.get('gpu') or 'no GPU'}{peak_words}; host {info['cpu']}, {info['cores']} cores, "
        f"{info['memory_gib']} GiB; Python {info['python']}, torch {info['torch']}, lightning {info['lightning']}, "
        f"transformers {info['transformers']}. The whole check took {record['seconds']:.0f} s."
    )
    steps = "\n".join(f"- {s['step']}: **{s['status']}**" + (f" ({s['detail']})" if s["detail"] else "")
                      for s in record["steps"])
    parts = [machine_line, "Steps of this run:\n\n" + steps]
    if "decode" in results:
        parts.append(_decode_part(results["decode"], "Decoders on the GPU: eager, static, compiled static"))
    if "bandwidth" in results:
        parts.append(_decode_part(results["bandwidth"], "The decode step's share of the memory bandwidth"))
    if results.get("trl", {}).get("trl"):
        from lightning_app_rlhf.bench.report import trl_table  # imports Lightning: only when there is a table

        rows = results["trl"]["trl"]
        table = trl_table(rows).replace("### Ours vs TRL 1.12.0 PPOTrainer", "### Ours vs TRL 1.12.0 PPOTrainer on the "
                                        "GPU", 1)
        cuda = [f"{r['settings']['preset']} {r['settings']['precision']} {_mib(r['ours'], 'peak_cuda_bytes')} / "
                f"{_mib(r['trl'], 'peak_cuda_bytes')}" for r in rows]
        parts.append(table + "\n\nPeak CUDA memory, ours / TRL (MiB): " + "; ".join(cuda) + ".")
    if results.get("placements", {}).get("placements"):
        parts.append(_placements_part(results["placements"]["placements"]))
    return "\n\n".join(parts)


def _decode_part(result: dict[str, Any], title: str) -> str:
    rows = result["decode"]
    first = rows[0]
    models = ", ".join(dict.fromkeys(f"`{r['model']}` ({r['params'] / 1e6:.1f}M parameters)" for r in rows))
    batches = ", ".join(dict.fromkeys(str(r["batch_size"]) for r in rows))
    equal = result.get("static_tokens_equal_eager")
    words = [f"### {title}", "",
             f"Model {models}, random-init, {first['dtype']}; batch {batches}; prompts of {first['prompt_tokens']} "
             f"positions (left-padded), {first['new_tokens']} new tokens per row, no stop token; median of the timed "
             "calls after the warm-up (min-max). `static` is uncompiled, `static_compiled` is `generation.compile: "
             "true` (`reduce-overhead`: a CUDA graph). Step ms: the call's time over the new tokens (the prefill "
             "charged to the steps); weights + KV GB/s: the parameter bytes (a tied embedding once) plus the mean "
             "KV cache bytes a step reads, over the step time; of peak: that over the peak bandwidth. Both are "
             "lower bounds."
             + (f" `static` samples `eager`'s tokens here: {str(equal).lower()}." if equal is not None else ""),
             "", decode_table(rows)]
    return "\n".join(words)


def _placements_part(rows: list[dict[str, Any]]) -> str:
    s = rows[0]["settings"]
    caption = (f"Preset `{s['preset']}`, batch {s['batch_size']}, {s['precision']}; medians (min-max). Train "
               "TFLOP/s: 6 FLOPs per parameter per token, actor + critic; MFU against the dense bf16 peak by device "
               "name.")
    header = ("| workload | processes | placement | samples/s | generated tokens/s | generate / score / train / "
              "reallocate ms | train TFLOP/s (MFU) | peak CUDA MiB (max) |")
    lines = ["### Placements on the GPU", "", caption, "", header,
             "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    for row in rows:
        ours, settings = row["ours"], row["settings"]
        tokens = f"{ours['gen_tokens_per_s']['median']:,.0f}" if "gen_tokens_per_s" in ours else "-"
        phases = " / ".join(f"{ours[f'{phase}_s'] * 1000:.0f}" if f"{phase}_s" in ours else "-"
                            for phase in ("generate", "score", "train", "reallocate"))
        flops = f"{ours['train_tflops']:.1f}" if "train_tflops" in ours else "-"
        if "train_mfu" in ours:
            flops += f" ({ours['train_mfu']:.1%})"
        spread = ours["samples_per_s"]
        lines.append(f"| {row['workload']} | {settings['processes']} | {settings['placement']} | "
                     f"{spread['median']:.1f} ({spread['min']:.1f}-{spread['max']:.1f}) | {tokens} | {phases} | "
                     f"{flops} | {_mib(ours, 'peak_cuda_bytes')} |")
    return "\n".join(lines)


def _mib(summary: dict[str, Any], key: str) -> str:
    values = summary.get(key)
    if not values:
        return "-"
    return f"{max(values) / 2**20:,.0f}"


def write_gpu_check_section(docs: Path, body: str) -> None:
    """Replace what lies between the ``gpu-check`` markers of ``docs`` with ``body`` (markers appended at the end
    of the page when missing); nothing outside the markers changes."""
    text = docs.read_text() if docs.exists() else "# Benchmarks\n"
    begin = text.find("<!-- gpu-check:begin")
    end = text.find(GPU_CHECK_END, begin + 1) if begin >= 0 else -1
    if begin >= 0 and end >= 0:
        head, tail = text[:begin], text[end + len(GPU_CHECK_END):]
    else:
        head, tail = text.rstrip("\n") + "\n\n", "\n"
    docs.write_text(f"{head}{GPU_CHECK_BEGIN}\n\n{body}\n\n{GPU_CHECK_END}{tail}")


def write_gpu_check_report(
    results_dir: Path, docs: Path, steps: Path | None = None, seconds: float = 0.0, section: Path | None = None
) -> str:
    """Write the GPU section of ``docs`` from a GPU check's results; return the section's text.

    Args:
        results_dir: The folder of the result files (and of :data:`GPU_CHECK_RECORD`).
        docs: The page whose ``gpu-check`` section is replaced (``docs/benchmarks.md``).
        steps: The steps file of the run that just ended: the record is made from it and this machine, and written
            to ``results_dir``. None: re-render from the record already there (e.g. after copying a GPU run's
            files back to ``docs/bench_results``).
        seconds: The whole check's wall time (with ``steps``).
        section: Also write the section alone to this file.
    """
    record_path = results_dir / GPU_CHECK_RECORD
    if steps is not None:
        from lightning_app_rlhf.bench.results import machine

        record = gpu_check_record(read_steps(steps), machine(), seconds)
        results_dir.mkdir(parents=True, exist_ok=True)
        record_path.write_text(json.dumps(record, indent=2))
    elif record_path.exists():
        record = json.loads(record_path.read_text())
    else:
        raise FileNotFoundError(f"No {GPU_CHECK_RECORD} in {results_dir}: run `bash scripts/gpu_check.sh` on a GPU "
                                "machine, then copy the files it leaves in $OUT (or docs/bench_results) there.")
    results = {}
    for kind, name in record["results"].items():
        path = results_dir / name
        if not path.exists():
            raise FileNotFoundError(f"{path} is named in {record_path} but missing: copy every JSON file of the GPU "
                                    "run into that folder, or run `bash scripts/gpu_check.sh` again.")
        results[kind] = json.loads(path.read_text())
    body = gpu_check_section(record, results)
    write_gpu_check_section(docs, body)
    if section is not None:
        section.write_text(body + "\n")
    return body


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m lightning_app_rlhf.bench.decode``: ``measure`` runs :func:`decode` with keyword arguments given
    as one JSON object (needs no jsonargparse, unlike ``python -m lightning_app_rlhf.bench decode``); ``report``
    writes the GPU section of ``docs/benchmarks.md`` (:func:`write_gpu_check_report`)."""
    parser = argparse.ArgumentParser(prog="python -m lightning_app_rlhf.bench.decode", description=main.__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    measure = commands.add_parser("measure", help="run the decode benchmark")
    measure.add_argument("kwargs", help='decode()\'s keyword arguments as JSON, e.g. \'{"models": ["tiny"]}\'')
    report = commands.add_parser("report", help="write the GPU section of docs/benchmarks.md")
    report.add_argument("--results", default="docs/bench_results", help="folder of the GPU run's result files")
    report.add_argument("--docs", default="docs/benchmarks.md", help="the page to update")
    report.add_argument("--steps", default=None, help="the run's steps file (omit to re-render from the record)")
    report.add_argument("--seconds", type=float, default=0.0, help="the whole check's wall time")
    report.add_argument("--section", default=None, help="also write the section alone to this file")
    args = parser.parse_args(argv)
    if args.command == "measure":
        decode(**json.loads(args.kwargs))
        return
    try:
        write_gpu_check_report(Path(args.results), Path(args.docs), Path(args.steps) if args.steps else None,
                               args.seconds, Path(args.section) if args.section else None)
    except FileNotFoundError as error:
        raise SystemExit(str(error)) from None


if __name__ == "__main__":
    main()
