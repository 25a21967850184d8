"""Decoder throughput: the ``eager`` and ``static`` generation backends against Hugging Face ``generate()``.

Every decoder samples the same left-padded random prompts from the same random-init model, with no stop token, so
each row generates exactly ``new_tokens`` tokens and tokens/s compare like for like. Plain PyTorch (no Lightning).
``python -m lightning_app_rlhf.bench decode --help`` lists the settings.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_app_rlhf.bench.presets import MODEL_PRESETS, SPECIAL_TOKENS
from lightning_app_rlhf.config import GenerationConfig
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

DECODERS = ("eager", "static", "static_compiled", "hf", "hf_static")
"""``eager``/``static``: our backends (``static`` compiles on CUDA only, ``static_compiled`` always); ``hf``:
``model.generate()`` with its dynamic cache; ``hf_static``: ``generate(cache_implementation="static")`` (which
compiles on CUDA)."""


def build_model(name: str, device: str, dtype: torch.dtype) -> nn.Module:
    """A random-init causal LM of preset ``name`` on ``device`` in ``dtype`` (seeded: the same weights every run)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if name not in DECODE_MODELS:
        raise ValueError(f"Unknown decode model {name!r}: choose from {sorted(DECODE_MODELS)}.")
    fields = {**DECODE_MODELS[name], **SPECIAL_TOKENS}
    config = AutoConfig.for_model(**fields)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).to(device).eval()
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


def decode_once(decoder: str, model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, new_tokens: int) -> int:
    """Run one decoder on the prompts; return the number of generated tokens."""
    if decoder in ("hf", "hf_static"):
        extra = {"cache_implementation": "static"} if decoder == "hf_static" else {}
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=True, top_k=0, top_p=1.0, temperature=1.0, **extra)
        return (out.shape[1] - ids.shape[1]) * ids.shape[0]
    backend = "eager" if decoder == "eager" else "static"
    config = GenerationConfig(max_new_tokens=new_tokens, backend=backend,
                              compile=True if decoder == "static_compiled" else None)
    keys = sample_keys(0, 0, torch.arange(ids.shape[0]))
    rollout = generate(model, ids, mask, config, keys, eos_token_id=[], pad_token_id=SPECIAL_TOKENS["pad_token_id"])
    return int(rollout.response_mask.sum())


def device_name(device: str, info: dict[str, Any]) -> str:
    """The measured device in words: the GPU's name on CUDA, else the CPU's with its cores."""
    if device.startswith("cuda") and info.get("gpu"):
        return str(info["gpu"])
    return f"{info['cpu']}, {info['cores']} cores"


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def measure_decoders(
    decoders: list[str], model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, new_tokens: int, warmup: int,
    repeats: int,
) -> list[dict[str, Any]]:
    """Per decoder, the median wall time of ``repeats`` calls after ``warmup`` calls (compilation and CUDA-graph
    capture happen there), with tokens/s. The decoders take turns call by call, so a slow spell of a shared machine
    hits them alike."""
    device = str(ids.device)
    warmup_s = {}
    for decoder in decoders:
        start = time.perf_counter()
        for _ in range(warmup):
            decode_once(decoder, model, ids, mask, new_tokens)
        _sync(device)
        warmup_s[decoder] = time.perf_counter() - start
    times: dict[str, list[float]] = {decoder: [] for decoder in decoders}
    tokens: dict[str, int] = {}
    for _ in range(repeats):
        for decoder in decoders:
            _sync(device)
            start = time.perf_counter()
            tokens[decoder] = decode_once(decoder, model, ids, mask, new_tokens)
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
) -> list[dict[str, Any]]:
    """One row per (model, batch size, decoder): tokens/s, and the weights' read bandwidth per decode step.

    The bandwidth is a lower bound of what each decode step moves: the parameter bytes once per generated token
    position (the KV cache reads come on top), over the whole call's time (prefill included).
    """
    unknown = sorted(set(decoders) - set(DECODERS))
    if unknown:
        raise ValueError(f"Unknown decoders {unknown}: choose from {list(DECODERS)}.")
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    rows = []
    for name in models:
        model = build_model(name, device, torch_dtype)
        param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        for batch_size in batch_sizes:
            ids, mask = prompts(batch_size, prompt_tokens, model.config.vocab_size, device)
            for row in measure_decoders(decoders, model, ids, mask, new_tokens, warmup, repeats):
                row.update({"model": name, "params": sum(p.numel() for p in model.parameters()),
                            "batch_size": batch_size, "new_tokens": new_tokens, "prompt_tokens": prompt_tokens,
                            "device": device, "dtype": dtype})
                row["weight_read_gbs"] = param_bytes * new_tokens / row["seconds"] / 1e9
                if peak_bandwidth_gbs:
                    row["bandwidth_fraction"] = row["weight_read_gbs"] / peak_bandwidth_gbs
                rows.append(row)
        del model
    for row in rows:  # speed-up over eager of the same model and batch
        eager = next((r for r in rows if r["decoder"] == "eager" and r["model"] == row["model"]
                      and r["batch_size"] == row["batch_size"]), None)
        if eager is not None:
            row["speedup_vs_eager"] = row["tokens_per_s"] / eager["tokens_per_s"]
    return rows


def decode_table(rows: list[dict[str, Any]]) -> str:
    """The rows as a markdown table."""
    lines = ["| model | params | batch | decoder | tokens/s | vs eager | call s (min-max) | weights GB/s |",
             "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['params'] / 1e6:.1f}M | {r['batch_size']} | `{r['decoder']}` | "
                     f"{r['tokens_per_s']:,.0f} | {r.get('speedup_vs_eager', float('nan')):.2f}x | "
                     f"{r['seconds']:.3f} ({r['seconds_min']:.3f}-{r['seconds_max']:.3f}) | "
                     f"{r['weight_read_gbs']:.2f} |")
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
    """Whether ``static`` samples ``eager``'s tokens on this model (the harness states it next to the speed)."""
    model = build_model(model_name, device, torch.float32)
    ids, mask = prompts(batch_size, prompt_tokens, model.config.vocab_size, device)
    keys = sample_keys(0, 0, torch.arange(batch_size))
    config = GenerationConfig(max_new_tokens=new_tokens)
    pad = SPECIAL_TOKENS["pad_token_id"]
    eager = generate(model, ids, mask, config, keys, [], pad)
    static = generate(model, ids, mask, replace(config, backend="static"), keys, [], pad)
    return bool(torch.equal(eager.sequences, static.sequences))


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
    out: str = "bench_results/decode.json",
    plot: str | None = None,
) -> list[dict[str, Any]]:
    """``eager`` vs ``static`` vs Hugging Face ``generate()``: tokens/s of one sampling call, every row generating
    ``new_tokens`` tokens (no stop token).

    On a GPU: ``--device cuda --dtype bfloat16 --models '[smollm2-135m, llama-1b]' --batch_sizes '[8, 64, 256]'
    --new_tokens 256 --decoders '[eager, static, hf, hf_static]' --peak_bandwidth_gbs 3350`` (H100 SXM).

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
        peak_bandwidth_gbs: The device's peak memory bandwidth (GB/s), to report the fraction reached.
        out: Where the JSON results go (with the markdown table next to it, ``.md``).
        plot: Where to draw the tokens/s bar chart (PNG), if set.
    """
    import json
    import sys

    from lightning_app_rlhf.bench.results import machine

    torch.set_num_threads(threads)
    rows = compare_decoders(models, batch_sizes, new_tokens, prompt_tokens, decoders, device, dtype, warmup, repeats,
                            peak_bandwidth_gbs)
    equal = check_equal_tokens(models[0], batch_sizes[0], min(new_tokens, 32), prompt_tokens, device)
    table = decode_table(rows)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    info = machine()
    Path(out).write_text(json.dumps({"machine": info, "threads": threads, "static_tokens_equal_eager": equal,
                                     "decode": rows}, indent=2))
    Path(out).with_suffix(".md").write_text(table + "\n")
    if plot:
        draw_decode_plot(rows, device_name(device, info), Path(plot))
    print(table, file=sys.stderr)
    print(f"static gives eager's tokens on {models[0]}: {equal}", file=sys.stderr)
    return rows
